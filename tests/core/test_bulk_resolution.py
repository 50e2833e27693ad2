"""Bulk resolution: many held steps settled in one call, all or nothing, each with its own
audit row - through the journal API (SQLite and PostgreSQL) and the CLI's ``resolve --file``."""

from __future__ import annotations

import csv
import io
import json

import pytest

from airflow_resumable.exceptions import ResolutionError
from airflow_resumable.journal import NotHeldError, StepJournal
from airflow_resumable.runner import Step, idempotency_key, run_batch
from tests.faces.test_cli import cli, snapshot
from tests.support import backends

pytestmark = pytest.mark.core

JOB = "bulk/job"
IDS = [f"item-{i:02d}" for i in range(1, 21)]


class Receiver:
    def __init__(self, lose: set[str]) -> None:
        self.lose, self.got = set(lose), {}

    def send(self, item, ctx):
        if item["id"] in self.lose:  # its first send: accepted or not, the reply never comes
            self.lose.discard(item["id"])
            if int(item["id"][-2:]) % 2:
                self.got[item["id"]] = self.got.get(item["id"], 0) + 1
            raise TimeoutError()
        self.got[item["id"]] = self.got.get(item["id"], 0) + 1
        return f"rcpt-{item['id']}"


def held_15(journal: StepJournal) -> Receiver:
    """Items 01-15 held with an unknown outcome (the odd ones reached the receiver), 16-20 done."""
    receiver = Receiver(set(IDS[:15]))
    steps = [Step("notify", receiver.send, side_effect=True)]
    for _ in range(20):
        try:
            result = run_batch(journal, JOB, [{"id": i} for i in IDS], steps, settle_in_task=False)
            break
        except TimeoutError:
            continue
    assert [h.item_id for h in result.held] == IDS[:15]
    return receiver


def decisions() -> list[dict]:
    """What the on-call found: odd items arrived (their receipt), even ones never did."""
    return [{"job_id": JOB, "item_id": i, "step": "notify", "note": "checked the receiver",
             **({"decision": "delivered", "receipt": f"rcpt-{i}"} if int(i[-2:]) % 2 else {"decision": "not_delivered"})}
            for i in IDS[:15]]


def test_fifteen_held_steps_settled_in_one_call_each_audited(journal_location):
    with StepJournal(journal_location) as journal:
        receiver = held_15(journal)
        done = journal.apply_decisions(decisions(), resolved_by="oncall")
        assert [(r.item_id, r.decision) for r in done] == [(d["item_id"], d["decision"]) for d in decisions()]
        audit = journal.resolutions(JOB)
        assert len(audit) == 15 and {a.resolved_by for a in audit} == {"oncall"}
        assert len({a.id for a in audit}) == 15 and journal.held(JOB) == []
        result = run_batch(journal, JOB, [{"id": i} for i in IDS], [Step("notify", receiver.send, side_effect=True)],
                           settle_in_task=False)
        assert (result.status, result.executed_steps) == ("completed", 7)  # the 7 even ones, once
    assert sorted(receiver.got) == IDS and set(receiver.got.values()) == {1}


@pytest.mark.parametrize(("bad", "error", "message"), [
    ({"item_id": "item-99"}, NotHeldError, "entry 7: job 'bulk/job' has no item 'item-99'"),
    ({"decision": "delivered", "receipt": None}, ResolutionError, "entry 7: delivered=True needs the receiver's receipt"),
    ({"decision": "maybe"}, ResolutionError, "entry 7: unknown decision 'maybe'"),
    ({"item_id": "item-16", "decision": "not_delivered"}, NotHeldError, "entry 7: "),  # done: nothing to resolve
    ({"item_id": "item-01"}, ResolutionError, "entry 7: the same step as entry 1"),
    ({"colour": "red"}, ResolutionError, "entry 7: unknown field(s) 'colour'"),
])
def test_one_bad_entry_refuses_the_whole_list_and_changes_nothing(journal_location, bad, error, message):
    with StepJournal(journal_location) as journal:
        held_15(journal)
        before = (journal.rows(JOB), journal.resolutions(JOB), journal.held(JOB))
        entries = decisions()
        entries[6] = {**entries[6], **bad}
        with pytest.raises(error) as refused:
            journal.apply_decisions(entries, resolved_by="oncall")
        assert message in str(refused.value), refused.value
        assert (journal.rows(JOB), journal.resolutions(JOB), journal.held(JOB)) == before


@pytest.mark.parametrize("entries", [[], {"job_id": JOB}, "x", [["not", "a", "mapping"]]])
def test_not_a_list_of_entries_is_refused(journal_location, entries):
    with StepJournal(journal_location) as journal:
        held_15(journal)
        with pytest.raises(ResolutionError):
            journal.apply_decisions(entries, resolved_by="oncall")
        assert len(journal.held(JOB)) == 15 and journal.resolutions(JOB) == []


def _write(path, entries, form):
    if form == "json":
        path.write_text(json.dumps(entries))
        return
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["job_id", "item_id", "step", "decision", "receipt", "note"])
    writer.writeheader()
    writer.writerows(entries)
    path.write_text(out.getvalue())


@pytest.mark.parametrize("form", ["json", "csv"])
def test_cli_resolve_file_settles_fifteen_at_once(tmp_path, form):
    path = tmp_path / "journal.sqlite3"
    with StepJournal(path) as journal:
        held_15(journal)
    decisions_file = tmp_path / f"decisions.{form}"
    _write(decisions_file, decisions(), form)
    result = cli(path, "resolve", "--file", str(decisions_file), "--resolved-by", "oncall", "--json")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)) == 15
    with StepJournal(path) as journal:
        assert journal.held(JOB) == [] and len(journal.resolutions(JOB)) == 15


@pytest.mark.parametrize("form", ["json", "csv"])
def test_cli_resolve_file_with_one_bad_entry_exits_1_and_changes_nothing(tmp_path, form):
    path = tmp_path / "journal.sqlite3"
    with StepJournal(path) as journal:
        held_15(journal)
    entries = decisions()
    entries[6]["item_id"] = "item-99"
    decisions_file = tmp_path / f"decisions.{form}"
    _write(decisions_file, entries, form)
    before = snapshot(path)
    result = cli(path, "resolve", "--file", str(decisions_file))
    assert result.returncode == 1 and "entry 7" in result.stderr and "nothing was changed" in result.stderr
    assert snapshot(path) == before


@pytest.mark.parametrize("args", [
    ["resolve", "--file", "missing.json"],
    ["resolve", "--file", "{file}", "bulk/job"],
    ["resolve", "bulk/job", "item-01"],
])
def test_cli_resolve_bad_usage_exits_2(tmp_path, args):
    path = tmp_path / "journal.sqlite3"
    with StepJournal(path) as journal:
        held_15(journal)
    decisions_file = tmp_path / "decisions.json"
    _write(decisions_file, decisions(), "json")
    before = snapshot(path)
    result = cli(path, *[a.replace("{file}", str(decisions_file)) for a in args])
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert snapshot(path) == before


@pytest.mark.parametrize("input_first", [True, False])
def test_an_item_held_twice_is_settled_whatever_the_order_of_its_decisions(journal_location, input_first):
    """A send held with an unknown outcome, then the item's input changed: two holds on one item. The
    not_delivered decision and use_new_input go through in either order of the list."""
    sent: list[tuple[str, int]] = []

    def send(item, ctx):
        if item["v"] == 1 and not sent:
            sent.append(("lost", 1))
            raise TimeoutError()
        sent.append((ctx.idempotency_key, item["v"]))
        return "rcpt"

    steps = [Step("validate", lambda item, ctx: True), Step("notify", send, side_effect=True)]
    with StepJournal(journal_location) as journal:
        with pytest.raises(TimeoutError):
            run_batch(journal, JOB, [{"id": "a", "v": 1}], steps, settle_in_task=False)
        run_batch(journal, JOB, [{"id": "a", "v": 1}], steps, settle_in_task=False)  # holds notify: unknown outcome
        run_batch(journal, JOB, [{"id": "a", "v": 2}], steps, settle_in_task=False)  # holds validate: input changed
        assert sorted((h.step, h.reason.value) for h in journal.held(JOB)) == [
            ("notify", "unknown_outcome"), ("validate", "input_changed")]
        entries = [{"job_id": JOB, "item_id": "a", "decision": "use_new_input"},
                   {"job_id": JOB, "item_id": "a", "step": "notify", "decision": "not_delivered"}]
        entries = entries if input_first else entries[::-1]
        done = journal.apply_decisions(entries, resolved_by="oncall")
        assert [r.decision for r in done] == [e["decision"] for e in entries]  # in the list's order
        assert journal.held(JOB) == []
        assert run_batch(journal, JOB, [{"id": "a", "v": 2}], steps, settle_in_task=False).status == "completed"
        (row,) = [r for r in journal.rows(JOB) if r.step == "notify"]
        assert row.generation == 1 and sent[1:] == [(idempotency_key(JOB, "a", "notify", 1), 2)]  # once, new key


def test_a_list_naming_more_jobs_than_it_may_claim_at_once_is_refused_before_any_claim(journal_location):
    entries = [{"job_id": f"job-{n:04d}", "item_id": "a", "step": "notify", "decision": "not_delivered"}
               for n in range(501)]
    with StepJournal(journal_location) as journal:
        run_batch(journal, "job-0000", [{"id": "a"}], [Step("notify", lambda item, ctx: "r", side_effect=True)],
                  settle_in_task=False)
        before = backends.snapshot(journal_location)
        with pytest.raises(ResolutionError, match=r"^decisions about 501 jobs in one list; at most 500 .*split"):
            journal.apply_decisions(entries, resolved_by="alice")
        assert backends.snapshot(journal_location) == before


def test_a_list_of_as_many_jobs_as_it_may_name_fits_a_worker_limit_of_1024_open_files(journal_location):
    """Each named job is claimed until the list is applied (on SQLite an open lock file each): 500 jobs
    under a worker's usual limit of 1,024 open files are answered, not an OSError."""
    import resource

    entries = [{"job_id": f"job-{n:04d}", "item_id": "a", "step": "notify", "decision": "not_delivered"}
               for n in range(500)]
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with StepJournal(journal_location) as journal:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        try:
            with pytest.raises(NotHeldError, match="^entry 1: unknown job 'job-0000'"):
                journal.apply_decisions(entries, resolved_by="alice")
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
