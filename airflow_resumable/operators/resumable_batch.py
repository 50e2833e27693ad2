"""ResumableBatchOperator: run a batch of items through steps so retries and Clear resume."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException

from airflow_resumable._compat import airflow_fail_exception, store_forever
from airflow_resumable._location import (
    HIGH_WATER_STORE_KEY,
    RESOLVE_DAG_ID,
    STARTED_STORE_KEY,
    STATE_STORE_KEY,
    SUMMARY_XCOM_KEY,
    batch_job,
    default_durability,
    default_job_id,
    default_max_attempts,
    default_on_journal_behind,
    default_settle_in_task,
)
from airflow_resumable._metrics import emit_batch_metrics, emit_journal_behind
from airflow_resumable.exceptions import JournalBehindError, ResumableError
from airflow_resumable.hooks.journal import ResumableJournalHook
from airflow_resumable.journal import HeldReason, StepJournal
from airflow_resumable.journal.backend import checked_durability
from airflow_resumable.links import ResumableJobLink
from airflow_resumable.runner import (
    BatchProgress,
    BatchResult,
    BatchStopped,
    Settlement,
    Step,
    StepFn,
    VerifyFn,
    run_batch,
)
from airflow_resumable.runner.drivers import check_concurrency, check_progress_interval
from airflow_resumable.runner.high_water import check_on_journal_behind, mark_record
from airflow_resumable.runner.settle import check_limit_key

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["HeldItemsError", "HeldItemsNeedAHumanError", "ResumableBatchOperator", "WrongWorkerError"]

# A 50,000-held-item batch must still produce a small XCom.
HELD_IN_SUMMARY = 100
HELD_IN_MESSAGE = 20


class WrongWorkerError(ResumableError, AirflowException):
    """This try runs on a worker whose journal does not hold the job: sending now would re-send."""


class HeldItemsError(ResumableError, AirflowException):
    """Items were held for a human; everything else was processed. A retry may settle some of them
    (a step with ``verify`` asks the receiver again)."""


class HeldItemsNeedAHumanError(HeldItemsError, airflow_fail_exception()):  # type: ignore[misc]
    """Items were held that no retry can settle (no ``verify`` on their step, or changed input): the
    task fails without spending its remaining retries. Resolve them, then Clear the task."""


class ResumableBatchOperator(BaseOperator):
    """Send each item of a batch once, resuming after a crash, a retry or a UI "Clear".

    Every step of every item is recorded in a step journal: a SQLite file on the worker, or a shared
    PostgreSQL journal (``journal_conn_id``) that any worker reaches. A retry (or a Clear) of the same
    task instance skips what succeeded, re-runs local steps, and never re-sends a side effect whose
    outcome is unknown: it asks ``verify``, or holds the item for a human (see the
    ``resolve_held_item`` DAG) and goes on with the others.

    :param items: the batch: a list of mappings, an XComArg, a template string that renders to the
        whole list, or a callable returning an iterable (called with the task context if it takes an
        argument) for batches too big for XCom; streamed, never loaded whole. Item contents are data
        and are never rendered as templates.
    :param steps: the steps, as :class:`~airflow_resumable.runner.Step` objects. Or use the shorthand:
    :param validate: local step ``fn(item, ctx)`` named ``validate``.
    :param transform: local step ``fn(item, ctx)`` named ``transform``.
    :param notify: the side effect ``fn(item, ctx)`` named ``notify``; return the receiver's receipt.
    :param verify: ``verify(ctx)`` -> the receipt for ``ctx.idempotency_key`` if the receiver has it,
        :data:`~airflow_resumable.runner.NOT_DELIVERED` if it affirms it never got it, else None.
        (The callbacks' types: :data:`~airflow_resumable.runner.StepFn`, ``VerifyFn``.)
    :param job_id: journal key (templated). Default ``{dag_id}/{task_id}/{run_id}[/{map_index}]``:
        the same on retry and Clear (both resume); a new DAG run is a new job. An explicit one on a
        mapped task must differ per map index (``{{ ti.map_index }}`` in it): shards share it otherwise.
    :param batch_task_id: instead of ``job_id``: this task is a later pass of the job that batch task
        ran in this DAG run (after a ``HeldItemSensor`` or a review). The job is the one its XCom
        summary names, and it must be in this task's journal - the one the summary records - or the
        task fails sending nothing (a pass on a journal that never saw the job would send every item
        again), unless ``start_afresh=True``. The journal itself is never taken from XCom.
    :param id_field: the item field holding its unique id.
    :param journal_conn_id: an Airflow connection holding the journal, opened through
        :class:`~airflow_resumable.hooks.journal.ResumableJournalHook`: a Postgres one (a shared journal: a
        retry or a Clear resumes on whichever worker it lands) or a SQLite one (a file on the worker).
        Wins over ``journal_path``. Default ``[resumable] journal_conn_id``.
    :param journal_path: the journal file (a worker-local SQLite journal). Default
        ``[resumable] journal_path``, else ``$AIRFLOW_HOME/resumable/journal.sqlite3``. Neither is
        ever taken from ``dag_run.conf`` or XCom.
    :param durability: ``"full"`` (fsync before every send) or ``"normal"``; default
        ``[resumable] durability``, else ``"full"``.
    :param on_held: ``"fail"`` (default): fail after all other items, listing the held ones;
        ``"succeed"``: succeed with status ``needs_review`` (put a HeldItemSensor downstream).
    :param start_afresh: opt in to starting from nothing when this try lands on a worker whose
        journal has never seen the job (the wrong-worker guard). Every item may be sent again.
    :param allow_network_filesystem: see :class:`~airflow_resumable.journal.StepJournal`; default
        ``[resumable] allow_network_filesystem`` (which the sensor, the review and resolve tasks, the CLI
        and the page read too), else ``False``.
    :param progress_interval: seconds between progress lines in the task log.
    :param concurrency: how many sends may be in flight at once (worker threads; default 1). Their
        IN_FLIGHT marks are committed in groups, one fsync per group. Items may finish out of order.
    :param settle_in_task: settle a receiver's "not now" in this try (SPEC §12): a refused send (HTTP
        429, nothing taken) is sent again after the wait the receiver asked for, an unknown outcome (a
        timeout, a 5xx) is looked up after a backoff, at the receiver's pace; items that run out of
        attempts are left for the next try and the task then fails with ``ReceiverUnavailableError``
        (nothing held). ``False``: the first failing send fails the task, as in 0.2 (the article's way).
        Default ``[resumable] settle_in_task``, else True. The waits count against ``execution_timeout``.
    :param max_attempts: sends and look-ups one step of one item gets in a try (and the failure rounds
        in a row that stop it). Default ``[resumable] max_attempts``, else 6.
    :param max_sends_per_second: the most sends a second of the ``notify`` shorthand (on ``steps=``, set it
        on each :class:`~airflow_resumable.runner.Step`). Default: learn the rate the receiver accepts.
    :param limit_key: share ``max_sends_per_second`` with every task naming this key on the same journal
        (mapped tasks, other DAGs: one limit for the fleet). Templated.
    :param idempotent: the receiver dedupes ``notify`` by its idempotency key for at least the job's
        lifetime: an unknown outcome is sent again with the same key instead of looked up or held.
    :param on_journal_behind: what to do when the journal has fewer IN_FLIGHT marks for the job than the
        high-water mark kept in the task state store (SPEC §13: the journal was restored, copied, or failed
        over to a standby that had not received everything). ``"refuse"``: fail with
        :class:`~airflow_resumable.exceptions.JournalBehindError`, sending nothing. ``"verify"``: every send
        the journal has no record of asks ``verify`` first (a step without one is held); a try that goes
        through the whole batch re-bases the mark. Default ``[resumable] on_journal_behind``, else
        ``"refuse"``. Airflow >= 3.3 (the task state store); on older Airflow there is no mark and no check.
    """

    template_fields: Sequence[str] = ("items", "job_id", "batch_task_id", "limit_key")
    ui_color = "#e8f4ea"
    # The task instance's "Resumable job" button opens its job on the Resumable jobs page.
    operator_extra_links = (ResumableJobLink(),)

    def __init__(
        self,
        *,
        items: Any,
        steps: Sequence[Step] | None = None,
        validate: StepFn | None = None,
        transform: StepFn | None = None,
        notify: StepFn | None = None,
        verify: VerifyFn | None = None,
        job_id: str | None = None,
        batch_task_id: str | None = None,
        id_field: str = "id",
        journal_conn_id: str | None = None,
        journal_path: str | os.PathLike[str] | None = None,
        durability: str | None = None,
        on_held: str = "fail",
        start_afresh: bool = False,
        allow_network_filesystem: bool | None = None,
        progress_interval: float = 30.0,
        concurrency: int = 1,
        settle_in_task: bool | None = None,
        max_attempts: int | None = None,
        max_sends_per_second: float | None = None,
        limit_key: str | None = None,
        idempotent: bool = False,
        on_journal_behind: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        shorthand = {"validate": validate, "transform": transform, "notify": notify}
        if job_id is not None and batch_task_id is not None:
            raise ValueError(f"{self.task_id}: give job_id= or batch_task_id= (whose job this task continues), "
                             "not both")
        if steps is not None and any(fn is not None for fn in (*shorthand.values(), verify)):
            raise ValueError(f"{self.task_id}: pass either steps=[...] or validate=/transform=/notify=/verify=, not both")
        if steps is None:
            if verify is not None and notify is None:
                raise ValueError(f"{self.task_id}: verify= needs notify= (it verifies the notify step)")
            try:
                # The limit key joins the step when the task runs (it may be a template); checked here if not.
                if limit_key is not None and not (isinstance(limit_key, str) and "{{" in limit_key):
                    check_limit_key(limit_key, "limit_key")
                if limit_key is not None and max_sends_per_second is None:
                    raise ValueError("limit_key shares a rate: give max_sends_per_second too")
                steps = [
                    Step(name, fn, side_effect=True, verify=verify, idempotent=idempotent,
                         max_sends_per_second=max_sends_per_second) if name == "notify" else Step(name, fn)
                    for name, fn in shorthand.items()
                    if fn is not None
                ]
            except ValueError as exc:
                raise ValueError(f"{self.task_id}: {exc}") from None
            if not steps:
                raise ValueError(f"{self.task_id}: give steps=[Step(...), ...] or at least notify=")
        elif max_sends_per_second is not None or limit_key is not None or idempotent:
            raise ValueError(f"{self.task_id}: with steps=[...], give max_sends_per_second, limit_key and idempotent "
                             "to each Step(...) that sends")
        if settle_in_task is not None and not isinstance(settle_in_task, bool):
            raise ValueError(f"{self.task_id}: settle_in_task must be True or False, not {settle_in_task!r}")
        if max_attempts is not None:
            try:
                Settlement(max_attempts=max_attempts)
            except ValueError as exc:
                raise ValueError(f"{self.task_id}: {exc}") from None
        if on_journal_behind is not None:
            try:
                check_on_journal_behind(on_journal_behind)
            except ValueError as exc:
                raise ValueError(f"{self.task_id}: {exc}") from None
        if on_held not in ("fail", "succeed"):
            raise ValueError(f"{self.task_id}: on_held must be 'fail' or 'succeed', not {on_held!r}")
        if durability is not None:
            checked_durability(durability, f"{self.task_id}: durability")
        self.items = items
        self.steps = list(steps)
        self.job_id = job_id
        self.batch_task_id = batch_task_id
        self.id_field = id_field
        self.journal_conn_id = journal_conn_id
        self.journal_path = journal_path
        self.durability = durability
        self.on_held = on_held
        self.start_afresh = start_afresh
        self.allow_network_filesystem = allow_network_filesystem
        self.settle_in_task = settle_in_task
        self.max_attempts = max_attempts
        self.limit_key = limit_key
        self.on_journal_behind = on_journal_behind
        try:
            self.concurrency = check_concurrency(concurrency)
            self.progress_interval = check_progress_interval(progress_interval)
        except ValueError as exc:
            raise ValueError(f"{self.task_id}: {exc}") from None

    def _settlement(self) -> Settlement | bool:
        settle = default_settle_in_task() if self.settle_in_task is None else self.settle_in_task
        if not settle:
            return False
        return Settlement(max_attempts=self.max_attempts or default_max_attempts())

    def _steps(self) -> list[Step]:
        """The steps to run: the notify shorthand's with its limit key as rendered."""
        if self.limit_key is None:
            return self.steps
        try:
            return [dataclasses.replace(step, limit_key=self.limit_key) if step.name == "notify" and step.side_effect
                    else step for step in self.steps]
        except ValueError as exc:
            raise ValueError(f"{self.task_id}: {exc}") from None

    # -- templating -----------------------------------------------------------------------------

    def _do_render_template_fields(
        self, parent: Any, template_fields: Iterable[str], context: Context, jinja_env: Any,
        seen_oids: set[int],
    ) -> None:
        # ``items`` is a templated field so an XComArg or a template string for the whole list is
        # resolved - but the items themselves are data: a payload saying "{{ name }}" must reach the
        # receiver byte for byte, so lists are never walked and callables are never called here.
        # (Overridden at this depth because a mapped task renders through it, not through
        # render_template_fields.)
        fields = list(template_fields)
        super()._do_render_template_fields(  # type: ignore[misc]
            parent, [name for name in fields if name != "items"], context, jinja_env, seen_oids
        )
        if parent is not self or "items" not in fields:
            return
        items = self.items
        if isinstance(items, str):
            self.items = _parse_rendered_items(self.render_template(items, context, jinja_env), self.task_id)
        elif not callable(items) and callable(getattr(items, "resolve", None)):
            self.items = items.resolve(context)

    # -- execution ------------------------------------------------------------------------------

    @cached_property
    def hook(self) -> ResumableJournalHook:
        """This task's journal: its own settings, then the Airflow config."""
        options: dict[str, Any] = {"durability": self.durability or default_durability()}
        if self.allow_network_filesystem is not None:  # else the config's, in the target's options
            options["allow_network_filesystem"] = self.allow_network_filesystem
        return ResumableJournalHook(self.journal_conn_id, self.journal_path, **options)

    def _iter_items(self, context: Context) -> Iterable[Mapping[str, Any]]:
        items = self.items
        if callable(items):
            parameters = inspect.signature(items).parameters.values()
            if not parameters:
                items = items()
            elif all(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
                items = items(**context)  # def items(**context), as Airflow's own callables take it
            else:
                items = items(context)
        if isinstance(items, (str, bytes, Mapping)) or not isinstance(items, Iterable):
            raise ValueError(
                f"{self.task_id}: items must be a list (or iterable) of mappings, got {type(items).__name__}"
            )
        return items

    def execute(self, context: Context) -> dict[str, Any]:
        continued_in: str | None = None  # the journal id the batch task this one continues recorded
        if self.batch_task_id is not None:
            job_id, continued_in = batch_job(context, owner=self.task_id, job_id=None,
                                             batch_task_id=self.batch_task_id)
        else:
            job_id = self.job_id or default_job_id(context)
        # The name Airflow records for this try ([core] hostname_callable), as the UI shows it: two
        # Celery workers on one machine have one socket.gethostname() but two of these.
        hostname = getattr(context["ti"], "hostname", None) or socket.gethostname()
        # Set by on_kill; made here, not in __init__: Airflow may deep-copy the operator before it runs.
        self._stop = threading.Event()
        store = context.get("task_state_store")
        started = store.get(STARTED_STORE_KEY) if store is not None else None
        if store is not None and started is None:
            # The first try to start after the store was empty keeps its number: only a mark written by
            # try 1 proves that no earlier try ran under a state Airflow has since dropped.
            store_forever(store, STARTED_STORE_KEY, {"try": context["ti"].try_number, "host": hostname})
        on_behind = self.on_journal_behind or default_on_journal_behind()
        with self.hook.get_conn() as journal:
            self._guard_worker(context, journal, job_id, hostname, started=started, continued_in=continued_in)
            self.log.info("Resumable job %s: journal %s, on %s", job_id, journal.location, hostname)
            if store is None:
                self.log.warning("High-water mark off: this Airflow has no task state store (Airflow >= 3.3), so a "
                                 "journal restored from a backup or failed over to a standby that had not received "
                                 "everything is not detected (SPEC §13)")
            elif self.batch_task_id is not None and continued_in is not None:
                self._carry_mark(context, _TaskStateMarks(store), job_id, continued_in)
            self._last_progress: BatchProgress | None = None
            try:
                result = run_batch(
                    journal, job_id, self._iter_items(context), self._steps(), id_field=self.id_field,
                    concurrency=self.concurrency, on_progress=self._log_progress,
                    progress_interval=self.progress_interval,
                    runner=f"{context['ti'].dag_id}.{context['ti'].task_id} try {context['ti'].try_number}",
                    stop=self._stop, dag_id=context["ti"].dag_id, settle_in_task=self._settlement(),
                    high_water=None if store is None else _TaskStateMarks(store), on_journal_behind=on_behind,
                )
            except BatchStopped:
                asked = self.__dict__.get("_stop_asked_at")
                self.log.warning("Stopped on request (mark failed / mark success / Clear / timeout) at %s: no send "
                                 "started after it, the sends in flight were recorded. Job %s is unfinished; "
                                 "a retry or a Clear resumes it.",
                                 datetime.fromtimestamp(asked, timezone.utc).isoformat() if asked else "?", job_id)
                if self._last_progress is not None:
                    emit_batch_metrics(self._last_progress, dag_id=context["ti"].dag_id,
                                       task_id=context["ti"].task_id)
                raise
            except BaseException as exc:
                if isinstance(exc, JournalBehindError):  # refused before any send: what on-call alerts on
                    emit_journal_behind(dag_id=context["ti"].dag_id, task_id=context["ti"].task_id)
                # A step failed: this try's counters still count (the runner reported how far it got).
                if self._last_progress is not None:
                    emit_batch_metrics(self._last_progress, dag_id=context["ti"].dag_id,
                                       task_id=context["ti"].task_id)
                raise
            summary = _summary(result, journal, hostname)
        context["ti"].xcom_push(key=SUMMARY_XCOM_KEY, value=summary)
        self._report(result)
        # Metrics before a held-items failure, so held counts are reported too.
        emit_batch_metrics(result, dag_id=context["ti"].dag_id, task_id=context["ti"].task_id)
        if result.held and self.on_held == "fail":
            raise held_items_error(result, self.steps)
        return summary

    def _carry_mark(self, context: Context, marks_store: _TaskStateMarks, job_id: str, journal_id: str) -> None:
        """A later pass starts from the count the batch task's summary recorded, until it keeps a mark of
        its own: a journal that went back between the two passes is refused all the same. (A count is
        data, not a location: the journal itself is never taken from XCom.)"""
        if marks_store.read() is not None:
            return
        summary = context["ti"].xcom_pull(task_ids=self.batch_task_id, key=SUMMARY_XCOM_KEY)
        marks = summary.get("journal_marks") if isinstance(summary, dict) else None
        if type(marks) is not int or marks < 0:
            return  # a summary of an older release
        marks_store.write(mark_record(journal_id=journal_id, job=job_id, marks=marks,
                                      by=f"task {self.batch_task_id} (its summary)"))

    def _guard_worker(
        self, context: Context, journal: StepJournal, job_id: str, hostname: str, *, started: object,
        continued_in: str | None = None,
    ) -> None:
        """Refuse to run a job whose journal is not this one (it would re-send everything).

        A worker-local journal: a retry on another worker is refused. A shared journal: any worker
        resumes; a try configured with a *different* journal than the one that holds the job is
        refused all the same. ``started``: the start mark an earlier try left in the task state store
        (the first try that wrote it into an empty store), or None.
        A later pass (``batch_task_id``) is refused, whatever its try, on a journal other than the one
        the batch task recorded (``continued_in``) or one that never saw the job.
        """
        shared = journal.shared
        here = {"host": hostname, "journal": journal.location, "journal_id": journal.journal_id, "shared": shared}
        store = context.get("task_state_store")
        recorded = store.get(STATE_STORE_KEY) if store is not None else None
        if isinstance(recorded, dict) and recorded.get("journal_id") == journal.journal_id:
            return
        ti = context["ti"]
        if isinstance(recorded, dict):
            where = recorded.get("journal") or recorded.get("journal_path")
            if recorded.get("shared"):
                danger = f"this job's journal is the shared journal {where}, but this try uses journal {journal.location}"
            else:
                danger = (
                    f"this job's journal is on host {recorded.get('host')!r} at {where}, "
                    f"but this try runs on {hostname!r} with journal {journal.location}"
                )
        elif self.batch_task_id is not None and (
            (continued_in is not None and continued_in != journal.journal_id) or not journal.has_job(job_id)
        ):
            danger = (
                f"this task continues the job task {self.batch_task_id!r} ran, but the journal {journal.location} "
                f"on {hostname!r} " + ("is not the one that task used" if continued_in not in (None, journal.journal_id)
                                       else "has never seen that job")
            )
        elif isinstance(started, dict) and started.get("try") == 1:
            # Try 1 started (it says so) and no try recorded a journal: none got past this guard, and
            # every try records its journal before its first send. Nothing was sent anywhere. A mark
            # of a later try proves nothing: Airflow may have dropped the state of a try that sent
            # ([state_store] clear_on_success) before it was written.
            danger = None
        elif not shared and ti.try_number > 1 and not journal.has_job(job_id):
            # Nothing in the store: Airflow < 3.3, or Airflow dropped this task's state ([state_store]
            # clear_on_success, on a success or a "mark success"; a first try on an older Airflow). A
            # journal that never saw the job is then all there is to go on.
            danger = (
                f"this is try {ti.try_number}, but the journal {journal.location} on {hostname!r} has never "
                "seen this job: earlier tries ran on another worker or the journal was removed"
            )
        else:
            danger = None
        if danger and not self.start_afresh:
            if store is not None and started is None:
                store.delete(STARTED_STORE_KEY)  # this try never got past the guard either: it says nothing
            advice = (
                "Point journal_conn_id (or [resumable] journal_conn_id) back at the journal that holds the job"
                if isinstance(recorded, dict) and recorded.get("shared") else
                "Run this task on the worker that holds the journal (pin it with a queue), or use a shared "
                "journal (journal_conn_id)"
            )
            raise WrongWorkerError(
                f"Resumable job {job_id}: {danger}. Nothing was sent. {advice}, or set start_afresh=True on the "
                "operator to start over - which may send every item again."
            )
        if danger:
            self.log.warning("Resumable job %s: %s; start_afresh=True, starting over.", job_id, danger)
        if store is not None:
            # Kept past the store's default retention: a Clear months later must still be guarded.
            store_forever(store, STATE_STORE_KEY, here)

    def on_kill(self) -> None:
        """Airflow stops the task (SIGTERM on "mark failed", "mark success", Clear; or the execution
        timeout): start no new send. Sends in flight are recorded as they finish and the task ends
        within a send's time, long before the supervisor's SIGKILL. Runs in a signal handler: it only
        sets a flag."""
        stop = self.__dict__.get("_stop")
        if stop is not None:
            self.__dict__.setdefault("_stop_asked_at", time.time())  # for the "Stopped on request" line
            stop.set()

    def _log_progress(self, progress: BatchProgress) -> None:
        self._last_progress = progress
        total = f"/{progress.items_total}" if progress.items_total is not None else ""
        rate = progress.items_done / progress.elapsed if progress.elapsed > 0 else 0.0
        settling = ""
        if progress.waits or progress.gave_up:
            settling = (f"; in this try {progress.resent_in_task} re-sent, {progress.settled_in_task} settled by "
                        f"look-up, {progress.waits} waits, {progress.gave_up} left for the next try")
        if progress.paused:
            settling += f"; receiver asked to wait: paused {progress.paused:.1f} s more"
        self.log.info(
            "Progress: %d%s items done, %d steps executed, %d skipped, %d held, %.0f items/s%s",
            progress.items_done, total, progress.executed_steps, progress.skipped_steps, progress.held, rate,
            settling,
        )

    def _report(self, result: BatchResult) -> None:
        self.log.info(
            "Job %s %s: %d items (%d completed), %d steps executed (%d re-sent: not delivered per verify), "
            "%d skipped (%d verified), %d held; settled in the task: %d re-sent after a refusal, %d unknown "
            "outcomes settled by look-up, %d waits",
            result.job_id, result.status, result.items_total, result.items_completed, result.executed_steps,
            result.resent_steps, result.skipped_steps, result.verified_steps, len(result.held),
            result.resent_in_task, result.settled_in_task, result.waits,
        )
        for held in result.held[:HELD_IN_MESSAGE]:
            self.log.warning("HELD %s / %s: %s", held.item_id, held.step, held.reason.value)
        if len(result.held) > HELD_IN_MESSAGE:
            self.log.warning("... and %d more held items", len(result.held) - HELD_IN_MESSAGE)


def _parse_rendered_items(rendered: Any, task_id: str) -> Any:
    """A template string for the whole list renders to a list (native) or its text (not native)."""
    if not isinstance(rendered, str):
        return rendered
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(rendered)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    raise ValueError(f"{task_id}: the items template did not render to a list of mappings")


def _summary(result: BatchResult, journal: StepJournal, hostname: str) -> dict[str, Any]:
    return {
        "job_id": result.job_id,
        "journal_path": None if journal.shared else str(getattr(journal, "path", journal.location)),
        "journal": journal.location,  # a path, or the shared journal's server and schema (no password)
        "journal_kind": journal.kind,
        "journal_id": journal.journal_id,
        "hostname": hostname,
        "status": result.status,
        "items_total": result.items_total,
        "items_completed": result.items_completed,
        "executed_steps": result.executed_steps,
        "skipped_steps": result.skipped_steps,
        "verified_steps": result.verified_steps,
        "resent_steps": result.resent_steps,  # verify answered NOT_DELIVERED: sent once more
        "held_count": len(result.held),
        "held": [
            {"item_id": h.item_id, "step": h.step, "reason": h.reason.value} for h in result.held[:HELD_IN_SUMMARY]
        ],
        "held_truncated": len(result.held) > HELD_IN_SUMMARY,
        "journal_marks": journal.marks(result.job_id),  # the job's IN_FLIGHT marks in the journal (SPEC §13)
    }


class _TaskStateMarks:
    """The high-water mark (SPEC §13) kept in the task instance's ``task_state_store``: per task instance,
    kept through retries and Clear, never expiring - but wiped with the rest of the task's state by
    ``[state_store] clear_on_success`` when a try succeeds: a Clear after that starts without a mark (the
    check starts again from the journal's count)."""

    def __init__(self, store: Any) -> None:
        self.store = store

    def read(self) -> dict[str, Any] | None:
        value = self.store.get(HIGH_WATER_STORE_KEY)
        return value if isinstance(value, dict) else None

    def write(self, record: dict[str, Any]) -> None:
        store_forever(self.store, HIGH_WATER_STORE_KEY, record)


def held_items_error(result: BatchResult, steps: Sequence[Step]) -> HeldItemsError:
    """The error a run that held items fails its task with. A retry asks ``verify`` again about
    unknown-outcome sends (a receiver may record late): worth the task's retries while some held send
    has a verify. Nothing else held changes without a human: then the task fails without spending them."""
    with_verify = {step.name for step in steps if step.side_effect and step.verify is not None}
    if any(h.reason == HeldReason.UNKNOWN_OUTCOME and h.step in with_verify for h in result.held):
        return HeldItemsError(_held_message(result))
    return HeldItemsNeedAHumanError(_held_message(result) + "\nNo retry can settle these (their steps have no "
                                    "verify), so this try fails without using the remaining retries.")


def _held_message(result: BatchResult) -> str:
    lines = [
        f"{len(result.held)} item(s) of job {result.job_id} were held for a human; all other items were "
        "processed and nothing was sent twice:"
    ]
    lines += [f"  {h.item_id} / {h.step}: {h.reason.value}" for h in result.held[:HELD_IN_MESSAGE]]
    if len(result.held) > HELD_IN_MESSAGE:
        lines.append(f"  ... and {len(result.held) - HELD_IN_MESSAGE} more (see the task's XCom summary)")
    lines.append(
        f"To resolve: check each with the receiver, then trigger the {RESOLVE_DAG_ID!r} DAG with conf "
        '{"job_id": ..., "item_id": ..., "step": ..., "decision": "delivered" (with "receipt") | '
        '"not_delivered" | "keep_previous_input" | "use_new_input"}; then Clear this task to resume.'
    )
    return "\n".join(lines)
