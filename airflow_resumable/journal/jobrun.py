"""The writer side: what a runner holds while it runs one job."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

from airflow_resumable.exceptions import JobPrunedError
from airflow_resumable.journal import statements as sql
from airflow_resumable.journal.backend import Claim, JournalBackend, claim_after_brief_holders
from airflow_resumable.journal.compaction import expand_item
from airflow_resumable.journal.records import HeldReason, Status, StepState, ts
from airflow_resumable.journal.statements import Statement

# Rows looked up per query when the runner resumes (well under every engine's parameter limit).
LOOKUP_CHUNK = 500
# Step sets a run's question about compacted items names at most (one parameter each).
MAX_COVERING_SETS = 500

Record = tuple[str, tuple[Any, ...]]


# A text as a JSON string (ensure_ascii off: json.dumps(text, ensure_ascii=False)).
_json_text = json.encoder.encode_basestring
# A status as the journal writes it (an enum member's .value is a slow property).
_STATUS_TEXT = {status: status.value for status in Status}

# Records about the job itself, not its steps: writing only these leaves the job's finished state alone.
_JOB_ONLY = (sql.TOUCH_JOB, sql.JOB_FINISHED)


class JobRun:
    """What a runner holds while it runs one job: the job's claim and a buffer of pending records.

    Records are buffered and written in one short transaction at the next commit point, so no
    write transaction stays open while user code runs (other jobs sharing the journal never wait
    on ours). The runner makes ``IN_FLIGHT`` marks commit points: it calls :meth:`flush` with
    ``durable=True`` after :meth:`mark_in_flight` and before the send starts, so the mark is
    committed - durably under full durability - together with everything buffered. Several marks
    buffered before one such flush share its commit (group commit).
    """

    # Commit buffered records at least this often even if no send comes along.
    FLUSH_ROWS = 1000
    FLUSH_SECONDS = 1.0
    # A receipt log past this size is emptied after the next commit (all of it is committed then).
    RECEIPT_LOG_LIMIT = 1 << 20

    def __init__(self, engine: JournalBackend, job_id: str, *, runner: str | None, dag_id: str | None = None) -> None:
        self.engine = engine
        self.job_id = job_id
        self.dag_id = dag_id
        self._pending: list[Record] = []
        self._last_flush = time.monotonic()
        self._claim = self._take_claim(engine, job_id, runner)
        self._seen_table = f"seen_{uuid.uuid4().hex}"
        try:
            found = engine.read(sql.JOB_PRUNED_AT, (job_id,))
            if found and found[0][0] is not None:
                raise JobPrunedError(
                    f"job {job_id!r} was pruned from journal {engine.location} on "
                    f"{ts(found[0][0]):%Y-%m-%d}; its history is gone, so running it again would "
                    "re-send every item. Use a new job_id only if sending everything again is intended."
                )
            # Every item id of this run with its digest (to refuse a repeated id across chunks
            # without holding a million ids in memory); rows after _chunk_start are the current chunk.
            with engine.scratch() as tx:
                tx.run(engine.seen_table_ddl(self._seen_table))
            # A job with no rows yet cannot have finished items: its first run skips the bulk check. (Rows
            # live or compacted: a job of compacted items only is no new job.)
            found = engine.read(sql.JOB_NUMBER, (job_id,))
            self._job_no: int | None = found[0][0] if found else None  # None: never compacted
            self._new_job = not engine.read(sql.JOB_HAS_ROWS, (job_id, self._job_no))
            self._step_sets: dict[tuple[str, ...], list[int]] = {}
            # A previous run of this job that died left its receipts behind: commit them before deciding.
            engine.recover(job_id)
            self._receipts = engine.receipt_log(job_id)
        except BaseException:
            self._claim.release()
            raise
        self._chunk_start = 0
        self._chunk_ids: list[str] = []
        self._last_touch = 0.0
        self._receipts_unwritten: list[bytes] = []
        self._receipts_uncommitted = False  # a receipt awaits its commit (engines without a receipt log)
        self._receipt_bytes = 0
        self._flush_failed = False
        self._receipt_prefix = f"[{_json_text(job_id)},"  # each receipt log line's start
        # The jobs row is written with the first flushed record, so a run refused before it
        # touched anything (bad input) leaves the journal exactly as it was.
        self._runner = runner
        self._flushed = False
        self._unfinished_marked = False

    @staticmethod
    def _take_claim(engine: JournalBackend, job_id: str, runner: str | None) -> Claim:
        # Another process may hold the job for a moment to fold its receipt log, to resolve one of
        # its items or to compact a batch: wait that out rather than fail the try. A running runner
        # fails us at once.
        return claim_after_brief_holders(engine, job_id, runner=runner)

    # -- lookups --------------------------------------------------------------------------------

    def lookup(self, item_ids: Sequence[str]) -> dict[str, dict[str, StepState]]:
        """The journal's rows of these items: ``{item_id: {step: StepState}}``."""
        found: dict[str, dict[str, StepState]] = {}
        if self._new_job:
            return found  # ids are unique within a run: only this run could have written them
        for start in range(0, len(item_ids), LOOKUP_CHUNK):
            part = item_ids[start:start + LOOKUP_CHUNK]
            for item_id, step, status, digest, output, held_reason, generation, not_sent in self.engine.read(
                sql.lookup_rows(len(part)), (self.job_id, *part)
            ):
                found.setdefault(item_id, {})[step] = StepState(
                    Status(status), digest, output, None if held_reason is None else HeldReason(held_reason),
                    int(generation), bool(not_sent),
                )
        return found

    def marks(self) -> int:
        """The IN_FLIGHT marks the journal has counted for this job (committed ones only)."""
        rows = self.engine.read(sql.JOB_MARKS, (self.job_id,))
        return int(rows[0][0]) if rows else 0

    def admit(self, chunk: Sequence[tuple[str, str]]) -> list[str]:
        """Take the next chunk's ``(item_id, digest)`` pairs; return ids an earlier chunk already had.

        When nothing is repeated the chunk becomes the current one for :meth:`unfinished`.
        """
        table = self._seen_table
        with self.engine.scratch() as tx:
            row = tx.one(sql.SEEN_MAX.format(table=table))
            start = (row[0] if row else None) or 0
            added = 0
            per_statement = sql.rows_per_statement(sql.SEEN_ROWS_PER_STATEMENT, sql.SEEN_VALUES_PER_ROW,
                                                   self.engine.max_params)
            for first in range(0, len(chunk), per_statement):
                part = chunk[first:first + per_statement]
                added += tx.run(sql.seen_insert(table, len(part)), [value for pair in part for value in pair])
            if added != len(chunk):
                tx.run(sql.SEEN_DELETE_AFTER.format(table=table), (start,))
                ids = [item_id for item_id, _ in chunk]
                return [r[0] for r in tx.all(sql.seen_repeated(table, len(ids)), ids)]
        self._chunk_start = start
        self._chunk_ids = [item_id for item_id, _ in chunk]
        return []

    def unfinished(self, steps: Sequence[str]) -> set[str]:
        """Ids of the current chunk that are not finished with the input just admitted.

        Finished means: a SUCCEEDED row with the same digest and no hold for every one of ``steps``
        (the decision table's "skip" for each). Asked in one query per chunk, so resuming a finished
        job reads no rows into Python at all.
        """
        if self._new_job:
            return set(self._chunk_ids)
        covering = self._covering_step_sets(steps)
        unfinished = {
            r[0]
            for r in self.engine.read(
                sql.seen_unfinished(self._seen_table, len(steps), len(covering), self.engine.digest_hex),
                (self._chunk_start, len(steps), self.job_id, *steps, self._job_no, *covering),
            )
        }
        if unfinished and self._job_no is not None:
            self._expand([item_id for item_id in self._chunk_ids if item_id in unfinished])
        return unfinished

    def _covering_step_sets(self, steps: Sequence[str]) -> list[int]:
        """The step sets of compacted items that have every one of these steps (an item compacted with more
        steps is finished for a run of fewer, as its live rows would be). At most MAX_COVERING_SETS: an item
        compacted under another is put back and looked at, which is slower, never wrong."""
        key = tuple(steps)
        if key not in self._step_sets:
            wanted = set(steps)
            found = self.engine.read(sql.STEP_SETS) if self._job_no is not None else []
            self._step_sets[key] = [n for n, names in found if wanted <= set(json.loads(names))][:MAX_COVERING_SETS]
        return self._step_sets[key] or [-1]  # -1: no step set has that number

    def _expand(self, item_ids: Sequence[str]) -> None:
        """Put the compacted ones among these items back in steps, their rows as they were, before the run
        looks at them (an item the run works on is never left split between the two)."""
        for start in range(0, len(item_ids), LOOKUP_CHUNK):
            part = item_ids[start:start + LOOKUP_CHUNK]
            found = self.engine.read(sql.compacted_items(len(part)), (self._job_no, *part))
            if not found:
                continue
            rows = [row for item_id, digest, names, data in found
                    for row in expand_item(self.job_id, item_id, digest, json.loads(names), data)]
            self.engine.apply([Statement(sql.RESTORE_ROW, rows, many=True),
                               Statement(sql.COMPACTED_DELETE, [(self._job_no, r[0]) for r in found], many=True)],
                              durable=False)

    # -- records --------------------------------------------------------------------------------

    def _row(
        self, item_id: str, step: str, side_effect: bool, status: Status, digest: str, *,
        receipt: str | None = None, output: str | None = None, error_type: str | None = None,
        attempts: int = 0, not_sent: bool = False,
    ) -> Record:
        now = time.time()
        return sql.UPSERT, (
            self.job_id, item_id, step, int(side_effect), _STATUS_TEXT[status], digest, receipt, output,
            error_type, attempts, now, now, int(not_sent),
        )

    def mark_in_flight(self, item_id: str, step: str, digest: str, *, new_attempt: bool = True) -> None:
        """Buffer the IN_FLIGHT mark of a send; ``flush(durable=True)`` it *before* the send starts.
        ``new_attempt=False``: the send was marked before and has not started yet (the mark is renewed)."""
        self._pending.append(self._row(item_id, step, True, Status.IN_FLIGHT, digest, attempts=int(new_attempt)))

    def mark_succeeded(
        self, item_id: str, step: str, digest: str, *, side_effect: bool, output: str,
        receipt: str | None, verified: bool = False, log_receipt: bool = False,
    ) -> None:
        """Buffer a SUCCEEDED row; with ``log_receipt``, :meth:`write_receipts` puts the send's
        receipt in the receipt log (where the engine has one), so that it survives the process
        dying before the next commit."""
        # A local step has no IN_FLIGHT row of its own (it is re-run whatever its state), so its
        # attempt is counted here; a send's attempt was counted by its IN_FLIGHT mark.
        attempts = 0 if side_effect else 1
        self._pending.append(
            self._row(item_id, step, side_effect, Status.SUCCEEDED, digest, receipt=receipt,
                      output=output, attempts=attempts)
        )
        if log_receipt:
            if self._receipts is None:
                self._receipts_uncommitted = True
            else:
                # json.dumps([job_id, item_id, step, digest, output, receipt, time]) without ensure_ascii,
                # the job's part encoded once per run.
                line = (f"{self._receipt_prefix}{_json_text(item_id)},{_json_text(step)},{_json_text(digest)},"
                        f"{_json_text(output)},{'null' if receipt is None else _json_text(receipt)},"
                        f"{time.time()!r}]\n")
                self._receipts_unwritten.append(line.encode("utf-8"))
        self._maybe_flush()

    def write_receipts(self) -> None:
        """Make the receipts recorded since the last commit survive this process being killed:
        call it before any further user code runs. With a receipt log: one write, no commit.
        Without one: a commit that need not be durable (the engine's cheap commit)."""
        if self._receipts is None:
            if self._receipts_uncommitted:
                self.flush(durable=False)
            return
        if not self._receipts_unwritten:
            return
        data = b"".join(self._receipts_unwritten)
        self._receipts_unwritten.clear()
        self._receipts.write(data)  # one write: a kill leaves whole lines and at most one torn
        self._receipt_bytes += len(data)

    def mark_failed(
        self, item_id: str, step: str, digest: str, *, side_effect: bool, error_type: str, not_sent: bool = False,
    ) -> None:
        """Record a FAILED step; ``not_sent``: a send that provably never left the process (the next
        run sends it again without verify or hold)."""
        self._pending.append(
            self._row(item_id, step, side_effect, Status.FAILED, digest, error_type=error_type,
                      attempts=0 if side_effect else 1, not_sent=side_effect and not_sent)
        )
        self.flush(durable=False)

    def take_back_mark(self, item_id: str, step: str, digest: str, *, created_row: bool, error_type: str) -> None:
        """A send whose IN_FLIGHT mark was committed never started. If the mark created the row, the
        row goes (the step is as if never reached); else it becomes FAILED and provably not sent, the
        attempt its mark counted taken back. Either way the next run sends it, with no verify or human."""
        if created_row:
            self._pending.append((sql.TAKE_BACK_MARK, (self.job_id, item_id, step, Status.IN_FLIGHT.value)))
        else:
            self._pending.append(self._row(item_id, step, True, Status.FAILED, digest, error_type=error_type,
                                           attempts=-1, not_sent=True))
        self.flush(durable=False)

    def audit(
        self, item_id: str, step: str, decision: str, *, resolved_by: str, note: str,
        previous_status: str | None, previous_held_reason: str | None,
    ) -> None:
        """Buffer an audit row for a settlement the runner made itself (verify answered NOT_DELIVERED),
        just before the send's IN_FLIGHT mark: both commit in that mark's durable flush, or neither."""
        self._pending.append((sql.AUDIT, (self.job_id, item_id, step, decision, None, note, resolved_by,
                                          time.time(), previous_status, previous_held_reason)))

    def hold(self, item_id: str, step: str, reason: HeldReason, *, new_digest: str | None = None) -> None:
        self._pending.append((sql.HOLD, (reason.value, new_digest, time.time(), self.job_id, item_id, step)))
        self._maybe_flush()

    def release_hold(self, item_id: str, step: str) -> None:
        """The input went back to what was journaled: the input_changed hold no longer applies."""
        self._pending.append((sql.HOLD, (None, None, time.time(), self.job_id, item_id, step)))
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if len(self._pending) >= self.FLUSH_ROWS or time.monotonic() - self._last_flush >= self.FLUSH_SECONDS:
            self.flush(durable=False)

    def finished(self) -> None:
        """This run went through the whole batch (held items or not): the job is no longer unfinished.
        Written with the run's last flush."""
        now = time.time()
        self._pending += [self._touch(now), (sql.JOB_FINISHED, (now, self.job_id))]

    def flush(self, *, durable: bool = False) -> None:
        if not self._pending:
            return
        if not self._unfinished_marked and any(r[0] not in _JOB_ONLY for r in self._pending):
            # This run's first step record: until it finishes, the job shows (and is kept) as unfinished.
            self._pending.insert(0, (sql.JOB_UNFINISHED, (self.job_id,)))
            self._unfinished_marked = True
        records, self._pending = self._pending, []
        now = time.time()
        pending = list(records)
        # The job's last update needs no finer grain than this (close() touches it at the end).
        touch = now - self._last_touch >= self.FLUSH_SECONDS
        if touch:
            pending.append(self._touch(now))
        try:
            self._commit(pending, durable)
        except BaseException:
            if records[0][0] is sql.JOB_UNFINISHED:
                self._unfinished_marked = False  # not written: the kept records get it again
                records = records[1:]
            # Nothing was written. Keep the records (a delivered send's SUCCEEDED among them) for
            # the next flush - close() flushes once more - but not the IN_FLIGHT marks: a mark is
            # buffered just before its send, and that send will not start now. Nor the audit rows of
            # the runner's own settlements: each announces a send buffered with it, which will not start.
            kept = [r for r in records
                    if not (r[0] is sql.UPSERT and r[1][4] == Status.IN_FLIGHT.value) and r[0] is not sql.AUDIT]
            self._pending = kept + self._pending
            self._flush_failed = True
            raise
        self._receipts_unwritten.clear()  # committed: the log need not hear of them
        self._receipts_uncommitted = False
        self._last_flush = time.monotonic()
        if touch:
            self._last_touch = now
        self._flushed = True
        if self._receipts is not None and self._receipt_bytes > self.RECEIPT_LOG_LIMIT:
            self._receipts.committed()
            self._receipt_bytes = 0

    def _touch(self, now: float) -> Record:
        return sql.TOUCH_JOB, (self.job_id, now, now, self._runner, self.dag_id)

    def _commit(self, pending: list[Record], durable: bool) -> None:
        # Consecutive records of one kind go in one statement (upserts) or one executemany.
        statements: list[Statement] = []
        start, count = 0, len(pending)
        while start < count:
            statement = pending[start][0]
            end = start + 1
            while end < count and pending[end][0] is statement:
                end += 1
            rows = [params for _, params in pending[start:end]]
            if statement is sql.UPSERT:
                statements += self.engine.upsert_statements(rows)
            else:
                statements.append(Statement(statement, rows, many=True))
            start = end
        self.engine.apply(statements, durable=durable)

    def close(self) -> None:
        try:
            if self.engine.closed:
                return  # the journal went first: nothing can be written, the claim is freed below
            if self._pending or self._flushed:
                self._pending.append(self._touch(time.time()))  # the job's last update: this run's end
            self.flush(durable=False)
            # Every receipt is committed now; a failed flush above keeps the log for the next
            # open to fold. After an earlier failed flush, fold it anyway (harmless if done).
            if self._receipts is not None:
                if self._flush_failed:
                    self.engine.recover(self.job_id)
                self._receipts.discard()
                self._receipts = None
            try:
                with self.engine.scratch() as tx:
                    tx.run(f"DROP TABLE IF EXISTS {self._seen_table}")
            except Exception:  # noqa: BLE001, S110 - a temporary table goes with the connection anyway
                pass
        finally:
            if self._receipts is not None:
                self._receipts.close()  # kept on disk: the next open folds it
            self._claim.release()

    def __enter__(self) -> JobRun:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None and not self._flushed:
            # A run that finished without writing a row (an empty batch) is still remembered, so
            # the wrong-worker guard knows this journal has seen the job.
            self._pending.append(self._touch(time.time()))
        self.close()
