"""HeldItemSensor: wait until a resumable job has nothing held or unresolved."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk.bases.sensor import BaseSensorOperator

from airflow_resumable._location import JournalTarget, batch_job
from airflow_resumable.hooks.journal import ResumableJournalHook
from airflow_resumable.journal import JobBusyError
from airflow_resumable.runner import verify_held
from airflow_resumable.triggers.held_items import HeldItemTrigger, job_settled

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["HeldItemSensor"]


class HeldItemSensor(BaseSensorOperator):
    """Wait until a resumable job has no held or unresolved side-effect rows.

    Two ways to wait without holding a worker slot:

    * **Deferrable** (shared journal only): the sensor checks once, then hands the wait to the
      triggerer (:class:`~airflow_resumable.triggers.held_items.HeldItemTrigger`), which reads the
      shared PostgreSQL journal every ``poke_interval`` seconds. A worker-local SQLite journal is out
      of the triggerer's reach, so an explicit ``deferrable=True`` on one is refused.
    * **Reschedule** (default otherwise): the sensor pokes from a worker and gives its slot back
      between pokes. With a worker-local journal, route it to the batch task's worker queue; with a
      shared journal (``journal_conn_id``) any worker will do.

    :param job_id: the job to watch (templated). Or:
    :param batch_task_id: the ResumableBatchOperator task whose XCom summary names the job (for a
        mapped batch task, give ``job_id`` of each shard instead). The journal is never taken from
        XCom: the sensor opens its own (below) and checks that it is the one the summary names.
    :param journal_conn_id: an Airflow Postgres connection holding a shared journal; default
        ``[resumable] journal_conn_id``. Wins over ``journal_path``.
    :param journal_path: the journal file; default as for the operator.
    :param verify: optional ``verify(ctx)``: on each poke, held unknown-outcome sends whose receipt
        the receiver now has are marked SUCCEEDED (for receivers that record asynchronously). Runs on
        a worker, so not with ``deferrable=True``.
    :param deferrable: wait in the triggerer (needs a shared journal). Default: ``[operators]
        default_deferrable`` when the journal is shared, else reschedule mode.
    """

    template_fields: Sequence[str] = ("job_id", "batch_task_id")

    def __init__(
        self,
        *,
        job_id: str | None = None,
        batch_task_id: str | None = None,
        journal_conn_id: str | None = None,
        journal_path: str | os.PathLike[str] | None = None,
        verify: Callable[..., Any] | None = None,
        mode: str = "reschedule",
        deferrable: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(mode=mode, **kwargs)
        if (job_id is None) == (batch_task_id is None):
            raise ValueError(f"{self.task_id}: give exactly one of job_id= or batch_task_id=")
        if deferrable and verify is not None:
            raise ValueError(
                f"{self.task_id}: verify= asks the receiver from a worker, but a deferrable sensor waits in the "
                "triggerer; use deferrable=False with verify="
            )
        self.deferrable = deferrable
        self.job_id = job_id
        self.batch_task_id = batch_task_id
        self.journal_conn_id = journal_conn_id
        self.journal_path = journal_path
        self.verify = verify

    @cached_property
    def hook(self) -> ResumableJournalHook:
        """The batch task's journal: this sensor's own settings, then the Airflow config."""
        return ResumableJournalHook(self.journal_conn_id, self.journal_path)

    def _job(self, context: Context) -> tuple[str, str | None]:
        """The job, and the journal id the batch task's summary recorded."""
        return batch_job(context, owner=self.task_id, job_id=self.job_id, batch_task_id=self.batch_task_id)

    def execute(self, context: Context) -> Any:
        if self.deferrable is False:  # reschedule mode: poke() finds the journal itself
            return super().execute(context)
        job_id, recorded_id = self._job(context)
        target = self.hook.target
        if not self._defers(target) or target.conn_id is None:
            return super().execute(context)
        journal_id = self._check(job_id, recorded_id)
        if journal_id is None:
            return None
        self.defer(
            trigger=HeldItemTrigger(job_id=job_id, journal_conn_id=target.conn_id, journal_id=journal_id,
                                    poll_interval=self.poke_interval),
            method_name="execute_complete",
            timeout=timedelta(seconds=self.timeout),
        )

    def _defers(self, target: JournalTarget) -> bool:
        """Whether this sensor waits in the triggerer (see the class docstring)."""
        if target.shared:
            if self.deferrable is not None:
                return bool(self.deferrable)
            from airflow_resumable._compat import conf

            return self.verify is None and conf().getboolean("operators", "default_deferrable", fallback=False)
        if self.deferrable:
            raise ValueError(
                f"{self.task_id}: deferrable=True needs a shared journal (journal_conn_id): the triggerer cannot read "
                f"the worker-local journal {target.display}. Use deferrable=False (reschedule mode also frees the "
                "worker slot between pokes), or a shared journal."
            )
        return False

    def execute_complete(self, context: Context, event: dict[str, Any] | None = None) -> None:
        if not isinstance(event, dict) or event.get("status") != "settled":
            message = event.get("message") if isinstance(event, dict) else None
            raise ValueError(f"{self.task_id}: {message or 'the trigger ended without an answer'}")
        self.log.info("Job %s has nothing held or unresolved", event.get("job_id"))

    def poke(self, context: Context) -> bool:
        return self._check(*self._job(context)) is None

    def _check(self, job_id: str, recorded_id: str | None) -> str | None:
        """None once the job is settled; else the id of the journal that holds it."""
        with self.hook.batch_journal(owner=self.task_id, recorded_id=recorded_id) as journal:
            job = journal.job(job_id) if self.verify is not None else None
            if job is not None and not job.settled:  # something for verify to ask the receiver about
                try:
                    for settled in verify_held(journal, job_id, self.verify, resolved_by=f"sensor {self.task_id}"):
                        self.log.info("%s / %s: settled by the receiver's answer", settled.item_id, settled.step)
                except JobBusyError:
                    # A run of the job is under way: it verifies its own held sends. Ask again next poke.
                    self.log.info("Job %s is running right now; not settled yet", job_id)
                    return journal.journal_id
            try:
                settled = job_settled(journal, job_id, self.log)
            except ValueError as exc:  # no such job in this journal
                raise ValueError(f"{self.task_id}: {exc}") from None
            return None if settled else journal.journal_id
