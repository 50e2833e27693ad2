"""The article's experiment through the core API, on a SQLite journal and on a PostgreSQL one."""

from __future__ import annotations

import pytest

from airflow_resumable.journal import HeldReason, HeldStep, StepJournal
from airflow_resumable.runner import idempotency_key, run_batch
from tests.support.receivers import AcceptedThenLost, DurableReceiver, RefusedBeforeAccept
from tests.support.scenario import FaultOnce, article_items, article_steps, rerun_everything

pytestmark = pytest.mark.core

JOB = "article/job-1"


@pytest.mark.parametrize(
    ("mode", "error", "baseline_duplicates", "third_run_executes"),
    [("before_accept", RefusedBeforeAccept, 40, 1), ("after_accept", AcceptedThenLost, 41, 0)],
)
def test_article_scenario(tmp_path, journal_location, mode, error, baseline_duplicates, third_run_executes):
    items = article_items()

    # The plain re-run-all baseline, against its own receiver.
    plain = DurableReceiver(tmp_path / "plain-receiver.sqlite3")
    assert rerun_everything(plain, JOB, items, FaultOnce("item-041", mode)) == 150
    assert plain.duplicates(JOB) == baseline_duplicates

    receiver = DurableReceiver(tmp_path / "receiver.sqlite3")
    fault = FaultOnce("item-041", mode)
    with StepJournal(journal_location) as journal:
        with pytest.raises(error):
            run_batch(journal, JOB, items, article_steps(receiver, fault), settle_in_task=False)
        assert len(receiver.counts(JOB)) == (40 if mode == "before_accept" else 41)

        second = run_batch(journal, JOB, items, article_steps(receiver, fault), settle_in_task=False)
        assert (second.executed_steps, second.skipped_steps) == (27, 122)
        assert second.held == [HeldStep(JOB, "item-041", "notify_external", HeldReason.UNKNOWN_OUTCOME)]
        assert second.status == "needs_review"
        assert second.items_completed == 49 and second.items_total == 50
        assert journal.held(JOB) == second.held

        # The human asks the receiver, as the article does, and records what it said.
        receipt = receiver.lookup(idempotency_key(JOB, "item-041", "notify_external"))
        if mode == "before_accept":
            assert receipt is None
            journal.resolve(JOB, "item-041", "notify_external", delivered=False, resolved_by="oncall",
                            note="receiver has no record")
        else:
            assert receipt is not None
            journal.resolve(JOB, "item-041", "notify_external", delivered=True, receipt=receipt,
                            resolved_by="oncall")

        third = run_batch(journal, JOB, items, article_steps(receiver, fault), settle_in_task=False)
        assert third.executed_steps == third_run_executes
        assert third.held == [] and third.status == "completed" and third.items_completed == 50
        assert journal.held(JOB) == []
        audit = journal.resolutions(JOB)
        assert [a.decision for a in audit] == ["not_delivered" if mode == "before_accept" else "delivered"]
        assert audit[0].resolved_by == "oncall"

    counts = receiver.counts(JOB)
    assert sorted(counts) == [f"item-{i:03d}" for i in range(1, 51)]
    assert set(counts.values()) == {1}, "every item reaches the receiver exactly once"


@pytest.mark.parametrize("mode", ["before_accept", "after_accept"])
def test_verify_finds_receipt_so_nothing_is_held(tmp_path, journal_location, mode):
    items = article_items()
    receiver = DurableReceiver(tmp_path / "receiver.sqlite3")
    fault = FaultOnce("item-041", mode)
    with StepJournal(journal_location) as journal:
        with pytest.raises((RefusedBeforeAccept, AcceptedThenLost)):
            run_batch(journal, JOB, items, article_steps(receiver, fault, with_verify=True), settle_in_task=False)
        second = run_batch(journal, JOB, items, article_steps(receiver, fault, with_verify=True), settle_in_task=False)
        if mode == "after_accept":
            # The receiver has it: verified, not re-sent, not held.
            assert second.held == [] and second.status == "completed"
            assert second.verified_steps == 1
            assert (second.executed_steps, second.skipped_steps) == (27, 123)
        else:
            # Verify says "no receipt": still never sent blindly, the item is held.
            assert [h.item_id for h in second.held] == ["item-041"]
    counts = receiver.counts(JOB)
    assert set(counts.values()) == {1}
    assert len(counts) == (50 if mode == "after_accept" else 49)
