"""The step journal: one SQLite file that remembers, per job, item and step, what was done.

This module owns every line of SQL and the schema. It imports nothing from Airflow.

Durability model
----------------
The connection runs WAL with ``synchronous=NORMAL``: every commit is written to the WAL before
``COMMIT`` returns (so it survives the process being killed) but not necessarily to the disk.
With ``durability="full"`` the journal additionally fsyncs the WAL file after every commit that
*guards a send* (the ``IN_FLIGHT`` mark of a side-effect step) and after every resolution, before
returning to the caller. Records that guard nothing (a local step's result, a send's ``SUCCEEDED``)
ride along with the next fsync: losing one of them to a power cut only makes the runner redo a
local step or verify a send again, never send twice.

Receipt log
-----------
A delivered send's receipt must survive the process being killed in whatever user code runs next,
but a SQLite commit for it would double the cost of every send. So the runner appends it to the
job's receipt log (``<journal>.locks/<job>.receipts``, one ``write``, no fsync) and commits it with
the next commit point. Opening the journal folds the log of any job whose runner is gone into the
steps it names - only rows still ``IN_FLIGHT`` with the same digest - and removes it.
"""

from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import json
import os
import socket
import sqlite3
import stat
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, Literal

from airflow_resumable._fs import network_location_reason

__all__ = [
    "SCHEMA_VERSION",
    "HeldReason",
    "HeldStep",
    "JobBusyError",
    "JobPrunedError",
    "JobRun",
    "JobSummary",
    "JournalCorruptError",
    "JournalError",
    "JournalLocationError",
    "JournalVersionError",
    "NotHeldError",
    "ResolutionError",
    "Resolution",
    "Status",
    "StepJournal",
    "StepRecord",
]

Durability = Literal["full", "normal"]


class Status(str, enum.Enum):
    IN_FLIGHT = "IN_FLIGHT"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    def __str__(self) -> str:
        return self.value


class HeldReason(str, enum.Enum):
    UNKNOWN_OUTCOME = "unknown_outcome"
    INPUT_CHANGED = "input_changed"

    def __str__(self) -> str:
        return self.value


# --------------------------------------------------------------------------------------- errors


class JournalError(Exception):
    """Base class of every error the journal raises."""


class JobBusyError(JournalError):
    """Another runner holds this job right now; nothing was sent."""

    holder = "holder unknown"  # who holds the job: pid, host, since when, which runner
    runner: str | None = None  # the holder's runner name, as it took the lock


class JobPrunedError(JournalError):
    """The job's history was pruned; running it again under the same job_id would re-send all."""


class JournalLocationError(JournalError):
    """The journal path is on a network or cloud-sync filesystem."""


class JournalCorruptError(JournalError):
    """The journal file is not a readable SQLite journal."""


class JournalVersionError(JournalError):
    """The journal was written by a newer version of this provider."""


class NotHeldError(JournalError, ValueError):
    """The step to resolve does not exist or is not held / unresolved."""


class ResolutionError(JournalError, ValueError):
    """A resolution was asked for with missing or malformed arguments."""


# -------------------------------------------------------------------------------------- records


@dataclass(frozen=True)
class StepRecord:
    job_id: str
    item_id: str
    step: str
    side_effect: bool
    status: Status
    digest: str
    receipt: str | None
    output: Any
    error_type: str | None
    held_reason: HeldReason | None
    new_digest: str | None
    attempts: int
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class HeldStep:
    job_id: str
    item_id: str
    step: str
    reason: HeldReason


@dataclass(frozen=True)
class JobSummary:
    job_id: str
    counts: Mapping[str, int]  # rows per status
    items: int
    held: int  # rows with a held reason
    unresolved: int  # side-effect rows neither SUCCEEDED nor held (e.g. left IN_FLIGHT by a crash)
    created_at: datetime
    updated_at: datetime
    pruned_at: datetime | None

    @property
    def settled(self) -> bool:
        return self.held == 0 and self.unresolved == 0


@dataclass(frozen=True)
class Resolution:
    id: int
    job_id: str
    item_id: str
    step: str
    decision: str
    receipt: str | None
    note: str
    resolved_by: str
    resolved_at: datetime
    previous_status: str | None
    previous_held_reason: str | None


def _ts(value: float) -> datetime:
    return datetime.fromtimestamp(value, tz=timezone.utc)


# --------------------------------------------------------------------------------------- schema

SCHEMA_VERSION = 3

_STEP_COLUMNS = (
    "job_id, item_id, step, side_effect, status, digest, receipt, output, error_type, "
    "held_reason, new_digest, attempts, created_at, updated_at"
)

# Each migration takes the schema from version N-1 to N. Never edit a released one: add another.
_MIGRATIONS: dict[int, tuple[str, ...]] = {
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
}

_OPEN_ROW = "(held_reason IS NOT NULL OR (side_effect = 1 AND status != 'SUCCEEDED'))"

_UPSERT_ROW = "(?, ?, ?, ?, ?, ?, ?, ?, ?, NULL, NULL, ?, ?, ?)"
_UPSERT_CONFLICT = """
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
    updated_at  = excluded.updated_at
"""
_UPSERT = f"INSERT INTO steps ({_STEP_COLUMNS}) VALUES {_UPSERT_ROW}{_UPSERT_CONFLICT}"
# Buffered rows are written as multi-row upserts of at most this many rows (one statement each):
# executemany would release and re-take the GIL per row, and sends on other threads want it.
UPSERT_ROWS_PER_STATEMENT = 250
_UPSERT_VALUES_PER_ROW = _UPSERT_ROW.count("?")


def _rows_per_statement(conn: sqlite3.Connection) -> int:
    # SQLite before 3.32 allows 999 variables per statement; ask the library we run on.
    limit = 999
    if hasattr(conn, "getlimit"):  # Python 3.11+
        limit = conn.getlimit(getattr(sqlite3, "SQLITE_LIMIT_VARIABLE_NUMBER", 9))
    return max(1, min(UPSERT_ROWS_PER_STATEMENT, limit // _UPSERT_VALUES_PER_ROW))


def _upsert_many(conn: sqlite3.Connection, rows: Sequence[tuple[Any, ...]]) -> None:
    size = _rows_per_statement(conn)
    for start in range(0, len(rows), size):
        part = rows[start:start + size]
        values = ",".join([_UPSERT_ROW] * len(part))
        conn.execute(f"INSERT INTO steps ({_STEP_COLUMNS}) VALUES {values}{_UPSERT_CONFLICT}",
                     [value for row in part for value in row])

_HOLD = """
UPDATE steps SET held_reason = ?, new_digest = ?, updated_at = ?
WHERE job_id = ? AND item_id = ? AND step = ?
"""

# A receipt from a dead runner's log settles only the very row it was logged for: a send still
# IN_FLIGHT for the same input, not held. Anything else has moved on (resolved, re-run) since.
_FOLD_RECEIPT = """
UPDATE steps SET status = 'SUCCEEDED', receipt = ?, output = ?, error_type = NULL, updated_at = ?
WHERE job_id = ? AND item_id = ? AND step = ? AND digest = ? AND side_effect = 1
  AND status = 'IN_FLIGHT' AND held_reason IS NULL
"""

RECEIPT_LOG_SUFFIX = ".receipts"
# Holders of a job lock that keep it only for one short transaction (see JobRun._take_lock).
_FOLD_RUNNER, _RESOLUTION_RUNNER = "receipt log fold", "resolution"
_BRIEF_HOLDERS = (_FOLD_RUNNER, _RESOLUTION_RUNNER)
FOLD_WAIT_SECONDS = 5.0

_TOUCH_JOB = """
INSERT INTO jobs (job_id, created_at, updated_at, last_runner) VALUES (?, ?, ?, ?)
ON CONFLICT (job_id) DO UPDATE SET updated_at = excluded.updated_at,
                                   last_runner = coalesce(excluded.last_runner, jobs.last_runner)
"""

# Rows looked up per query when the runner resumes (well under SQLite's variable limit).
LOOKUP_CHUNK = 500


def _record(row: sqlite3.Row | tuple[Any, ...]) -> StepRecord:
    return StepRecord(
        job_id=row[0],
        item_id=row[1],
        step=row[2],
        side_effect=bool(row[3]),
        status=Status(row[4]),
        digest=row[5],
        receipt=row[6],
        output=None if row[7] is None else json.loads(row[7]),
        error_type=row[8],
        held_reason=None if row[9] is None else HeldReason(row[9]),
        new_digest=row[10],
        attempts=row[11],
        created_at=_ts(row[12]),
        updated_at=_ts(row[13]),
    )


# ---------------------------------------------------------------------------------- the journal


class StepJournal:
    """A SQLite step journal on a local disk.

    :param path: the journal file; its directory is created ``0700`` and the file ``0600``.
    :param durability: ``"full"`` (default) fsyncs the ``IN_FLIGHT`` mark of every send before the
        send starts; ``"normal"`` is WAL + ``synchronous=NORMAL`` only: safe against a killed
        process, **not** against power loss or an OS crash.
    :param allow_network_filesystem: open a journal on NFS/SMB/sshfs/cloud-sync anyway. SQLite's WAL
        does not work there; only set this if you know the mount gives real POSIX locks and
        shared memory, and never share the file between hosts.
    :param busy_timeout: seconds a write waits for another task writing the same file.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        durability: Durability = "full",
        allow_network_filesystem: bool = False,
        busy_timeout: float = 30.0,
    ) -> None:
        if durability not in ("full", "normal"):
            raise ValueError(f"durability must be 'full' or 'normal', not {durability!r}")
        self.path = Path(path).expanduser().absolute()
        self.durability: Durability = durability
        self.fsync_count = 0  # fsyncs this journal asked for; benchmarks and tests read it
        self._wal_fd: int | None = None
        self._conn: sqlite3.Connection | None = None

        if not allow_network_filesystem:
            reason = network_location_reason(self.path)
            if reason:
                raise JournalLocationError(
                    f"journal path {self.path} is refused: {reason}, and SQLite's WAL mode does not "
                    "work there. Put the journal on a local disk ([resumable] journal_path), or pass "
                    "allow_network_filesystem=True if you are sure the mount is safe."
                )
        self._create_file()
        try:
            self._conn = sqlite3.connect(
                str(self.path), timeout=busy_timeout, isolation_level=None, check_same_thread=False
            )
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            self._refuse_foreign_database()
            mode = self._switch_to_wal(busy_timeout)
            if str(mode).lower() != "wal":
                raise JournalLocationError(
                    f"journal {self.path} could not be switched to WAL mode (got {mode!r}); "
                    "put it on a local disk."
                )
            self._conn.execute("PRAGMA synchronous = NORMAL")
            self._migrate()
            self.journal_id: str = self._conn.execute(
                "SELECT value FROM meta WHERE key = 'journal_id'"
            ).fetchone()[0]
        except sqlite3.DatabaseError as exc:
            self._close_quietly()
            raise self._corrupt(exc) from None
        except BaseException:
            self._close_quietly()
            raise
        self._tighten_permissions()
        try:
            self._fold_orphaned_receipt_logs()
        except BaseException:
            self._close_quietly()
            raise

    # -- opening ------------------------------------------------------------------------------

    def _create_file(self) -> None:
        directory = self.path.parent
        if not directory.exists():
            try:
                directory.mkdir(mode=0o700, parents=True)
                directory.chmod(0o700)  # mkdir's mode is filtered by the umask
            except OSError as exc:
                raise JournalError(
                    f"cannot create the journal directory {directory} ({type(exc).__name__}); "
                    "check the path and its permissions."
                ) from None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as exc:
            raise JournalError(
                f"cannot open the journal {self.path} ({type(exc).__name__}); check that the path is "
                "a writable file on a local disk."
            ) from None
        os.close(fd)

    def _tighten_permissions(self) -> None:
        # Only once the file is known to be a journal: a refused foreign file is left untouched.
        for name in (str(self.path), str(self.path) + "-wal", str(self.path) + "-shm"):
            with contextlib.suppress(OSError):
                info = os.stat(name)
                if stat.S_IMODE(info.st_mode) & 0o077 and info.st_uid == os.getuid():
                    os.chmod(name, 0o600)

    def _refuse_foreign_database(self) -> None:
        # Read-only questions first: a file that is not a journal must not be switched to WAL.
        conn = self._connection
        if conn.execute("PRAGMA user_version").fetchone()[0] == 0 and conn.execute(
            "SELECT count(*) FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'"
        ).fetchone()[0]:
            raise JournalCorruptError(
                f"{self.path} is a SQLite database but not a step journal (it has tables and no "
                "journal schema version). Point [resumable] journal_path at a file of its own."
            )

    def _switch_to_wal(self, busy_timeout: float) -> str:
        # Switching a new file to WAL needs an exclusive lock, and SQLite answers SQLITE_BUSY at
        # once (no busy handler) while another process opens the same file: retry until the timeout.
        deadline = time.monotonic() + busy_timeout
        while True:
            try:
                return str(self._connection.execute("PRAGMA journal_mode = WAL").fetchone()[0])
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.005)

    def _migrate(self) -> None:
        conn = self._connection
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise JournalVersionError(
                f"journal {self.path} has schema version {version}, but this airflow-provider-resumable "
                f"understands versions up to {SCHEMA_VERSION}: it was written by a newer release. "
                "Upgrade the provider on this worker; do not edit the file."
            )
        if version == SCHEMA_VERSION:
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Re-read under the write lock: another process may have migrated meanwhile.
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == 0 and conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                raise JournalCorruptError(
                    f"{self.path} is a SQLite database but not a step journal (it has tables and no "
                    "journal schema version). Point [resumable] journal_path at a file of its own."
                )
            for target in range(version + 1, SCHEMA_VERSION + 1):
                for statement in _MIGRATIONS[target]:
                    conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise

    @property
    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise JournalError(f"journal {self.path} is closed")
        return self._conn

    def _corrupt(self, exc: sqlite3.DatabaseError) -> JournalError:
        return JournalCorruptError(
            f"journal {self.path} is unreadable or corrupt ({type(exc).__name__}: "
            f"{'not a SQLite database' if 'not a database' in str(exc) else 'malformed'}). Nothing "
            "was sent. Move the file aside and restore it from a backup; do not delete it while "
            "items may be held."
        )

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._wal_fd is not None:
            os.close(self._wal_fd)
            self._wal_fd = None

    def _close_quietly(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __enter__(self) -> StepJournal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StepJournal({str(self.path)!r}, durability={self.durability!r})"

    # -- transactions -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _write(self, *, durable: bool) -> Iterator[sqlite3.Connection]:
        """One short write transaction; fsync'd afterwards when ``durable`` under full durability."""
        conn = self._connection
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
                raise JournalError(
                    f"journal {self.path} stayed locked by another writer past the busy timeout; "
                    "nothing was sent. Retry the task."
                ) from None
            if isinstance(exc, sqlite3.IntegrityError):
                raise
            raise self._corrupt(exc) from None
        if durable and self.durability == "full":
            self._sync_wal()

    def _sync_wal(self) -> None:
        # fsync works on the file, not on the descriptor: syncing our own descriptor of the -wal
        # file makes every frame SQLite wrote to it so far durable.
        if self._wal_fd is None:
            self._wal_fd = os.open(str(self.path) + "-wal", os.O_RDONLY)
            # The first time, also make the -wal file's directory entry durable.
            dir_fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        os.fsync(self._wal_fd)
        self.fsync_count += 1

    def _read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._connection.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as exc:
            raise self._corrupt(exc) from None

    # -- running a job ------------------------------------------------------------------------

    def open_job(self, job_id: str, *, runner: str | None = None) -> JobRun:
        """Take the one-runner lock of ``job_id`` (at once, or :class:`JobBusyError`)."""
        return JobRun(self, job_id, runner=runner)

    def has_job(self, job_id: str) -> bool:
        return bool(self._read("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)))

    def _lock_path(self, job_id: str) -> Path:
        name = hashlib.sha256(job_id.encode("utf-8")).hexdigest()[:40]
        return Path(str(self.path) + ".locks") / f"{name}.lock"

    def _receipt_log_path(self, job_id: str) -> Path:
        return self._lock_path(job_id).with_suffix(RECEIPT_LOG_SUFFIX)

    def _fold_orphaned_receipt_logs(self) -> None:
        """Commit what dead runners logged but had not committed yet (see "Receipt log")."""
        directory = Path(str(self.path) + ".locks")
        try:
            names = [n for n in os.listdir(directory) if n.endswith(RECEIPT_LOG_SUFFIX)]
        except FileNotFoundError:
            return
        for name in names:
            try:
                lock = _JobLock(directory / (name[: -len(RECEIPT_LOG_SUFFIX)] + ".lock"), "(receipt log)",
                                self.path, runner=_FOLD_RUNNER)
            except JobBusyError:
                continue  # its runner is alive: it commits its receipts itself
            try:
                self._fold_receipt_log(directory / name)
            finally:
                lock.release()

    def _fold_receipt_log(self, path: Path) -> None:
        """Fold one job's receipt log into its steps, then remove it. The caller holds the job lock."""
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return
        updates = []
        for line in data.split(b"\n"):
            try:
                job_id, item_id, step, digest, output, receipt, at = json.loads(line)
            except (ValueError, TypeError):
                continue  # a torn last line: that send stays IN_FLIGHT, to be verified
            updates.append((receipt, output, at, job_id, item_id, step, digest))
        if updates:
            with self._write(durable=True) as conn:
                conn.executemany(_FOLD_RECEIPT, updates)
        path.unlink(missing_ok=True)

    # -- read API -----------------------------------------------------------------------------

    def jobs(self) -> list[JobSummary]:
        """Every job with per-status row counts, newest first."""
        return self._job_summaries("", ())

    def job(self, job_id: str) -> JobSummary | None:
        found = self._job_summaries("WHERE j.job_id = ?", (job_id,))
        return found[0] if found else None

    def _job_summaries(self, where: str, params: Sequence[Any]) -> list[JobSummary]:
        rows = self._read(
            f"""SELECT j.job_id, j.created_at, j.updated_at, j.pruned_at,
                       count(s.step), count(DISTINCT s.item_id),
                       coalesce(sum(s.status = 'IN_FLIGHT'), 0),
                       coalesce(sum(s.status = 'SUCCEEDED'), 0),
                       coalesce(sum(s.status = 'FAILED'), 0),
                       coalesce(sum(s.held_reason IS NOT NULL), 0),
                       coalesce(sum(s.held_reason IS NULL AND s.side_effect = 1
                                    AND s.status != 'SUCCEEDED'), 0)
                FROM jobs j LEFT JOIN steps s ON s.job_id = j.job_id
                {where}
                GROUP BY j.job_id ORDER BY j.updated_at DESC""",
            params,
        )
        return [
            JobSummary(
                job_id=r[0],
                created_at=_ts(r[1]),
                updated_at=_ts(r[2]),
                pruned_at=None if r[3] is None else _ts(r[3]),
                counts={"IN_FLIGHT": r[6], "SUCCEEDED": r[7], "FAILED": r[8]},
                items=r[5],
                held=r[9],
                unresolved=r[10],
            )
            for r in rows
        ]

    def rows(self, job_id: str, item_id: str | None = None) -> list[StepRecord]:
        """The job's step rows (one item's when ``item_id`` is given)."""
        if item_id is None:
            found = self._read(
                f"SELECT {_STEP_COLUMNS} FROM steps WHERE job_id = ? ORDER BY item_id, created_at",
                (job_id,),
            )
        else:
            found = self._read(
                f"SELECT {_STEP_COLUMNS} FROM steps WHERE job_id = ? AND item_id = ? ORDER BY created_at",
                (job_id, item_id),
            )
        return [_record(r) for r in found]

    def held(self, job_id: str | None = None) -> list[HeldStep]:
        """Steps the runner held for a human, in one job or in all."""
        sql = "SELECT job_id, item_id, step, held_reason FROM steps WHERE held_reason IS NOT NULL"
        params: tuple[Any, ...] = ()
        if job_id is not None:
            sql += " AND job_id = ?"
            params = (job_id,)
        return [HeldStep(r[0], r[1], r[2], HeldReason(r[3])) for r in self._read(sql + " ORDER BY 1, 2", params)]

    def open_rows(self, job_id: str) -> list[StepRecord]:
        """Held rows plus side-effect rows not yet SUCCEEDED: what keeps a job from being settled."""
        return [
            _record(r)
            for r in self._read(
                f"SELECT {_STEP_COLUMNS} FROM steps WHERE job_id = ? AND {_OPEN_ROW} ORDER BY item_id",
                (job_id,),
            )
        ]

    def resolutions(self, job_id: str) -> list[Resolution]:
        """The append-only audit log of resolutions for a job, oldest first."""
        return [
            Resolution(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], _ts(r[8]), r[9], r[10])
            for r in self._read(
                """SELECT id, job_id, item_id, step, decision, receipt, note, resolved_by, resolved_at,
                          previous_status, previous_held_reason
                   FROM resolutions WHERE job_id = ? ORDER BY id""",
                (job_id,),
            )
        ]

    # -- resolution API (SPEC §5) -------------------------------------------------------------

    @staticmethod
    def _check_person(resolved_by: object, note: object) -> None:
        if not isinstance(resolved_by, str) or not resolved_by.strip():
            raise ResolutionError("resolved_by is required: say who made this decision")
        if not isinstance(note, str):
            raise ResolutionError("note must be a string")

    def resolve(
        self,
        job_id: str,
        item_id: str,
        step: str,
        *,
        delivered: bool,
        receipt: str | None = None,
        resolved_by: str,
        note: str = "",
    ) -> Resolution:
        """Settle a side-effect step whose outcome was unknown.

        ``delivered=True`` (with the receiver's ``receipt`` as evidence) marks it SUCCEEDED: it is
        never sent again. ``delivered=False`` means the receiver confirmed it never arrived: the row
        is cleared and the next run sends it once. If you cannot confirm either, do not call this.
        """
        self._check_person(resolved_by, note)
        if not isinstance(delivered, bool):
            raise ResolutionError("delivered must be True or False")
        if delivered and (not isinstance(receipt, str) or not receipt.strip()):
            raise ResolutionError(
                "delivered=True needs the receiver's receipt as evidence; if you cannot find one, "
                "leave the step held"
            )
        if receipt is not None and not isinstance(receipt, str):
            raise ResolutionError("receipt must be a string")
        with self._quiet_job(job_id), self._write(durable=True) as conn:
            found = conn.execute(
                "SELECT side_effect, status, held_reason FROM steps WHERE job_id = ? AND item_id = ? AND step = ?",
                (job_id, item_id, step),
            ).fetchone()
            if found is None:
                raise self._no_such_row(conn, job_id, item_id, step)
            side_effect, status, held_reason = found
            if not side_effect or status == Status.SUCCEEDED:
                raise NotHeldError(
                    f"{job_id} / {item_id} / {step} is {status}"
                    f"{'' if side_effect else ' (a local step)'}, not an unknown-outcome send; "
                    "there is nothing to resolve"
                    + (" (for a changed input use resolve_input_change)" if held_reason else "")
                )
            now = time.time()
            keep_reason = held_reason if held_reason == HeldReason.INPUT_CHANGED else None
            if delivered:
                conn.execute(
                    """UPDATE steps SET status = 'SUCCEEDED', receipt = ?, output = ?, error_type = NULL,
                              held_reason = ?, updated_at = ?
                       WHERE job_id = ? AND item_id = ? AND step = ?""",
                    (receipt, json.dumps(receipt), keep_reason, now, job_id, item_id, step),
                )
            else:
                conn.execute(
                    "DELETE FROM steps WHERE job_id = ? AND item_id = ? AND step = ?", (job_id, item_id, step)
                )
            return self._audit(
                conn, job_id, item_id, step, "delivered" if delivered else "not_delivered",
                receipt, note, resolved_by, now, status, held_reason,
            )

    def resolve_input_change(
        self, job_id: str, item_id: str, *, use_new_input: bool, resolved_by: str, note: str = ""
    ) -> Resolution:
        """Settle an item held because its input changed since it was journaled.

        ``use_new_input=False`` (keep previous): the new input is taken as already handled; the next
        run skips the item. ``use_new_input=True``: the item's rows are cleared and the next run
        processes the new input from scratch (its side effects are sent again).
        """
        self._check_person(resolved_by, note)
        if not isinstance(use_new_input, bool):
            raise ResolutionError("use_new_input must be True or False")
        with self._quiet_job(job_id), self._write(durable=True) as conn:
            found = conn.execute(
                """SELECT step, status, new_digest FROM steps
                   WHERE job_id = ? AND item_id = ? AND held_reason = 'input_changed'""",
                (job_id, item_id),
            ).fetchone()
            if found is None:
                raise self._no_such_row(conn, job_id, item_id, None)
            step, status, new_digest = found
            now = time.time()
            if use_new_input:
                conn.execute("DELETE FROM steps WHERE job_id = ? AND item_id = ?", (job_id, item_id))
            else:
                conn.execute(
                    """UPDATE steps SET digest = ?, new_digest = NULL, updated_at = ?,
                              held_reason = CASE WHEN held_reason = 'input_changed' THEN NULL
                                                 ELSE held_reason END
                       WHERE job_id = ? AND item_id = ?""",
                    (new_digest, now, job_id, item_id),
                )
            return self._audit(
                conn, job_id, item_id, step, "use_new_input" if use_new_input else "keep_previous_input",
                None, note, resolved_by, now, status, HeldReason.INPUT_CHANGED.value,
            )

    @contextlib.contextmanager
    def _quiet_job(self, job_id: str) -> Iterator[None]:
        """Hold the job's lock while resolving: never settle a row its running job is still writing.

        (A send resolved "not delivered" while it is in flight would lose its receipt to the delete.)
        """
        try:
            lock = _JobLock(self._lock_path(job_id), job_id, self.path, runner=_RESOLUTION_RUNNER)
        except JobBusyError as exc:
            busy = JobBusyError(
                f"job {job_id!r} is running right now ({exc.holder}); nothing was changed. Resolve "
                "its held items after the run ends."
            )
            busy.holder, busy.runner = exc.holder, exc.runner
            raise busy from None
        try:
            self._fold_receipt_log(self._receipt_log_path(job_id))
            yield
        finally:
            lock.release()

    def _no_such_row(self, conn: sqlite3.Connection, job_id: str, item_id: str, step: str | None) -> NotHeldError:
        if conn.execute("SELECT 1 FROM jobs WHERE job_id = ?", (job_id,)).fetchone() is None:
            return NotHeldError(f"unknown job {job_id!r} in journal {self.path}; check the job_id")
        if conn.execute(
            "SELECT 1 FROM steps WHERE job_id = ? AND item_id = ? LIMIT 1", (job_id, item_id)
        ).fetchone() is None:
            return NotHeldError(f"job {job_id!r} has no item {item_id!r}; check the item_id")
        if step is None:
            return NotHeldError(f"{job_id} / {item_id} is not held for an input change")
        return NotHeldError(f"item {item_id!r} of job {job_id!r} has no step {step!r}; check the step name")

    def _audit(
        self, conn: sqlite3.Connection, job_id: str, item_id: str, step: str, decision: str,
        receipt: str | None, note: str, resolved_by: str, now: float,
        previous_status: str | None, previous_held_reason: str | None,
    ) -> Resolution:
        cursor = conn.execute(
            """INSERT INTO resolutions (job_id, item_id, step, decision, receipt, note, resolved_by,
                                        resolved_at, previous_status, previous_held_reason)
               VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)""",
            (job_id, item_id, step, decision, receipt, note, resolved_by, now, previous_status,
             previous_held_reason),
        )
        conn.execute("UPDATE jobs SET updated_at = ? WHERE job_id = ?", (now, job_id))
        return Resolution(
            int(cursor.lastrowid or 0), job_id, item_id, step, decision, receipt, note, resolved_by,
            _ts(now), previous_status, previous_held_reason,
        )

    # -- housekeeping -------------------------------------------------------------------------

    def prune(self, older_than: timedelta) -> list[str]:
        """Forget finished jobs not updated for ``older_than``; returns the pruned job ids.

        A job is finished when every row is SUCCEEDED and nothing is held. A job with held or
        unresolved rows, or one running right now, is never pruned. A pruned job leaves a tombstone:
        running it again under the same job_id is refused (it would re-send everything).
        """
        if not isinstance(older_than, timedelta) or older_than < timedelta(0):
            raise ValueError("older_than must be a non-negative datetime.timedelta, e.g. timedelta(days=30)")
        cutoff = time.time() - older_than.total_seconds()
        candidates = [
            r[0]
            for r in self._read(
                """SELECT job_id FROM jobs j WHERE pruned_at IS NULL AND updated_at < ?
                   AND NOT EXISTS (SELECT 1 FROM steps s WHERE s.job_id = j.job_id
                                   AND (s.status != 'SUCCEEDED' OR s.held_reason IS NOT NULL))""",
                (cutoff,),
            )
        ]
        pruned: list[str] = []
        for job_id in candidates:
            try:
                lock = _JobLock(self._lock_path(job_id), job_id, self.path, runner="prune")
            except JobBusyError:
                continue  # running right now: not finished after all
            try:
                with self._write(durable=True) as conn:
                    # Re-check inside the transaction: a run may have finished in between.
                    still_finished = conn.execute(
                        """SELECT NOT EXISTS (SELECT 1 FROM steps WHERE job_id = ?
                                              AND (status != 'SUCCEEDED' OR held_reason IS NOT NULL))""",
                        (job_id,),
                    ).fetchone()[0]
                    if not still_finished:
                        continue
                    conn.execute("DELETE FROM steps WHERE job_id = ?", (job_id,))
                    conn.execute("UPDATE jobs SET pruned_at = ? WHERE job_id = ?", (time.time(), job_id))
                pruned.append(job_id)
            finally:
                lock.release(remove=True)
        return pruned


# --------------------------------------------------------------------------------- one-runner lock


class _JobLock:
    """An exclusive ``flock`` on a per-job lock file.

    The kernel drops a flock when its process dies (SIGKILL included), so a lock left by a dead
    runner never needs manual cleanup: the next runner simply gets it.
    """

    def __init__(self, path: Path, job_id: str, journal_path: Path, *, runner: str | None) -> None:
        if not path.parent.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.path = path
        while True:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder, holder_runner = self._holder()
                os.close(self._fd)
                busy = JobBusyError(
                    f"job {job_id!r} is already running ({holder}, journal {journal_path}). "
                    "Nothing was sent. Wait for that run to finish or stop it; two runs of one job "
                    "would send items twice."
                )
                busy.holder, busy.runner = holder, holder_runner
                raise busy from None
            except BaseException:
                os.close(self._fd)
                raise
            # prune() unlinks lock files; a lock on an unlinked inode would not exclude anyone.
            try:
                if os.fstat(self._fd).st_ino == os.stat(path).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(self._fd)
        info = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "runner": runner}
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, json.dumps(info).encode("utf-8"), 0)

    def _holder(self) -> tuple[str, str | None]:
        """Who holds the lock, for messages, and the runner name it gave."""
        try:
            info = json.loads(os.pread(self._fd, 4096, 0) or b"{}")
            since = _ts(float(info["since"])).strftime("%Y-%m-%d %H:%M:%S UTC")
            who = f"pid {info['pid']} on {info['host']} since {since}"
            runner = info.get("runner")
            return who + (f", {runner}" if runner else ""), runner
        except (ValueError, KeyError, TypeError, OSError):
            return "holder unknown", None

    def release(self, *, remove: bool = False) -> None:
        if self._fd < 0:
            return
        if remove:
            # Unlink while still holding the lock so no other runner holds a lock on a dead inode.
            with contextlib.suppress(OSError):
                self.path.unlink()
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = -1


# ------------------------------------------------------------------------------- the writer side


class JobRun:
    """What a runner holds while it runs one job: the job's lock and a buffer of pending records.

    Records are buffered and written in one short transaction at the next commit point, so no
    write transaction stays open while user code runs (other jobs sharing the file never wait on
    ours). The runner makes ``IN_FLIGHT`` marks commit points: it calls :meth:`flush` with
    ``durable=True`` after :meth:`mark_in_flight` and before the send starts, so the mark is
    committed - and under full durability fsync'd - together with everything buffered. Several
    marks buffered before one such flush share its fsync (group commit).
    """

    # Commit buffered records at least this often even if no send comes along.
    FLUSH_ROWS = 1000
    FLUSH_SECONDS = 1.0

    def __init__(self, journal: StepJournal, job_id: str, *, runner: str | None) -> None:
        self.journal = journal
        self.job_id = job_id
        self._pending: list[tuple[str, tuple[Any, ...]]] = []
        self._last_flush = time.monotonic()
        self._lock = self._take_lock(journal, job_id, runner)
        try:
            found = journal._read("SELECT pruned_at FROM jobs WHERE job_id = ?", (job_id,))
            if found and found[0][0] is not None:
                raise JobPrunedError(
                    f"job {job_id!r} was pruned from journal {journal.path} on "
                    f"{_ts(found[0][0]):%Y-%m-%d}; its history is gone, so running it again would "
                    "re-send every item. Use a new job_id only if sending everything again is intended."
                )
            # Every item id of this run (to refuse a repeated id across chunks without holding a
            # million ids in memory) with its digest; the rows after _chunk_start are the current chunk.
            self._seen_table = f"seen_{uuid.uuid4().hex}"
            journal._connection.execute(
                f"CREATE TEMP TABLE {self._seen_table} (item_id TEXT NOT NULL UNIQUE, digest TEXT NOT NULL)"
            )
            # A job with no rows yet cannot have finished items: its first run skips the bulk check.
            self._new_job = not journal._read("SELECT 1 FROM steps WHERE job_id = ? LIMIT 1", (job_id,))
            # A previous run of this job that died left its receipts here: commit them before deciding.
            self._receipt_log = journal._receipt_log_path(job_id)
            journal._fold_receipt_log(self._receipt_log)
        except BaseException:
            self._lock.release()
            raise
        self._chunk_start = 0
        self._chunk_ids: list[str] = []
        self._last_touch = 0.0
        self._receipt_fd: int | None = None
        self._receipt_bytes = 0
        self._receipts_unwritten: list[bytes] = []
        self._flush_failed = False
        # The jobs row is written with the first flushed record, so a run refused before it
        # touched anything (bad input) leaves the journal exactly as it was.
        self._runner = runner
        self._flushed = False

    @staticmethod
    def _take_lock(journal: StepJournal, job_id: str, runner: str | None) -> _JobLock:
        # Another process opening the journal may hold the lock for a moment to fold this job's
        # receipt log (or to resolve one of its items): wait that out rather than fail the try.
        deadline = time.monotonic() + FOLD_WAIT_SECONDS
        while True:
            try:
                return _JobLock(journal._lock_path(job_id), job_id, journal.path, runner=runner)
            except JobBusyError as exc:
                if exc.runner not in _BRIEF_HOLDERS or time.monotonic() >= deadline:
                    raise
                time.sleep(0.01)

    # -- lookups --------------------------------------------------------------------------------

    def lookup(self, item_ids: Sequence[str]) -> dict[str, dict[str, tuple[Any, ...]]]:
        """Rows of these items, as ``{item_id: {step: (status, digest, output_json, held_reason)}}``."""
        found: dict[str, dict[str, tuple[Any, ...]]] = {}
        if self._new_job:
            return found  # ids are unique within a run: only this run could have written them
        for start in range(0, len(item_ids), LOOKUP_CHUNK):
            part = item_ids[start:start + LOOKUP_CHUNK]
            marks = ",".join("?" * len(part))
            for item_id, step, status, digest, output, held_reason in self.journal._read(
                f"""SELECT item_id, step, status, digest, output, held_reason FROM steps
                    WHERE job_id = ? AND item_id IN ({marks})""",
                (self.job_id, *part),
            ):
                found.setdefault(item_id, {})[step] = (status, digest, output, held_reason)
        return found

    def admit(self, chunk: Sequence[tuple[str, str]]) -> list[str]:
        """Take the next chunk's ``(item_id, digest)`` pairs; return ids an earlier chunk already had.

        When nothing is repeated the chunk becomes the current one for :meth:`unfinished`.
        """
        conn = self.journal._connection
        row = conn.execute(f"SELECT max(rowid) FROM temp.{self._seen_table}").fetchone()
        start = row[0] or 0
        before = conn.total_changes
        # One transaction for the chunk: row by row, each insert would be a transaction of the temp
        # database of its own. It takes no lock on the journal file itself.
        conn.execute("BEGIN")
        try:
            conn.executemany(f"INSERT OR IGNORE INTO temp.{self._seen_table} (item_id, digest) VALUES (?, ?)", chunk)
        finally:
            conn.execute("COMMIT")
        if conn.total_changes - before != len(chunk):
            conn.execute(f"DELETE FROM temp.{self._seen_table} WHERE rowid > ?", (start,))
            ids = [item_id for item_id, _ in chunk]
            marks = ",".join("?" * len(ids))
            return [r[0] for r in conn.execute(
                f"SELECT item_id FROM temp.{self._seen_table} WHERE item_id IN ({marks})", ids
            )]
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
        marks = ",".join("?" * len(steps))
        return {
            r[0]
            for r in self.journal._read(
                f"""SELECT c.item_id FROM temp.{self._seen_table} c
                    WHERE c.rowid > ? AND ? != (
                        SELECT count(*) FROM steps s
                        WHERE s.job_id = ? AND s.item_id = c.item_id AND s.step IN ({marks})
                          AND s.status = 'SUCCEEDED' AND s.digest = c.digest AND s.held_reason IS NULL)""",
                (self._chunk_start, len(steps), self.job_id, *steps),
            )
        }

    # -- records --------------------------------------------------------------------------------

    def _row(
        self, item_id: str, step: str, side_effect: bool, status: Status, digest: str, *,
        receipt: str | None = None, output: str | None = None, error_type: str | None = None,
        attempts: int = 0,
    ) -> tuple[str, tuple[Any, ...]]:
        now = time.time()
        return _UPSERT, (
            self.job_id, item_id, step, int(side_effect), status.value, digest, receipt, output,
            error_type, attempts, now, now,
        )

    def mark_in_flight(self, item_id: str, step: str, digest: str) -> None:
        """Buffer the IN_FLIGHT mark of a send; ``flush(durable=True)`` it *before* the send starts."""
        self._pending.append(self._row(item_id, step, True, Status.IN_FLIGHT, digest, attempts=1))

    def mark_succeeded(
        self, item_id: str, step: str, digest: str, *, side_effect: bool, output: str,
        receipt: str | None, verified: bool = False, log_receipt: bool = False,
    ) -> None:
        """Buffer a SUCCEEDED row; with ``log_receipt``, :meth:`write_receipts` puts the send's
        receipt in the receipt log, so that it survives the process dying before the next commit."""
        # A local step has no IN_FLIGHT row of its own (it is re-run whatever its state), so its
        # attempt is counted here; a send's attempt was counted by its IN_FLIGHT mark.
        attempts = 0 if side_effect else 1
        self._pending.append(
            self._row(item_id, step, side_effect, Status.SUCCEEDED, digest, receipt=receipt,
                      output=output, attempts=attempts)
        )
        if log_receipt:
            line = json.dumps([self.job_id, item_id, step, digest, output, receipt, time.time()],
                              ensure_ascii=False, separators=(",", ":"))
            self._receipts_unwritten.append(line.encode("utf-8") + b"\n")
        self._maybe_flush()

    # A log past this size is emptied after the next commit (everything in it is committed then).
    RECEIPT_LOG_LIMIT = 1 << 20

    def write_receipts(self) -> None:
        """Append the receipts recorded since the last commit to the receipt log: call it before
        any further user code runs (one write, no fsync)."""
        if not self._receipts_unwritten:
            return
        if self._receipt_fd is None:
            self._receipt_fd = os.open(self._receipt_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        data = b"".join(self._receipts_unwritten)
        self._receipts_unwritten.clear()
        os.write(self._receipt_fd, data)  # one write: a kill leaves whole lines and at most one torn
        self._receipt_bytes += len(data)

    def mark_failed(self, item_id: str, step: str, digest: str, *, side_effect: bool, error_type: str) -> None:
        self._pending.append(
            self._row(item_id, step, side_effect, Status.FAILED, digest, error_type=error_type,
                      attempts=0 if side_effect else 1)
        )
        self.flush(durable=False)

    def hold(self, item_id: str, step: str, reason: HeldReason, *, new_digest: str | None = None) -> None:
        self._pending.append((_HOLD, (reason.value, new_digest, time.time(), self.job_id, item_id, step)))
        self._maybe_flush()

    def release_hold(self, item_id: str, step: str) -> None:
        """The input went back to what was journaled: the input_changed hold no longer applies."""
        self._pending.append((_HOLD, (None, None, time.time(), self.job_id, item_id, step)))
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if len(self._pending) >= self.FLUSH_ROWS or time.monotonic() - self._last_flush >= self.FLUSH_SECONDS:
            self.flush(durable=False)

    def flush(self, *, durable: bool = False) -> None:
        if not self._pending:
            return
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
            # Nothing was written. Keep the records (a delivered send's SUCCEEDED among them) for
            # the next flush - close() flushes once more - but not the IN_FLIGHT marks: a mark is
            # buffered just before its send, and that send will not start now.
            kept = [r for r in records if not (r[0] is _UPSERT and r[1][4] == Status.IN_FLIGHT.value)]
            self._pending = kept + self._pending
            self._flush_failed = True
            raise
        self._receipts_unwritten.clear()  # committed: the log need not hear of them
        self._last_flush = time.monotonic()
        if touch:
            self._last_touch = now
        self._flushed = True
        if self._receipt_fd is not None and self._receipt_bytes > self.RECEIPT_LOG_LIMIT:
            os.ftruncate(self._receipt_fd, 0)  # all of it was in the transaction just committed
            self._receipt_bytes = 0

    def _touch(self, now: float) -> tuple[str, tuple[Any, ...]]:
        return _TOUCH_JOB, (self.job_id, now, now, self._runner)

    def _commit(self, pending: list[tuple[str, tuple[Any, ...]]], durable: bool) -> None:
        with self.journal._write(durable=durable) as conn:
            # Consecutive records of one kind go in one statement (upserts) or one executemany.
            start = 0
            while start < len(pending):
                sql = pending[start][0]
                end = start
                while end < len(pending) and pending[end][0] == sql:
                    end += 1
                if sql is _UPSERT:
                    _upsert_many(conn, [params for _, params in pending[start:end]])
                else:
                    conn.executemany(sql, [params for _, params in pending[start:end]])
                start = end

    def close(self) -> None:
        try:
            if self.journal._conn is not None:
                if self._pending or self._flushed:
                    self._pending.append(self._touch(time.time()))  # the job's last update: this run's end
                self.flush(durable=False)
                # Every receipt is committed now; a failed flush above keeps the log for the next
                # open to fold. After an earlier failed flush, fold it anyway (harmless if done).
                if self._flush_failed:
                    self.journal._fold_receipt_log(self._receipt_log)
                self._receipt_log.unlink(missing_ok=True)
                with contextlib.suppress(sqlite3.Error):
                    self.journal._connection.execute(f"DROP TABLE IF EXISTS temp.{self._seen_table}")
        finally:
            if self._receipt_fd is not None:
                os.close(self._receipt_fd)
                self._receipt_fd = None
            self._lock.release()

    def __enter__(self) -> JobRun:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None and not self._flushed:
            # A run that finished without writing a row (an empty batch) is still remembered, so
            # the wrong-worker guard knows this journal has seen the job.
            self._pending.append(self._touch(time.time()))
        self.close()
