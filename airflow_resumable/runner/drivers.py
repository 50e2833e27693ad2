"""The two ways a run sends: one send at a time (:class:`_Sequential`), or up to N at once on worker
threads (:class:`_Concurrent`).

Either way, a send's IN_FLIGHT mark is committed before the send starts, the journal is written by
the thread that called ``run_batch`` only, and a receipt is committed (or logged) before any more
user code runs.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from airflow_resumable.exceptions import BatchStopped
from airflow_resumable.journal import JobRun, StepState
from airflow_resumable.runner.batch import (
    ItemSteps,
    Task,
    _Batch,
    _call,
    _Done,
    _look_up,
    _Outcome,
    _Prepared,
    _Send,
    _Wait,
)
from airflow_resumable.runner.settle import FINAL, kind_of
from airflow_resumable.runner.verify import VERIFY_RESOLVER

# One logger for every part of the runner (airflow_resumable.runner): one name for a user to configure.
log = logging.getLogger(__package__)


# The longest a marked send waits in the queue for a thread before it starts. Past that its mark is
# committed again first: a runner cut off from a shared journal loses its claim only seconds after its
# last commit, so a send never starts after another runner may have taken the job over.
MAX_QUEUE_WAIT = 1.0


def _commit_marks(run: JobRun, sends: Iterable[_Send]) -> None:
    """Mark these sends IN_FLIGHT and commit the marks (with everything buffered) in one durable
    flush - one fsync under full durability. Call it before any of them starts."""
    for send in sends:
        if send.resent_from is not None and not send.marked_before:
            run.audit(send.item.item_id, send.step.name, "not_delivered", resolved_by=VERIFY_RESOLVER,
                      note="the receiver's look-up has no record of this key; sent again once",
                      previous_status=send.resent_from[0], previous_held_reason=send.resent_from[1])
        run.mark_in_flight(send.item.item_id, send.step.name, send.item.digest, new_attempt=not send.marked_before)
    run.flush(durable=True)


def _advance(gen: ItemSteps, value: str | None) -> Task | None:
    """Run an item on to its next send or look-up (None: the item is done or held)."""
    try:
        return next(gen) if value is None else gen.send(value)
    except StopIteration:
        return None


def _check_stop(stop: threading.Event | None) -> None:
    """Raise :class:`BatchStopped` if the run was asked to stop: called before any send starts."""
    if stop is not None and stop.is_set():
        raise _stopped()


def _sleep_until(moment: float, stop: threading.Event | None) -> None:
    """Wait until ``moment`` (``time.monotonic()``); a stop ends the wait at once (BatchStopped)."""
    delay = moment - time.monotonic()
    if delay > 0:
        if stop is None:
            time.sleep(delay)
        elif stop.wait(delay):
            raise _stopped()
    _check_stop(stop)


def _settle_next(batch: _Batch, task: Task, outcome: _Outcome) -> _Done | _Wait | object:
    """What follows a finished send or look-up (see :meth:`_Batch.after_send`)."""
    if isinstance(task, _Send):
        return batch.after_send(task, outcome)
    return batch.after_verify(task, outcome)


class _Sequential:
    """concurrency=1: one send at a time, each IN_FLIGHT mark committed (and fsync'd) just before it.
    A send refused or failed is settled right there (a wait, then a re-send or a look-up) before the
    run goes on to the next item."""

    def __init__(self, batch: _Batch, stop: threading.Event | None = None) -> None:
        self.batch, self.stop = batch, stop

    def start(self, p: _Prepared, rows: Mapping[str, StepState]) -> None:
        gen = self.batch.steps_of(p, rows)
        task = _advance(gen, None)
        while task is not None:
            try:
                encoded = self._settle(task)
            except BaseException:
                gen.close()
                raise
            if encoded is None:  # held, or left for the next try
                gen.close()
                return
            task = _advance(gen, encoded)

    def _settle(self, task: Task) -> str | None:
        run = self.batch.run
        while True:
            if isinstance(task, _Send):
                pace = self.batch.paces.get(task.step.name)
                if pace is not None:
                    slot = pace.reserve()
                    assert slot is not None
                    _sleep_until(slot, self.stop)
                _check_stop(self.stop)
                _commit_marks(run, [task])
                try:
                    following = self.batch.after_send(task, _call(task))
                finally:
                    run.write_receipts()  # before any further user code
            else:
                following = self.batch.after_verify(task, _look_up(task))
            if isinstance(following, _Done):
                return following.encoded
            if not isinstance(following, _Wait):
                return None
            _sleep_until(following.due, self.stop)
            task = following.task

    def finish(self) -> None:
        pass

    def abort(self, cause: BaseException) -> None:
        pass


class _Concurrent:
    """Up to ``n`` sends at once on worker threads; the journal is written by this thread only.

    Sends are marked IN_FLIGHT in groups: the marks of a group are committed together, with one
    fsync (or one synchronous commit) under full durability, and only then are its sends handed to
    the worker threads (group commit). So that a thread that finishes a send never waits for this
    thread to commit the next mark, up to ``ahead`` (a quarter of ``n``) sends more than there are
    threads are marked and queued: a free thread takes the next one at once. A queued send does not
    start once the run was stopped or another send raised, and a run that fails or stops takes back
    the marks of the queued sends that never started (so the next run sends them with no human);
    only a SIGKILL can leave them IN_FLIGHT, as it leaves the sends in progress - at most
    ``n + ahead``.

    While every thread is busy, this thread waits until a quarter of ``n`` places are free, prepares
    items until their sends fill the free places (at most half of ``n``) and commits them as one
    group: the longer a commit takes, the more sends end meanwhile and the larger the next group, and
    a busy pipeline never costs more than one durable commit per quarter of ``n`` sends. A thread
    left idle (the queue ran dry) gets what is ready as soon as that is a quarter of ``n``; a run
    with nothing in flight starts at once.
    A send that ended frees its place at once, but is recorded when the next group is committed: its
    receipt rides with that commit (with a receipt log, it is logged too), always before any more
    user code runs. Local steps run on this thread, between sends.

    Settlement in the task: a send refused or failed waits (``waiting``, by due time) and is then marked
    and queued again, or looked up on a worker thread; the other items go on meanwhile. Each send
    takes a slot of its receiver's pace when its group is committed (only slots within half of
    ``MAX_QUEUE_WAIT``); its thread waits for the slot, and a send whose receiver paused meanwhile is
    handed back unsent, to be queued again when the pause ends.
    """

    def __init__(self, batch: _Batch, n: int, stop: threading.Event | None = None) -> None:
        self.batch, self.n, self.stop = batch, n, stop
        self.ahead = max(1, n // 4)
        self.min_group = max(1, n // 4)
        self.max_ready = max(self.min_group, n // 2)
        # A send of the last step finishes its item: recording it runs no user code afterwards.
        self.last_step = batch.steps[-1].name
        self.pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="resumable-send")
        self.ready: list[tuple[ItemSteps, _Send]] = []
        self.in_flight: dict[Future[_Outcome], tuple[ItemSteps, Task]] = {}
        self.finished: queue.SimpleQueue[Future[_Outcome]] = queue.SimpleQueue()
        # Sends and look-ups waiting to be tried again: (due, order, item, task), soonest first.
        self.waiting: list[tuple[float, int, ItemSteps, Task]] = []
        self._order = itertools.count()
        # Set once a send raised (or the run is aborting): no queued send starts after that.
        self.halted = threading.Event()
        self.halted_by: BaseException | None = None

    def start(self, p: _Prepared, rows: Mapping[str, StepState]) -> None:
        self.batch.run.write_receipts()  # the item's own steps are user code
        gen = self.batch.steps_of(p, rows)
        task = _advance(gen, None)
        if task is not None:
            self._queue(gen, task)
        while True:
            self._promote_due()
            # Sends that ended count as free places at once, but are recorded only when a group is
            # committed: their receipts ride with its commit instead of a commit of their own.
            unrecorded = self.finished.qsize()
            room = self.n + self.ahead - len(self.in_flight) + unrecorded
            if self.ready and room > 0 and self._group_is_due(room, len(self.in_flight) - unrecorded):
                self._record_finished(wait=False)
                if not self._dispatch(self.n + self.ahead - len(self.in_flight)):
                    self._idle()  # the receiver's pace lets none start yet
            elif len(self.ready) >= self.max_ready:
                self._record_finished(wait=True)  # nothing more to prepare: wait for a send to end
            else:
                self.batch.run.write_receipts()  # this thread goes back to the caller's code
                return

    def _group_is_due(self, room: int, active: int) -> bool:
        """Whether to commit the ready sends' marks now, or prepare more items first to share the commit.
        ``active``: the sends marked and not yet ended (under way or queued)."""
        if not active:
            return True  # nothing is being sent: start at once
        if active < self.n:
            return len(self.ready) >= self.min_group  # a thread is idle: the queue ran dry
        return room >= self.min_group and len(self.ready) >= min(room, self.max_ready)

    def finish(self) -> None:
        # Anything raising here (a send's error, a stop, Airflow's execution timeout) goes to abort(), which
        # starts none of the queued sends; shutting the pool down on the way out would start them all.
        while self.ready or self.in_flight or self.waiting:
            self._record_finished(wait=False)
            self._promote_due()
            room = self.n + self.ahead - len(self.in_flight)
            if self.ready and room > 0 and self._dispatch(room):
                continue
            self._idle()
        self.pool.shutdown(wait=True)

    def _queue(self, gen: ItemSteps, task: Task) -> None:
        if isinstance(task, _Send):
            self.ready.append((gen, task))
        else:
            self._wait(gen, task, time.monotonic())

    def _wait(self, gen: ItemSteps, task: Task, due: float) -> None:
        heapq.heappush(self.waiting, (due, next(self._order), gen, task))

    def _promote_due(self) -> None:
        """Hand on the waiting sends and look-ups that are due: sends to be marked, look-ups to a thread."""
        now = time.monotonic()
        while self.waiting and self.waiting[0][0] <= now:
            _, _, gen, task = heapq.heappop(self.waiting)
            if isinstance(task, _Send):
                self.ready.insert(0, (gen, task))  # before newer items: it has waited already
                continue
            pace = self.batch.paces.get(task.step.name)
            if pace is not None and pace.paused_until > now:  # no look-up while the receiver asks to wait
                self._wait(gen, task, pace.paused_until)
                continue
            future = self.pool.submit(_look_up, task)
            self.in_flight[future] = (gen, task)
            future.add_done_callback(self.finished.put)

    def _idle(self) -> None:
        """Nothing can start now: wait for a send to end, a wait to run out or a pace slot (a stop ends it)."""
        moments = [self.waiting[0][0]] if self.waiting else []
        moments += [pace.next_free() for pace in {id(p): p for p in self.batch.paces.values()}.values()
                    if self.ready]
        timeout = min(moments, default=time.monotonic() + 0.1) - time.monotonic()
        if timeout >= 0.05:
            # A wait (a receiver's pause, a backoff): the receipts of the sends recorded so far are made to
            # survive a kill now, not with the next group's commit, which may be seconds away.
            self.batch.run.write_receipts()
        self._record_finished(wait=True, timeout=min(0.1, max(0.001, timeout)))
        _check_stop(self.stop)

    def _dispatch(self, room: int) -> int:
        """Mark and queue up to ``room`` ready sends whose receiver has a slot soon; returns how many."""
        _check_stop(self.stop)  # abort() then closes what is ready and records what is in flight
        group: list[tuple[ItemSteps, _Send, float]] = []
        kept: list[tuple[ItemSteps, _Send]] = []
        for gen, send in self.ready:
            if len(group) < room:
                pace = self.batch.paces.get(send.step.name)
                slot = 0.0 if pace is None else pace.reserve(MAX_QUEUE_WAIT / 2)
                if slot is not None:
                    group.append((gen, send, slot))
                    continue
            kept.append((gen, send))
        self.ready = kept
        if not group:
            return 0
        _commit_marks(self.batch.run, [send for _, send, _ in group])  # the group shares one commit
        committed = time.monotonic()
        for gen, send, slot in group:
            future = self.pool.submit(self._send_if_still_due, send, committed, slot)
            self.in_flight[future] = (gen, send)
            future.add_done_callback(self.finished.put)
        return len(group)

    def _send_if_still_due(self, send: _Send, committed: float, slot: float) -> _Outcome:
        """On a worker thread: a send queued before a stop, or before another send raised, never starts
        after it, nor long after its mark was committed (a shared journal's claim may have passed to
        another runner by then), nor while its receiver asks every send to wait."""
        delay = slot - time.monotonic()
        if delay > 0:
            self.halted.wait(delay)  # its slot of the receiver's pace
        if self.stop is not None and self.stop.is_set():
            return _Outcome(not_started="stopped")
        if self.halted.is_set():
            return _Outcome(not_started="halted", error=self.halted_by)
        pace = self.batch.paces.get(send.step.name)
        if pace is not None and pace.paused_until > time.monotonic():
            return _Outcome(not_started="paused")
        if time.monotonic() - committed > MAX_QUEUE_WAIT:
            return _Outcome(not_started="waited too long")
        outcome = _call(send)
        if outcome.error is not None and (self.batch.settlement is None or kind_of(outcome.error) == FINAL):
            self.halted_by = self.halted_by or outcome.error
            self.halted.set()  # the batch fails with this error: the sends queued behind it stay unsent
        return outcome

    def _record_finished(self, *, wait: bool, timeout: float | None = None) -> None:
        """Record the sends that finished (``wait``: at least one, waiting for it up to ``timeout``) and
        run their items on."""
        done: list[Future[_Outcome]] = []
        if wait:
            try:
                done.append(self.finished.get(timeout=timeout))
            except queue.Empty:
                return
        while not self.finished.empty():
            done.append(self.finished.get_nowait())
        if not done:
            return
        # In the order they ended: the pace learns from a refusal after the sends that went through before it.
        done.sort(key=lambda future: future.result().ended)
        finished: list[tuple[ItemSteps, Task, str]] = []
        error: BaseException | None = None
        for future in done:
            gen, task = self.in_flight.pop(future)
            outcome = future.result()
            if isinstance(task, _Send) and outcome.not_started == "paused":
                # The receiver asked every send to wait: the mark is taken back now (a kill during a long
                # pause must not leave it IN_FLIGHT, for a human), and the send marked again after it.
                self.batch.record_not_started(task, ReceiverPaused)
                again = dataclasses.replace(task, marked_before=False, resent_from=None)  # audited with its mark
                self._wait(gen, again, self.batch.paces[task.step.name].paused_until)
                continue
            if isinstance(task, _Send) and outcome.not_started == "waited too long":
                log.info("item %s: %s waited over %g s for a thread; its mark is renewed before it starts",
                         task.item.item_id, task.step.name, MAX_QUEUE_WAIT)
                self.ready.insert(0, (gen, dataclasses.replace(task, marked_before=True)))
                continue
            if outcome.not_started is not None:
                assert isinstance(task, _Send)
                gen.close()
                cause = outcome.error or _stopped()  # "halted" carries the error that halted the sends
                self.batch.record_not_started(task, type(cause))
                error = error or cause
                continue
            try:
                following = _settle_next(self.batch, task, outcome)
            except BaseException as exc:  # recorded FAILED; the others of this round still count
                gen.close()
                error = error or exc
                continue
            if isinstance(following, _Done):
                finished.append((gen, task, following.encoded))
            elif isinstance(following, _Wait):
                self._wait(gen, following.task, following.due)
            else:
                gen.close()  # held, or left for the next try
        if error is not None or any(task.step.name != self.last_step for _, task, _ in finished):
            self.batch.run.write_receipts()  # one write (or commit) for the round, before any user code
        for gen, task, encoded in finished:
            if error is None or task.step.name == self.last_step:
                # Its item goes on (an item whose last step this was completes, running no user code).
                following_task = _advance(gen, encoded)
                if following_task is not None:
                    self._queue(gen, following_task)
            else:
                gen.close()  # its later steps wait for the next run
        if error is not None:
            raise error

    def abort(self, cause: BaseException) -> None:
        """Something raised: start nothing more, but record every send already started, and take back
        the marks of those that never started."""
        self.halted.set()  # no queued send starts from now on
        try:
            for gen, send in self.ready:
                gen.close()  # never sent
                if send.marked_before:  # marked, then handed back unsent (it waited too long for a thread)
                    self._take_back(send, type(cause))
            self.ready = []
            for _, _, gen, _task in self.waiting:
                gen.close()  # recorded FAILED (or its mark taken back): the next run sends it, or asks first
            self.waiting = []
            for future, (gen, task) in list(self.in_flight.items()):
                if future.cancel():  # still queued: it never reaches the receiver
                    del self.in_flight[future]
                    gen.close()
                    if isinstance(task, _Send):
                        self._take_back(task, type(cause))
            while self.in_flight:
                # Waited on themselves, not on the queue of finished sends: a failure while a round of it
                # was being recorded may have taken some out of the queue and left them here.
                done, _ = wait(list(self.in_flight), return_when=FIRST_COMPLETED)
                for future in done:
                    self._record_aborted(future, cause)
            try:
                self.batch.run.write_receipts()
            except Exception as exc:  # noqa: BLE001 - the error that stopped the batch is the one to raise
                log.warning("could not record the receipts of the last sends (%s); the next run verifies "
                            "or holds them", type(exc).__name__)
        finally:
            self.pool.shutdown(wait=True)

    def _record_aborted(self, future: Future[_Outcome], cause: BaseException) -> None:
        """Record a send that ended while the run was aborting; its item goes no further this run."""
        gen, task = self.in_flight.pop(future)
        outcome = future.result()
        if not isinstance(task, _Send):
            gen.close()  # a look-up: the step stays as it was, the next run asks again
            return
        if outcome.not_started is not None:
            gen.close()
            self._take_back(task, type(cause))
            return
        try:
            following = self.batch.after_send(task, outcome)
        except BaseException:  # noqa: S110 - recorded FAILED; the first error is the one raised
            gen.close()
            return
        if isinstance(following, _Done) and task.step.name == self.last_step:
            _advance(gen, following.encoded)  # the item's last step: it completes, no user code runs
        else:
            gen.close()  # its later steps (or its re-send) wait for the next run

    def _take_back(self, send: _Send, cause: type[BaseException]) -> None:
        try:
            self.batch.record_not_started(send, cause)
        except Exception as exc:  # noqa: BLE001 - left IN_FLIGHT: the next run verifies or holds it
            log.warning("could not record that a queued send of item %s never started (%s); the next run "
                        "verifies or holds it", send.item.item_id, type(exc).__name__)


class ReceiverPaused(Exception):  # noqa: N818 - its name is what the journal records
    """The error type recorded for a send whose mark was taken back unsent: the receiver asked to wait."""


def _stopped() -> BatchStopped:
    return BatchStopped("stopped on request: no new send was started; the sends in flight were recorded "
                        "as they finished. The job is unfinished: a retry or a Clear resumes it.")


MAX_CONCURRENCY = 256


def check_progress_interval(interval: object) -> float:
    """``interval`` (seconds between progress reports) if it is a usable value, else ValueError."""
    if isinstance(interval, bool) or not isinstance(interval, int | float) or not 0 <= interval < float("inf"):
        raise ValueError(f"progress_interval must be a number of seconds (0 or more), not {interval!r}")
    return float(interval)


def check_concurrency(concurrency: object) -> int:
    """``concurrency`` if it is a usable value, else ValueError (the operator checks it at parse time)."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency must be an integer from 1 to {MAX_CONCURRENCY}, not {concurrency!r}")
    return concurrency
