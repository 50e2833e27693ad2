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
