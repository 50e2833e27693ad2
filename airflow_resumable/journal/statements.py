"""The journal's SQL, as named statements both backends run.

Statements are written with ``?`` placeholders and only SQL that SQLite and PostgreSQL read the same
way (``ON CONFLICT``, ``CASE``, no engine-specific functions); the PostgreSQL backend turns the
placeholders into its own when it runs them. Timestamps are seconds since the epoch (a float) on
both engines, so the records and the comparisons are the same code.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from typing import Any, NamedTuple

from airflow_resumable.journal.records import JOB_STATUSES


class Statement(NamedTuple):
    """One statement of a write: ``params`` for one execution, or (``many``) a list of them."""

    sql: str
    params: Sequence[Any]
    many: bool = False


# The columns the runner writes (the upserts), and those a StepRecord is read from: the key's
# generation is never written by a runner (a use_new_input resolution moves it on).
STEP_COLUMNS = (
    "job_id, item_id, step, side_effect, status, digest, receipt, output, error_type, "
    "held_reason, new_digest, attempts, created_at, updated_at, not_sent"
)
RECORD_COLUMNS = (
    "job_id, item_id, step, side_effect, status, digest, receipt, output, error_type, "
    "held_reason, new_digest, attempts, created_at, updated_at, generation, not_sent, version"
)
# Every statement that changes a step row moves its version on (a new row starts at 1): a decision made
# on what a person saw is applied only while the row is still as seen.
NEXT_VERSION = "version = version + 1"

# Held rows, and side-effect rows not yet SUCCEEDED whose outcome is unknown: what keeps a job from
# being settled. A send that provably never left (not_sent) only waits for the next run.
OPEN_ROW = "(held_reason IS NOT NULL OR (side_effect = 1 AND status != 'SUCCEEDED' AND not_sent = 0))"

UPSERT_ROW = "(?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, ?, ?, ?, ?)"
UPSERT_VALUES_PER_ROW = UPSERT_ROW.count("?")
UPSERT_CONFLICT = """
ON CONFLICT (job_id, item_id, step) DO UPDATE SET
    side_effect = excluded.side_effect,
    status      = excluded.status,
    digest      = excluded.digest,
    receipt     = excluded.receipt,
    output      = excluded.output,
    error_type  = excluded.error_type,
    held_reason = NULL,
    new_digest  = NULL,
    attempts    = steps.attempts + excluded.attempts,
    updated_at  = excluded.updated_at,
    not_sent    = excluded.not_sent,
    version     = steps.version + 1
"""
UPSERT = f"INSERT INTO steps ({STEP_COLUMNS}) VALUES {UPSERT_ROW}{UPSERT_CONFLICT}"


# PostgreSQL: any number of rows in one statement of fixed text (parsed and planned once, then a
# prepared statement), the rows as one JSON array of arrays: json's C encoder writes it, where an
# array per column made psycopg quote every cell in Python (about 15% of the runner thread at
# concurrency 16). {durable} is empty, or a join that makes the statement's own transaction commit
# synchronously (set_config(..., is_local) lasts until that commit).
_UPSERT_JSON = f"""
INSERT INTO steps ({STEP_COLUMNS})
SELECT r->>0, r->>1, r->>2, (r->>3)::smallint, r->>4, r->>5, r->>6, r->>7, r->>8, NULL, NULL,
       (r->>9)::integer, (r->>10)::double precision, (r->>11)::double precision, (r->>12)::smallint
FROM json_array_elements(?::json) AS t(r)
{{durable}}
{UPSERT_CONFLICT}"""
UPSERT_JSON = _UPSERT_JSON.format(durable="")
UPSERT_JSON_SYNCHRONOUS = _UPSERT_JSON.format(
    durable="CROSS JOIN (SELECT set_config('synchronous_commit', 'on', true)) AS synchronous"
)


@functools.lru_cache(maxsize=64)  # the text of the few row counts a run uses
def upsert_rows(count: int) -> str:
    """One statement that upserts ``count`` rows (one round trip, one parse)."""
    return f"INSERT INTO steps ({STEP_COLUMNS}) VALUES {','.join([UPSERT_ROW] * count)}{UPSERT_CONFLICT}"


# Buffered rows are written as multi-row upserts of at most this many rows (one statement each):
# executemany would release and re-take the GIL per row, and sends on other threads want it.
UPSERT_ROWS_PER_STATEMENT = 250


def without_repeats(rows: Sequence[Sequence[Any]], limit: int) -> list[list[Sequence[Any]]]:
    """``UPSERT_ROW`` parameter rows in order, cut into parts of at most ``limit`` rows that never carry
    one step twice (PostgreSQL refuses to update one row twice in a statement): applied part by part,
    as if row by row."""
    parts: list[list[Sequence[Any]]] = []
    part: list[Sequence[Any]] = []
    keys: set[tuple[Any, Any, Any]] = set()
    for row in rows:
        key = (row[0], row[1], row[2])  # job_id, item_id, step
        if len(part) == limit or key in keys:
            parts.append(part)
            part, keys = [], set()
        part.append(row)
        keys.add(key)
    if part:
        parts.append(part)
    return parts


def rows_per_statement(preferred: int, values_per_row: int, max_params: int) -> int:
    """Rows of a multi-row statement: ``preferred``, fewer where the engine's parameter limit says so."""
    return max(1, min(preferred, max_params // values_per_row))


def upsert_statements(rows: Sequence[Sequence[Any]], max_params: int) -> list[Statement]:
    """``rows`` as few multi-row upsert statements as the engine's parameter limit allows. For an engine that
    upserts a statement's rows one after the other, as SQLite does: a step twice in one is fine there
    (PostgreSQL's statements are cut by :func:`without_repeats`)."""
    limit = rows_per_statement(UPSERT_ROWS_PER_STATEMENT, UPSERT_VALUES_PER_ROW, max_params)
    return [Statement(upsert_rows(len(part)), list(itertools.chain.from_iterable(part)))
            for part in (rows[n:n + limit] for n in range(0, len(rows), limit))]


HOLD = """
UPDATE steps SET held_reason = ?, new_digest = ?, updated_at = ?, version = version + 1
WHERE job_id = ? AND item_id = ? AND step = ?
"""

# A receipt from a dead runner's log settles only the very row it was logged for: a send still
# IN_FLIGHT for the same input, not held. Anything else has moved on (resolved, re-run) since.
FOLD_RECEIPT = """
UPDATE steps SET status = 'SUCCEEDED', receipt = ?, output = ?, error_type = NULL, updated_at = ?,
       version = version + 1
WHERE job_id = ? AND item_id = ? AND step = ? AND digest = ? AND side_effect = 1
  AND status = 'IN_FLIGHT' AND held_reason IS NULL
"""

# The job's DAG is the one its first run in Airflow gave: it decides who may settle the job's items.
TOUCH_JOB = """
INSERT INTO jobs (job_id, created_at, updated_at, last_runner, dag_id) VALUES (?, ?, ?, ?, ?)
ON CONFLICT (job_id) DO UPDATE SET updated_at = excluded.updated_at,
                                   last_runner = coalesce(excluded.last_runner, jobs.last_runner),
                                   dag_id = coalesce(jobs.dag_id, excluded.dag_id)
"""

# A run under way (or stopped, or killed, part way) leaves the job unfinished; a run through the
# whole batch (held items or not) finishes it.
JOB_UNFINISHED = "UPDATE jobs SET finished_at = NULL WHERE job_id = ?"
JOB_FINISHED = "UPDATE jobs SET finished_at = ? WHERE job_id = ?"

# A send whose IN_FLIGHT mark created its row never started: the row goes, as if it had never been marked.
TAKE_BACK_MARK = "DELETE FROM steps WHERE job_id = ? AND item_id = ? AND step = ? AND status = ?"

JOB_PRUNED_AT = "SELECT pruned_at FROM jobs WHERE job_id = ?"
JOB_EXISTS = "SELECT 1 FROM jobs WHERE job_id = ?"
# The IN_FLIGHT marks a job has counted (schema 9; a job without a row has none).
JOB_MARKS = "SELECT n_marks FROM jobs WHERE job_id = ?"
# A job's or an item's rows, live or compacted (params: job_id, job_no; job_id, item_id, job_no, item_id).
# Compacted items are found by the job's number as a value: PostgreSQL's planner then opens one partition of
# compacted, not every one (a join on jobs locked them all, per statement).
JOB_HAS_ROWS = """SELECT 1 FROM steps WHERE job_id = ?
                  UNION ALL SELECT 1 FROM compacted WHERE job_no = ?
                  LIMIT 1"""
ITEM_HAS_ROWS = """SELECT 1 FROM steps WHERE job_id = ? AND item_id = ?
                   UNION ALL SELECT 1 FROM compacted WHERE job_no = ? AND item_id = ?
                   LIMIT 1"""


def lookup_rows(count: int) -> str:
    """The rows the decision table needs for ``count`` items of one job."""
    return f"""SELECT item_id, step, status, digest, output, held_reason, generation, not_sent FROM steps
               WHERE job_id = ? AND item_id IN ({','.join('?' * count)})"""


# A job's summary is its own row: the counts are kept by triggers (schema version 7), no step row is read.
JOB_SUMMARY_COLUMNS = """job_id, created_at, updated_at, pruned_at, n_items, n_in_flight, n_succeeded, n_failed,
    n_held, n_unresolved, finished_at, dag_id"""
JOB_SUMMARY = f"SELECT {JOB_SUMMARY_COLUMNS} FROM jobs WHERE job_id = ?"
# The jobs list, newest first: (created_at, job_id) never changes, so a page's key stays where it was.
JOBS = f"SELECT {JOB_SUMMARY_COLUMNS} FROM jobs WHERE 1 = 1"
JOBS_AFTER = " AND (created_at < ? OR (created_at = ? AND job_id < ?))"
JOBS_ORDER = " ORDER BY created_at DESC, job_id DESC"
# A job's status (JobSummary.status) as a condition on its row.
_LIVE = "pruned_at IS NULL"
_SETTLED = "n_held = 0 AND n_unresolved = 0 AND n_failed = 0"
JOB_STATUS_WHERE = {
    "pruned": "pruned_at IS NOT NULL",
    "needs_review": f"{_LIVE} AND n_held > 0",
    "incomplete": f"{_LIVE} AND n_held = 0 AND (n_unresolved > 0 OR n_failed > 0)",
    "unfinished": f"{_LIVE} AND {_SETTLED} AND finished_at IS NULL",
    "completed": f"{_LIVE} AND {_SETTLED} AND finished_at IS NOT NULL",
}
assert set(JOB_STATUS_WHERE) == set(JOB_STATUSES), "a job status without its condition"

# A job's rows in one order whatever the page size: by item, then in the order its steps were first
# written (created_at never changes), then by name. Pages go on after the last row's key.
JOB_ROWS = f"SELECT {RECORD_COLUMNS} FROM steps WHERE job_id = ?"
ROWS_ITEM = " AND item_id = ?"
ROWS_STATUS = " AND status = ?"
# item_id >= ? bounds the index range; the row value picks up after the last row shown.
ROWS_AFTER = " AND item_id >= ? AND (item_id > ? OR created_at > ? OR (created_at = ? AND step > ?))"
ROWS_ORDER = " ORDER BY item_id, created_at, step"
OPEN_ROWS = f"SELECT {RECORD_COLUMNS} FROM steps WHERE job_id = ? AND {OPEN_ROW} ORDER BY item_id, step"
# {held_steps}: the engine's way to read the steps table through steps_held (JournalBackend.held_steps).
HELD = """SELECT job_id, item_id, step, held_reason, generation, version, created_at FROM {held_steps}
          WHERE held_reason IS NOT NULL"""
# The same steps as whole rows (what a table of held steps shows): the same order, the same pages.
HELD_ROWS = f"SELECT {RECORD_COLUMNS} FROM {{held_steps}} WHERE held_reason IS NOT NULL"
HELD_JOB = " AND job_id = ?"
HELD_AFTER = " AND job_id >= ? AND (job_id > ? OR item_id > ? OR (item_id = ? AND step > ?))"
HELD_ORDER = " ORDER BY job_id, item_id, step"
# A job's audit log by its index (job_id, id): oldest first, or newest first for the latest few.
RESOLUTIONS = """
SELECT id, job_id, item_id, step, decision, receipt, note, resolved_by, resolved_at,
       previous_status, previous_held_reason
FROM resolutions WHERE job_id = ?"""
RESOLUTIONS_AFTER = " AND id > ?"
RESOLUTIONS_BEFORE = " AND id < ?"
RESOLUTIONS_ORDER = " ORDER BY id"
RESOLUTIONS_NEWEST_FIRST = " ORDER BY id DESC"

RESOLVABLE_STEP = """
SELECT side_effect, status, held_reason, not_sent, version, created_at, attempts, generation FROM steps
WHERE job_id = ? AND item_id = ? AND step = ?
"""
RESOLVE_DELIVERED = """
UPDATE steps SET status = 'SUCCEEDED', receipt = ?, output = ?, error_type = NULL, held_reason = ?, updated_at = ?,
       version = version + 1
WHERE job_id = ? AND item_id = ? AND step = ?
"""
# not_delivered: the send is owed, under the same key (the generation stays): the next run sends it
# once, without verify. A row is never deleted while its key may have reached a receiver.
RESOLVE_NOT_DELIVERED = """
UPDATE steps SET status = 'FAILED', not_sent = 1, receipt = NULL, output = NULL, error_type = NULL,
       held_reason = ?, updated_at = ?, version = version + 1
WHERE job_id = ? AND item_id = ? AND step = ?
"""
INPUT_CHANGE_HOLD = """
SELECT step, status, new_digest, version, created_at FROM steps
WHERE job_id = ? AND item_id = ? AND held_reason = 'input_changed'
"""
# use_new_input: the new input is a new operation. Every step of the item runs again on it: its sends
# move to their next key generation and are owed (not_sent: no key of that generation was ever used),
# its local steps are FAILED so they run again. The rows stay, all with the new digest, as any item's do.
USE_NEW_INPUT = """
UPDATE steps SET generation = generation + side_effect, not_sent = side_effect, status = 'FAILED', digest = ?,
       receipt = NULL, output = NULL, error_type = NULL, held_reason = NULL, new_digest = NULL, updated_at = ?,
       version = version + 1
WHERE job_id = ? AND item_id = ?
"""
KEEP_PREVIOUS_INPUT = """
UPDATE steps SET digest = ?, new_digest = NULL, updated_at = ?, version = version + 1,
       held_reason = CASE WHEN held_reason = 'input_changed' THEN NULL ELSE held_reason END
WHERE job_id = ? AND item_id = ?
"""
AUDIT = """
INSERT INTO resolutions (job_id, item_id, step, decision, receipt, note, resolved_by, resolved_at,
                         previous_status, previous_held_reason)
VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
"""
JOB_UPDATED = "UPDATE jobs SET updated_at = ? WHERE job_id = ?"

# A finished job: a run went through the whole batch, and every row is SUCCEEDED with nothing held.
FINISHED_JOB = "finished_at IS NOT NULL AND n_in_flight = 0 AND n_failed = 0 AND n_held = 0"
PRUNE_CANDIDATES = f"""
SELECT job_id FROM jobs WHERE pruned_at IS NULL AND updated_at < ? AND {FINISHED_JOB} ORDER BY created_at, job_id
"""
# ... and still not updated since the cut-off: a run that went through the job again after the candidates
# were read (a Clear, a new pass) made it recent.
JOB_STILL_FINISHED = f"SELECT 1 FROM jobs WHERE job_id = ? AND pruned_at IS NULL AND updated_at < ? AND {FINISHED_JOB}"
# A prune marks the job pruned first (so no run of it starts on a part of its history), then deletes its
# rows a bounded batch per transaction; one that was interrupted is finished by the next prune.
PRUNES_UNDER_WAY = "SELECT job_id FROM jobs WHERE pruned_at IS NOT NULL AND n_items > 0 ORDER BY created_at, job_id"
# The last item of the next batch of at most ? items after the given one ("" before the first), and the
# deletion of the batch: a range of the primary key.
PRUNE_BATCH_END = """SELECT max(item_id) FROM (SELECT item_id FROM steps WHERE job_id = ? AND item_id > ?
                                        GROUP BY item_id ORDER BY item_id LIMIT ?) AS batch"""
PRUNE_BATCH = "DELETE FROM steps WHERE job_id = ? AND item_id > ? AND item_id <= ?"
MARK_PRUNED = "UPDATE jobs SET pruned_at = ? WHERE job_id = ?"

JOURNAL_ID = "SELECT value FROM meta WHERE key = 'journal_id'"

# The set of item ids one run has admitted (a temporary table of the run's own connection), so a
# repeated id is refused across chunks without holding a million ids in memory.
SEEN_MAX = "SELECT max(n) FROM {table}"
SEEN_DELETE_AFTER = "DELETE FROM {table} WHERE n > ?"
# Pairs per insert into it: one statement for a chunk, not one per id (executemany sends PostgreSQL a
# statement per row, a quarter of the runner thread's time at concurrency 16).
SEEN_ROWS_PER_STATEMENT = 500
SEEN_VALUES_PER_ROW = 2  # (item_id, digest)


def seen_insert(table: str, count: int) -> str:
    """Adds ``count`` (item_id, digest) pairs; an id already there is skipped (the count says how many were added)."""
    return f"INSERT INTO {table} (item_id, digest) VALUES {','.join(['(?, ?)'] * count)} ON CONFLICT (item_id) DO NOTHING"


def seen_repeated(table: str, count: int) -> str:
    return f"SELECT item_id FROM {table} WHERE item_id IN ({','.join('?' * count)})"


def seen_unfinished(table: str, steps: int, step_sets: int, digest_hex: str) -> str:
    """Ids of the current chunk not SUCCEEDED with the admitted input for every one of the steps: neither
    in live rows nor as a compacted item of the same digest whose step set is one of ``step_sets`` given
    (those having every one of the steps). ``digest_hex``: the engine's expression for a compacted digest
    as lowercase hex (``{}`` where the column goes)."""
    return f"""SELECT c.item_id FROM {table} c
               WHERE c.n > ? AND ? != (
                   SELECT count(*) FROM steps s
                   WHERE s.job_id = ? AND s.item_id = c.item_id AND s.step IN ({','.join('?' * steps)})
                     AND s.status = 'SUCCEEDED' AND s.digest = c.digest AND s.held_reason IS NULL)
                 AND NOT EXISTS (
                   SELECT 1 FROM compacted k
                   WHERE k.job_no = ? AND k.item_id = c.item_id AND k.step_set IN ({','.join('?' * step_sets)})
                     AND {digest_hex.format("k.digest")} = c.digest)"""


# -- compacted items (schema version 8; see journal/compaction.py) ------------------------------------

JOB_NUMBER = "SELECT job_no FROM jobs WHERE job_id = ?"
COMPACTED_ITEM = """SELECT k.digest, s.names, k.data FROM compacted k JOIN step_sets s ON s.id = k.step_set
                    WHERE k.job_no = ? AND k.item_id = ?"""
# {next_job_no}: the engine's next free job number (JournalBackend.next_job_no).
NUMBER_JOB = "UPDATE jobs SET job_no = {next_job_no} WHERE job_id = ? AND job_no IS NULL"
STEP_SET_ADD = "INSERT INTO step_sets (hash, names) VALUES (?, ?) ON CONFLICT (hash) DO NOTHING"
STEP_SET_ID = "SELECT id FROM step_sets WHERE hash = ?"
STEP_SETS = "SELECT id, names FROM step_sets"
# Jobs with items to compact: a run went through them since compaction last did, and none since the cut-off.
COMPACT_CANDIDATES = """
SELECT job_id FROM jobs WHERE pruned_at IS NULL AND finished_at IS NOT NULL AND n_succeeded > 0
  AND (compacted_at IS NULL OR compacted_at < finished_at) AND updated_at < ? ORDER BY created_at, job_id
"""
JOB_STILL_COMPACTABLE = """SELECT 1 FROM jobs WHERE job_id = ? AND pruned_at IS NULL AND finished_at IS NOT NULL
                           AND updated_at < ?"""
# The next batch of at most ? live items after the given one, as the range (after, last] of the primary key.
COMPACT_ROWS = f"SELECT {RECORD_COLUMNS} FROM steps WHERE job_id = ? AND item_id > ? AND item_id <= ? ORDER BY item_id"


def compacted_insert(count: int) -> str:
    return ("INSERT INTO compacted (job_no, step_set, n_steps, item_id, digest, data) VALUES "
            + ", ".join(["(?, ?, ?, ?, ?, ?)"] * count))


def items_delete(count: int) -> str:
    """The live rows of ``count`` items of a job (now compacted)."""
    return f"DELETE FROM steps WHERE job_id = ? AND item_id IN ({','.join('?' * count)})"

JOB_COMPACTED = "UPDATE jobs SET compacted_at = ? WHERE job_id = ?"


def compacted_items(count: int) -> str:
    """``count`` items of a job (by number) as compacted, with their step sets' names."""
    return f"""SELECT k.item_id, k.digest, s.names, k.data FROM compacted k JOIN step_sets s ON s.id = k.step_set
               WHERE k.job_no = ? AND k.item_id IN ({','.join('?' * count)})"""


# An item put back in steps: its rows exactly as they were (version, attempts, times), then its compacted row goes.
RESTORE_ROW = f"INSERT INTO steps ({RECORD_COLUMNS}) VALUES ({', '.join('?' * 17)})"
COMPACTED_DELETE = "DELETE FROM compacted WHERE job_no = ? AND item_id = ?"
# A job's page of compacted items (rows()): after the cursor's item, by the primary key.
COMPACTED_PAGE = "SELECT k.item_id, k.digest, s.names, k.data FROM compacted k JOIN step_sets s ON s.id = k.step_set"
COMPACTED_PAGE_IDS = "SELECT k.item_id FROM compacted k"
COMPACTED_PAGE_WHERE = " WHERE k.job_no = ?"
COMPACTED_PAGE_ITEM = " AND k.item_id = ?"
COMPACTED_PAGE_FROM = " AND k.item_id >= ?"
COMPACTED_PAGE_ORDER = " ORDER BY k.item_id"


def merged_item_order(live: str, compacted_where: str) -> str:
    """The item ids of a page's live rows (the query ``live``) and of its compacted items (``compacted_where``
    after COMPACTED_PAGE_IDS), one each, in the database's own order of its keys."""
    return (f"SELECT item_id FROM ({live}) AS live UNION SELECT item_id FROM ({COMPACTED_PAGE_IDS}{compacted_where}) "
            "AS compacted ORDER BY item_id")


# Prune: a job's compacted items, a bounded batch per transaction, as its live rows.
PRUNE_COMPACTED_END = """SELECT max(item_id) FROM (SELECT item_id FROM compacted WHERE job_no = ? AND item_id > ?
                                             ORDER BY item_id LIMIT ?) AS batch"""
PRUNE_COMPACTED = "DELETE FROM compacted WHERE job_no = ? AND item_id > ? AND item_id <= ?"
# PostgreSQL (JournalBackend.compacted_partitions; schema.py): make room for a numbered job's items; forget a
# pruned job's number, its counts losing its compacted items (then no reader sees them); the partitions
# every number of which was given and none of which a job has any more; drop one (re-checked under lock).
COMPACTED_PARTITION = "SELECT compacted_partition(?)"
FORGET_COMPACTED = """UPDATE jobs SET job_no = NULL, n_items = n_items - k.items, n_succeeded = n_succeeded - k.step_rows
FROM (SELECT count(*) AS items, coalesce(sum(n_steps), 0) AS step_rows FROM compacted WHERE job_no = ?) AS k
WHERE job_id = ?"""
DROPPABLE_PARTITIONS = """
SELECT p.first, p.stop FROM (
  SELECT split_part(c.relname, '_', 2)::bigint AS first, split_part(c.relname, '_', 3)::bigint AS stop
  FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
  WHERE i.inhparent = to_regclass('compacted') AND c.relname ~ '^compacted_[0-9]+_[0-9]+$') AS p
WHERE p.stop - 1 <= (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM job_numbers)
  AND NOT EXISTS (SELECT 1 FROM jobs WHERE job_no >= p.first AND job_no < p.stop)
ORDER BY p.first
"""
DROP_PARTITION = "SELECT compacted_drop(?, ?)"
READ_COMMITTED = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED"  # whatever the server's default
