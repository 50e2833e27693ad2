"""The seam between the journal's logic and the engine it runs on.

:class:`~airflow_resumable.journal.base.StepJournal` (the read, resolution and housekeeping API) and
:class:`~airflow_resumable.journal.jobrun.JobRun` (what the runner writes through) are written once,
against :class:`JournalBackend`: the engine a journal holds (``StepJournal.engine``). Each engine
implements it: :class:`~airflow_resumable.journal.sqlite.SqliteBackend` (a file, ``flock`` claims, a
receipt log beside the file) and :class:`~airflow_resumable.journal.postgres.PostgresBackend` (a
schema, session advisory-lock claims); :func:`~airflow_resumable.journal.engines.open_engine` picks one
by the location. Nothing above this seam knows which one it talks to.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import Any, Literal, Protocol

from airflow_resumable.exceptions import JobBusyError
from airflow_resumable.journal import statements as sql
from airflow_resumable.journal.statements import Statement

__all__ = [
    "BRIEF_HOLDERS", "BRIEF_HOLDER_DOING", "BRIEF_WAIT_SECONDS", "COMPACTION_RUNNER", "DURABILITIES", "Claim",
    "Durability", "EngineBase", "JournalBackend", "ReceiptLog", "Tx", "checked_durability",
    "claim_after_brief_holders",
]

Durability = Literal["full", "normal"]
DURABILITIES: tuple[Durability, ...] = ("full", "normal")


def checked_durability(value: object, setting: str = "durability") -> Durability:
    """``value`` if it names a durability; else a ValueError naming ``setting`` and the choices."""
    for durability in DURABILITIES:
        if value == durability:
            return durability
    raise ValueError(f"{setting} must be 'full' or 'normal', not {value!r}")

# Who holds a job only for one short transaction: a runner or a decision finding them waits instead of failing.
FOLD_RUNNER, RESOLUTION_RUNNER, COMPACTION_RUNNER = "receipt log fold", "resolution", "compaction"
BRIEF_HOLDERS = (FOLD_RUNNER, RESOLUTION_RUNNER, COMPACTION_RUNNER)
# What a brief holder is doing to the job, for a refusal that names it.
BRIEF_HOLDER_DOING = {FOLD_RUNNER: "having its receipt log folded", RESOLUTION_RUNNER: "being decided about",
                      COMPACTION_RUNNER: "being compacted"}
# How long a run or a decision waits out brief holders of the job before it gives up.
BRIEF_WAIT_SECONDS = 5.0


def claim_after_brief_holders(engine: JournalBackend, job_id: str, *, runner: str | None, brief: bool = False) -> Claim:
    """The job's claim, once any brief holder (a resolution, a receipt-log fold, a compaction batch) has
    let go, waiting up to :data:`BRIEF_WAIT_SECONDS` in all. A run holding the job, or a brief holder
    still there after the wait: :class:`JobBusyError`, naming it (``runner``)."""
    deadline = time.monotonic() + BRIEF_WAIT_SECONDS
    while True:
        try:
            return engine.claim(job_id, runner=runner, brief=brief)
        except JobBusyError as exc:
            if exc.runner not in BRIEF_HOLDERS or time.monotonic() >= deadline:
                raise
            time.sleep(0.01)


class Tx(Protocol):
    """One open transaction (or, for :meth:`~JournalBackend._scratch`, the run's scratch space)."""

    @property
    def max_params(self) -> int:
        """Bound parameters one statement may carry."""

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None: ...

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Execute; return the number of rows changed."""
        ...

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        """Execute once per parameter row; return the rows changed in all."""
        ...

    def insert_id(self, sql: str, params: Sequence[Any]) -> int:
        """Run an INSERT into a table with an ``id`` key; return the new row's id."""
        ...


class Claim(Protocol):
    """A job's one-runner claim. It frees itself when its holder dies (see each backend)."""

    def release(self, *, remove: bool = False) -> None:
        """Give the claim up; ``remove`` also removes what the claim left behind (prune)."""
        ...


class ReceiptLog(Protocol):
    """Where a running job's delivered receipts wait for the next commit (one write, no commit)."""

    def write(self, data: bytes) -> None: ...

    def committed(self) -> None:
        """Everything written so far is committed: the log may be emptied."""
        ...

    def discard(self) -> None:
        """The run ended with every receipt committed: close and remove the log."""
        ...

    def close(self) -> None:
        """Close the log and keep it, for the next run (or resolution) to fold."""
        ...


class JournalBackend(Protocol):
    """What the journal's logic needs from an engine."""

    location: str  # where the journal is, fit for messages and logs (no password)
    journal_id: str
    kind: str  # "sqlite" | "postgresql"
    shared: bool  # any worker may open it (a database server), or only the one whose disk holds it
    held_steps: str  # the steps table as held steps are read from it: through the partial index steps_held
    # The most UTF-8 bytes a row's key (job_id + item_id + step) may take, or None: no limit below the ids'.
    max_key_bytes: int | None
    next_job_no: str  # SQL for a job's number when it is first compacted (a fresh one, whoever asks at once)
    # compacted is partitioned by job number (PostgreSQL): a numbered job's partition is made when it is
    # numbered, and prune forgets a pruned job's items and drops whole partitions rather than delete rows.
    compacted_partitions: bool
    digest_hex: str  # SQL for a compacted digest ({} is its column) as the lowercase hex the steps table keeps
    durability: Durability
    migrated_from: int | None  # the schema version the open found (None: a new journal)
    commit_count: int  # write transactions committed; benchmarks and tests read them
    durable_commit_count: int  # of which made durable before returning (full durability)

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...

    def read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    def incarnation(self) -> str:
        """What changes when the journal could have lost commits without a run noticing: its host
        rebooted or its file was replaced (SQLite), its server restarted or another took over (PostgreSQL)."""
        ...

    def write(self, *, durable: bool) -> contextlib.AbstractContextManager[Tx]:
        """One short write transaction.

        ``durable``: the transaction guards a send (an IN_FLIGHT mark) or settles one (a
        resolution); under ``durability="full"`` it is on stable storage when the block exits.
        """
        ...

    @property
    def max_params(self) -> int:
        """Bound parameters one statement may carry."""
        ...

    def upsert_statements(self, rows: Sequence[Sequence[Any]]) -> list[Statement]:
        """Statements that upsert these ``steps`` rows (``statements.UPSERT_ROW`` parameters each)."""
        ...

    def apply(self, statements: Sequence[Statement], *, durable: bool) -> None:
        """Commit these statements as one write (``durable`` as for :meth:`write`); results unread."""
        ...

    def scratch(self) -> contextlib.AbstractContextManager[Tx]:
        """A transaction on the run's temporary tables only (no lock on the journal)."""
        ...

    def snapshot(self) -> contextlib.AbstractContextManager[Tx]:
        """A read-only transaction: its reads all see the journal as it was at its first."""
        ...

    def claim(self, job_id: str, *, runner: str | None, brief: bool = False) -> Claim:
        """The job's claim, at once, or :class:`~airflow_resumable.exceptions.JobBusyError`.

        ``brief`` claims (a resolution, a receipt-log fold) are held for one transaction; a runner
        finding one waits it out instead of failing.
        """
        ...

    def recover(self, job_id: str) -> None:
        """Commit what a dead runner of the job left outside the database (its receipt log)."""
        ...

    def receipt_log(self, job_id: str) -> ReceiptLog | None:
        """The job's receipt log, or None where every receipt rides with the next commit."""
        ...

    def seen_table_ddl(self, table: str) -> str:
        """A temporary table ``(n <ascending integer key>, item_id TEXT UNIQUE, digest TEXT)``."""
        ...


class EngineBase:
    """What both engines share: the durability setting, the commit counters, the generic writes."""

    location: str
    journal_id: str
    migrated_from: int | None = None

    def __init__(self, durability: Durability) -> None:
        self.durability: Durability = checked_durability(durability)
        self.commit_count = 0
        self.durable_commit_count = 0

    def write(self, *, durable: bool) -> contextlib.AbstractContextManager[Tx]:
        raise NotImplementedError

    @property
    def max_params(self) -> int:
        raise NotImplementedError

    def upsert_statements(self, rows: Sequence[Sequence[Any]]) -> list[Statement]:
        return sql.upsert_statements(rows, self.max_params)

    def apply(self, statements: Sequence[Statement], *, durable: bool) -> None:
        with self.write(durable=durable) as tx:
            for statement in statements:
                if statement.many:
                    tx.many(statement.sql, statement.params)
                else:
                    tx.run(statement.sql, statement.params)

    def recover(self, job_id: str) -> None:
        return None

    def receipt_log(self, job_id: str) -> ReceiptLog | None:
        return None
