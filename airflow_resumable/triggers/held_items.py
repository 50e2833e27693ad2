"""HeldItemTrigger: the deferrable HeldItemSensor's wait, run by the triggerer.

It reads a *shared* journal only: the triggerer runs on its own host (or at least in its own
process), so a worker-local SQLite file is out of its reach. The trigger carries the Airflow
connection id and the journal's identity, never a URL or password (trigger arguments are stored in
the metadata database); it looks the connection up in the triggerer and checks that the journal it
reaches is the one the sensor saw.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

__all__ = ["HeldItemTrigger"]


def job_settled(journal: Any, job_id: str, log: Any) -> bool:
    """Whether job ``job_id`` has nothing held or unresolved, said in the log either way (the sensor's
    poke and the trigger's poll). ValueError if the journal has no such job: waiting cannot help."""
    job = journal.job(job_id)
    if job is None:
        raise ValueError(f"journal {journal.location} has no job {job_id!r}")
    if job.settled:
        log.info("Job %s has nothing held or unresolved", job_id)
        return True
    log.info("Job %s: %d held, %d unresolved; waiting", job_id, job.held, job.unresolved)
    return False


class HeldItemTrigger(BaseTrigger):
    """Fire once job ``job_id`` of the shared journal behind ``journal_conn_id`` is settled.

    Polls every ``poll_interval`` seconds; one read per poll in a thread (the journal is synchronous).
    A failed read (the server restarting, a network blip) is logged and retried at the next poll: the
    sensor's ``timeout`` bounds the wait, not one unlucky poll.

    Events: ``{"status": "settled", ...}`` when nothing is held or unresolved; ``{"status": "error",
    "message": ...}`` when the job or the journal is not the one the sensor saw (retrying cannot help).
    """

    def __init__(self, *, job_id: str, journal_conn_id: str, journal_id: str, poll_interval: float = 30.0) -> None:
        super().__init__()
        self.job_id = job_id
        self.journal_conn_id = journal_conn_id
        self.journal_id = journal_id
        self.poll_interval = float(poll_interval)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            f"{type(self).__module__}.{type(self).__qualname__}",
            {"job_id": self.job_id, "journal_conn_id": self.journal_conn_id, "journal_id": self.journal_id,
             "poll_interval": self.poll_interval},
        )

    def _check(self) -> dict[str, Any] | None:
        """One poll: an event to fire, or None to wait on. Raises JournalError/OSError on a failed read."""
        from airflow_resumable.hooks.journal import ResumableJournalHook

        with ResumableJournalHook(self.journal_conn_id).get_conn() as journal:
            if journal.journal_id != self.journal_id:
                return {"status": "error", "message": (
                    f"connection {self.journal_conn_id!r} now reaches another journal than the one the sensor "
                    f"saw ({journal.location}); point it back at the journal that holds job {self.job_id!r}")}
            try:
                settled = job_settled(journal, self.job_id, self.log)
            except ValueError as exc:
                return {"status": "error", "message": str(exc)}
            return {"status": "settled", "job_id": self.job_id} if settled else None

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from airflow_resumable.exceptions import JournalConfigError
        from airflow_resumable.journal import JournalError

        while True:
            try:
                event = await asyncio.to_thread(self._check)
            except JournalConfigError as exc:  # no such connection, not a Postgres one: no poll will help
                event = {"status": "error", "message": str(exc)}
            except (JournalError, OSError) as exc:
                # Type name only: a driver's message may quote the connection string.
                self.log.warning("Job %s: the journal could not be read (%s); next try in %.0f s",
                                 self.job_id, type(exc).__name__, self.poll_interval)
                event = None
            if event is not None:
                yield TriggerEvent(event)
                return
            await asyncio.sleep(self.poll_interval)
