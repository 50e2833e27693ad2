"""The two ways a run sends: one send at a time (:class:`_Sequential`), or up to N at once on worker
threads (:class:`_Concurrent`).

Either way, a send's IN_FLIGHT mark is committed before the send starts, the journal is written by
the thread that called ``run_batch`` only, and a receipt is committed (or logged) before any more
user code runs.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from airflow_resumable.exceptions import BatchStopped
from airflow_resumable.journal import JobRun, StepState
from airflow_resumable.runner.batch import ItemSteps, _Batch, _call, _Outcome, _Prepared, _Send
from airflow_resumable.runner.verify import VERIFY_RESOLVER

# The runner's one logger, named after the package (airflow_resumable.runner) as before it was split.
log = logging.getLogger(__package__)


def _commit_marks(run: JobRun, sends: Iterable[_Send]) -> None:
    """Mark these sends IN_FLIGHT and commit the marks (with everything buffered) in one durable
    flush - one fsync under full durability. Call it before any of them starts."""
    for send in sends:
        if send.resent_from is not None:
            run.audit(send.item.item_id, send.step.name, "not_delivered", resolved_by=VERIFY_RESOLVER,
                      note="the receiver's look-up has no record of this key; sent again once",
                      previous_status=send.resent_from[0], previous_held_reason=send.resent_from[1])
        run.mark_in_flight(send.item.item_id, send.step.name, send.item.digest)
    run.flush(durable=True)


def _advance(gen: ItemSteps, value: str | None) -> _Send | None:
    """Run an item on to its next send (None: the item is done or held)."""
    try:
        return next(gen) if value is None else gen.send(value)
    except StopIteration:
        return None


def _check_stop(stop: threading.Event | None) -> None:
    """Raise :class:`BatchStopped` if the run was asked to stop: called before any send starts."""
    if stop is not None and stop.is_set():
        raise BatchStopped("stopped on request: no new send was started; the sends in flight were recorded "
                           "as they finished. The job is unfinished: a retry or a Clear resumes it.")


class _Sequential:
    """concurrency=1: one send at a time, each IN_FLIGHT mark committed (and fsync'd) just before it."""

    def __init__(self, batch: _Batch, stop: threading.Event | None = None) -> None:
        self.batch, self.stop = batch, stop

    def start(self, p: _Prepared, rows: Mapping[str, StepState]) -> None:
        gen = self.batch.steps_of(p, rows)
        send = _advance(gen, None)
        while send is not None:
            run = self.batch.run
            try:
                _check_stop(self.stop)
            except BatchStopped:
                gen.close()
                raise
            _commit_marks(run, [send])
            try:
                encoded = self.batch.record_send(send, _call(send))
            finally:
                run.write_receipts()  # before any further user code
            send = _advance(gen, encoded)

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


class _Concurrent:
    """Up to ``n`` sends in flight on worker threads; the journal is written by this thread only.

    Sends are started in groups: the IN_FLIGHT marks of a group are committed together, with one
    fsync (or one synchronous commit) under full durability, before any send of the group starts
    (group commit). A group is started once at least ``n // 4`` sends are ready and there is room
    for them (or nothing else is in flight), so a full pipeline costs at most one durable commit
    per four sends. While the pipeline is full, up to ``n // 2`` items are prepared ahead (their
    local steps run); once that many are ready, this thread waits for sends to finish and starts
    the next group as soon as it fits - with no user code in between, so the receipts of the sends
    that finished meanwhile ride with that group's commit instead of a commit of their own. Local
    steps run on this thread, between sends; receipts are always committed (or, with a receipt
    log, logged) before any of them runs.
    """

    def __init__(self, batch: _Batch, n: int, stop: threading.Event | None = None) -> None:
        self.batch, self.n, self.stop = batch, n, stop
        self.min_group = max(1, n // 4)
        self.max_ready = max(self.min_group, n // 2)
        # A send of the last step finishes its item: recording it runs no user code afterwards.
        self.last_step = batch.steps[-1].name
        self.pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="resumable-send")
        self.ready: list[tuple[ItemSteps, _Send]] = []
        self.in_flight: dict[Future[_Outcome], tuple[ItemSteps, _Send]] = {}

    def start(self, p: _Prepared, rows: Mapping[str, StepState]) -> None:
        self.batch.run.write_receipts()  # the item's own steps are user code
        gen = self.batch.steps_of(p, rows)
        send = _advance(gen, None)
        if send is not None:
            self.ready.append((gen, send))
        while True:
            room = self.n - len(self.in_flight)
            if self.ready and room >= min(len(self.ready), self.min_group) and (
                len(self.ready) >= self.min_group or not self.in_flight
            ):
                self._dispatch(room)
            elif len(self.ready) >= self.max_ready:
                self._collect(defer_receipts=True)  # the next thing this thread does is a dispatch
            else:
                return

    def finish(self) -> None:
        try:
            while self.ready or self.in_flight:
                room = self.n - len(self.in_flight)
                if self.ready and room > 0:
                    self._dispatch(room)
                else:
                    self._collect()
        finally:
            self.pool.shutdown(wait=True)

    def _dispatch(self, room: int) -> None:
        _check_stop(self.stop)  # abort() then closes what is ready and records what is in flight
        group, self.ready = self.ready[:room], self.ready[room:]
        _commit_marks(self.batch.run, [send for _, send in group])  # the group shares one commit
        for gen, send in group:
            self.in_flight[self.pool.submit(_call, send)] = (gen, send)

    def _collect(self, *, defer_receipts: bool = False) -> None:
        done, _ = wait(self.in_flight, return_when=FIRST_COMPLETED)
        finished: list[tuple[ItemSteps, str]] = []
        error: BaseException | None = None
        for future in done:
            gen, send = self.in_flight.pop(future)
            try:
                finished.append((gen, self.batch.record_send(send, future.result())))
            except BaseException as exc:  # recorded FAILED; the others of this round still count
                gen.close()
                error = error or exc
            if send.step.name != self.last_step:
                defer_receipts = False  # its item goes on with more steps: user code
        if error is not None or not defer_receipts:
            self.batch.run.write_receipts()  # one write (or commit) for the round, before any user code
        if error is not None:
            for gen, _ in finished:
                gen.close()
            raise error
        for gen, encoded in finished:
            following = _advance(gen, encoded)
            if following is not None:
                self.ready.append((gen, following))

    def abort(self) -> None:
        """Something raised: start nothing more, but record every send already started."""
        for gen, _ in self.ready:
            gen.close()  # never marked IN_FLIGHT, never sent
        self.ready = []
        try:
            while self.in_flight:
                done, _ = wait(self.in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    gen, send = self.in_flight.pop(future)
                    try:
                        encoded = self.batch.record_send(send, future.result())
                    except BaseException:  # noqa: S110 - recorded FAILED; the first error is the one raised
                        gen.close()
                        continue
                    if send.step.name == self.last_step:
                        _advance(gen, encoded)  # the item's last step: it completes, no user code runs
                    else:
                        gen.close()  # its later steps wait for the next run
            try:
                self.batch.run.write_receipts()
            except Exception as exc:  # noqa: BLE001 - the error that stopped the batch is the one to raise
                log.warning("could not record the receipts of the last sends (%s); the next run verifies "
                            "or holds them", type(exc).__name__)
        finally:
            self.pool.shutdown(wait=True)


MAX_CONCURRENCY = 256


def check_concurrency(concurrency: object) -> int:
    """``concurrency`` if it is a usable value, else ValueError (the operator checks it at parse time)."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency must be an integer from 1 to {MAX_CONCURRENCY}, not {concurrency!r}")
    return concurrency
