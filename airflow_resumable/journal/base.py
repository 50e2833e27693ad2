"""The journal: :class:`StepJournal`, its API written once over the engine primitives of :mod:`.backend`.

The API is composed of its parts, each in its own module: the reads and their pages (:mod:`.reads`),
a person's decisions about held steps (:mod:`.decisions`, checked by :mod:`.checks`) and housekeeping
(:mod:`.housekeeping`). This module opens the engine and hands out a run's claim (:class:`JobRun`).
"""

from __future__ import annotations

import os
from typing import Any

from airflow_resumable.journal.backend import Durability, JournalBackend
from airflow_resumable.journal.decisions import JournalDecisions
from airflow_resumable.journal.engines import open_engine
from airflow_resumable.journal.housekeeping import JournalHousekeeping
from airflow_resumable.journal.jobrun import JobRun
from airflow_resumable.journal.pace import JournalPace
from airflow_resumable.journal.reads import JournalReads
from airflow_resumable.journal.schema import SCHEMA_VERSION

__all__ = ["StepJournal", "migrate"]


def migrate(location: str | os.PathLike[str], **options: Any) -> tuple[int | None, int]:
    """Move the journal at ``location`` to this release's schema; returns (the version it had, or None
    for a new journal; the version it has now). What ``airflow-resumable migrate`` runs.

    A shared (PostgreSQL) journal is never migrated as a side effect: a worker of this release refuses an
    older one until this has run, and sends nothing. A SQLite journal is migrated by whoever opens it.
    """
    with StepJournal(location, migrate=True, **options) as journal:
        return journal.migrated_from, SCHEMA_VERSION


class StepJournal(JournalReads, JournalDecisions, JournalHousekeeping):
    """The step journal: per job, item and step, what was done.

    ``StepJournal(location, ...)`` opens a SQLite file when ``location`` is a path, and a
    PostgreSQL schema when it is a ``postgresql://`` or ``postgres://`` URL (a shared journal that
    every worker reaches). Both have the same methods, records, errors and guarantees: this class is
    written once over :attr:`engine` (a :class:`~airflow_resumable.journal.backend.JournalBackend`).

    :param location: a filesystem path, or a libpq URL.
    :param durability: ``"full"`` (default): the ``IN_FLIGHT`` mark of every send is on stable
        storage before the send starts. ``"normal"``: it survives the runner being killed, but not
        power loss or a crash of the OS (SQLite) or of the database server (PostgreSQL).

    ``readonly=True``: open for reading only (the UI page, the CLI's read commands): the open writes
    nothing, so it works on a full disk; a SQLite journal then shows what is committed, and receipts a
    dead runner left in its receipt log are folded by the next writer (a run, a resolution, prune).
    ``migrate=True``: move a shared journal of an older schema to this release's (see :func:`migrate`).
    SQLite only: ``allow_network_filesystem``, ``busy_timeout``. PostgreSQL only: ``schema``
    (default ``resumable``), ``claim_timeout`` (seconds within which a runner that vanished or was
    cut off from the server loses its claim on a job, default 30), ``connect_timeout``.
    """

    def __init__(self, location: str | os.PathLike[str], *, durability: Durability = "full", **options: Any) -> None:
        self.engine: JournalBackend = open_engine(location, durability=durability, **options)
        self._deciding: set[str] = set()  # jobs whose claim this journal holds for a decision (deciding())

    @classmethod
    def on(cls, engine: JournalBackend) -> StepJournal:
        """A journal over an engine opened by hand (a test's, an engine of one's own)."""
        journal = cls.__new__(cls)
        journal.engine, journal._deciding = engine, set()
        return journal

    # What the engine says about itself.

    @property
    def location(self) -> str:
        return self.engine.location

    @property
    def journal_id(self) -> str:
        return self.engine.journal_id

    @property
    def kind(self) -> str:
        return self.engine.kind

    def incarnation(self) -> str:
        """What changes when the journal could have lost commits without a run noticing (SPEC §13)."""
        return self.engine.incarnation()

    @property
    def shared(self) -> bool:
        """Whether any worker may open this journal (a database server), or only the worker whose disk holds it."""
        return self.engine.shared

    @property
    def durability(self) -> Durability:
        return self.engine.durability

    @property
    def max_key_bytes(self) -> int | None:
        """The most UTF-8 bytes job_id + item_id + step may take together here (None: the ids' own limits)."""
        return self.engine.max_key_bytes

    @property
    def migrated_from(self) -> int | None:
        """The schema version this open found (None: a new journal)."""
        return self.engine.migrated_from

    @property
    def commit_count(self) -> int:
        """Write transactions committed; benchmarks and tests read them."""
        return self.engine.commit_count

    @property
    def durable_commit_count(self) -> int:
        """Of which made durable before returning (full durability)."""
        return self.engine.durable_commit_count

    @property
    def closed(self) -> bool:
        return self.engine.closed

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> StepJournal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StepJournal({self.location!r}, durability={self.durability!r})"

    # -- running a job ------------------------------------------------------------------------

    def shared_pace(self, limit_key: str) -> JournalPace:
        """The send rate of ``limit_key``, kept with every run that names it on this journal."""
        return JournalPace(self.engine, limit_key)

    def open_job(self, job_id: str, *, runner: str | None = None, dag_id: str | None = None) -> JobRun:
        """Claim ``job_id`` for one runner (at once, or :class:`JobBusyError`). ``dag_id``: the Airflow
        DAG running it, recorded with the job by its first run (it decides who may settle its items)."""
        return JobRun(self.engine, job_id, runner=runner, dag_id=dag_id)

