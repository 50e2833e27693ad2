"""The journal's schema on each engine, as numbered migrations.

Each migration takes the schema from version N-1 to N. Never edit a released one: add another (on
every engine that has the version). A journal at a version above :data:`SCHEMA_VERSION` was written
by a newer release and is refused, never downgraded.
"""

from __future__ import annotations

SCHEMA_VERSION = 6

# Version 4: when a run last went through the whole batch (NULL while a run is under way, and after
# one that stopped or died part way: such a job shows as not finished and is never pruned). Jobs
# journaled before count as finished when they were last updated, as they were shown then.
def _finished_at(seconds_type: str) -> tuple[str, ...]:
    return (f"ALTER TABLE jobs ADD COLUMN finished_at {seconds_type}", "UPDATE jobs SET finished_at = updated_at")


# Version 5 (SPEC §9): a send's key generation (0 = the key earlier versions used, so existing
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
}
