"""The journal's housekeeping: forgetting finished jobs (prune) without holding up runs on the same journal."""

from __future__ import annotations

import time
from datetime import timedelta

from airflow_resumable.journal import statements as sql
from airflow_resumable.journal.backend import JournalBackend
from airflow_resumable.journal.errors import JobBusyError

__all__ = ["JournalHousekeeping"]


class JournalHousekeeping:
    """What an operator runs now and then on a journal (``airflow-resumable prune``)."""

    engine: JournalBackend

    # Items deleted per transaction by prune: short enough that a run on the same journal waits
    # milliseconds, not seconds, for its next mark's commit.
    PRUNE_BATCH_ITEMS = 500
    # Seconds between two batches, at least: longer than any sleep of SQLite's busy handler in a
    # writer's first 100 ms of waiting (1, 2, 5, 10, 15, 20, 25, 25 ms). A run whose mark found a
    # batch under way then wakes up in the pause after it; with pauses as short as the batches
    # (5-10 ms) it kept waking while the next batch held the journal, up to 8 batches (107 ms).
    PRUNE_PAUSE = 0.03

    def prune(self, older_than: timedelta) -> list[str]:
        """Forget finished jobs not updated for ``older_than``; returns the pruned job ids.

        A job is finished when a run went through its whole batch, every row is SUCCEEDED and nothing
        is held. A job with held or unresolved rows, or one running right now, is never pruned. A
        pruned job leaves a tombstone: running it again under the same job_id is refused (it would
        re-send everything). The tombstone is written first, then the rows are deleted in short
        transactions of :attr:`PRUNE_BATCH_ITEMS` items, pausing at least :attr:`PRUNE_PAUSE` between
        them so runs on the same journal commit their marks meanwhile; a prune that was interrupted is
        finished by the next one.
        """
        if not isinstance(older_than, timedelta) or older_than < timedelta(0):
            raise ValueError("older_than must be a non-negative datetime.timedelta, e.g. timedelta(days=30)")
        cutoff = time.time() - older_than.total_seconds()
        pruned = [job_id for (job_id,) in self.engine.read(sql.PRUNES_UNDER_WAY)
                  if self._prune_job(job_id, cutoff, resume=True)]
        pruned += [job_id for (job_id,) in self.engine.read(sql.PRUNE_CANDIDATES, (cutoff,))
                   if self._prune_job(job_id, cutoff, resume=False)]
        return pruned

    def _prune_job(self, job_id: str, cutoff: float, *, resume: bool) -> bool:
        try:
            claim = self.engine.claim(job_id, runner="prune")
        except JobBusyError:
            return False  # running right now: not finished after all
        try:
            if not resume:
                with self.engine.write(durable=True) as tx:
                    # Re-check under the claim: a run may have started and stopped in between.
                    if tx.one(sql.JOB_STILL_FINISHED, (job_id, cutoff)) is None:
                        return False
                    tx.run(sql.MARK_PRUNED, (time.time(), job_id))
            after = ""  # item ids are never empty: "" comes before every one
            while True:
                started = time.monotonic()
                with self.engine.write(durable=False) as tx:
                    (last,) = tx.one(sql.PRUNE_BATCH_END, (job_id, after, self.PRUNE_BATCH_ITEMS)) or (None,)
                    if last is not None:
                        tx.run(sql.PRUNE_BATCH, (job_id, after, last))
                if last is None:
                    return True
                after = last
                # As long again as the batch took (at least PRUNE_PAUSE, at most 50 ms): writers waiting for
                # the journal get in.
                self._pause(max(self.PRUNE_PAUSE, min(0.05, time.monotonic() - started)))
        finally:
            claim.release(remove=True)

    def _pause(self, seconds: float) -> None:
        """The prune's pause between two batches (its own method: a test watches it, not every sleep)."""
        time.sleep(seconds)
