"""The journal's schema on each engine, as numbered migrations.

Each migration takes the schema from version N-1 to N. Never edit a released one: add another (on
every engine that has the version). A journal at a version above :data:`SCHEMA_VERSION` was written
by a newer release and is refused, never downgraded.
"""

from __future__ import annotations

SCHEMA_VERSION = 9

# Version 4: when a run last went through the whole batch (NULL while a run is under way, and after
# one that stopped or died part way: such a job shows as not finished and is never pruned). Jobs
# journaled before count as finished when they were last updated, as they were shown then.
def _finished_at(seconds_type: str) -> tuple[str, ...]:
    return (f"ALTER TABLE jobs ADD COLUMN finished_at {seconds_type}", "UPDATE jobs SET finished_at = updated_at")


# Version 5: a send's key generation (0 = the key earlier versions used, so existing
# journals keep their keys; a use_new_input resolution starts the next one), and whether a FAILED
# send provably never left the process (NotSentError, or a not_delivered settlement): such a row is
# sent again by the next run without verify or hold. Both columns are kept whatever the runner
# writes, except not_sent, which every write of the row sets.
_GENERATIONS = (
    "ALTER TABLE steps ADD COLUMN generation INTEGER NOT NULL DEFAULT 0",
    "ALTER TABLE steps ADD COLUMN not_sent SMALLINT NOT NULL DEFAULT 0 CHECK (not_sent IN (0, 1))",
)

# Version 6: a decision is applied only to the row its maker saw. Every write of a step row moves its
# version on (the text a person is shown is derived from it and the row's creation time, so a row
# pruned and written again never repeats one). Existing rows start at 1. The DAG that owns a job is
# recorded with the job by its first run (NULL for jobs written outside Airflow or by older releases):
# who may settle a job's items is decided by it, never by the job id's text.
_VERSIONS = (
    "ALTER TABLE steps ADD COLUMN version INTEGER NOT NULL DEFAULT 1",
    "ALTER TABLE jobs ADD COLUMN dag_id TEXT",
)

# Version 7 (fleet scale): every job carries its own counts - items, rows per status, held rows, and
# unresolved sends (side-effect rows neither SUCCEEDED nor held nor provably unsent) - kept by triggers
# on steps in the very transaction that changes a row, whoever changes it (a run, a resolution, prune,
# a hand-written statement - but not SQLite's INSERT OR REPLACE, which deletes the row it replaces
# without firing the delete trigger: the journal never writes one). Reading a job's summary then reads
# no step rows. The migration counts once. The held index gains the step, the last part of the held
# list's order (its pages' key), and jobs get an index for the jobs list's order (newest first:
# creation time never changes, so a page boundary never moves while the list is paged).
COUNTERS = ("n_items", "n_in_flight", "n_succeeded", "n_failed", "n_held", "n_unresolved")
# Whether a row r counts as an unresolved send (the jobs summary's "unresolved").
_UNRESOLVED = "({r}.held_reason IS NULL AND {r}.side_effect = 1 AND {r}.status != 'SUCCEEDED' AND {r}.not_sent = 0)"
# What one row adds to each status / hold counter, in COUNTERS[1:] order.
_ROW_COUNTS = (
    "({r}.status = 'IN_FLIGHT')", "({r}.status = 'SUCCEEDED')", "({r}.status = 'FAILED')",
    "({r}.held_reason IS NOT NULL)", _UNRESOLVED,
)


def _row_counts(row: str, cast: str = "") -> list[str]:
    return [f"{term.format(r=row)}{cast}" for term in _ROW_COUNTS]


_RECOUNT_SUMS = ", ".join(f"coalesce(sum(CASE WHEN {t} THEN 1 ELSE 0 END), 0) AS {c}"
                          for t, c in zip(_row_counts("steps"), COUNTERS[1:], strict=True))
_RECOUNT_SELECT = f"""SELECT job_id AS counted_job, count(DISTINCT item_id) AS n_items, {_RECOUNT_SUMS}
FROM steps GROUP BY job_id"""


def _counters(integer: str) -> tuple[str, ...]:
    return (
        *(f"ALTER TABLE jobs ADD COLUMN {c} {integer} NOT NULL DEFAULT 0" for c in COUNTERS),
        f"""UPDATE jobs SET {", ".join(f"{c} = counted.{c}" for c in COUNTERS)}
            FROM ({_RECOUNT_SELECT}) AS counted
            WHERE jobs.job_id = counted.counted_job""",
        "DROP INDEX steps_held",
        "CREATE INDEX steps_held ON steps (job_id, item_id, step) WHERE held_reason IS NOT NULL",
        "CREATE INDEX jobs_by_created ON jobs (created_at, job_id)",
    )


# Version 8 (compact rows): a finished item's rows may live as one row of ``compacted`` (see
# journal/compaction.py): the job as its number (jobs.job_no, given when the job is first compacted), the
# item, the input's digest as bytes, the set of its steps as a number (step_sets, found by the hash of its
# names: names may be longer than an index entry holds) and the packed rows. An item's rows are all in
# steps or all in compacted, never split. Its counts follow it: items and SUCCEEDED rows, kept by the
# triggers on compacted as by those on steps. jobs.compacted_at: when compaction last went through the job
# (it goes through again once a later run finished it again).
def _compacted(integer: str, blob: str, serial: str, table_options: str) -> tuple[str, ...]:
    return (
        f"ALTER TABLE jobs ADD COLUMN job_no {integer}",
        "ALTER TABLE jobs ADD COLUMN compacted_at " + ("REAL" if integer == "INTEGER" else "DOUBLE PRECISION"),
        "CREATE UNIQUE INDEX jobs_by_number ON jobs (job_no)",
        f"CREATE TABLE step_sets (id {serial}, hash TEXT NOT NULL UNIQUE, names TEXT NOT NULL)",
        f"""CREATE TABLE compacted (
            job_no   {integer} NOT NULL,
            step_set INTEGER NOT NULL,
            n_steps  SMALLINT NOT NULL CHECK (n_steps > 0),
            item_id  TEXT NOT NULL,
            digest   {blob} NOT NULL,
            data     {blob} NOT NULL,
            PRIMARY KEY (job_no, item_id)
        ) """ + table_options,
    )


_RECOUNT_WITH_COMPACTED = f"""SELECT counted_job, {", ".join(f"CAST(sum({c}) AS BIGINT) AS {c}" for c in COUNTERS)}
FROM ({_RECOUNT_SELECT}
      UNION ALL
      SELECT j.job_id, count(*), 0, sum(k.n_steps), 0, 0, 0 FROM compacted k JOIN jobs j ON j.job_no = k.job_no
      GROUP BY j.job_id) AS parts
GROUP BY counted_job"""


def recount_statement() -> str:
    """Each job's counts as the triggers keep them, counted from its step rows and its compacted items
    (tests compare the two)."""
    return _RECOUNT_WITH_COMPACTED


_SQLITE_NEW_ITEM = (
    "NOT EXISTS (SELECT 1 FROM steps s WHERE s.job_id = NEW.job_id AND s.item_id = NEW.item_id AND s.step != NEW.step)"
)
# A send's IN_FLIGHT mark, as version 9 counts it (jobs.n_marks).
_MARK = "({r}.side_effect = 1 AND {r}.status = 'IN_FLIGHT')"


def _sqlite_counted_insert(marks: bool = False) -> str:
    """The insert counting trigger: version 7's, or with version 9's count of marks."""
    added: tuple[str, ...] = COUNTERS
    columns, values = ", ".join(COUNTERS), ", ".join(_row_counts("NEW"))
    if marks:
        columns, values, added = columns + ", n_marks", values + ", " + _MARK.format(r="NEW"), (*COUNTERS, "n_marks")
    return f"""CREATE TRIGGER steps_counted_insert AFTER INSERT ON steps BEGIN
       INSERT INTO jobs (job_id, created_at, updated_at, {columns})
       VALUES (NEW.job_id, NEW.created_at, NEW.updated_at, {_SQLITE_NEW_ITEM}, {values})
       ON CONFLICT (job_id) DO UPDATE SET {", ".join(f"{c} = {c} + excluded.{c}" for c in added)};
       END"""


def _sqlite_counted_update(marks: bool = False) -> str:
    """The update counting trigger: version 7's, or with version 9's (a row that becomes IN_FLIGHT)."""
    sets = ", ".join(f"{c} = {c} + {new} - {old}" for c, new, old in
                     zip(COUNTERS[1:], _row_counts("NEW"), _row_counts("OLD"), strict=True))
    if marks:
        sets += f", n_marks = n_marks + ({_MARK.format(r='NEW')} AND OLD.status != 'IN_FLIGHT')"
    return f"""CREATE TRIGGER steps_counted_update AFTER UPDATE ON steps
       WHEN OLD.status != NEW.status OR OLD.held_reason IS NOT NEW.held_reason OR OLD.side_effect != NEW.side_effect
         OR OLD.not_sent != NEW.not_sent
       BEGIN
       UPDATE jobs SET {sets}
       WHERE job_id = NEW.job_id;
       END"""

_SQLITE_COUNTERS = (
    *_counters("INTEGER"),
    # A row is never moved to another job, item or step (no statement does): the counts rely on it.
    """CREATE TRIGGER steps_key_fixed BEFORE UPDATE OF job_id, item_id, step, created_at ON steps
       BEGIN SELECT RAISE(ABORT, 'a step row keeps its job, item, step and creation time'); END""",
    _sqlite_counted_insert(),
    _sqlite_counted_update(),
    f"""CREATE TRIGGER steps_counted_delete AFTER DELETE ON steps BEGIN
       UPDATE jobs SET n_items = n_items - NOT EXISTS (SELECT 1 FROM steps s WHERE s.job_id = OLD.job_id
                                                                          AND s.item_id = OLD.item_id),
                       {", ".join(f"{c} = {c} - {old}" for c, old in zip(COUNTERS[1:], _row_counts("OLD"), strict=True))}
       WHERE job_id = OLD.job_id;
       END""",
)

# PostgreSQL: one trigger per statement, over its transition tables, so a statement of thousands of
# rows updates each job's row once (a trigger per row would update it once per row, and every update of
# one row in one transaction makes its next update walk a longer chain of versions: quadratic). An
# INSERT ... ON CONFLICT DO UPDATE fires both: the rows it inserted reach the INSERT trigger, those it
# updated the UPDATE trigger. An item is new when all its rows are rows this statement inserted.
_PG_SUMS = ", ".join(f"count(*) FILTER (WHERE {t})" for t in _row_counts("r"))
# What each row adds (+) or takes away (-) from each count, as one column per counter.
_PG_SIGNED = ", ".join(f"({t})::int * sign AS {c}" for t, c in zip(_row_counts("r"), COUNTERS[1:], strict=True))
_PG_COUNTERS = (
    *_counters("BIGINT"),
    """CREATE FUNCTION steps_key_fixed() RETURNS trigger LANGUAGE plpgsql AS
       'BEGIN RAISE EXCEPTION ''a step row keeps its job, item, step and creation time''; END'""",
    """CREATE TRIGGER steps_key_fixed BEFORE UPDATE OF job_id, item_id, step, created_at ON steps
       FOR EACH ROW EXECUTE FUNCTION steps_key_fixed()""",
    f"""CREATE FUNCTION steps_counted_insert() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
         INSERT INTO jobs AS j (job_id, created_at, updated_at, {", ".join(COUNTERS)})
         SELECT r.job_id, min(r.created_at), max(r.updated_at),
                count(*) FILTER (WHERE r.first_of_item AND r.added = (
                    SELECT count(*) FROM steps s WHERE s.job_id = r.job_id AND s.item_id = r.item_id)),
                {_PG_SUMS}
         FROM (SELECT i.*, count(*) OVER item AS added, row_number() OVER item = 1 AS first_of_item
               FROM inserted i WINDOW item AS (PARTITION BY i.job_id, i.item_id)) AS r
         GROUP BY r.job_id
         ON CONFLICT (job_id) DO UPDATE SET {", ".join(f"{c} = j.{c} + excluded.{c}" for c in COUNTERS)};
         RETURN NULL;
       END $$""",
    """CREATE TRIGGER steps_counted_insert AFTER INSERT ON steps REFERENCING NEW TABLE AS inserted
       FOR EACH STATEMENT EXECUTE FUNCTION steps_counted_insert()""",
    # An update's change to each count: what the rows count now, less what they counted before.
    f"""CREATE FUNCTION steps_counted_update() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
         UPDATE jobs AS j SET {", ".join(f"{c} = j.{c} + d.{c}" for c in COUNTERS[1:])}
         FROM (SELECT job_id, {", ".join(f"sum({c}) AS {c}" for c in COUNTERS[1:])}
               FROM (SELECT r.job_id, {_PG_SIGNED} FROM (SELECT *, 1 AS sign FROM after_update) AS r
                     UNION ALL
                     SELECT r.job_id, {_PG_SIGNED} FROM (SELECT *, -1 AS sign FROM before_update) AS r) AS changes
               GROUP BY job_id) AS d
         WHERE j.job_id = d.job_id AND ({", ".join(f"d.{c}" for c in COUNTERS[1:])}) != (0, 0, 0, 0, 0);
         RETURN NULL;
       END $$""",
    """CREATE TRIGGER steps_counted_update AFTER UPDATE ON steps
       REFERENCING OLD TABLE AS before_update NEW TABLE AS after_update
       FOR EACH STATEMENT EXECUTE FUNCTION steps_counted_update()""",
    f"""CREATE FUNCTION steps_counted_delete() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
         UPDATE jobs AS j SET {", ".join(f"{c} = j.{c} - d.{c}" for c in COUNTERS)}
         FROM (SELECT r.job_id,
                      count(DISTINCT r.item_id) FILTER (WHERE NOT EXISTS (
                          SELECT 1 FROM steps s WHERE s.job_id = r.job_id AND s.item_id = r.item_id)),
                      {_PG_SUMS}
               FROM deleted r GROUP BY r.job_id) AS d (job_id, {", ".join(COUNTERS)})
         WHERE j.job_id = d.job_id;
         RETURN NULL;
       END $$""",
    """CREATE TRIGGER steps_counted_delete AFTER DELETE ON steps REFERENCING OLD TABLE AS deleted
       FOR EACH STATEMENT EXECUTE FUNCTION steps_counted_delete()""",
)

_SQLITE_COMPACTED = (
    *_compacted("INTEGER", "BLOB", "INTEGER PRIMARY KEY", "WITHOUT ROWID"),
    """CREATE TRIGGER compacted_kept BEFORE UPDATE ON compacted
       BEGIN SELECT RAISE(ABORT, 'a compacted item is never changed: it is expanded back into steps'); END""",
    """CREATE TRIGGER compacted_counted_insert AFTER INSERT ON compacted BEGIN
       UPDATE jobs SET n_items = n_items + 1, n_succeeded = n_succeeded + NEW.n_steps WHERE job_no = NEW.job_no;
       END""",
    """CREATE TRIGGER compacted_counted_delete AFTER DELETE ON compacted BEGIN
       UPDATE jobs SET n_items = n_items - 1, n_succeeded = n_succeeded - OLD.n_steps WHERE job_no = OLD.job_no;
       END""",
)

# The counting functions name jobs and steps unqualified: they run with the search_path of the session
# that fired them, and a hand-written statement from a session whose search_path names another schema
# (or none) counted into another journal's jobs, or failed. Version 8 fixes each function's search_path
# to the journal's schema (the one migrations run in).
_PG_COUNTING_FUNCTIONS = ("steps_counted_insert", "steps_counted_update", "steps_counted_delete",
                          "compacted_counted_insert", "compacted_counted_delete")
# On PostgreSQL, compacted is partitioned by job number, COMPACTED_PARTITION_JOBS numbers a partition
# (compacted_<first>_<end>, made by compacted_partition() when compaction numbers a job). Prune forgets
# a pruned job's number (its compacted items then belong to no job: no reader sees them, no count holds
# them) and drops a partition once every number in it was given and no job has one of them any more
# (compacted_drop()): deleting millions of rows wrote as much WAL as the rows took, and a run's marks on
# the same server waited for it (a mark must wait at most 100 ms). The functions run with the journal's schema
# and refuse to wait for a lock longer than a moment (readers of compacted queue behind the drop).
COMPACTED_PARTITION_JOBS = 64
_PG_PARTITIONS_LOCK = "PERFORM pg_advisory_xact_lock(hashtext(current_schema()), hashtext('compacted partitions'))"
# Read from the catalog as of this statement (a cached lookup could predate what the lock waited for).
_PG_PARTITION_EXISTS = ("EXISTS (SELECT 1 FROM pg_class WHERE relname = name "
                        "AND relnamespace = current_schema()::regnamespace)")
_PG_COMPACTED = (
    *_compacted("BIGINT", "BYTEA", "INTEGER GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY",
                "PARTITION BY RANGE (job_no)"),
    "CREATE SEQUENCE job_numbers",
    f"""CREATE FUNCTION compacted_partition(number BIGINT) RETURNS void LANGUAGE plpgsql AS $$
       DECLARE
         first BIGINT := number - number % {COMPACTED_PARTITION_JOBS};
         name TEXT := format('compacted_%s_%s', first, first + {COMPACTED_PARTITION_JOBS});
       BEGIN
         {_PG_PARTITIONS_LOCK};
         IF NOT {_PG_PARTITION_EXISTS} THEN
           -- Made apart and attached: attaching locks compacted against other DDL only, not its readers.
           EXECUTE format('CREATE TABLE %I.%I (LIKE compacted INCLUDING DEFAULTS INCLUDING CONSTRAINTS)',
                          current_schema(), name);
           EXECUTE format('ALTER TABLE compacted ATTACH PARTITION %I.%I FOR VALUES FROM (%s) TO (%s)',
                          current_schema(), name, first, first + {COMPACTED_PARTITION_JOBS});
         END IF;
       END $$""",
    # Its checks must see what committed while it waited for the lock: a statement's own snapshot (read
    # committed), never the transaction's (under repeatable read it would miss a job numbered meanwhile).
    f"""CREATE FUNCTION compacted_drop(first BIGINT, stop BIGINT) RETURNS boolean LANGUAGE plpgsql AS $$
       DECLARE
         name TEXT := format('compacted_%s_%s', first, stop);
       BEGIN
         IF current_setting('transaction_isolation') != 'read committed' THEN
           RAISE EXCEPTION 'compacted_drop() runs in a read committed transaction';
         END IF;
         {_PG_PARTITIONS_LOCK};
         IF NOT {_PG_PARTITION_EXISTS}
            OR stop - 1 > (SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM job_numbers)
            OR EXISTS (SELECT 1 FROM jobs WHERE job_no >= first AND job_no < stop) THEN
           RETURN false;
         END IF;
         -- Dropping a partition locks all of compacted: its readers queue behind the drop while it waits.
         PERFORM set_config('lock_timeout', '50ms', true);
         EXECUTE format('DROP TABLE %I.%I', current_schema(), name);
         RETURN true;
       EXCEPTION WHEN lock_not_available THEN
         RETURN false;  -- someone is reading compacted: the next try, or the next prune, drops it
       END $$""",
    "ALTER FUNCTION compacted_partition(BIGINT) SET search_path FROM CURRENT",
    "ALTER FUNCTION compacted_drop(BIGINT, BIGINT) SET search_path FROM CURRENT",
    """CREATE FUNCTION compacted_kept() RETURNS trigger LANGUAGE plpgsql AS
       'BEGIN RAISE EXCEPTION ''a compacted item is never changed: it is expanded back into steps''; END'""",
    """CREATE TRIGGER compacted_kept BEFORE UPDATE ON compacted FOR EACH ROW EXECUTE FUNCTION compacted_kept()""",
    """CREATE FUNCTION compacted_counted_insert() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
         UPDATE jobs AS j SET n_items = j.n_items + d.items, n_succeeded = j.n_succeeded + d.rows
         FROM (SELECT job_no, count(*) AS items, sum(n_steps) AS rows FROM inserted GROUP BY job_no) AS d
         WHERE j.job_no = d.job_no;
         RETURN NULL;
       END $$""",
    """CREATE TRIGGER compacted_counted_insert AFTER INSERT ON compacted REFERENCING NEW TABLE AS inserted
       FOR EACH STATEMENT EXECUTE FUNCTION compacted_counted_insert()""",
    """CREATE FUNCTION compacted_counted_delete() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
         UPDATE jobs AS j SET n_items = j.n_items - d.items, n_succeeded = j.n_succeeded - d.rows
         FROM (SELECT job_no, count(*) AS items, sum(n_steps) AS rows FROM deleted GROUP BY job_no) AS d
         WHERE j.job_no = d.job_no;
         RETURN NULL;
       END $$""",
    """CREATE TRIGGER compacted_counted_delete AFTER DELETE ON compacted REFERENCING OLD TABLE AS deleted
       FOR EACH STATEMENT EXECUTE FUNCTION compacted_counted_delete()""",
    *(f"ALTER FUNCTION {name}() SET search_path FROM CURRENT" for name in _PG_COUNTING_FUNCTIONS),
)

# Version 9 (SPEC §13): every job counts its sends' IN_FLIGHT marks (jobs.n_marks), in the transaction
# that commits them - by the counting triggers, so no statement and no trigger firing is added. A row
# that becomes IN_FLIGHT counts one; nothing ever takes one away (not a delete, prune or compaction):
# a journal whose count is below one a run saw has lost marks (restored, copied, failed over). A run
# keeps its high-water mark outside the journal (runner/high_water.py). Existing jobs start at 0: no
# mark was kept for them outside either.
_SQLITE_MARKS = (
    "ALTER TABLE jobs ADD COLUMN n_marks INTEGER NOT NULL DEFAULT 0",
    "DROP TRIGGER steps_counted_insert",
    "DROP TRIGGER steps_counted_update",
    _sqlite_counted_insert(marks=True),
    _sqlite_counted_update(marks=True),
)
# PostgreSQL: the statement triggers count the rows they see IN_FLIGHT (an update's rows as they are
# after it: a mark renewed counts again, which only moves the count on faster).
_PG_MARKS = (
    "ALTER TABLE jobs ADD COLUMN n_marks BIGINT NOT NULL DEFAULT 0",
    f"""CREATE OR REPLACE FUNCTION steps_counted_insert() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
         INSERT INTO jobs AS j (job_id, created_at, updated_at, {", ".join(COUNTERS)}, n_marks)
         SELECT r.job_id, min(r.created_at), max(r.updated_at),
                count(*) FILTER (WHERE r.first_of_item AND r.added = (
                    SELECT count(*) FROM steps s WHERE s.job_id = r.job_id AND s.item_id = r.item_id)),
                {_PG_SUMS}, count(*) FILTER (WHERE {_MARK.format(r="r")})
         FROM (SELECT i.*, count(*) OVER item AS added, row_number() OVER item = 1 AS first_of_item
               FROM inserted i WINDOW item AS (PARTITION BY i.job_id, i.item_id)) AS r
         GROUP BY r.job_id
         ON CONFLICT (job_id) DO UPDATE SET {", ".join(f"{c} = j.{c} + excluded.{c}" for c in (*COUNTERS, "n_marks"))};
         RETURN NULL;
       END $$""",
    f"""CREATE OR REPLACE FUNCTION steps_counted_update() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN
         UPDATE jobs AS j SET {", ".join(f"{c} = j.{c} + d.{c}" for c in COUNTERS[1:])}, n_marks = j.n_marks + d.n_marks
         FROM (SELECT job_id, {", ".join(f"sum({c}) AS {c}" for c in COUNTERS[1:])},
                      sum(marks) AS n_marks
               FROM (SELECT r.job_id, {_PG_SIGNED}, ({_MARK.format(r="r")})::int AS marks
                     FROM (SELECT *, 1 AS sign FROM after_update) AS r
                     UNION ALL
                     SELECT r.job_id, {_PG_SIGNED}, 0 FROM (SELECT *, -1 AS sign FROM before_update) AS r) AS changes
               GROUP BY job_id) AS d
         WHERE j.job_id = d.job_id AND ({", ".join(f"d.{c}" for c in (*COUNTERS[1:], "n_marks"))}) != (0, 0, 0, 0, 0, 0);
         RETURN NULL;
       END $$""",    # A function replaced loses its settings: the journal's schema again (as version 8 fixed it).
    "ALTER FUNCTION steps_counted_insert() SET search_path FROM CURRENT",
    "ALTER FUNCTION steps_counted_update() SET search_path FROM CURRENT",
)


SQLITE_MIGRATIONS: dict[int, tuple[str, ...]] = {
    1: (
        """CREATE TABLE steps (
            job_id      TEXT NOT NULL,
            item_id     TEXT NOT NULL,
            step        TEXT NOT NULL,
            side_effect INTEGER NOT NULL CHECK (side_effect IN (0, 1)),
            status      TEXT NOT NULL CHECK (status IN ('IN_FLIGHT', 'SUCCEEDED', 'FAILED')),
            digest      TEXT NOT NULL,
            receipt     TEXT,
            output      TEXT,
            error_type  TEXT,
            held_reason TEXT CHECK (held_reason IN ('unknown_outcome', 'input_changed')),
            new_digest  TEXT,
            attempts    INTEGER NOT NULL DEFAULT 0,
            created_at  REAL NOT NULL,
            updated_at  REAL NOT NULL,
            PRIMARY KEY (job_id, item_id, step)
        ) WITHOUT ROWID""",
        """CREATE TABLE resolutions (
            id                   INTEGER PRIMARY KEY AUTOINCREMENT,
            job_id               TEXT NOT NULL,
            item_id              TEXT NOT NULL,
            step                 TEXT NOT NULL,
            decision             TEXT NOT NULL,
            receipt              TEXT,
            note                 TEXT NOT NULL DEFAULT '',
            resolved_by          TEXT NOT NULL,
            resolved_at          REAL NOT NULL,
            previous_status      TEXT,
            previous_held_reason TEXT
        )""",
        "CREATE INDEX resolutions_by_job ON resolutions (job_id, id)",
        # The audit log is append-only: the database itself refuses edits and deletions.
        """CREATE TRIGGER resolutions_no_update BEFORE UPDATE ON resolutions
           BEGIN SELECT RAISE(ABORT, 'the resolution audit log is append-only'); END""",
        """CREATE TRIGGER resolutions_no_delete BEFORE DELETE ON resolutions
           BEGIN SELECT RAISE(ABORT, 'the resolution audit log is append-only'); END""",
        # REPLACE deletes the old row without firing DELETE triggers (recursive_triggers is off).
        """CREATE TRIGGER resolutions_no_replace BEFORE INSERT ON resolutions
           WHEN NEW.id IS NOT NULL AND EXISTS (SELECT 1 FROM resolutions WHERE id = NEW.id)
           BEGIN SELECT RAISE(ABORT, 'the resolution audit log is append-only'); END""",
    ),
    2: (
        """CREATE TABLE jobs (
            job_id      TEXT PRIMARY KEY,
            created_at  REAL NOT NULL,
            updated_at  REAL NOT NULL,
            last_runner TEXT,
            pruned_at   REAL
        ) WITHOUT ROWID""",
        """INSERT INTO jobs (job_id, created_at, updated_at)
           SELECT job_id, min(created_at), max(updated_at) FROM steps GROUP BY job_id""",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL) WITHOUT ROWID",
        "INSERT INTO meta (key, value) VALUES ('journal_id', lower(hex(randomblob(16))))",
        # Held and unresolved rows are few; this keeps the sensor's and prune's questions cheap.
        """CREATE INDEX steps_open ON steps (job_id, item_id)
           WHERE held_reason IS NOT NULL OR (side_effect = 1 AND status != 'SUCCEEDED')""",
    ),
    3: (
        # Every send went into steps_open as IN_FLIGHT and out again as SUCCEEDED: two index writes
        # per send on the hot path. Holds are what the UI, CLI and sensor look for across jobs; the
        # open sends of one job are found through the primary key (job_id, ...).
        "DROP INDEX steps_open",
        "CREATE INDEX steps_held ON steps (job_id, item_id) WHERE held_reason IS NOT NULL",
    ),
    4: _finished_at("REAL"),
    5: _GENERATIONS,
    6: _VERSIONS,
    7: _SQLITE_COUNTERS,
    8: _SQLITE_COMPACTED,
    9: _SQLITE_MARKS,
}

# PostgreSQL journals start at version 3, the same tables and meaning as SQLite's version 3. The
# version lives in meta ('schema_version'); statements run with the journal's schema first on the
# search_path. Timestamps are seconds since the epoch, as on SQLite, so both share their SQL.
POSTGRES_FIRST_VERSION = 3
POSTGRES_MIGRATIONS: dict[int, tuple[str, ...]] = {
    3: (
        """CREATE TABLE steps (
            job_id      TEXT NOT NULL,
            item_id     TEXT NOT NULL,
            step        TEXT NOT NULL,
            side_effect SMALLINT NOT NULL CHECK (side_effect IN (0, 1)),
            status      TEXT NOT NULL CHECK (status IN ('IN_FLIGHT', 'SUCCEEDED', 'FAILED')),
            digest      TEXT NOT NULL,
            receipt     TEXT,
            output      TEXT,
            error_type  TEXT,
            held_reason TEXT CHECK (held_reason IN ('unknown_outcome', 'input_changed')),
            new_digest  TEXT,
            attempts    INTEGER NOT NULL DEFAULT 0,
            created_at  DOUBLE PRECISION NOT NULL,
            updated_at  DOUBLE PRECISION NOT NULL,
            PRIMARY KEY (job_id, item_id, step)
        )""",
        "CREATE INDEX steps_held ON steps (job_id, item_id) WHERE held_reason IS NOT NULL",
        """CREATE TABLE resolutions (
            id                   BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
            job_id               TEXT NOT NULL,
            item_id              TEXT NOT NULL,
            step                 TEXT NOT NULL,
            decision             TEXT NOT NULL,
            receipt              TEXT,
            note                 TEXT NOT NULL DEFAULT '',
            resolved_by          TEXT NOT NULL,
            resolved_at          DOUBLE PRECISION NOT NULL,
            previous_status      TEXT,
            previous_held_reason TEXT
        )""",
        "CREATE INDEX resolutions_by_job ON resolutions (job_id, id)",
        # The audit log is append-only: the database itself refuses edits, deletions and TRUNCATE.
        """CREATE FUNCTION resolutions_append_only() RETURNS trigger LANGUAGE plpgsql AS
           'BEGIN RAISE EXCEPTION ''the resolution audit log is append-only''; END'""",
        """CREATE TRIGGER resolutions_no_update_or_delete BEFORE UPDATE OR DELETE ON resolutions
           FOR EACH ROW EXECUTE FUNCTION resolutions_append_only()""",
        """CREATE TRIGGER resolutions_no_truncate BEFORE TRUNCATE ON resolutions
           FOR EACH STATEMENT EXECUTE FUNCTION resolutions_append_only()""",
        """CREATE TABLE jobs (
            job_id      TEXT PRIMARY KEY,
            created_at  DOUBLE PRECISION NOT NULL,
            updated_at  DOUBLE PRECISION NOT NULL,
            last_runner TEXT,
            pruned_at   DOUBLE PRECISION
        )""",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
        "INSERT INTO meta (key, value) VALUES ('journal_id', md5(random()::text || clock_timestamp()::text))",
    ),
    4: _finished_at("DOUBLE PRECISION"),
    5: _GENERATIONS,
    6: _VERSIONS,
    7: _PG_COUNTERS,
    8: _PG_COMPACTED,
    9: _PG_MARKS,
}
