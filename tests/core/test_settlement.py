"""A "not now" settled in the task (SPEC §12): a refused send is sent again after the wait the receiver
asked for, an unknown outcome is looked up in the same run, attempts are bounded, a receiver that keeps
failing stops the run without holding anything, a stop ends a wait at once, and with settlement off the
first failing send stops the run as before. On a SQLite journal and a PostgreSQL one, one send at a time
and 16."""

from __future__ import annotations

import threading
import time

import pytest

from airflow_resumable.exceptions import (
    OutcomeUnknownError,
    ReceiverRefused,
    ReceiverUnavailableError,
    ReceiverUnreachable,
)
from airflow_resumable.journal import HeldReason, Status, StepJournal
from airflow_resumable.runner import NOT_DELIVERED, BatchStopped, Settlement, Step, run_batch

pytestmark = pytest.mark.core

# Short waits: what is tested is what happens after them, not how long they are.
QUICK = Settlement(first_backoff=0.01, max_backoff=0.05)
ITEMS = [{"id": f"item-{n:02d}"} for n in range(40)]


class AirflowFailException(Exception):  # noqa: N818 - named as Airflow's: the runner knows it by name
    """Stands in for Airflow's: the runner imports nothing from Airflow and knows it by its name."""


class Rejected(AirflowFailException):
    pass


class Receiver:
    """An outside system scripted per item: each send takes the item's next fault, if any.

    ``refuse``: 429 with Retry-After (nothing taken); ``lost``: taken, then the reply is lost (a timeout);
    ``fail``: a 5xx before taking it; ``down``: no connection; ``reject``: a permanent refusal. Look-ups
    are authoritative (a key never taken is NOT_DELIVERED) unless scripted to fail (``lookup_faults``).
    """

    def __init__(self, faults: dict[str, list[str]] | None = None, *, lookup_faults: int = 0,
                 retry_after: float = 0.02, dedupe: bool = False) -> None:
        self.faults = {key: list(value) for key, value in (faults or {}).items()}
        self.lookup_faults = lookup_faults
        self.retry_after = retry_after
        self.dedupe = dedupe
        self.lock = threading.Lock()
        self.delivered: dict[str, int] = {}  # idempotency key -> deliveries
        self.calls = 0
        self.lookups = 0

    def send(self, item, ctx):
        with self.lock:
            self.calls += 1
            fault = self.faults.get(item["id"], []).pop(0) if self.faults.get(item["id"]) else None
        if fault == "refuse":
            raise ReceiverRefused(429, retry_after=self.retry_after)
        if fault == "down":
            raise ReceiverUnreachable("connection refused")
        if fault == "fail":
            raise OutcomeUnknownError("HTTP 502")
        if fault == "reject":
            raise Rejected("no such recipient")
        with self.lock:
            if not (self.dedupe and ctx.idempotency_key in self.delivered):
                self.delivered[ctx.idempotency_key] = self.delivered.get(ctx.idempotency_key, 0) + 1
        if fault == "lost":
            raise TimeoutError("the reply never came")
        return f"rcpt-{ctx.idempotency_key}"

    def verify(self, ctx):
        with self.lock:
            self.lookups += 1
            if self.lookup_faults:
                self.lookup_faults -= 1
                raise ConnectionResetError("the look-up's connection was reset")
            return f"rcpt-{ctx.idempotency_key}" if ctx.idempotency_key in self.delivered else NOT_DELIVERED

    def duplicates(self) -> int:
        return sum(n - 1 for n in self.delivered.values())


def notify(receiver: Receiver, **options) -> list[Step]:
    return [Step("notify", receiver.send, side_effect=True, verify=receiver.verify, **options)]


@pytest.mark.parametrize("concurrency", [1, 16])
def test_refusals_and_lost_replies_are_settled_in_one_run_with_every_item_delivered_once(journal_location,
                                                                                         concurrency):
    faults = {"item-03": ["refuse", "refuse"], "item-07": ["lost"], "item-11": ["fail", "refuse"],
              "item-20": ["down"], "item-33": ["fail", "lost"]}
    receiver = Receiver(faults)
    with StepJournal(journal_location) as journal:
        result = run_batch(journal, "job", ITEMS, notify(receiver), concurrency=concurrency, settle_in_task=QUICK)
        assert (result.status, result.held, result.items_completed) == ("completed", [], 40)
        assert not journal.open_rows("job")
        assert {r.status for r in journal.rows("job")} == {Status.SUCCEEDED}
    assert len(receiver.delivered) == 40 and receiver.duplicates() == 0
    # Refused sends are sent again (item-03 twice, item-11 after its refusal, item-20); unknown outcomes are
    # looked up, never re-sent blindly: item-07 (a receipt), item-11 (not delivered: sent once), item-33
    # (not delivered, sent once, its reply lost: looked up again, a receipt).
    assert (result.resent_in_task, result.resent_steps) == (4, 2)
    assert result.settled_in_task == 4 and receiver.lookups == 4
    assert result.waits == 8 and result.gave_up == 0


def test_the_counts_of_a_settled_run_add_up(tmp_path):
    receiver = Receiver({"item-01": ["lost"], "item-02": ["refuse"]})
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        result = run_batch(journal, "job", ITEMS[:5], notify(receiver), settle_in_task=QUICK)
    # item-01: sent once (executed), its lost reply settled by the look-up; item-02: sent again once.
    assert (result.executed_steps, result.skipped_steps, result.verified_steps) == (5, 0, 1)
    assert (result.resent_in_task, result.settled_in_task, result.waits, result.resent_steps) == (1, 1, 2, 0)


@pytest.mark.parametrize("concurrency", [1, 16])
def test_an_unknown_outcome_without_verify_is_held_in_the_run_and_the_others_go_on(tmp_path, concurrency):
    receiver = Receiver({"item-05": ["lost"]})
    steps = [Step("notify", receiver.send, side_effect=True)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        result = run_batch(journal, "job", ITEMS, steps, concurrency=concurrency, settle_in_task=QUICK)
        assert [(h.item_id, h.reason) for h in result.held] == [("item-05", HeldReason.UNKNOWN_OUTCOME)]
        assert result.items_completed == 39
    assert receiver.duplicates() == 0 and len(receiver.delivered) == 40


@pytest.mark.parametrize("concurrency", [1, 16])
def test_an_idempotent_step_is_sent_again_with_the_same_key_not_looked_up(tmp_path, concurrency):
    receiver = Receiver({"item-05": ["lost", "fail"], "item-06": ["lost"]}, dedupe=True)
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        result = run_batch(journal, "job", ITEMS, notify(receiver, idempotent=True), concurrency=concurrency,
                           settle_in_task=QUICK)
    assert (result.held, result.items_completed, receiver.lookups) == ([], 40, 0)
    assert result.resent_in_task == 3 and receiver.duplicates() == 0


@pytest.mark.parametrize("concurrency", [1, 16])
def test_a_look_up_that_raises_is_asked_again_and_then_left_for_the_next_try_not_held(tmp_path, concurrency):
    # Each look-up fails until the attempts run out: the step stays FAILED (unknown), nothing is held.
    settlement = Settlement(max_attempts=3, first_backoff=0.01, max_backoff=0.02)
    receiver = Receiver({"item-05": ["lost"]}, lookup_faults=2)
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(ReceiverUnavailableError, match="1 item\\(s\\) waiting.*None of them was held") as failed:
            run_batch(journal, "job", ITEMS, notify(receiver), concurrency=concurrency, settle_in_task=settlement)
        assert (failed.value.items_waiting, failed.value.reason) == (1, "attempts_exhausted")
        (row,) = journal.rows("job", "item-05")
        assert (row.status, row.held_reason, row.not_sent) == (Status.FAILED, None, False)
        assert not journal.held("job")
        assert receiver.lookups == 2
        # The next try asks first (the look-up answers now): a receipt, never a second send.
        result = run_batch(journal, "job", ITEMS, notify(receiver), concurrency=concurrency, settle_in_task=settlement)
        assert (result.status, result.verified_steps, result.skipped_steps) == ("completed", 1, 40)
    assert receiver.duplicates() == 0 and len(receiver.delivered) == 40


@pytest.mark.parametrize("concurrency", [1, 16])
def test_a_receiver_that_stays_down_stops_the_run_after_bounded_attempts_and_the_next_try_resumes(
        journal_location, concurrency):
    settlement = Settlement(max_attempts=4, first_backoff=0.01, max_backoff=0.04)
    down = Receiver({item["id"]: ["down"] * 100 for item in ITEMS})
    with StepJournal(journal_location) as journal:
        with pytest.raises(ReceiverUnavailableError, match="receiver unavailable: .*item\\(s\\) waiting") as failed:
            run_batch(journal, "job", ITEMS, notify(down), concurrency=concurrency, settle_in_task=settlement)
        # Bounded: a few rounds of attempts, not every item's attempts one after another.
        assert down.calls <= (settlement.max_attempts + 1) * (concurrency + max(1, concurrency // 4)) + 4
        assert failed.value.reason == "receiver_failing"
        assert failed.value.items_waiting + (failed.value.items_unread or 0) == 40
        assert not journal.held("job")
        assert all(row.not_sent for row in journal.rows("job"))  # refused before anything was written
        up = Receiver()
        result = run_batch(journal, "job", ITEMS, notify(up), concurrency=concurrency, settle_in_task=settlement)
        assert (result.status, result.items_completed, up.lookups) == ("completed", 40, 0)
    assert len(up.delivered) == 40 and up.duplicates() == 0


@pytest.mark.parametrize("concurrency", [1, 16])
def test_a_stop_during_a_wait_ends_the_try_at_once(tmp_path, concurrency):
    stop = threading.Event()
    receiver = Receiver({"item-02": ["refuse"]}, retry_after=60)
    threading.Timer(0.5, stop.set).start()
    started = time.monotonic()
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(BatchStopped):
            run_batch(journal, "job", ITEMS, notify(receiver), concurrency=concurrency, stop=stop)
        assert time.monotonic() - started < 30  # not the 60 s the receiver asked for
        (row,) = journal.rows("job", "item-02")
        assert (row.status, row.not_sent) == (Status.FAILED, True)  # the next try sends it, unasked
        result = run_batch(journal, "job", ITEMS, notify(receiver), concurrency=concurrency)
        assert result.status == "completed"
    assert receiver.duplicates() == 0 and len(receiver.delivered) == 40


def test_a_wait_longer_than_a_run_waits_stops_it_with_the_receivers_retry_after(tmp_path):
    receiver = Receiver({"item-02": ["refuse"]}, retry_after=3600)
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(ReceiverUnavailableError, match="asked to wait 3600 s") as failed:
            run_batch(journal, "job", ITEMS, notify(receiver), settle_in_task=QUICK)
    assert (failed.value.retry_after, failed.value.reason) == (3600, "long_retry_after")
    # Items 00 and 01 went through; the other 38 (read in, as the batch's first chunk) wait.
    assert (failed.value.items_waiting, failed.value.items_unread) == (38, 0)


@pytest.mark.parametrize("concurrency", [1, 16])
def test_a_permanent_refusal_fails_the_run_at_once_as_before(tmp_path, concurrency):
    receiver = Receiver({"item-04": ["reject"]})
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(Rejected):
            run_batch(journal, "job", ITEMS, notify(receiver), concurrency=concurrency, settle_in_task=QUICK)
        (row,) = journal.rows("job", "item-04")
        assert (row.status, row.error_type) == (Status.FAILED, "Rejected")
    assert receiver.calls < 40 or concurrency > 1


@pytest.mark.parametrize("concurrency", [1, 16])
def test_with_settlement_off_the_first_failing_send_stops_the_run(tmp_path, concurrency):
    receiver = Receiver({"item-04": ["refuse"]})
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(ReceiverRefused):
            run_batch(journal, "job", ITEMS, notify(receiver), concurrency=concurrency, settle_in_task=False)
        (row,) = journal.rows("job", "item-04")
        assert (row.status, row.not_sent) == (Status.FAILED, True)
    assert receiver.calls <= 4 + 2 * concurrency


def test_max_sends_per_second_is_kept_by_every_thread(tmp_path):
    receiver = Receiver()
    moments: list[float] = []

    def send(item, ctx):
        moments.append(time.monotonic())
        return receiver.send(item, ctx)

    steps = [Step("notify", send, side_effect=True, max_sends_per_second=40)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        run_batch(journal, "job", ITEMS, steps, concurrency=16)
    moments.sort()
    # 40 sends at 40/s: never faster than the rate (a lower bound; a loaded machine is only slower).
    assert moments[-1] - moments[0] >= 39 / 40 * 0.9
    for n in range(len(moments) - 20):
        assert moments[n + 20] - moments[n] >= 0.25, "20 sends in a quarter second: twice the rate"


def test_a_rate_learned_from_refusals_stops_hammering_the_receiver(tmp_path):
    """A receiver that takes 50 sends a second and refuses the rest (no Retry-After): the run learns it."""
    lock, window = threading.Lock(), []

    def send(item, ctx):
        now = time.monotonic()
        with lock:
            window[:] = [t for t in window if t > now - 1.0]
            if len(window) >= 50:
                raise ReceiverRefused(429)
            window.append(now)
        return "ok"

    items = [{"id": n} for n in range(300)]
    steps = [Step("notify", send, side_effect=True)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        result = run_batch(journal, "job", items, steps, concurrency=8,
                           settle_in_task=Settlement(max_attempts=20, first_backoff=0.05, max_backoff=0.5))
    assert (result.status, result.items_completed) == ("completed", 300)
    assert result.resent_in_task < 150, "refused again and again: the pace did not adapt"


@pytest.mark.parametrize("options, message", [
    ({"max_sends_per_second": -1}, "max_sends_per_second must be a positive number"),
    ({"max_sends_per_second": 0}, "max_sends_per_second must be a positive number"),
    ({"max_sends_per_second": True}, "max_sends_per_second must be a positive number"),
    ({"max_sends_per_second": 5, "limit_key": 7}, "limit_key must be non-empty text"),
    ({"max_sends_per_second": 5, "limit_key": " "}, "limit_key must be non-empty text"),
    ({"limit_key": "crm"}, "give max_sends_per_second too"),
    ({"idempotent": "yes"}, "idempotent must be True or False"),
])
def test_bad_pace_options_are_refused_when_the_step_is_made(options, message):
    with pytest.raises(ValueError, match=message):
        Step("notify", lambda item, ctx: "ok", side_effect=True, **options)


def test_pace_options_are_for_sends_only():
    with pytest.raises(ValueError, match="for side_effect steps"):
        Step("validate", lambda item, ctx: True, max_sends_per_second=5)


@pytest.mark.parametrize("options, message", [
    ({"max_attempts": 0}, "max_attempts must be a whole number of at least 1"),
    ({"max_attempts": 2.5}, "max_attempts must be a whole number"),
    ({"first_backoff": -1}, "first_backoff must be a number of seconds"),
    ({"max_wait": float("inf")}, "max_wait must be a number of seconds"),
])
def test_bad_settlement_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        Settlement(**options)


def test_settle_in_task_takes_a_switch_or_a_settlement(tmp_path):
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(ValueError, match="settle_in_task must be True, False or a Settlement"):
            run_batch(journal, "job", ITEMS, notify(Receiver()), settle_in_task="yes")
        assert journal.jobs() == []  # refused before anything was written


@pytest.mark.parametrize("mode", ["refuse", "lost"])
@pytest.mark.parametrize("concurrency", [1, 16])
def test_a_runner_killed_during_a_wait_is_resumed_by_the_next_try_exactly_once(journal_location, tmp_path, mode,
                                                                               concurrency):
    """The crash matrix's kill points of settlement: SIGKILL while a refused send waits for its re-send
    (``refuse``), or while a lost reply waits for its look-up (``lost``)."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    from tests.support.postgres_server import wait_until
    from tests.support.receivers import DurableReceiver
    from tests.support.settle_child import ITEMS as CHILD_ITEMS
    from tests.support.settle_child import steps as child_steps

    root = Path(__file__).resolve().parents[2]
    receiver_file, marker = tmp_path / "receiver.sqlite3", tmp_path / "fault-fired"
    DurableReceiver(receiver_file)
    child = subprocess.Popen([sys.executable, "-m", "tests.support.settle_child", journal_location,
                              str(receiver_file), str(marker), mode, str(concurrency)],
                             cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    try:
        assert wait_until(lambda: marker.exists() or child.poll() is not None, 60), "the fault never fired"
        with StepJournal(journal_location) as journal:
            # Killed once the failure is recorded: the item waits (a re-send, or a look-up) in the try.
            assert wait_until(lambda: any(r.item_id == "item-05" and r.status == Status.FAILED
                                          for r in journal.rows("settle/job")), 30)
        assert child.poll() is None, "the child ended instead of waiting"
        time.sleep(0.3)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    receiver = DurableReceiver(receiver_file)
    with StepJournal(journal_location) as journal:
        result = run_batch(journal, "settle/job", CHILD_ITEMS, child_steps(receiver, None, mode))
        assert (result.status, result.held, result.items_completed) == ("completed", [], 20)
        # A refused send is sent again unasked; a lost reply is looked up and found.
        assert result.verified_steps == (1 if mode == "lost" else 0)
    assert receiver.duplicates("settle/job") == 0 and len(receiver.counts("settle/job")) == 20


def test_a_progress_callback_failing_on_the_way_out_does_not_hide_why_the_run_stopped(tmp_path):
    def progress(_):
        raise RuntimeError("the task log is gone")

    receiver = Receiver({"item-02": ["refuse"]}, retry_after=3600)
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(ReceiverUnavailableError, match="asked to wait 3600 s"):
            run_batch(journal, "job", ITEMS, notify(receiver), settle_in_task=QUICK, on_progress=progress,
                      progress_interval=3600)


def test_failures_recorded_late_make_one_round_not_many():
    """A busy runner records failures after the fact: sends that were already on their way when the
    last failure was recorded could not wait for it, so they do not count as rounds of their own."""
    from airflow_resumable.runner.settle import Pace

    now = [10.0]
    pace = Pace(None, adaptive=False, clock=lambda: now[0])
    settlement = Settlement(max_attempts=3, first_backoff=0.05)
    # Ten sends one after the other, each refused; the runner records them all at 10.0, after the last.
    streaks = [pace.failed(9.0 + n * 0.05, 9.01 + n * 0.05, refused=True, retry_after=None, settlement=settlement)
               for n in range(10)]
    assert streaks == [1] * 10
    now[0] = 10.5
    assert pace.failed(10.2, 10.3, refused=True, retry_after=None, settlement=settlement) == 2
    assert pace.paused() > 0, "from the second round every send waits"
    pace.went_through(10.6)
    assert pace.failed(10.7, 10.8, refused=True, retry_after=None, settlement=settlement) == 1
