"""The journal's housekeeping: forgetting finished jobs (prune) without holding up runs on the same journal."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

from airflow_resumable.exceptions import JobBusyError, JournalConnectionError, JournalError
from airflow_resumable.journal import statements as sql
from airflow_resumable.journal.backend import COMPACTION_RUNNER, JournalBackend, Tx
from airflow_resumable.journal.compaction import compact_item, step_set_key

__all__ = ["JournalHousekeeping"]

log = logging.getLogger(__name__)


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
        if self.engine.compacted_partitions:
            self._drop_partitions()
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
            self._in_batches((sql.PRUNE_BATCH_END, sql.PRUNE_BATCH), job_id)
            found = self.engine.read(sql.JOB_NUMBER, (job_id,))
            if found and found[0][0] is not None:  # and its compacted items
                if self.engine.compacted_partitions:  # forgotten now, dropped with their partition
                    with self.engine.write(durable=True) as tx:
                        tx.run(sql.FORGET_COMPACTED, (found[0][0], job_id))
                else:  # deleted the same way
                    self._in_batches((sql.PRUNE_COMPACTED_END, sql.PRUNE_COMPACTED), found[0][0])
            return True
        finally:
            claim.release(remove=True)

    # Tries to drop one partition, and the pause between them: a drop gives up after 50 ms when someone
    # is reading compacted (its readers would queue behind it).
    DROP_TRIES = 3
    DROP_RETRY_PAUSE = 0.5

    def _drop_partitions(self) -> None:
        """Drop the partitions of ``compacted`` whose items belong to no job any more (PostgreSQL), each in a
        transaction of its own. Nothing is rewritten: the server frees the files. One that cannot be dropped
        now is left to the next prune (its items are no job's: no read sees them)."""
        try:
            for first, stop in self.engine.read(sql.DROPPABLE_PARTITIONS):
                self._drop_partition(first, stop)
        except JournalConnectionError:
            raise
        except JournalError as exc:  # refused: e.g. a role that does not own the journal's tables
            log.warning("prune could not drop the partitions of compacted whose jobs are all pruned: %s The "
                        "pruned jobs are pruned; their compacted items wait, no job's, for the next prune. Run "
                        "prune as the role that owns the journal's tables.", exc)

    def _drop_partition(self, first: int, stop: int) -> None:
        for attempt in range(self.DROP_TRIES):
            if attempt:
                self._pause(self.DROP_RETRY_PAUSE)
            with self.engine.write(durable=True) as tx:
                tx.run(sql.READ_COMMITTED)
                (dropped,) = tx.one(sql.DROP_PARTITION, (first, stop)) or (False,)
            if dropped:
                return

    def _in_batches(self, statements: tuple[str, str], key: object) -> None:
        """Delete a job's rows (``statements``: the end of the next batch after an item, the deletion of the
        batch) a bounded batch per transaction, pausing between them."""
        batch_end, delete = statements
        after = ""  # item ids are never empty: "" comes before every one
        while True:
            started = time.monotonic()
            with self.engine.write(durable=False) as tx:
                (last,) = tx.one(batch_end, (key, after, self.PRUNE_BATCH_ITEMS)) or (None,)
                if last is not None:
                    tx.run(delete, (key, after, last))
            if last is None:
                return
            after = last
            self._pause_after_batch(started)

    def compact(self, older_than: timedelta = timedelta(0)) -> dict[str, int]:
        """Keep the finished items of jobs no run has touched for ``older_than`` as one row each (schema 8,
        ``journal/compaction.py``); returns how many items of each job were compacted.

        An item is finished when every one of its steps is SUCCEEDED and nothing of it is held; the rest
        of the job stays as it is (held items, failed ones). Nothing a reader sees changes: ``rows()``,
        counts and versions are the same, and a run that needs an item again (its input changed, a step
        was added) puts its rows back first. A job running right now is left for the next time. Like
        prune, in short transactions of :attr:`PRUNE_BATCH_ITEMS` items with pauses between them; one
        that was interrupted is finished by the next (a job is compacted again once a run finished it
        again).
        """
        if not isinstance(older_than, timedelta) or older_than < timedelta(0):
            raise ValueError("older_than must be a non-negative datetime.timedelta, e.g. timedelta(hours=1)")
        cutoff = time.time() - older_than.total_seconds()
        done: dict[str, int] = {}
        for (job_id,) in self.engine.read(sql.COMPACT_CANDIDATES, (cutoff,)):
            count = self._compact_job(job_id, cutoff)
            if count is not None:
                done[job_id] = count
        return done

    def _compact_job(self, job_id: str, cutoff: float) -> int | None:
        """Compact one job, each batch under the job's claim, taken for that batch only: a run of the job
        that starts meanwhile waits one batch at most (compaction is a brief holder), and compaction then
        leaves the job to it (the next compaction goes on once a run finished it again)."""
        step_sets: dict[tuple[str, ...], int] = {}
        compacted, after, job_no = 0, "", None
        while True:
            started = time.monotonic()
            try:
                claim = self.engine.claim(job_id, runner=COMPACTION_RUNNER, brief=True)
            except JobBusyError:
                return compacted or None  # a run (or a person) has the job now
            try:
                with self.engine.write(durable=False) as tx:
                    # Under the claim: no run, prune or decision acts on the job's rows meanwhile.
                    if tx.one(sql.JOB_STILL_COMPACTABLE, (job_id, cutoff)) is None:
                        return compacted or None  # run again (or pruned) since the candidates were read
                    if job_no is None:
                        tx.run(sql.NUMBER_JOB.format(next_job_no=self.engine.next_job_no), (job_id,))
                        (job_no,) = tx.one(sql.JOB_NUMBER, (job_id,)) or (None,)
                        if self.engine.compacted_partitions:
                            tx.one(sql.COMPACTED_PARTITION, (job_no,))
                    (last,) = tx.one(sql.PRUNE_BATCH_END, (job_id, after, self.PRUNE_BATCH_ITEMS)) or (None,)
                    if last is None:
                        tx.run(sql.JOB_COMPACTED, (time.time(), job_id))
                        return compacted
                    compacted += self._compact_batch(tx, job_id, job_no, after, last, step_sets)
            finally:
                claim.release()
            after = last
            self._pause_after_batch(started)

    def _compact_batch(
        self, tx: Tx, job_id: str, job_no: int, after: str, last: str, step_sets: dict[tuple[str, ...], int],
    ) -> int:
        """Compact the finished items among the job's items in (``after``, ``last``]; returns how many."""
        by_item: dict[str, list[tuple[Any, ...]]] = {}
        for row in tx.all(sql.COMPACT_ROWS, (job_id, after, last)):
            by_item.setdefault(row[1], []).append(row)
        items = [c for item_id, rows in by_item.items() if (c := compact_item(job_id, item_id, rows)) is not None]
        if not items:
            return 0
        for item in items:
            if item.names not in step_sets:
                names, key = step_set_key(item.names)
                tx.run(sql.STEP_SET_ADD, (key, names))
                (step_sets[item.names],) = tx.one(sql.STEP_SET_ID, (key,)) or (None,)
        per_statement = sql.rows_per_statement(len(items), 6, tx.max_params)  # the engine's parameter limit
        for start in range(0, len(items), per_statement):
            part = items[start:start + per_statement]
            tx.run(sql.compacted_insert(len(part)),
                   [value for item in part for value in (job_no, step_sets[item.names], len(item.names), item.item_id,
                                                         item.digest, item.data)])
            tx.run(sql.items_delete(len(part)), [job_id, *(item.item_id for item in part)])
        return len(items)

    def _pause_after_batch(self, started: float) -> None:
        """As long again as the batch begun at ``started`` (``time.monotonic()``) took, at least PRUNE_PAUSE and
        at most 50 ms: writers waiting for the journal get in."""
        self._pause(max(self.PRUNE_PAUSE, min(0.05, time.monotonic() - started)))

    def _pause(self, seconds: float) -> None:
        """The prune's pause between two batches (its own method: a test watches it, not every sleep)."""
        time.sleep(seconds)
