"""Both journal engines for the contract tests: where a test's journal lives, and a raw look at it.

``journal_location`` (a fixture in conftest.py) is a SQLite file path or a PostgreSQL URL of a
database made for that test. :func:`snapshot` reads every row of every journal table through a
connection of its own, so a test can prove a refused call left the journal exactly as it was.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

JOURNAL_TABLES = {"steps", "jobs", "resolutions", "meta"}


def is_postgres(location: object) -> bool:
    return isinstance(location, str) and location.startswith(("postgresql://", "postgres://"))


def snapshot(location: str | Path, schema: str = "resumable") -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table of the journal, read through a connection of our own."""
    if is_postgres(location):
        import psycopg

        with psycopg.connect(str(location), autocommit=True) as conn:
            tables = [r[0] for r in conn.execute(
                "SELECT tablename FROM pg_tables WHERE schemaname = %s ORDER BY 1", (schema,))]
            assert JOURNAL_TABLES <= set(tables), tables
            return {t: sorted(conn.execute(f'SELECT * FROM "{schema}"."{t}"').fetchall(), key=repr) for t in tables}
    conn = sqlite3.connect(f"file:{location}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        assert JOURNAL_TABLES <= set(tables)
        return {t: sorted(conn.execute(f'SELECT * FROM "{t}"').fetchall(), key=repr) for t in tables}
    finally:
        conn.close()


def execute(
    location: str | Path, statement: str, params: tuple[Any, ...] = (), schema: str = "resumable"
) -> list[tuple[Any, ...]]:
    """Run one statement on the journal's tables from outside (a separate connection), ``?`` placeholders."""
    if is_postgres(location):
        import psycopg

        with psycopg.connect(str(location), autocommit=True) as conn:
            conn.execute(f'SET search_path = "{schema}"')
            cur = conn.execute(statement.replace("?", "%s"), params)
            return cur.fetchall() if cur.description else []
    conn = sqlite3.connect(str(location), isolation_level=None, timeout=10)
    try:
        return conn.execute(statement, params).fetchall()
    finally:
        conn.close()


def columns(location: str | Path, table: str, schema: str = "resumable") -> list[str]:
    """The names of ``table``'s columns, in order."""
    if is_postgres(location):
        return [r[0] for r in execute(location, "SELECT column_name FROM information_schema.columns WHERE "
                                                "table_schema = ? AND table_name = ? ORDER BY ordinal_position",
                                      (schema, table), schema)]
    return [r[1] for r in execute(location, f'PRAGMA table_info("{table}")')]


def counts_and_recount(location: str | Path) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, ...]]]:
    """Every job's counts as the journal keeps them (jobs row), and as counted from its step rows now.

    Jobs without step rows count zero everywhere. The two must be equal after anything at all.
    """
    from airflow_resumable.journal.schema import COUNTERS, recount_statement

    kept = {r[0]: tuple(int(v) for v in r[1:]) for r in execute(location, f"SELECT job_id, {', '.join(COUNTERS)} FROM jobs")}
    counted = {r[0]: tuple(int(v) for v in r[1:]) for r in execute(location, recount_statement())}
    zero = (0,) * len(COUNTERS)
    return kept, {job_id: counted.get(job_id, zero) for job_id in kept} | {
        job_id: row for job_id, row in counted.items() if job_id not in kept}


def assert_counts_exact(location: str | Path) -> None:
    """The counts the journal keeps with each job equal a recount of its step rows."""
    kept, counted = counts_and_recount(location)
    assert kept == counted, {k: (kept.get(k), counted.get(k)) for k in set(kept) | set(counted)
                             if kept.get(k) != counted.get(k)}


def sqlite_downgrade(path: str | Path, version: int) -> None:
    """Take a SQLite journal written by this release back to an older schema ``version`` (5 to 8), as
    that release would have left it: for the migration tests of journals that hold real runs' rows (with
    no compacted items: version 7 had none)."""
    from airflow_resumable.journal.schema import COUNTERS

    conn = sqlite3.connect(str(path), isolation_level=None)
    try:
        assert conn.execute("SELECT count(*) FROM compacted").fetchone()[0] == 0, "expand the items first"
        _sqlite_drop_marks(conn)
        if version == 8:
            conn.execute("PRAGMA user_version = 8")
            return
        for trigger in ("compacted_kept", "compacted_counted_insert", "compacted_counted_delete"):
            conn.execute(f"DROP TRIGGER {trigger}")
        conn.execute("DROP TABLE compacted")
        conn.execute("DROP TABLE step_sets")
        conn.execute("DROP INDEX jobs_by_number")
        conn.execute("ALTER TABLE jobs DROP COLUMN job_no")
        conn.execute("ALTER TABLE jobs DROP COLUMN compacted_at")
        if version == 7:
            conn.execute("PRAGMA user_version = 7")
            return
        for trigger in ("steps_key_fixed", "steps_counted_insert", "steps_counted_update", "steps_counted_delete"):
            conn.execute(f"DROP TRIGGER {trigger}")
        conn.execute("DROP INDEX jobs_by_created")
        conn.execute("DROP INDEX steps_held")
        conn.execute("CREATE INDEX steps_held ON steps (job_id, item_id) WHERE held_reason IS NOT NULL")
        for column in COUNTERS:
            conn.execute(f"ALTER TABLE jobs DROP COLUMN {column}")
        if version < 6:
            conn.execute("ALTER TABLE steps DROP COLUMN version")
            conn.execute("ALTER TABLE jobs DROP COLUMN dag_id")
        conn.execute(f"PRAGMA user_version = {version}")
    finally:
        conn.close()


def _sqlite_drop_marks(conn: sqlite3.Connection) -> None:
    """Version 9 undone: the marks column, and the counting triggers as version 7 wrote them."""
    from airflow_resumable.journal.schema import SQLITE_MIGRATIONS

    conn.execute("DROP TRIGGER steps_counted_insert")
    conn.execute("DROP TRIGGER steps_counted_update")
    conn.execute("ALTER TABLE jobs DROP COLUMN n_marks")
    for statement in SQLITE_MIGRATIONS[7]:
        if "CREATE TRIGGER steps_counted_insert" in statement or "CREATE TRIGGER steps_counted_update" in statement:
            conn.execute(statement)


def postgres_downgrade_to_6(url: str, schema: str = "resumable") -> None:
    """Take a PostgreSQL journal written by this release back to schema version 6 (what 0.3.0's
    predecessor left); a test then drops what versions 6, 5 and 4 added, for older ones."""
    import psycopg

    from airflow_resumable.journal.schema import COUNTERS

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'SET search_path = "{schema}"')
        assert conn.execute("SELECT count(*) FROM compacted").fetchone()[0] == 0, "expand the items first"
        conn.execute("ALTER TABLE jobs DROP COLUMN n_marks")  # version 9 (its functions are dropped below)
        for name in ("compacted_kept", "compacted_counted_insert", "compacted_counted_delete"):
            conn.execute(f"DROP TRIGGER {name} ON compacted")
            conn.execute(f"DROP FUNCTION {name}()")
        for statement in ("DROP TABLE compacted", "DROP FUNCTION compacted_partition(BIGINT)",
                          "DROP FUNCTION compacted_drop(BIGINT, BIGINT)", "DROP TABLE step_sets",
                          "DROP SEQUENCE job_numbers",
                          "DROP INDEX jobs_by_number", "ALTER TABLE jobs DROP COLUMN job_no, DROP COLUMN compacted_at"):
            conn.execute(statement)
        for name in ("steps_key_fixed", "steps_counted_insert", "steps_counted_update", "steps_counted_delete"):
            conn.execute(f"DROP TRIGGER {name} ON steps")
            conn.execute(f"DROP FUNCTION {name}()")
        conn.execute("DROP INDEX jobs_by_created")
        conn.execute("DROP INDEX steps_held")
        conn.execute("CREATE INDEX steps_held ON steps (job_id, item_id) WHERE held_reason IS NOT NULL")
        conn.execute("ALTER TABLE jobs " + ", ".join(f"DROP COLUMN {c}" for c in COUNTERS))
        conn.execute("UPDATE meta SET value = '6' WHERE key = 'schema_version'")


def assert_summary_is_a_recount(journal: Any, job_id: str) -> None:
    """``journal.job(job_id)`` (the counts kept with the job) equals a count of ``journal.rows(job_id)``."""
    rows = journal.rows(job_id)
    summary = journal.job(job_id)
    counted = {
        "items": len({r.item_id for r in rows}),
        "counts": {s: sum(1 for r in rows if r.status.value == s) for s in ("IN_FLIGHT", "SUCCEEDED", "FAILED")},
        "held": sum(1 for r in rows if r.held_reason is not None),
        "unresolved": sum(1 for r in rows if r.held_reason is None and r.side_effect
                          and r.status.value != "SUCCEEDED" and not r.not_sent),
    }
    kept = {"items": summary.items, "counts": dict(summary.counts), "held": summary.held,
            "unresolved": summary.unresolved} if summary else None
    assert kept == counted or (summary is None and not rows), (job_id, kept, counted)
