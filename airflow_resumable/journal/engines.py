"""Which engine a journal location names: a file path (SQLite) or a ``postgresql://`` URL."""

from __future__ import annotations

import os
from typing import Any

from airflow_resumable.exceptions import JournalLocationError
from airflow_resumable.journal.backend import JournalBackend

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def is_postgres_url(location: object) -> bool:
    return isinstance(location, str) and location.lower().startswith(POSTGRES_SCHEMES)


def open_engine(location: str | os.PathLike[str], **options: Any) -> JournalBackend:
    """The engine of the journal at ``location``, open (options as :class:`~.base.StepJournal` takes them)."""
    if is_postgres_url(location):
        # Imported here: psycopg is an optional dependency, and a SQLite journal never needs it.
        from airflow_resumable.journal.postgres import PostgresBackend

        return PostgresBackend(str(location), **options)
    if isinstance(location, str) and "://" in location:
        raise JournalLocationError(
            f"journal location {location.split('://', 1)[0]}://... is not supported: give a file "
            "path (SQLite) or a postgresql:// URL"
        )
    from airflow_resumable.journal.sqlite import SqliteBackend

    return SqliteBackend(location, **options)
