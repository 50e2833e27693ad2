"""A step row's version: it moves on with every write, and a decision carries the one its maker saw."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from airflow_resumable.exceptions import ResolutionError, StaleDecisionError
from airflow_resumable.journal import HeldReason, JobBusyError, StepJournal
from airflow_resumable.runner import NOT_DELIVERED, Step, StepContext, run_batch, verify_held
from tests.support import backends
from tests.support.scenario import held_job

pytestmark = pytest.mark.core

JOB = "versions/job"


def lost(item: Mapping[str, Any], ctx: StepContext) -> str:
    raise ConnectionError("reply lost")


def delivered(item: Mapping[str, Any], ctx: StepContext) -> str:
    return f"r-{ctx.item_id}"


def versions(journal: StepJournal, job_id: str = JOB) -> dict[tuple[str, str], str]:
    return {(r.item_id, r.step): r.version for r in journal.rows(job_id)}


def state(journal: StepJournal, job_id: str = JOB) -> tuple[Any, ...]:
    return tuple(journal.rows(job_id)), tuple(journal.resolutions(job_id))


def test_every_write_of_a_row_moves_its_version_on_and_a_skip_does_not(journal_location):
    with StepJournal(journal_location) as journal:
        with pytest.raises(ConnectionError):
            run_batch(journal, JOB, [{"id": "a"}], [Step("send", lost, side_effect=True)], settle_in_task=False)
        failed = versions(journal)[("a", "send")]
        assert len(failed) == 16 and int(failed, 16) >= 0  # opaque hex text
        run_batch(journal, JOB, [{"id": "a"}], [Step("send", lost, side_effect=True)], settle_in_task=False)  # held now
        (hold,) = journal.held(JOB)
        assert hold.version == versions(journal)[("a", "send")] != failed
        journal.resolve(JOB, "a", "send", delivered=False, resolved_by="alice", expected_version=hold.version)
        owed = versions(journal)[("a", "send")]
        assert owed not in (failed, hold.version)
        run_batch(journal, JOB, [{"id": "a"}], [Step("send", delivered, side_effect=True)], settle_in_task=False)
        sent = versions(journal)[("a", "send")]
        assert sent not in (failed, hold.version, owed)
        run_batch(journal, JOB, [{"id": "a"}], [Step("send", delivered, side_effect=True)],
                  settle_in_task=False)  # all skipped
        assert versions(journal)[("a", "send")] == sent


def test_an_input_change_hold_and_its_resolution_move_the_version_on(journal_location):
    steps = [Step("send", delivered, side_effect=True)]
    with StepJournal(journal_location) as journal:
        run_batch(journal, JOB, [{"id": "a", "v": 1}], steps, settle_in_task=False)
        before = versions(journal)[("a", "send")]
        run_batch(journal, JOB, [{"id": "a", "v": 2}], steps, settle_in_task=False)
        (hold,) = journal.held(JOB)
        assert hold.reason == HeldReason.INPUT_CHANGED and hold.version != before
        with pytest.raises(StaleDecisionError, match="changed since it was looked at"):
            journal.resolve_input_change(JOB, "a", use_new_input=False, resolved_by="bob", expected_version=before)
        journal.resolve_input_change(JOB, "a", use_new_input=True, resolved_by="bob", expected_version=hold.version)
        assert versions(journal)[("a", "send")] != hold.version


def test_a_decision_on_a_version_the_row_no_longer_has_is_refused_and_changes_nothing(journal_location):
    held_job(journal_location, JOB)
    held_job(journal_location, "versions/other", "b")
    with StepJournal(journal_location) as journal:
        (seen,) = journal.held(JOB)
        # Someone else settles it, and a run sends it again and loses the reply again: held again.
        journal.resolve(JOB, "a", "send", delivered=False, resolved_by="bob")
        with pytest.raises(ConnectionError):
            run_batch(journal, JOB, [{"id": "a"}], [Step("send", lost, side_effect=True)], settle_in_task=False)
        run_batch(journal, JOB, [{"id": "a"}], [Step("send", lost, side_effect=True)], settle_in_task=False)
        (now,) = journal.held(JOB)
        assert now.reason == seen.reason and now.generation == seen.generation  # looks the same ...
        assert now.version != seen.version  # ... but is not the row alice saw
        before = state(journal) + state(journal, "versions/other")
        with pytest.raises(StaleDecisionError) as refused:
            journal.resolve(JOB, "a", "send", delivered=False, resolved_by="alice", expected_version=seen.version)
        message = str(refused.value)
        assert f"{JOB} / a / send" in message and "held (unknown_outcome)" in message and "look at it again" in message
        assert isinstance(refused.value, ValueError) and isinstance(refused.value, ResolutionError)
        assert state(journal) + state(journal, "versions/other") == before
        # The list form: one stale entry and nothing of the list is applied.
        (other,) = journal.held("versions/other")
        with pytest.raises(StaleDecisionError, match="(?i)^entry 2: .*nothing was changed"):
            journal.apply_decisions([
                {"job_id": "versions/other", "item_id": "b", "step": "send", "decision": "not_delivered",
                 "version": other.version},
                {"job_id": JOB, "item_id": "a", "step": "send", "decision": "delivered", "receipt": "r",
                 "version": seen.version},
            ], resolved_by="alice")
        assert state(journal) + state(journal, "versions/other") == before
        # What it is now can still be decided, with the version it has now.
        journal.apply_decision(JOB, "a", "send", "not_delivered", resolved_by="alice", expected_version=now.version)
        assert journal.held(JOB) == []


def test_a_decision_without_a_version_applies_to_the_row_as_it_is_now(journal_location):
    held_job(journal_location, JOB)
    with StepJournal(journal_location) as journal:
        journal.apply_decisions([{"job_id": JOB, "item_id": "a", "step": "send", "decision": "not_delivered",
                                  "version": ""}], resolved_by="a hand-written conf")
        assert journal.held(JOB) == []


@pytest.mark.parametrize(("field", "value", "message"), [
    ("note", "x" * 4097, "note is 4097 bytes; at most 4096"),
    ("note", "é" * 2049, "note is 4098 bytes"),
    ("note", "bad \ud800 text", "note contains a lone surrogate"),
    ("note", "nul \x00", "note contains a NUL"),
    ("receipt", "r" * (64 * 1024 + 1), "receipt is 65537 bytes"),
    ("receipt", "\udcff", "receipt contains a lone surrogate"),
    ("item_id", "a\ud800", "item_id contains a lone surrogate"),
    ("item_id", "i" * 1025, "item_id is 1025 characters"),
    ("step", "s" * 1025, "step is 1025 characters"),
    ("version", "\ud800", "version contains a lone surrogate"),
    ("version", 7, "version must be text"),
])
def test_bad_decision_text_is_refused_with_one_message_and_changes_nothing(journal_location, field, value, message):
    held_job(journal_location, JOB)
    entry = {"job_id": JOB, "item_id": "a", "step": "send", "decision": "delivered", "receipt": "r-1", field: value}
    with StepJournal(journal_location) as journal:
        before = state(journal)
        with pytest.raises(ValueError, match=message):
            journal.apply_decisions([entry], resolved_by="alice")
        assert state(journal) == before


def test_the_job_records_the_dag_of_its_first_run(journal_location):
    with StepJournal(journal_location) as journal:
        run_batch(journal, "reports/2026-12-05", [{"id": "a"}], [Step("send", delivered, side_effect=True)],
                  dag_id="payments", settle_in_task=False)
        run_batch(journal, "reports/2026-12-05", [{"id": "b"}], [Step("send", delivered, side_effect=True)],
                  dag_id="reports", settle_in_task=False)
        run_batch(journal, "outside/airflow", [{"id": "a"}], [Step("send", delivered, side_effect=True)],
                  settle_in_task=False)
        assert journal.job("reports/2026-12-05").dag_id == "payments"
        assert journal.job("outside/airflow").dag_id is None


def test_verify_held_asks_and_settles_under_the_jobs_claim(journal_location):
    """While the receiver is being asked, no run of the job can start (it would act on the step the
    answer is about); a run that holds the job makes verify_held refuse before asking anything."""
    held_job(journal_location, JOB)
    asked: list[str] = []
    with StepJournal(journal_location) as journal, StepJournal(journal_location) as other:
        def look_up(ctx: StepContext) -> Any:
            asked.append(ctx.idempotency_key)
            with pytest.raises(JobBusyError):  # a run started now must not get the job
                run_batch(other, JOB, [{"id": "a"}], [Step("send", delivered, side_effect=True)], settle_in_task=False)
            return NOT_DELIVERED

        settled = verify_held(journal, JOB, look_up)
        assert [s.item_id for s in settled] == ["a"] and len(asked) == 1
        assert [r.decision for r in journal.resolutions(JOB)] == ["not_delivered"]

        held_job(journal_location, "versions/second")
        with journal.open_job("versions/second"), pytest.raises(JobBusyError):
            verify_held(other, "versions/second", look_up)
        assert len(asked) == 1  # nothing was asked about a job that is running


def test_a_newer_journal_version_is_migrated_forward_from_version_5_on_sqlite(tmp_path):
    path = tmp_path / "journal.sqlite3"
    held_job(str(path), JOB)
    backends.sqlite_downgrade(path, 5)
    with StepJournal(path) as journal:
        (hold,) = journal.held(JOB)
        assert hold.version and journal.job(JOB).dag_id is None
        journal.resolve(JOB, "a", "send", delivered=False, resolved_by="alice", expected_version=hold.version)
        # Schema 9's count starts at 0 for the old job and counts this release's marks: the resolved send
        # is marked IN_FLIGHT again when it is sent.
        assert journal.marks(JOB) == 0
        run_batch(journal, JOB, [{"id": "a"}], [Step("send", lambda item, ctx: "r", side_effect=True)])
        assert journal.marks(JOB) == 1


def test_a_resend_whose_mark_could_not_be_committed_leaves_no_audit_row(journal_location, monkeypatch):
    """The runner's own settlement ("sent again once") is announced by its audit row only together with
    the send's IN_FLIGHT mark: when that commit fails, the send never starts and no audit row is left
    for the run's closing flush to write."""
    with StepJournal(journal_location) as journal:
        with pytest.raises(ConnectionError):
            run_batch(journal, JOB, [{"id": "a"}], [Step("send", lost, side_effect=True)], settle_in_task=False)
        sends: list[str] = []
        steps = [Step("send", lambda item, ctx: sends.append(ctx.item_id) or "r", side_effect=True,
                      verify=lambda ctx: NOT_DELIVERED)]
        apply = journal.engine.apply

        def mark_commit_fails(statements, *, durable):
            if durable:
                raise OSError("the journal's disk went away")
            return apply(statements, durable=durable)

        monkeypatch.setattr(journal.engine, "apply", mark_commit_fails)
        with pytest.raises(OSError):
            run_batch(journal, JOB, [{"id": "a"}], steps, settle_in_task=False)
        monkeypatch.setattr(journal.engine, "apply", apply)
        assert sends == [] and journal.resolutions(JOB) == []
        run_batch(journal, JOB, [{"id": "a"}], steps, settle_in_task=False)
        assert sends == ["a"] and [r.resolved_by for r in journal.resolutions(JOB)] == ["verify"]
