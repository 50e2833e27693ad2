"""Decisions about what was seen: a person looks at a held send, asks the receiver, and answers - but
meanwhile a run in another process re-sent the step, or another person settled it and a run re-sent
it and it was held again. The first person's answer was true of the row they saw, not of the row as it
is now: it is refused (StaleDecisionError) and nothing changes, so the key is never sent a third time.
And an automatic settlement (verify answered "not delivered") leaves no audit row when a stop lands
before its send.

Runs go through real processes (``tests/support/crash_child.py``) sending over real HTTP to the demo receiver
on 127.0.0.1, with de-duplication off so that the receiver's own count shows every send that reached
it; on a SQLite journal and on a PostgreSQL one.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from airflow_resumable.demo_receiver import serve
from airflow_resumable.exceptions import StaleDecisionError
from airflow_resumable.journal import HeldReason, HeldStep, Resolution, Status, StepJournal, StepRecord
from airflow_resumable.runner import NOT_DELIVERED, BatchStopped, Step, StepContext, idempotency_key, run_batch
from tests.support.crash_child import (
    EXIT_COMPLETED,
    EXIT_NEEDS_REVIEW,
    EXIT_SEND_FAILED,
    ChildRun,
    HttpReceiverClient,
    ReceiverFailed,
    items,
)

pytestmark = pytest.mark.core

JOB = "stale/nightly"
SEND = "notify_external"  # the child's side-effect step
N_ITEMS = 3
EVERY_ITEM_ONCE = {f"item-{i:03d}": 1 for i in range(1, N_ITEMS + 1)}


class Receiver:
    """The demo receiver on a free port of 127.0.0.1, counting every delivery (no de-duplication)."""

    def __init__(self, path: Path) -> None:
        self.server = serve(0, path, dedupe=False)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.store = self.server.store  # type: ignore[attr-defined]
        self.client = HttpReceiverClient(self.url, timeout=10)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fail_next_send(self, item_id: str, mode: str) -> None:
        """``before_accept``: answered 503, nothing stored. ``after_accept``: stored, the reply lost."""
        self.store.arm(item_id, mode)

    def deliveries(self) -> dict[str, int]:
        """The receiver's own count of deliveries per item (one send step: one key per item)."""
        return dict(self.store.stats()["per_item"])

    def has(self, held: HeldStep) -> str | None:
        """What a person learns by asking the receiver about a held send: its receipt, or no record."""
        return self.client.lookup(idempotency_key(held.job_id, held.item_id, held.step, held.generation))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(tmp_path) -> Iterator[Receiver]:
    started = Receiver(tmp_path / "receiver.sqlite3")
    yield started
    started.close()


@dataclass(frozen=True)
class Deployment:
    """What a run in another process needs: where the journal is, and where the receiver is."""

    location: str
    receiver: Receiver
    tmp: Path

    def run_elsewhere(self, expect: int, *, verify: str = "none", only: tuple[str, ...] = ()) -> dict[str, Any]:
        """One run of the job in a process of its own; ``expect`` is its exit code. Returns its summary."""
        code, summary, err = ChildRun(self.tmp, self.location, None, JOB, n_items=N_ITEMS, verify=verify,
                                      http_receiver=self.receiver.url, only=only).finish(timeout=60)
        assert code == expect, (code, summary, err)
        return summary


@pytest.fixture
def world(journal_location, receiver, tmp_path) -> Deployment:
    return Deployment(journal_location, receiver, tmp_path)


def look(journal: StepJournal, item_id: str) -> HeldStep:
    """A person opens the job and reads the held send of ``item_id``, with the version they see."""
    (held,) = [h for h in journal.held(JOB) if h.item_id == item_id]
    assert held.reason == HeldReason.UNKNOWN_OUTCOME and held.version
    return held


def snapshot(journal: StepJournal) -> tuple[list[StepRecord], list[Resolution]]:
    return journal.rows(JOB), journal.resolutions(JOB)


def row(journal: StepJournal, item_id: str) -> StepRecord:
    (found,) = [r for r in journal.rows(JOB, item_id) if r.step == SEND]
    return found


def hold_a_send_that_never_arrived(world: Deployment, item_id: str = "item-002") -> None:
    """The receiver refuses ``item_id``'s first send before accepting it (503: to the runner the outcome
    is unknown), and the next run holds it. The other items are delivered."""
    world.receiver.fail_next_send(item_id, "before_accept")
    assert world.run_elsewhere(EXIT_SEND_FAILED)["send_failed"] == ReceiverFailed.__name__
    assert [h[0] for h in world.run_elsewhere(EXIT_NEEDS_REVIEW)["held"]] == [item_id]
    assert item_id not in world.receiver.deliveries()


@pytest.mark.parametrize("resend", ["answered", "reply_lost"])
def test_a_decision_on_a_held_step_that_a_run_settled_since_is_refused(world, resend):
    """A looks (the receiver has no record: "not delivered"); meanwhile a run in another process asks
    the receiver too and re-sends it once. Answered, the step is done; its reply lost, it is unknown
    again - and A's not_delivered, applied to it, would have the next run send the key a second time."""
    hold_a_send_that_never_arrived(world)
    with StepJournal(world.location) as journal:
        seen = look(journal, "item-002")
        assert world.receiver.has(seen) is None  # A's answer: not delivered

        if resend == "reply_lost":
            world.receiver.fail_next_send("item-002", "after_accept")
        meanwhile = world.run_elsewhere(EXIT_COMPLETED if resend == "answered" else EXIT_SEND_FAILED,
                                        verify="three_way")
        assert world.receiver.deliveries() == EVERY_ITEM_ONCE, meanwhile
        assert row(journal, "item-002").status == (Status.SUCCEEDED if resend == "answered" else Status.FAILED)

        before = snapshot(journal)
        with pytest.raises(StaleDecisionError, match="item-002 / notify_external changed since it was looked at"):
            journal.resolve(JOB, "item-002", SEND, delivered=False, resolved_by="ana",
                            note="the receiver had no record", expected_version=seen.version)
        assert snapshot(journal) == before

    following = world.run_elsewhere(EXIT_COMPLETED, verify="three_way")
    assert (following["executed"], following["resent"]) == (0, 0)
    assert following["verified"] == (1 if resend == "reply_lost" else 0)  # found by key, not sent
    assert world.receiver.deliveries() == EVERY_ITEM_ONCE


def test_a_decision_after_another_person_settled_and_a_run_re_held_the_step_is_refused(world):
    """A and B look at the same held send (no record at the receiver). B answers not_delivered; a run
    sends it, the receiver stores it but the reply is lost, and the next run holds it again. A's
    not_delivered, about the row A saw, would send the key again: refused."""
    hold_a_send_that_never_arrived(world)
    with StepJournal(world.location) as journal:
        seen_by_ana, seen_by_ben = look(journal, "item-002"), look(journal, "item-002")
        assert world.receiver.has(seen_by_ana) is None and world.receiver.has(seen_by_ben) is None
        journal.resolve(JOB, "item-002", SEND, delivered=False, resolved_by="ben",
                        note="the receiver had no record", expected_version=seen_by_ben.version)

        world.receiver.fail_next_send("item-002", "after_accept")
        world.run_elsewhere(EXIT_SEND_FAILED)  # the one deliberate re-send: stored, reply lost
        assert [h[0] for h in world.run_elsewhere(EXIT_NEEDS_REVIEW)["held"]] == ["item-002"]
        assert look(journal, "item-002").version != seen_by_ana.version

        before = snapshot(journal)
        with pytest.raises(StaleDecisionError, match="changed since it was looked at.*held \\(unknown_outcome\\)"):
            journal.resolve(JOB, "item-002", SEND, delivered=False, resolved_by="ana",
                            note="the receiver had no record", expected_version=seen_by_ana.version)
        # The short form a table shows (its first 8 characters) stands for the version it starts: refused too.
        short = seen_by_ana.version[:8]
        with pytest.raises(StaleDecisionError, match=f"changed since it was looked at \\(version {short}\\)"):
            journal.resolve(JOB, "item-002", SEND, delivered=False, resolved_by="ana",
                            note="the receiver had no record", expected_version=short)
        assert snapshot(journal) == before
        assert [(r.decision, r.resolved_by) for r in journal.resolutions(JOB)] == [("not_delivered", "ben")]

        # Looked at again (in a table: the short form), the send is found at the receiver: settled on what it is now.
        now = look(journal, "item-002")
        receipt = world.receiver.has(now)
        assert receipt is not None
        journal.resolve(JOB, "item-002", SEND, delivered=True, receipt=receipt, resolved_by="ana",
                        expected_version=now.version[:8])

    assert world.run_elsewhere(EXIT_COMPLETED)["executed"] == 0
    # Two deliberate sends of item-002 (the first refused before it was stored): one delivery, no third.
    assert world.receiver.deliveries() == EVERY_ITEM_ONCE


def decision(item_id: str, version: str | None, receipt: str | None) -> Mapping[str, Any]:
    """One entry of a list of decisions: delivered when the receiver had a receipt, else not_delivered."""
    return {"job_id": JOB, "item_id": item_id, "step": SEND, "version": version, "receipt": receipt,
            "decision": "delivered" if receipt else "not_delivered"}


def test_a_list_of_decisions_with_one_stale_entry_applies_none(world):
    """A looks at two held sends and decides both in one list; meanwhile a run in another process
    re-sent one of them. The list is refused as a whole: the other entry, still true, is not applied."""
    world.receiver.fail_next_send("item-001", "after_accept")  # stored, the reply lost
    world.run_elsewhere(EXIT_SEND_FAILED)
    world.receiver.fail_next_send("item-002", "before_accept")  # refused, nothing stored
    world.run_elsewhere(EXIT_SEND_FAILED)
    assert [h[0] for h in world.run_elsewhere(EXIT_NEEDS_REVIEW)["held"]] == ["item-001", "item-002"]
    with StepJournal(world.location) as journal:
        first, second = look(journal, "item-001"), look(journal, "item-002")
        seen = [decision("item-001", first.version, world.receiver.has(first)),
                decision("item-002", second.version, world.receiver.has(second))]
        assert [entry["decision"] for entry in seen] == ["delivered", "not_delivered"]

        world.receiver.fail_next_send("item-002", "after_accept")
        world.run_elsewhere(EXIT_SEND_FAILED, verify="three_way", only=("item-002",))  # re-sent, reply lost

        before = snapshot(journal)
        with pytest.raises(StaleDecisionError, match="^entry 2: .*item-002 / notify_external changed since"):
            journal.apply_decisions(seen, resolved_by="ana")
        assert snapshot(journal) == before
        assert [h.item_id for h in journal.held(JOB)] == ["item-001"]  # the true entry was not applied

        # Looked at again: both are at the receiver now, and decided on the rows as they are.
        now = [row(journal, "item-001"), row(journal, "item-002")]
        assert now[0].version == first.version and now[1].version != second.version
        receipts = [world.receiver.has(first), world.receiver.has(second)]
        assert all(receipts)
        journal.apply_decisions([decision(r.item_id, r.version, receipt) for r, receipt in zip(now, receipts)],
                                resolved_by="ana")
        assert [(r.item_id, r.decision, r.resolved_by) for r in journal.resolutions(JOB)] == [
            ("item-002", "not_delivered", "verify"), ("item-001", "delivered", "ana"), ("item-002", "delivered", "ana")]

    assert world.run_elsewhere(EXIT_COMPLETED)["executed"] == 0
    assert world.receiver.deliveries() == EVERY_ITEM_ONCE


@pytest.mark.parametrize("concurrency", [1, 16])
def test_a_stop_between_verify_and_the_send_leaves_no_audit_row_and_sends_nothing(journal_location, receiver,
                                                                                   concurrency):
    """verify says the receiver never got item-002's key, and the stop lands right after that answer:
    the send never starts, so there is no "sent again once" audit row and no IN_FLIGHT mark. The next
    run (no stop) asks again, sends it once, and audits that once."""
    batch = items(5)
    stop = threading.Event()

    def send(item: Mapping[str, Any], ctx: StepContext) -> str:
        return receiver.client.deliver(ctx.job_id, ctx.item_id, ctx.step, ctx.idempotency_key, str(item["amount"]))

    def verify_then_stop(ctx: StepContext) -> Any:
        answer = receiver.client.lookup(ctx.idempotency_key) or NOT_DELIVERED
        if answer is NOT_DELIVERED:
            stop.set()  # as on_kill does from its signal handler, between the answer and the send
        return answer

    steps = [Step(SEND, send, side_effect=True, verify=verify_then_stop)]
    with StepJournal(journal_location) as journal:
        receiver.fail_next_send("item-002", "before_accept")
        with pytest.raises(ReceiverFailed):
            run_batch(journal, JOB, batch, steps, concurrency=concurrency, settle_in_task=False)
        sent_before = receiver.deliveries()
        assert "item-002" not in sent_before

        with pytest.raises(BatchStopped):
            run_batch(journal, JOB, batch, steps, concurrency=concurrency, stop=stop, settle_in_task=False)
        assert stop.is_set()
        assert [r for r in journal.resolutions(JOB) if r.resolved_by == "verify"] == []
        assert row(journal, "item-002").status == Status.FAILED
        assert [r.item_id for r in journal.rows(JOB) if r.status == Status.IN_FLIGHT] == []
        assert receiver.deliveries() == sent_before

        resumed = run_batch(journal, JOB, batch, steps, concurrency=concurrency, stop=threading.Event(),
                            settle_in_task=False)
        assert (resumed.status, resumed.resent_steps) == ("completed", 1)
        (audit,) = [r for r in journal.resolutions(JOB) if r.resolved_by == "verify"]
        assert (audit.item_id, audit.decision, audit.previous_status) == ("item-002", "not_delivered", "FAILED")
    assert receiver.deliveries() == {item["id"]: 1 for item in batch}
