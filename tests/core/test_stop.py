"""Stop means stop: once ``stop`` is set (the operator's on_kill), no send starts; the sends in
flight are recorded; the job shows as unfinished and is never pruned until a run goes through the whole
batch. On a SQLite journal and on a PostgreSQL one, one send at a time and 16."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from airflow_resumable.journal import Status, StepJournal
from airflow_resumable.runner import BatchStopped, Step, run_batch

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
        rows = [r for r in journal.rows(JOB) if r.step == "notify"]
        assert len(rows) == sent and {r.status for r in rows} == {Status.SUCCEEDED}
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
