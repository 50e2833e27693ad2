"""The resumable runner: the per-item state machine over the step journal.

A run goes through the items once, in order, and for every step of every item asks the journal what
is already known of it; the answer is a row of one table (:mod:`~airflow_resumable.runner.decisions`):
run it, skip it, ask the receiver (:mod:`~airflow_resumable.runner.verify`), or hold the item for a
human. It imports nothing from Airflow.

The package's parts: :mod:`~airflow_resumable.runner.steps` (what a batch is made of),
:mod:`~airflow_resumable.runner.decisions` (the table), :mod:`~airflow_resumable.runner.batch` (one
run: the items read in and their steps walked), :mod:`~airflow_resumable.runner.drivers` (one send at
a time, or many at once), :mod:`~airflow_resumable.runner.verify` (asking the receiver, in a run and
between runs) and :mod:`~airflow_resumable.runner.results`. Import from the package, not from its parts:
the parts may move.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from airflow_resumable.exceptions import (
    BatchStopped,
    InvalidItemError,
    NotSentError,
    ReceiverUnavailableError,
)
from airflow_resumable.journal import HeldStep, StepJournal
from airflow_resumable.journal.records import MAX_JOB_ID_LENGTH
from airflow_resumable.runner.batch import (
    _Batch,
    _chunks,
    _is_storable,
    _planned_ids,
    _prepare,
    _ReceiverGaveUp,
    _room_for_item_ids,
    _with_next,
)
from airflow_resumable.runner.decisions import Action, decide
from airflow_resumable.runner.drivers import (
    _check_stop,
    _Concurrent,
    _Sequential,
    check_concurrency,
    check_progress_interval,
)
from airflow_resumable.runner.high_water import HighWater, MarkStore, check_on_journal_behind
from airflow_resumable.runner.results import BatchProgress, BatchResult
from airflow_resumable.runner.settle import Settlement, checked_settlement
from airflow_resumable.runner.steps import (
    NOT_DELIVERED,
    NotDelivered,
    Step,
    StepContext,
    StepFn,
    VerifyFn,
    _check_steps,
    canonical_digest,
    idempotency_key,
)
from airflow_resumable.runner.verify import verify_held

# The runner's public names. The errors a step raises or a run ends with, and HeldStep (what a run
# reports held), are importable from here too; every other error is in airflow_resumable.exceptions.
__all__ = [
    "NOT_DELIVERED", "Action", "BatchProgress", "BatchResult", "MarkStore", "NotDelivered", "Settlement", "Step",
    "StepContext",
    "StepFn", "VerifyFn", "canonical_digest", "decide", "idempotency_key", "run_batch", "verify_held",
    "BatchStopped", "HeldStep", "InvalidItemError", "NotSentError",
]

# One logger for every part of the runner (airflow_resumable.runner): one name for a user to configure.
log = logging.getLogger(__name__)


def run_batch(
    journal: StepJournal,
    job_id: str,
    items: Iterable[Mapping[str, Any]],
    steps: Iterable[Step],
    *,
    id_field: str = "id",
    concurrency: int = 1,
    on_progress: Callable[[BatchProgress], None] | None = None,
    progress_interval: float = 10.0,
    runner: str | None = None,
    stop: threading.Event | None = None,
    dag_id: str | None = None,
    settle_in_task: bool | Settlement = True,
    high_water: MarkStore | None = None,
    on_journal_behind: str = "refuse",
) -> BatchResult:
    """Run ``steps`` over ``items`` under ``job_id``, resuming whatever the journal already has.

    Items may be any iterable; they are streamed in chunks, never loaded whole. A step that raises
    is recorded FAILED (type name only) and the exception propagates: run the job again to resume.
    With ``concurrency=N`` up to N side-effect sends run at once on worker threads (local steps
    and all journal writes stay on the calling thread); items may finish in a different order, with
    the same results. Raises :class:`~airflow_resumable.journal.JobBusyError` at once if another
    runner holds the job. Setting ``stop`` (from another thread or a signal handler) stops the run:
    no send starts after that, the sends in flight are recorded, and :class:`BatchStopped` is raised;
    the job stays unfinished (``JobSummary.status``) until a run goes through the whole batch.
    ``dag_id``: the Airflow DAG running the job, recorded with it by its first run (who may settle its
    held items is decided by that DAG).

    ``settle_in_task`` (SPEC §12; on by default): a send the receiver refuses ("not now", HTTP 429) is
    sent again in this run with the same key after the wait it asked for (else a backoff); a send whose
    outcome is unknown (a timeout, a 5xx) is looked up after a backoff, in this run (a step declared
    ``idempotent`` is sent again instead). Sends keep each step's pace (``Step.max_sends_per_second``,
    else the rate the receiver is seen to accept). Attempts are bounded (:class:`Settlement`); items that
    run out are left for the next try, the others go on, and the run then raises
    :class:`~airflow_resumable.exceptions.ReceiverUnavailableError` saying how many items wait. A
    receiver that keeps failing stops the run the same way. ``False``: the first failing send stops the
    run, as before (the article's way).

    ``high_water`` (SPEC §13): where to keep a high-water mark of the job's IN_FLIGHT marks outside the
    journal (:mod:`airflow_resumable.runner.high_water`; the operator uses the task state store). Before
    its first send the run compares it with the journal's count: a journal that is behind is refused
    with :class:`~airflow_resumable.exceptions.JournalBehindError`, nothing sent - or, with
    ``on_journal_behind="verify"``, every send the journal has no record of asks ``verify`` first (a step
    without one is held), and a run that goes through the whole batch re-bases the mark.
    """
    if not isinstance(job_id, str) or not job_id.strip() or not _is_storable(job_id):
        raise ValueError("job_id must be a non-empty string of valid Unicode text without NUL characters")
    if len(job_id) > MAX_JOB_ID_LENGTH:  # no decision could name the job's held items
        raise ValueError(f"job_id is {len(job_id)} characters; at most {MAX_JOB_ID_LENGTH}")
    if not isinstance(id_field, str) or not id_field:
        raise ValueError("id_field must be a non-empty string")
    check_concurrency(concurrency)
    on_journal_behind = check_on_journal_behind(on_journal_behind)
    settlement = checked_settlement(settle_in_task)
    progress_interval = check_progress_interval(progress_interval)
    checked_steps = _check_steps(steps)
    step_names = [s.name for s in checked_steps]
    id_room = _room_for_item_ids(journal, job_id, step_names)
    items_total = len(items) if hasattr(items, "__len__") else None  # type: ignore[arg-type]
    started = last_report = time.monotonic()
    result = BatchResult(job_id=job_id, status="completed")

    def progress() -> BatchProgress:
        # Items done: completed or held (a held item stops at its held step) - not merely read in.
        paused = max((pace.paused() for pace in batch.paces.values()), default=0.0) if batch else 0.0
        return BatchProgress(result.items_completed + len(result.held), items_total, result.executed_steps,
                             result.skipped_steps, len(result.held), time.monotonic() - started,
                             result.verified_steps, result.waits, result.resent_in_task, result.settled_in_task,
                             result.gave_up, paused)

    def report_if_due() -> None:
        nonlocal last_report
        if on_progress is not None and time.monotonic() - last_report >= progress_interval:
            last_report = time.monotonic()
            on_progress(progress())

    batch: _Batch | None = None
    with journal.open_job(job_id, runner=runner, dag_id=dag_id) as run:
        batch = _Batch(run, checked_steps, result, settlement, shared_pace=journal.shared_pace)
        hw = None
        if high_water is not None:
            hw = HighWater(high_water, run, journal=journal.location, journal_id=journal.journal_id, label=runner,
                           on_behind=on_journal_behind, concurrency=concurrency, incarnation=journal.incarnation())
            hw.start()  # a journal found behind is refused here, before anything is sent
            batch.high_water = hw
        driver = _Sequential(batch, stop) if concurrency == 1 else _Concurrent(batch, concurrency, stop)
        try:
            for chunk, following in _with_next(_chunks(items), read_ahead=hw is not None):
                if hw is not None:  # the record of a window names the items coming next: read one chunk ahead
                    if not result.items_total:
                        hw.plan(_planned_ids(chunk, id_field))
                    hw.plan(_planned_ids(following, id_field))
                prepared = _prepare(chunk, id_field, result.items_total, run, max_id_bytes=id_room)
                result.items_total += len(prepared)
                # Items whose every step is SUCCEEDED with this very input are settled in bulk by
                # the journal (row "SUCCEEDED -> skip" of the decision table, for all their steps).
                unfinished = run.unfinished(step_names)
                rows = run.lookup([p.item_id for p in prepared if p.item_id in unfinished]) if unfinished else {}
                for p in prepared:
                    if p.item_id in unfinished:
                        _check_stop(stop)
                        if hw is not None:
                            hw.admit(p.item_id)
                        driver.start(p, rows.get(p.item_id, {}))
                        report_if_due()  # by time, between items: slow sends still report
                    else:
                        result.skipped_steps += len(checked_steps)
                        result.items_completed += 1
                report_if_due()
            driver.finish()
            if result.gave_up:
                raise _ReceiverGaveUp("attempts_exhausted", batch.last_retry_after)
            run.finished()  # the whole batch was gone through: the job is no longer unfinished
            if hw is not None:
                hw.close(finished=True)
        except BaseException as exc:
            driver.abort(exc)
            if hw is not None:
                try:
                    hw.close(finished=False)
                except Exception as close_error:  # noqa: BLE001 - the window stays open: the next run verifies it
                    log.warning("high-water mark: the last record was not written (%s)", type(close_error).__name__)
            if on_progress is not None:
                # How far this run got, for the task log and metrics; the original error still wins.
                try:
                    on_progress(progress())
                except Exception as progress_error:  # noqa: BLE001
                    log.warning("on_progress raised %s while the batch was failing", type(progress_error).__name__)
            if isinstance(exc, _ReceiverGaveUp):
                raise _unavailable(exc, result, items_total, settlement or Settlement()) from None
            raise
    result.elapsed = time.monotonic() - started
    result.status = "needs_review" if result.held else "completed"
    if on_progress is not None:
        on_progress(progress())
    return result


_WHY = {
    "receiver_failing": "the receiver kept failing or refusing ({attempts} rounds in a row, no send going through)",
    "attempts_exhausted": "{gave_up} item(s) ran out of attempts ({attempts} each) while the receiver refused or "
                          "failed them",
    "long_retry_after": "the receiver asked to wait {retry_after:g} s, longer than a run waits (Settlement.max_wait)",
}


def _unavailable(gave_up: _ReceiverGaveUp, result: BatchResult, items_total: int | None,
                 settlement: Settlement) -> ReceiverUnavailableError:
    """The error a run ends with when items are left waiting for the receiver (none of them held)."""
    waiting = result.items_total - result.items_completed - len(result.held)
    unread = None if items_total is None else max(0, items_total - result.items_total)
    attempts = settlement.max_attempts
    why = _WHY[gave_up.reason].format(attempts=attempts, gave_up=result.gave_up,
                                      retry_after=gave_up.retry_after or 0.0)
    after = f"; it last asked to wait {gave_up.retry_after:g} s" if gave_up.retry_after is not None else ""
    left = f"{waiting} item(s) waiting" + (f" and {unread} not reached" if unread else "")
    held = (f" ({len(result.held)} other item(s) were held for a person: their outcome is unknown and no "
            "look-up could tell)") if result.held else ""
    return ReceiverUnavailableError(
        f"receiver unavailable: {left} - {why}{after}. None of them was held{held}: a retry of this task resumes "
        "them "
        "(refused sends are sent again, unknown outcomes are looked up first). If the receiver is down, retry "
        "later (a task's retry_delay, or RetryAfterPolicy on Airflow >= 3.3).",
        items_waiting=waiting, items_unread=unread, retry_after=gave_up.retry_after, reason=gave_up.reason)
