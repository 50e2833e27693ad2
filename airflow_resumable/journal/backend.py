"""The seam between the journal's logic and the engine it runs on.

:class:`~airflow_resumable.journal.base.StepJournal` (the read, resolution and housekeeping API) and
:class:`~airflow_resumable.journal.jobrun.JobRun` (what the runner writes through) are written once,
against the small set of primitives below. Each engine supplies them: ``sqlite.SqliteJournal`` (a
file, ``flock`` claims, a receipt log beside the file) and ``postgres.PostgresJournal`` (a schema,
session advisory-lock claims). Nothing above this seam knows which one it talks to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol


class Statement(NamedTuple):
    """One statement of a write: ``params`` for one execution, or (``many``) a list of them."""

    sql: str
    params: Sequence[Any]
    many: bool = False


class Tx(Protocol):
    """One open transaction (or, for :meth:`~JournalBackend._scratch`, the run's scratch space)."""

    max_params: int  # bound parameters one statement may carry

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
    closed: bool

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    def _write(self, *, durable: bool) -> Any:
        """A context manager around one short write transaction, yielding a :class:`Tx`.

        ``durable``: the transaction guards a send (an IN_FLIGHT mark) or settles one (a
        resolution); under ``durability="full"`` it is on stable storage when the block exits.
        """
        ...

    _max_params: int  # bound parameters one statement may carry

    def _upsert_statements(self, rows: Sequence[Sequence[Any]]) -> list[Statement]:
        """Statements that upsert these ``steps`` rows (``statements.UPSERT_ROW`` parameters each)."""
        ...

    def _apply(self, statements: Sequence[Statement], *, durable: bool) -> None:
        """Commit these statements as one write (``durable`` as for :meth:`_write`); results unread."""
        ...

    def _scratch(self) -> Any:
        """A context manager yielding a :class:`Tx` on the run's temporary tables only (no lock)."""
        ...

    def _claim(self, job_id: str, *, runner: str | None, brief: bool = False) -> Claim:
        """The job's claim, at once, or :class:`~airflow_resumable.journal.errors.JobBusyError`.

        ``brief`` claims (a resolution, a receipt-log fold) are held for one transaction; a runner
        finding one waits it out instead of failing.
        """
        ...

    def _recover(self, job_id: str) -> None:
        """Commit what a dead runner of the job left outside the database (its receipt log)."""
        ...

    def _receipt_log(self, job_id: str) -> ReceiptLog | None:
        """The job's receipt log, or None where every receipt rides with the next commit."""
        ...

    def _seen_table_ddl(self, table: str) -> str:
        """A temporary table ``(n <ascending integer key>, item_id TEXT UNIQUE, digest TEXT)``."""
        ...
