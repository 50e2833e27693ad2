"""Stop means stop: once ``stop`` is set (the operator's on_kill), no send starts; the sends in
flight are recorded; the job shows as unfinished and is never pruned until a run goes through the whole
batch. On a SQLite journal and on a PostgreSQL one, one send at a time and 16."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from airflow_resumable.journal import Status, StepJournal
from airflow_resumable.runner import BatchStopped, NotSentError, Step, run_batch
from tests.support.postgres_server import wait_until

pytestmark = pytest.mark.core

JOB = "stop/job"
ITEMS = [{"id": f"item-{i:03d}"} for i in range(1, 121)]


class Receiver:
    """Counts sends; records whether each one *started* after the stop was asked for."""

    def __init__(self, stop: threading.Event, stop_after: int | None) -> None:
        self.stop, self.stop_after = stop, stop_after
        self.lock = threading.Lock()
        self.sent: dict[str, int] = {}
        self.started_after_stop = 0
        self.started_before_stop = 0  # sends begun when the stop was asked for

    def send(self, item, ctx):
        with self.lock:
            self.started_after_stop += self.stop.is_set()
            count = sum(self.sent.values()) + 1
            self.sent[item["id"]] = self.sent.get(item["id"], 0) + 1
        time.sleep(0.004)
        if self.stop_after is not None and count == self.stop_after:
            with self.lock:  # as on_kill does, from the SIGTERM handler, while sends are in flight
                self.started_before_stop = sum(self.sent.values())
                self.stop.set()
        return f"rcpt-{item['id']}"


@pytest.mark.parametrize("concurrency", [1, 16])
def test_no_send_starts_after_stop_and_the_job_stays_unfinished_until_resumed(journal_location, concurrency):
    stop = threading.Event()
    receiver = Receiver(stop, stop_after=30)
    steps = [Step("validate", lambda item, ctx: True), Step("notify", receiver.send, side_effect=True)]
    with StepJournal(journal_location) as journal:
        progress = []
        with pytest.raises(BatchStopped, match="no new send was started"):
            run_batch(journal, JOB, ITEMS, steps, concurrency=concurrency, stop=stop, on_progress=progress.append,
                      progress_interval=3600)
        # No send was dispatched after the stop; at 16, sends dispatched just before it may reach the
        # receiver after it (at most the others then in flight).
        assert receiver.started_after_stop <= concurrency - 1
        sent = sum(receiver.sent.values())
        # The sends begun before the stop (on a loaded machine the stopping send may be slow to come
        # back, and others start meanwhile), and at most the others then being dispatched.
        assert 30 <= receiver.started_before_stop <= sent <= receiver.started_before_stop + concurrency - 1, sent
        # Every send made is recorded (none left IN_FLIGHT: they finished), and the run says how far it got.
        # At 16, the sends marked and queued for a thread when the stop came never started: their marks
        # were taken back (their rows went), so they are as if never reached.
        rows = [r for r in journal.rows(JOB) if r.step == "notify"]
        assert {r.item_id for r in rows} == set(receiver.sent) and {r.status for r in rows} == {Status.SUCCEEDED}
        assert progress[-1].items_done == sent < len(ITEMS)
        job = journal.job(JOB)
        assert job is not None and job.status == "unfinished" and job.finished_at is None
        assert journal.prune(timedelta(0)) == []  # a job stopped part way is never pruned as finished

        again = Receiver(threading.Event(), None)
        resumed = run_batch(journal, JOB, ITEMS, [Step("validate", lambda item, ctx: True),
                                                  Step("notify", again.send, side_effect=True)], concurrency=concurrency)
        assert resumed.status == "completed" and resumed.executed_steps + resumed.skipped_steps == 2 * len(ITEMS)
        # Each item reached the receiver once, over the two runs.
        assert sorted([*receiver.sent, *again.sent]) == [i["id"] for i in ITEMS]
        assert set(receiver.sent.values()) == set(again.sent.values()) == {1}
        job = journal.job(JOB)
        assert job is not None and job.status == "completed" and job.finished_at is not None
        assert journal.prune(timedelta(0)) == [JOB]


def test_a_stop_asked_before_the_run_sends_nothing_and_a_finished_job_runs_unfinished_again(journal_location):
    stop = threading.Event()
    receiver = Receiver(stop, stop_after=None)
    steps = [Step("notify", receiver.send, side_effect=True)]
    with StepJournal(journal_location) as journal:
        run_batch(journal, JOB, ITEMS[:5], steps)
        assert journal.job(JOB).status == "completed"
        stop.set()
        with pytest.raises(BatchStopped):
            run_batch(journal, JOB, ITEMS, steps, stop=stop)
        assert sum(receiver.sent.values()) == 5 and receiver.started_after_stop == 0
        # Nothing was written by the stopped run: the job is as the last run left it.
        assert journal.job(JOB).status == "completed"
        stop.clear()
        receiver.stop_after = 7  # the 7th send of this run stops it (2 new items sent)
        with pytest.raises(BatchStopped):
            run_batch(journal, JOB, ITEMS, steps, stop=stop)
        assert journal.job(JOB).status == "unfinished"


def test_an_empty_batch_finishes_a_new_job(journal_location):
    with StepJournal(journal_location) as journal:
        run_batch(journal, "stop/empty", [], [Step("notify", lambda item, ctx: "r", side_effect=True)])
        job = journal.job("stop/empty")
        assert job is not None and job.status == "completed"


@pytest.mark.parametrize("ended_by", ["stop", "a send raising"])
@pytest.mark.parametrize("earlier_row", [False, True], ids=["new row", "row of an earlier run"])
def test_a_send_queued_for_a_thread_when_the_run_ends_never_starts_and_its_mark_is_taken_back(
    journal_location, earlier_row, ended_by
):
    """At concurrency 4 a fifth send is marked IN_FLIGHT and queued while four sends are under way (so
    a thread that finishes takes it at once). The run ends while it waits - stopped, or one of the four
    sends raises: it never reaches the receiver, and its mark is taken back - its row goes if the mark
    created it, else it is FAILED and provably not sent with its attempts as before - so the next run
    sends it with no verify and no human."""
    queued = "item-005"
    release = threading.Event()
    calls: list[str] = []
    refuse = {queued} if earlier_row else set()  # the earlier run's try of the queued item is refused

    failing = threading.Event()  # "a send raising": item-002's send raises once this is set

    def send(item, ctx):
        calls.append(item["id"])
        if item["id"] in refuse:
            raise NotSentError("refused before anything left")
        while not release.is_set():
            if item["id"] == "item-002" and failing.is_set():
                raise NotSentError("refused before anything left")
            time.sleep(0.01)
        return f"rcpt-{item['id']}"

    stop = threading.Event()
    steps = [Step("notify", send, side_effect=True)]
    with StepJournal(journal_location) as journal, StepJournal(journal_location) as onlooker:
        if earlier_row:
            with pytest.raises(NotSentError):
                run_batch(journal, JOB, [{"id": queued}], steps, settle_in_task=False)
            calls.clear()
            refuse.clear()
            earlier = next(r for r in journal.rows(JOB) if r.item_id == queued)
            assert earlier.status == Status.FAILED and earlier.not_sent and earlier.attempts == 1

        def queued_marked() -> bool:
            rows = {r.item_id: r.status for r in onlooker.rows(JOB)}
            return len(calls) == 4 and rows.get(queued) == Status.IN_FLIGHT

        outcome: list[BaseException | None] = []
        runner = threading.Thread(target=lambda: outcome.append(_raised(
            # Without settlement: a send that raises halts the queued ones (with it, it would be sent again).
            lambda: run_batch(journal, JOB, ITEMS[:20], steps, concurrency=4, stop=stop, settle_in_task=False))))
        runner.start()
        try:
            assert wait_until(queued_marked, 30), (calls, onlooker.rows(JOB))
            if ended_by == "stop":
                stop.set()
            else:  # item-002 raises while the other three are still under way; they end after that
                failing.set()
                assert wait_until(lambda: any(r.item_id == "item-002" and r.status == Status.FAILED
                                              for r in onlooker.rows(JOB)), 30)
        finally:
            release.set()
            runner.join(30)
        assert isinstance(outcome[0], BatchStopped if ended_by == "stop" else NotSentError), outcome
        assert sorted(calls) == ["item-001", "item-002", "item-003", "item-004"]  # the queued one never started
        rows = {r.item_id: r for r in journal.rows(JOB)}
        sent = {f"item-00{i}" for i in range(1, 5)} - ({"item-002"} if failing.is_set() else set())
        assert {item for item, r in rows.items() if r.status == Status.SUCCEEDED} == sent
        if earlier_row:
            assert rows[queued].status == Status.FAILED and rows[queued].not_sent and rows[queued].attempts == 1
            assert rows[queued].error_type == ("BatchStopped" if ended_by == "stop" else "NotSentError")
        else:
            assert queued not in rows
        assert journal.job(JOB).unresolved == 0

        stop.clear()
        failing.clear()
        calls.clear()
        resumed = run_batch(journal, JOB, ITEMS[:20], steps, concurrency=4)
        assert resumed.status == "completed" and not resumed.held and resumed.verified_steps == 0
        # Every send not made before (the taken-back one among them) once, and no human was asked.
        assert sorted(calls) == sorted({i["id"] for i in ITEMS[:20]} - sent)


def _raised(call) -> BaseException | None:
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the test looks at what the run raised
        return exc
    return None


def test_a_send_that_waited_over_a_second_for_a_thread_renews_its_mark_before_it_starts(journal_location, caplog):
    """The four threads are busy for 1.5 s; the fifth send, marked and queued meanwhile, has waited too
    long when a thread frees (a shared journal's claim could have passed on): it is not started on
    that mark. Its mark is committed again, then it is sent - once, with one attempt counted."""
    slow = {"item-001", "item-002", "item-003", "item-004"}
    calls: list[str] = []

    def send(item, ctx):
        calls.append(item["id"])
        if item["id"] in slow:
            time.sleep(1.5)
        return f"rcpt-{item['id']}"

    with StepJournal(journal_location) as journal, caplog.at_level("INFO", logger="airflow_resumable.runner"):
        result = run_batch(journal, JOB, ITEMS[:6], [Step("notify", send, side_effect=True)], concurrency=4)
        assert result.status == "completed" and not result.held
        assert sorted(calls) == [f"item-00{i}" for i in range(1, 7)]  # each once
        assert "item item-005: notify waited over 1 s for a thread" in caplog.text
        assert {(r.item_id, r.status, r.attempts) for r in journal.rows(JOB)} == {
            (f"item-00{i}", Status.SUCCEEDED, 1) for i in range(1, 7)}
        assert journal.resolutions(JOB) == []


# -------------------------------------------- an error while the last sends end (execution_timeout)


class TaskTimeout(Exception):
    """What Airflow's execution_timeout raises in the task's main thread (from a SIGALRM handler)."""


def test_an_error_while_the_last_sends_end_starts_none_of_the_queued_ones(tmp_path):
    """Airflow's execution timeout raises in the main thread and stops the task only after execute()
    unwound. Raised while the run waited for its last sends, the queued ones all started on the way out
    (the thread pool was shut down before anything halted them); now none does, and their marks go."""
    import signal

    started, release = [], threading.Event()

    def send(item, ctx):
        started.append(item["id"])
        release.wait(30)
        return "ok"

    def timeout(signum, frame):
        raise TaskTimeout()

    def fire_then_release():
        wait_until(lambda: len(started) == 2, timeout=30)
        time.sleep(0.3)  # the run is waiting for those two in its last round
        signal.pthread_kill(threading.main_thread().ident, signal.SIGALRM)
        time.sleep(0.5)
        release.set()

    previous = signal.signal(signal.SIGALRM, timeout)
    helper = threading.Thread(target=fire_then_release)
    helper.start()
    try:
        with StepJournal(tmp_path / "journal.sqlite3") as journal:
            with pytest.raises(TaskTimeout):
                run_batch(journal, JOB, [{"id": n} for n in ("1", "2", "3")],
                          [Step("send", send, side_effect=True)], concurrency=2)
            helper.join(30)
            assert sorted(started) == ["1", "2"], "a queued send started after the error"
            assert {r.item_id: r.status for r in journal.rows(JOB)} == {"1": Status.SUCCEEDED, "2": Status.SUCCEEDED}
            assert run_batch(journal, JOB, [{"id": "3"}], [Step("send", send, side_effect=True)]).held == []
            assert started == ["1", "2", "3"]
    finally:
        release.set()
        signal.signal(signal.SIGALRM, previous)


def test_a_send_handed_back_for_waiting_too_long_is_not_left_in_flight_by_a_stop(tmp_path, monkeypatch):
    """A queued send that waited too long for a thread is handed back and marked again before it starts.
    A stop in between left its committed mark IN_FLIGHT although it never started, and the next run held
    it for a human; its mark is taken back now, and the next run sends it."""
    from airflow_resumable.runner import drivers

    monkeypatch.setattr(drivers, "MAX_QUEUE_WAIT", 0.2)
    stop, sent = threading.Event(), []

    def prepare(item, ctx):
        if item["id"] == "4":  # the run's own thread is busy while item 3 is handed back, then asked to stop
            time.sleep(1.2)
            stop.set()
        return None

    def send(item, ctx):
        sent.append(item["id"])
        if item["id"] in ("1", "2"):
            time.sleep(0.6)
        return "ok"

    items = [{"id": str(n)} for n in range(1, 6)]
    steps = [Step("prepare", prepare), Step("send", send, side_effect=True)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(BatchStopped):
            run_batch(journal, JOB, items, steps, concurrency=2, stop=stop)
        never_started = {r.item_id for r in journal.rows(JOB) if r.step == "send"} - set(sent)
        assert all(r.status != Status.IN_FLIGHT for r in journal.rows(JOB) if r.item_id in never_started)
        again = run_batch(journal, JOB, items, steps, concurrency=2)
        assert again.held == [] and again.status == "completed"
        assert sorted(sent) == ["1", "2", "3", "4", "5"]


def test_a_journal_failing_while_a_failing_round_is_recorded_ends_the_run(tmp_path):
    """A send failed, and the journal failed (locked past the busy timeout by another writer) while the
    run recorded that round: some ended sends were out of the queue it then waited on, and the task hung
    for ever. It ends with the journal's error now."""
    import sqlite3

    from airflow_resumable.journal import JournalError

    path = tmp_path / "journal.sqlite3"
    locked: list[sqlite3.Connection] = []

    def send(item, ctx):
        if item["id"] == "1":
            time.sleep(1.0)
            raise RuntimeError("the receiver answered 500")
        if item["id"] == "2":
            time.sleep(1.3)
        return "ok"

    calls: list[object] = []

    def on_progress(progress):
        calls.append(progress)
        if len(calls) == 3:  # item 3 is queued behind the two sends
            time.sleep(1.6)
            other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
            other.execute("BEGIN IMMEDIATE")  # another task writing the same journal file
            locked.append(other)

    outcome: dict = {}

    def run() -> None:
        with StepJournal(path, busy_timeout=0.3) as journal:
            try:
                run_batch(journal, JOB, [{"id": str(n)} for n in range(1, 6)], [Step("send", send, side_effect=True)],
                          concurrency=2, on_progress=on_progress, progress_interval=0)
            except BaseException as exc:  # noqa: BLE001
                outcome["raised"] = exc

    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(60)
    for conn in locked:
        conn.rollback()
        conn.close()
    assert not runner.is_alive(), "the run hung"
    assert isinstance(outcome.get("raised"), (JournalError, RuntimeError)), outcome
