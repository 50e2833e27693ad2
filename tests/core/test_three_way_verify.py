"""Verify has three answers: a receipt (done), None (cannot tell: hold), NOT_DELIVERED (the
receiver affirms it never got the key: send now, once, audited as resolved by ``verify``). On a SQLite
journal and on a PostgreSQL one."""

from __future__ import annotations

import datetime

import pytest

from airflow_resumable.journal import HeldReason, HeldStep, Status, StepJournal
from airflow_resumable.runner import NOT_DELIVERED, Step, idempotency_key, run_batch, verify_held

pytestmark = pytest.mark.core

JOB = "three-way/job"


class Receiver:
    """Authoritative look-up: it records a delivery before it answers."""

    def __init__(self) -> None:
        self.delivered: dict[str, int] = {}
        self.refuse: set[str] = set()

    def send(self, item, ctx):
        if item["id"] in self.refuse:
            self.refuse.discard(item["id"])
            raise TimeoutError()  # no reply: the outcome is unknown (here it never arrived)
        self.delivered[ctx.idempotency_key] = self.delivered.get(ctx.idempotency_key, 0) + 1
        return f"rcpt-{item['id']}"

    def lookup(self, ctx):
        return f"rcpt-{ctx.item_id}" if ctx.idempotency_key in self.delivered else None

    def three_way(self, ctx):
        return self.lookup(ctx) or NOT_DELIVERED


ITEMS = [{"id": i} for i in ("a", "b", "c")]


def fail_once_at(journal: StepJournal, receiver: Receiver, item_id: str) -> list[Step]:
    """A first run whose send of ``item_id`` gets no reply (it never arrived); returns the plain steps."""
    receiver.refuse.add(item_id)
    plain = [Step("notify", receiver.send, side_effect=True)]
    with pytest.raises(TimeoutError):
        run_batch(journal, JOB, ITEMS, plain, settle_in_task=False)
    return plain


def test_not_delivered_sends_a_held_send_once_and_audits_it(journal_location):
    receiver = Receiver()
    with StepJournal(journal_location) as journal:
        plain = fail_once_at(journal, receiver, "b")
        held = run_batch(journal, JOB, ITEMS, plain, settle_in_task=False)  # no verify: held, never re-sent blindly
        assert held.held == [HeldStep(JOB, "b", "notify", HeldReason.UNKNOWN_OUTCOME)]

        three_way = [Step("notify", receiver.send, side_effect=True, verify=receiver.three_way)]
        result = run_batch(journal, JOB, ITEMS, three_way, settle_in_task=False)
        assert (result.status, result.held, result.resent_steps, result.executed_steps) == ("completed", [], 1, 1)
        assert set(receiver.delivered.values()) == {1} and len(receiver.delivered) == 3
        (audit,) = journal.resolutions(JOB)
        assert (audit.item_id, audit.step, audit.decision, audit.resolved_by, audit.receipt) == (
            "b", "notify", "not_delivered", "verify", None)
        assert (audit.previous_status, audit.previous_held_reason) == ("FAILED", "unknown_outcome")
        (row,) = journal.rows(JOB, "b")
        assert (row.status, row.receipt, row.held_reason, row.attempts) == (Status.SUCCEEDED, "rcpt-b", None, 2)
        # Resumed again: nothing is sent, nothing audited.
        again = run_batch(journal, JOB, ITEMS, three_way, settle_in_task=False)
        assert (again.executed_steps, again.resent_steps, len(journal.resolutions(JOB))) == (0, 0, 1)


def test_none_still_holds_and_a_receipt_still_settles_without_a_send(journal_location):
    receiver = Receiver()
    with StepJournal(journal_location) as journal:
        fail_once_at(journal, receiver, "c")
        unsure = run_batch(journal, JOB, ITEMS, [Step("notify", receiver.send, side_effect=True,
                                                      verify=receiver.lookup)], settle_in_task=False)
        assert unsure.held == [HeldStep(JOB, "c", "notify", HeldReason.UNKNOWN_OUTCOME)]
        assert idempotency_key(JOB, "c", "notify") not in receiver.delivered and journal.resolutions(JOB) == []


# Answers that are no receipt: a look-up saying "not found" as False (or 0, {}, []), a record object,
# bytes, and text the journal could not keep as a receipt.
NOT_RECEIPTS = [False, True, 0, 17, {}, [], {"found": True}, b"rcpt", datetime.datetime(2026, 12, 5), "a\x00b",
                "r" * (64 * 1024 + 1)]


@pytest.mark.parametrize("answer", NOT_RECEIPTS, ids=lambda a: type(a).__name__)
def test_an_answer_that_is_no_receipt_holds_and_never_settles(journal_location, answer):
    """Only text settles a send as delivered: the item the receiver never got is held for a human (in a
    run and in verify_held), never marked SUCCEEDED and never sent; verify_held goes on to the next."""
    receiver = Receiver()
    with StepJournal(journal_location) as journal:
        fail_once_at(journal, receiver, "b")
        receiver.refuse.add("c")  # c's send gets no reply this time
        with pytest.raises(TimeoutError):
            run_batch(journal, JOB, ITEMS, [Step("notify", receiver.send, side_effect=True, verify=lambda ctx: answer)],
                      settle_in_task=False)
        assert journal.held(JOB) == [HeldStep(JOB, "b", "notify", HeldReason.UNKNOWN_OUTCOME)]
        (row,) = journal.rows(JOB, "b")
        assert (row.status, row.receipt) == (Status.FAILED, None)

        receiver.delivered[idempotency_key(JOB, "c", "notify")] = 1  # c did arrive; its reply was lost
        settled = verify_held(journal, JOB, lambda ctx: answer if ctx.item_id == "b" else receiver.lookup(ctx))
        assert [s.item_id for s in settled] == ["c"]  # b's answer holds b; c's receipt still settles c
        assert journal.held(JOB)[0].item_id == "b" and [r.item_id for r in journal.resolutions(JOB)] == ["c"]
    assert idempotency_key(JOB, "b", "notify") not in receiver.delivered


def test_verify_held_resolves_not_delivered_so_the_next_run_sends_once(journal_location):
    receiver = Receiver()
    with StepJournal(journal_location) as journal:
        steps = fail_once_at(journal, receiver, "a")
        settled = verify_held(journal, JOB, receiver.three_way)  # e.g. the sensor's verify
        assert settled == [HeldStep(JOB, "a", "notify", HeldReason.UNKNOWN_OUTCOME)]
        (audit,) = journal.resolutions(JOB)
        assert (audit.decision, audit.resolved_by) == ("not_delivered", "verify")
        result = run_batch(journal, JOB, ITEMS, steps, settle_in_task=False)
        assert (result.status, result.executed_steps) == ("completed", 3)
        assert set(receiver.delivered.values()) == {1} and len(receiver.delivered) == 3


def test_not_delivered_is_one_value_that_survives_pickling():
    import pickle

    assert pickle.loads(pickle.dumps(NOT_DELIVERED)) is NOT_DELIVERED
    assert repr(NOT_DELIVERED) == "NOT_DELIVERED" and type(NOT_DELIVERED)() is NOT_DELIVERED
