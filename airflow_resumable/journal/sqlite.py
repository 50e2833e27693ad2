"""The embedded engine: one SQLite file on the worker's local disk.

Durability
----------
The connection runs WAL with ``synchronous=NORMAL``: every commit is written to the WAL before
``COMMIT`` returns (so it survives the process being killed) but not necessarily to the disk.
With ``durability="full"`` the journal additionally fsyncs the WAL file after every commit that
*guards a send* (the ``IN_FLIGHT`` mark of a side-effect step) and after every resolution, before
returning to the caller. Records that guard nothing (a local step's result, a send's ``SUCCEEDED``)
ride along with the next fsync: losing one of them to a power cut only makes the runner redo a
local step or verify a send again, never send twice.

Claims
------
One runner per job: an exclusive ``flock`` on ``<journal>.locks/<job>.lock``. The kernel drops it
when its process dies (SIGKILL included), so a dead runner's claim never needs manual cleanup.

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
import errno
import fcntl
import hashlib
import json
import math
import os
import socket
import sqlite3
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from airflow_resumable._fs import network_location_reason
from airflow_resumable.exceptions import (
    JobBusyError,
    JournalCorruptError,
    JournalDiskFullError,
    JournalError,
    JournalLocationError,
    JournalVersionError,
)
from airflow_resumable.journal import statements as sql
from airflow_resumable.journal.backend import FOLD_RUNNER, Durability, EngineBase
from airflow_resumable.journal.records import ts
from airflow_resumable.journal.schema import SCHEMA_VERSION, SQLITE_MIGRATIONS
from airflow_resumable.journal.statements import Statement

RECEIPT_LOG_SUFFIX = ".receipts"
_CREATING = threading.Lock()  # journal files are created one at a time in a process (see _create_file)


def _variable_limit(conn: sqlite3.Connection) -> int:
    limit = 999  # SQLite before 3.32; ask the library we run on where we can
    if hasattr(conn, "getlimit"):  # Python 3.11+
        limit = conn.getlimit(getattr(sqlite3, "SQLITE_LIMIT_VARIABLE_NUMBER", 9))
    return int(limit)


class SqliteTx:
    """A :class:`~airflow_resumable.journal.backend.Tx` on a sqlite3 connection."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    @property
    def max_params(self) -> int:
        return _variable_limit(self.conn)

    def one(self, sql: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self.conn.execute(sql, params).fetchone()
        return row

    def all(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self.conn.execute(sql, params).fetchall()

    def run(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self.conn.execute(sql, params).rowcount

    def many(self, sql: str, rows: Sequence[Sequence[Any]]) -> int:
        return self.conn.executemany(sql, rows).rowcount

    def insert_id(self, sql: str, params: Sequence[Any]) -> int:
        return int(self.conn.execute(sql, params).lastrowid or 0)


# Linux's id of the current boot of the host (a new one after every reboot).
BOOT_ID = "/proc/sys/kernel/random/boot_id"


class SqliteBackend(EngineBase):
    """The engine of a SQLite step journal on a local disk.

    :param path: the journal file; its directory is created ``0700`` and the file ``0600``.
    :param durability: ``"full"`` (default) fsyncs the ``IN_FLIGHT`` mark of every send before the
        send starts; ``"normal"`` is WAL + ``synchronous=NORMAL`` only: safe against a killed
        process, **not** against power loss or an OS crash.
    :param allow_network_filesystem: open a journal on NFS/SMB/sshfs/cloud-sync anyway. SQLite's WAL
        does not work there; only set this if you know the mount gives real POSIX locks and
        shared memory, and never share the file between hosts.
    :param busy_timeout: seconds a write waits for another task writing the same file.
    """

    kind = "sqlite"
    shared = False
    max_key_bytes: int | None = None
    next_job_no = "(SELECT coalesce(max(job_no), 0) + 1 FROM jobs)"  # writers take turns: no two get one number
    compacted_partitions = False
    digest_hex = "lower(hex({}))"
    # Given job_id = ?, SQLite's planner walks the job's rows in the primary key rather than the
    # partial index of held steps (it keeps no table sizes): a whole job of 100,000 items read for a
    # page of five held steps. The index is named.
    held_steps = "steps INDEXED BY steps_held"

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        durability: Durability = "full",
        allow_network_filesystem: bool = False,
        busy_timeout: float = 30.0,
        schema: str | None = None,
        claim_timeout: float | None = None,
        connect_timeout: float | None = None,
        readonly: bool = False,
        migrate: bool = False,
    ) -> None:
        # schema, claim_timeout and connect_timeout belong to the PostgreSQL engine: accepted (a
        # configuration may name them for either engine) and unused here. A SQLite journal belongs to
        # one worker, which moves it to its release's schema when it opens it (migrate or not).
        super().__init__(durability)
        # The file itself, not the path as written: the job locks live next to it, and two paths to
        # one file (a symlink, "a/../a", another relative path) must meet at the same locks.
        self.path = Path(path).expanduser().resolve()
        self.location = str(self.path)
        self.fsync_count = 0  # fsyncs this journal asked for; benchmarks and tests read it
        self._wal_fd: int | None = None
        self._conn: sqlite3.Connection | None = None

        if not allow_network_filesystem:
            reason = network_location_reason(self.path)
            if reason:
                raise JournalLocationError(
                    f"journal path {self.path} is refused: {reason}, and SQLite's WAL mode does not "
                    "work there. Put the journal on a local disk ([resumable] journal_path), use a "
                    "shared journal on PostgreSQL ([resumable] journal_conn_id), or pass "
                    "allow_network_filesystem=True ([resumable] allow_network_filesystem) if you are sure the "
                    "mount is safe."
                )
        self._create_file()
        try:
            try:
                self._connect(busy_timeout, private_index=False)
            except sqlite3.OperationalError as exc:
                if not (readonly and self._is_disk_full(exc)):
                    raise
                # A full disk has no room for the shared-memory index (-shm) that WAL readers share:
                # this reader keeps a private one in memory instead (exclusive locking mode, held for
                # the moment the reader is open; writers are failing on the full disk anyway).
                self._close_quietly()
                self._connect(busy_timeout, private_index=True)
        except sqlite3.DatabaseError as exc:
            self._close_quietly()
            raise self._corrupt(exc) from None
        except BaseException:
            self._close_quietly()
            raise
        self._tighten_permissions()
        if readonly:  # a reader (the UI page, the CLI's read commands) writes nothing: no fold
            return
        try:
            self._fold_orphaned_receipt_logs()
        except BaseException:
            self._close_quietly()
            raise

    def _connect(self, busy_timeout: float, *, private_index: bool) -> None:
        """Connect, check the file is a journal in WAL mode, migrate it, read its id."""
        self._conn = sqlite3.connect(
            str(self.path), timeout=busy_timeout, isolation_level=None, check_same_thread=False
        )
        if private_index:
            self._conn.execute("PRAGMA locking_mode = EXCLUSIVE")
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
        self.journal_id = self._conn.execute(sql.JOURNAL_ID).fetchone()[0]

    def _is_disk_full(self, exc: sqlite3.DatabaseError) -> bool:
        """SQLITE_FULL, or an I/O error (e.g. no room to size the -shm file) on a disk with no room left."""
        code = getattr(exc, "sqlite_errorcode", None)
        if code == SQLITE_FULL or "disk is full" in str(exc):
            return True
        if code is None or code & 0xFF != SQLITE_IOERR:
            return False
        try:
            info = os.statvfs(self.path.parent)
        except OSError:
            return False
        return info.f_bavail * info.f_frsize < NEARLY_FULL_BYTES

    # -- opening ------------------------------------------------------------------------------

    def _create_file(self) -> None:
        directory = self.path.parent
        if not directory.exists():
            try:
                directory.mkdir(mode=0o700, parents=True)
                directory.chmod(0o700)  # mkdir's mode is filtered by the umask
            except FileExistsError:
                pass  # another process made it meanwhile (or a file is in the way: the open below says so)
            except OSError as exc:
                if _is_enospc(exc):
                    raise self._disk_full("ENOSPC") from None
                raise JournalError(
                    f"cannot create the journal directory {directory} ({type(exc).__name__}); "
                    "check the path and its permissions."
                ) from None
        # Never a descriptor of ours on a journal that exists: closing any descriptor of a file drops
        # every POSIX lock this process holds on it, SQLite's included. Another journal open on the
        # file in this process would lose its shared lock, and the next process to close its
        # connection would take itself for the last one, checkpoint and delete the -wal file under
        # that journal: what it wrote from then on would be seen by no other process, and lost
        # with it. A new file has no lock of this process yet (creations take turns).
        try:
            with _CREATING:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.close(fd)
        except FileExistsError:
            pass
        except OSError as exc:
            if _is_enospc(exc):
                raise self._disk_full("ENOSPC") from None
            raise self._unopenable(type(exc).__name__) from None
        try:
            info = os.stat(self.path)
        except OSError as exc:
            raise self._unopenable(type(exc).__name__) from None
        if stat.S_ISDIR(info.st_mode):
            raise self._unopenable("IsADirectoryError")
        if not os.access(self.path, os.R_OK | os.W_OK):
            raise self._unopenable("PermissionError")
        links = info.st_nlink
        if links > 1:
            # Another name for this file would get its own locks and its own -wal file: refused.
            raise JournalLocationError(
                f"journal {self.path} has {links} hard links; open it through one path only (its job locks and "
                "WAL file are kept next to the name it is opened by)"
            )

    def _unopenable(self, why: str) -> JournalError:
        return JournalError(
            f"cannot open the journal {self.path} ({why}); check that the path is a writable file on a local disk."
        )

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
        # One statement, so one snapshot: another process may be creating the journal right now, and
        # "version 0" from before its commit with "has tables" from after it is no foreign database.
        version, tables = conn.execute(
            "SELECT (SELECT user_version FROM pragma_user_version), "
            "(SELECT count(*) FROM sqlite_master WHERE name NOT LIKE 'sqlite_%')"
        ).fetchone()
        if version == 0 and tables:
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
        self.migrated_from = version or None
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
                for statement in SQLITE_MIGRATIONS[target]:
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

    @property
    def closed(self) -> bool:
        return self._conn is None

    def _disk_full(self, what: str) -> JournalDiskFullError:
        return disk_full_error(self.path, what)

    def _corrupt(self, exc: sqlite3.DatabaseError) -> JournalError:
        if self._is_disk_full(exc):
            return self._disk_full(getattr(exc, "sqlite_errorname", None) or "SQLITE_FULL")
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

    # -- transactions -------------------------------------------------------------------------

    @contextlib.contextmanager
    def write(self, *, durable: bool) -> Iterator[SqliteTx]:
        """One short write transaction; fsync'd afterwards when ``durable`` under full durability."""
        conn = self._connection
        try:
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield SqliteTx(conn)
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            raise self._write_error(exc) from None
        self._committed(durable)

    def apply(self, statements: Sequence[Statement], *, durable: bool) -> None:
        conn = self._connection
        if len(statements) != 1 or statements[0].many or conn.in_transaction:
            super().apply(statements, durable=durable)
            return
        # A runner's usual commit: one multi-row upsert. One statement is a transaction of its own
        # (SQLite's autocommit): it takes the write lock as it starts, as BEGIN IMMEDIATE would, and
        # commits or rolls back whole. Two statements fewer - and, with sends running on other threads,
        # two fewer waits for the GIL, which every statement gives up while SQLite works.
        try:
            conn.execute(statements[0].sql, statements[0].params)
        except sqlite3.DatabaseError as exc:
            raise self._write_error(exc) from None
        self._committed(durable)

    def _write_error(self, exc: sqlite3.DatabaseError) -> Exception:
        if isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc):
            return JournalError(
                f"journal {self.path} stayed locked by another writer past the busy timeout; "
                "nothing was sent. Retry the task."
            )
        if isinstance(exc, sqlite3.IntegrityError):
            return exc
        return self._corrupt(exc)

    def _committed(self, durable: bool) -> None:
        self.commit_count += 1
        if durable and self.durability == "full":
            self._sync_wal()
            self.durable_commit_count += 1

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[SqliteTx]:
        # A deferred transaction reads one snapshot of the WAL from its first read on (no lock taken).
        conn = self._connection
        try:
            conn.execute("BEGIN")
            try:
                yield SqliteTx(conn)
            finally:
                conn.execute("COMMIT")
        except sqlite3.DatabaseError as exc:
            raise self._corrupt(exc) from None

    @contextlib.contextmanager
    def scratch(self) -> Iterator[SqliteTx]:
        # One transaction of the temporary database: it takes no lock on the journal file itself.
        conn = self._connection
        conn.execute("BEGIN")
        try:
            yield SqliteTx(conn)
        finally:
            conn.execute("COMMIT")

    @property
    def max_params(self) -> int:
        return _variable_limit(self._connection)

    def seen_table_ddl(self, table: str) -> str:
        return f"CREATE TEMP TABLE {table} (n INTEGER PRIMARY KEY, item_id TEXT NOT NULL UNIQUE, digest TEXT NOT NULL)"

    def _sync_wal(self) -> None:
        # fsync works on the file, not on the descriptor: syncing our own descriptor of the -wal
        # file makes every frame SQLite wrote to it so far durable. fdatasync where there is one, as
        # SQLite's own synchronous=FULL does: the frames and the file's size, without its times (a WAL
        # reused from its start after a checkpoint keeps its size, so most syncs write no inode).
        try:
            if self._wal_fd is None:
                self._wal_fd = os.open(str(self.path) + "-wal", os.O_RDONLY)
                # The first time, also make the -wal file's directory entry durable.
                dir_fd = os.open(self.path.parent, os.O_RDONLY)
                try:
                    os.fsync(dir_fd)
                finally:
                    os.close(dir_fd)
            getattr(os, "fdatasync", os.fsync)(self._wal_fd)  # macOS has no fdatasync
        except OSError as exc:
            if _is_enospc(exc):
                raise self._disk_full("ENOSPC on fsync") from None
            raise
        self.fsync_count += 1

    def incarnation(self) -> str:
        """The host's boot and the file's number: a reboot (a crash can drop commits not yet synced)
        changes it, and so does a file put in the journal's place under another number (a restore may reuse
        the old number: the count, not this, catches a restore)."""
        try:
            with open(BOOT_ID, encoding="ascii") as f:
                boot = f.read().strip()
        except OSError:  # not Linux: the boot is unknown, so every open window is verified
            boot = "unknown"
        st = os.stat(self.path)
        return f"sqlite:{boot}:{st.st_dev}:{st.st_ino}"

    def read(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._connection.execute(sql, params).fetchall()
        except sqlite3.DatabaseError as exc:
            raise self._corrupt(exc) from None

    # -- claims and receipt logs --------------------------------------------------------------

    def _lock_path(self, job_id: str) -> Path:
        name = hashlib.sha256(job_id.encode("utf-8")).hexdigest()[:40]
        return Path(str(self.path) + ".locks") / f"{name}.lock"

    def _receipt_log_path(self, job_id: str) -> Path:
        return self._lock_path(job_id).with_suffix(RECEIPT_LOG_SUFFIX)

    def claim(self, job_id: str, *, runner: str | None, brief: bool = False) -> JobLock:
        return JobLock(self._lock_path(job_id), job_id, self.path, runner=runner)

    def recover(self, job_id: str) -> None:
        self._fold_receipt_log(self._receipt_log_path(job_id))

    def receipt_log(self, job_id: str) -> FileReceiptLog:
        return FileReceiptLog(self._receipt_log_path(job_id))

    def _fold_orphaned_receipt_logs(self) -> None:
        """Commit what dead runners logged but had not committed yet (see "Receipt log")."""
        directory = Path(str(self.path) + ".locks")
        try:
            names = [n for n in os.listdir(directory) if n.endswith(RECEIPT_LOG_SUFFIX)]
        except FileNotFoundError:
            return
        for name in names:
            try:
                lock = JobLock(directory / (name[: -len(RECEIPT_LOG_SUFFIX)] + ".lock"), "(receipt log)",
                               self.path, runner=FOLD_RUNNER)
            except JobBusyError:
                continue  # its runner is alive: it commits its receipts itself
            try:
                self._fold_receipt_log(directory / name)
            finally:
                lock.release()

    def _fold_receipt_log(self, path: Path) -> None:
        """Fold one job's receipt log into its steps, then remove it. The caller holds the job's claim."""
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
            # Only what this job's runner could have written: the log is named after its job (a log
            # under one job's name must not touch another job, whose runner may hold its lock), and
            # every field has its type. Anything else is skipped: that send stays IN_FLIGHT.
            if not (
                isinstance(job_id, str) and self._receipt_log_path(job_id) == path
                and all(isinstance(v, str) for v in (item_id, step, digest))
                and all(v is None or isinstance(v, str) for v in (output, receipt))
                and isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at)
            ):
                continue
            updates.append((receipt, output, at, job_id, item_id, step, digest))
        if updates:
            with self.write(durable=True) as tx:
                tx.many(sql.FOLD_RECEIPT, updates)
        path.unlink(missing_ok=True)


SQLITE_IOERR, SQLITE_FULL = 10, 13  # sqlite3's constants (Python 3.11+); extended codes keep them in the low byte
NEARLY_FULL_BYTES = 1 << 20  # an I/O error with less room than this left is taken for a full disk


def _is_enospc(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def disk_full_error(journal: Path, what: str) -> JournalDiskFullError:
    return JournalDiskFullError(
        f"the disk holding journal {journal} is full ({what}). Nothing is lost: what the journal "
        "committed is intact, and a send whose outcome it could not record stays IN_FLIGHT for the next "
        "run to verify or hold. Free space on that disk, then retry the task; do not move, delete or "
        "restore the journal."
    )


class FileReceiptLog:
    """A job's receipt log: appended with one ``write`` per round, never fsync'd."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def write(self, data: bytes) -> None:
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(self._fd, data)
        except OSError as exc:
            if _is_enospc(exc):
                journal = Path(str(self.path.parent).removesuffix(".locks"))  # <journal>.locks/<job>.receipts
                raise disk_full_error(journal, "ENOSPC writing a receipt log") from None
            raise

    def committed(self) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def discard(self) -> None:
        self.close()
        self.path.unlink(missing_ok=True)


class JobLock:
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
                    "would send items twice.", holder=holder, runner=holder_runner,
                )
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
        try:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, json.dumps(info).encode("utf-8"), 0)
        except OSError as exc:  # who holds the lock is for messages only: a full disk must not stop the run
            if not _is_enospc(exc):
                self.release()
                raise

    def _holder(self) -> tuple[str, str | None]:
        """Who holds the lock, for messages, and the runner name it gave."""
        try:
            info = json.loads(os.pread(self._fd, 4096, 0) or b"{}")
            since = ts(float(info["since"])).strftime("%Y-%m-%d %H:%M:%S UTC")
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
