"""The shared engine: a schema in a PostgreSQL database that every worker reaches.

Durability
----------
Under ``durability="full"`` every transaction that commits ``IN_FLIGHT`` marks (and every
resolution) runs with ``synchronous_commit=on`` whatever the server's default, so a committed mark
is in the server's durable WAL before the send starts; several marks committed together
(``concurrency=N``) share one commit. Everything else commits with ``synchronous_commit=off``: it
survives the runner being killed, and a crash of the database server can only turn a delivered
send back into an unknown outcome (verified or held by the next run), never cause a second send.
``"normal"`` runs every transaction with ``off``: a mark survives the runner being killed, not a
crash of the database server (the last few hundred milliseconds of commits can be lost).

Claims
------
One runner per job, across hosts: a session-level advisory lock (``pg_try_advisory_lock``) on a
key derived from the schema and the job id, taken and used on the one connection that commits the
run's marks. The server frees it when that session ends: at once when the runner's process dies,
and within ``claim_timeout`` seconds when its host vanishes or is cut off (TCP keepalives and
``tcp_user_timeout`` on both ends of the connection). The journal never reconnects: a runner whose
connection broke stops with :class:`~airflow_resumable.exceptions.JournalConnectionError`
before its next mark, so it never starts another send after its claim could have passed on.

Session locks need a connection that stays one server session: connect directly. Through a pooler
in transaction or statement mode each transaction may run in another server session: that is
detected when a job is claimed (where the pooler lets it show) and refused. Through a pooler in
session mode claims hold, but the ``claim_timeout`` bound then covers only the pooler's own
connection to the server: a runner cut off from the pooler keeps its claim until the pooler gives
up on it (its own TCP keepalive settings).

There is no receipt log beside the journal (the next run may be on another host): a delivered
send's receipt is committed right after the send returns, with ``synchronous_commit=off``, before
any further user code runs (at ``concurrency=N``, once per round of finished sends).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Iterator, Sequence
from typing import Any

from airflow_resumable.exceptions import (
    JobBusyError,
    JournalConnectionError,
    JournalCorruptError,
    JournalError,
    JournalLocationError,
    JournalVersionError,
)
from airflow_resumable.journal import statements as sql
from airflow_resumable.journal.backend import BRIEF_HOLDERS, Durability, EngineBase
from airflow_resumable.journal.schema import POSTGRES_FIRST_VERSION, POSTGRES_MIGRATIONS, SCHEMA_VERSION
from airflow_resumable.journal.statements import Statement

try:
    import psycopg
    from psycopg import sql as pgsql
    from psycopg.conninfo import conninfo_to_dict
except ImportError:  # pragma: no cover - the postgres extra is not installed
    psycopg = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

DEFAULT_SCHEMA = "resumable"
# Servers whose replication was looked at by this process (one warning each).
_REPLICATION_CHECKED: set[str] = set()
DEFAULT_CLAIM_TIMEOUT = 30.0
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
# The parameter limit of one statement in PostgreSQL's wire protocol.
_MAX_PARAMS = 65535
# Rows per array upsert: large enough for any group commit, small enough for a short statement.
UPSERT_JSON_ROWS = 5000


# Rows of the upsert as JSON (ids and outputs are valid Unicode without NUL: the runner checked them).
_ROWS_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False)


@functools.lru_cache(maxsize=1024)
def _pg(statement: str) -> str:
    """A statement of :mod:`.statements` with psycopg's placeholders (none of them holds a '%')."""
    return statement.replace("?", "%s")


def _lock_key(schema: str, name: str) -> int:
    """A signed 64-bit advisory-lock key for ``name`` within the journal's schema."""
    digest = hashlib.sha256(f"airflow-resumable\0{schema}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def redacted(url: str) -> str:
    """``url`` for messages and logs: user, host, port and database, never the password."""
    try:
        parts = conninfo_to_dict(url)
    except Exception:  # noqa: BLE001 - a malformed URL is reported without echoing it
        return "postgresql://(unparsable URL)"
    user = f"{parts['user']}@" if parts.get("user") else ""
    host = parts.get("host") or "localhost"
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{user}{host}{port}/{parts.get('dbname') or ''}"


class PgTx:
    """A :class:`~airflow_resumable.journal.backend.Tx` on a psycopg cursor."""

    max_params = _MAX_PARAMS

    def __init__(self, cursor: Any) -> None:
        self.cur = cursor

    def one(self, statement: str, params: Sequence[Any] = ()) -> tuple[Any, ...] | None:
        row: tuple[Any, ...] | None = self.cur.execute(_pg(statement), params).fetchone()
        return row

    def all(self, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        rows: list[tuple[Any, ...]] = self.cur.execute(_pg(statement), params).fetchall()
        return rows

    def run(self, statement: str, params: Sequence[Any] = ()) -> int:
        return int(self.cur.execute(_pg(statement), params).rowcount)

    def many(self, statement: str, rows: Sequence[Sequence[Any]]) -> int:
        if not rows:
            return 0
        self.cur.executemany(_pg(statement), rows)
        return int(self.cur.rowcount)

    def insert_id(self, statement: str, params: Sequence[Any]) -> int:
        row = self.cur.execute(_pg(statement) + " RETURNING id", params).fetchone()
        return int(row[0])


class PostgresBackend(EngineBase):
    """The engine of a shared step journal in a PostgreSQL schema.

    :param url: a libpq URL, ``postgresql://user:password@host:5432/dbname`` (any libpq option may
        follow as a query parameter, e.g. ``?sslmode=require``).
    :param durability: ``"full"`` (default): marks commit with ``synchronous_commit=on``;
        ``"normal"``: with ``off`` (safe against a killed runner, not a server crash).
    :param schema: the schema holding the journal's tables (created if missing).
    :param claim_timeout: seconds within which the server frees the job of a runner whose host
        vanished or was cut off from it (default 30).
    :param connect_timeout: seconds to wait for the server when opening.
    """

    kind = "postgresql"
    shared = True
    # A B-tree entry holds at most 2,704 bytes (a third of a page): the key's three texts, their headers and
    # the entry's own. A longer key fails the row's first write - after the items before it were sent.
    max_key_bytes: int | None = 2600
    next_job_no = "nextval('job_numbers')"
    compacted_partitions = True
    digest_hex = "encode({}, 'hex')"
    held_steps = "steps"  # PostgreSQL's planner picks steps_held by itself, analyzed or not

    def __init__(
        self,
        url: str,
        *,
        durability: Durability = "full",
        schema: str = DEFAULT_SCHEMA,
        claim_timeout: float = DEFAULT_CLAIM_TIMEOUT,
        connect_timeout: float = 10.0,
        allow_network_filesystem: bool = False,
        busy_timeout: float | None = None,
        readonly: bool = False,
        migrate: bool = False,
    ) -> None:
        # allow_network_filesystem and busy_timeout belong to the SQLite engine: accepted, unused.
        # readonly: opening writes nothing here anyway (a SELECT-only role can open the journal).
        # migrate: a shared journal is moved to this release's schema only when asked to (the
        # `airflow-resumable migrate` command), never as a side effect of a task.
        super().__init__(durability)
        if psycopg is None:
            raise JournalError(
                "a postgresql:// journal needs psycopg 3: pip install 'airflow-provider-resumable[postgres]'"
            )
        if not isinstance(schema, str) or not _SCHEMA_NAME.fullmatch(schema):
            raise JournalLocationError(
                f"journal schema {schema!r} is not a plain lower-case PostgreSQL name "
                "(letters, digits and _, at most 63 characters)"
            )
        if isinstance(claim_timeout, bool) or not isinstance(claim_timeout, (int, float)) or not (
            5 <= claim_timeout <= 3600
        ):
            raise ValueError(f"claim_timeout must be a number of seconds from 5 to 3600, not {claim_timeout!r}")
        self.schema = schema
        self.claim_timeout = float(claim_timeout)
        self.location = f"{redacted(url)} (schema {schema})"
        self._conn: Any = None
        self._claimed: set[str] = set()
        self._lost: JournalConnectionError | None = None
        self._connect(url, connect_timeout)
        try:
            self._migrate(explicit=migrate)
            found = self.read(sql.JOURNAL_ID)
            self.journal_id = str(found[0][0])
            self._warn_of_an_asynchronous_standby()
        except BaseException:
            self.close()
            raise

    def _warn_of_an_asynchronous_standby(self) -> None:
        """One warning per server and process if the server streams to a standby asynchronously (SPEC
        §13): a failover to it loses the last commits, and the journal goes back in time."""
        where = self.location.split(" (schema")[0]
        if where in _REPLICATION_CHECKED:
            return
        _REPLICATION_CHECKED.add(where)
        try:
            rows = self._conn.execute("SELECT application_name, sync_state FROM pg_stat_replication").fetchall()
        except psycopg.Error as exc:
            log.debug("journal %s: the replication state cannot be read (%s)", where, type(exc).__name__)
            return
        if any(state is None for _, state in rows):
            log.debug("journal %s: this role may not read the replication state (pg_monitor or pg_read_all_stats "
                      "lets it); an asynchronous standby would go unnoticed here", where)
            return
        lagging = sorted(str(name) or "?" for name, state in rows if state not in ("sync", "quorum"))
        if lagging:
            log.warning(
                "journal %s: the server streams to %d standby(s) asynchronously (%s). A failover to one loses the "
                "last commits: the journal goes back in time, and runs are refused until someone decides "
                "(on_journal_behind, SPEC §13). Fix: synchronous replication (synchronous_standby_names naming "
                "the standby, synchronous_commit on or remote_apply).", where, len(lagging), ", ".join(lagging))

    # -- opening ------------------------------------------------------------------------------

    def _keepalive(self) -> tuple[int, int, int]:
        """(idle, interval, count) in seconds: a silent peer is given up on within ~2/3 of the bound."""
        idle = max(1, int(self.claim_timeout / 3))
        interval = max(1, int(self.claim_timeout / 9))
        return idle, interval, 3

    def _connect(self, url: str, connect_timeout: float) -> None:
        idle, interval, count = self._keepalive()
        user_timeout_ms = int(self.claim_timeout * 2000 / 3)
        try:
            # Client side: the runner notices a dead server or link as fast as the server notices it.
            self._conn = psycopg.connect(
                url, autocommit=True, connect_timeout=max(1, int(connect_timeout)),
                keepalives=1, keepalives_idle=idle, keepalives_interval=interval, keepalives_count=count,
                tcp_user_timeout=user_timeout_ms, application_name=self._application_name(None),
            )
        except psycopg.Error as exc:
            raise JournalConnectionError(
                f"cannot connect to the journal database {self.location} ({type(exc).__name__}); nothing "
                "was sent. Check that the server is up and the connection's host, port, user, password "
                "and database are right."
            ) from None
        # A job's claim lives as long as this session: a server, role or database that ends idle sessions
        # (idle_session_timeout, common on managed PostgreSQL) would end it while a send is under way - the
        # session is idle then - and let a second run of the job send the item again. Never for this one.
        idle_timeouts = "SET idle_in_transaction_session_timeout = 0; "
        if self._conn.info.server_version >= 140000:  # idle_session_timeout is PostgreSQL 14's
            idle_timeouts += "SET idle_session_timeout = 0; "
        try:
            with self._conn.transaction():
                # Server side: the claim (the session) ends within the bound when the runner goes silent.
                self._conn.execute(
                    pgsql.SQL(
                        "SET tcp_keepalives_idle = {}; SET tcp_keepalives_interval = {}; "
                        "SET tcp_keepalives_count = {}; SET tcp_user_timeout = {}; " + idle_timeouts +
                        "SET synchronous_commit = off; SET search_path = {}"
                    ).format(idle, interval, count, user_timeout_ms, pgsql.Identifier(self.schema))
                )
        except psycopg.Error as exc:
            self.close()
            raise JournalConnectionError(
                f"cannot set up the session on the journal database {self.location} ({type(exc).__name__})"
            ) from None

    def _schema_version(self) -> int | None:
        meta = pgsql.Identifier(self.schema, "meta").as_string(self._conn)
        row = self._conn.execute("SELECT to_regclass(%s) IS NOT NULL", (meta,)).fetchone()
        if not row[0]:
            return None
        found = self._conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
        return None if found is None else int(found[0])

    def _migrate(self, *, explicit: bool) -> None:
        try:
            version = self._schema_version()
            self.migrated_from = version
            if version is not None and version > SCHEMA_VERSION:
                raise self._too_new(version)
            if version == SCHEMA_VERSION:
                return  # nothing to write: a read-only role can open the journal
            if version is not None and not explicit:
                raise self._too_old(version)
            with self._conn.transaction():
                # One migrator at a time, across hosts; the others find the work done.
                self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(self.schema, "(migrate)"),))
                self._conn.execute(pgsql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(pgsql.Identifier(self.schema)))
                version = self._schema_version()
                if version is None:
                    foreign = self._conn.execute(
                        "SELECT count(*) FROM pg_tables WHERE schemaname = %s", (self.schema,)
                    ).fetchone()[0]
                    if foreign:
                        raise JournalCorruptError(
                            f"schema {self.schema!r} of {redacted_db(self.location)} holds tables but no step "
                            "journal; give the journal a schema of its own ([resumable] journal_schema)."
                        )
                    version = POSTGRES_FIRST_VERSION - 1
                elif version > SCHEMA_VERSION:
                    raise self._too_new(version)
                self.migrated_from = version if version >= POSTGRES_FIRST_VERSION else None
                for target in range(version + 1, SCHEMA_VERSION + 1):
                    for statement in POSTGRES_MIGRATIONS[target]:
                        self._conn.execute(statement)
                self._conn.execute(
                    """INSERT INTO meta (key, value) VALUES ('schema_version', %s)
                       ON CONFLICT (key) DO UPDATE SET value = excluded.value""",
                    (str(SCHEMA_VERSION),),
                )
        except psycopg.Error as exc:
            raise JournalError(
                f"cannot open the journal schema {self.schema!r} in {self.location} ({type(exc).__name__}); "
                "check that the user may use (or create) the schema and its tables."
            ) from None

    def _too_old(self, version: int) -> JournalVersionError:
        return JournalVersionError(
            f"journal {self.location} has schema version {version}, and this airflow-provider-resumable needs "
            f"version {SCHEMA_VERSION}. Nothing was sent. A shared journal is migrated once, on purpose, as "
            "Airflow's own database is: run `airflow-resumable migrate` (the compose file's init service and "
            "the README's Helm job do) once no worker of the previous release uses it."
        )

    def _too_new(self, version: int) -> JournalVersionError:
        return JournalVersionError(
            f"journal {self.location} has schema version {version}, but this airflow-provider-resumable "
            f"understands versions up to {SCHEMA_VERSION}: it was written by a newer release. Upgrade the "
            "provider on this worker; do not edit the tables."
        )

    @property
    def closed(self) -> bool:
        return self._conn is None

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):
                conn.close()

    # -- transactions -------------------------------------------------------------------------

    @property
    def _connection(self) -> Any:
        if self._lost is not None:
            # Never reconnect: a new session would not hold this run's claim.
            raise JournalConnectionError(str(self._lost))
        if self._conn is None:
            raise JournalError(f"journal {self.location} is closed")
        return self._conn

    def _failed(self, exc: Exception) -> JournalError:
        """The journal's error for a failed statement. A lost connection is final for this object."""
        conn = self._conn
        if conn is None or conn.broken or conn.closed:
            self._lost = JournalConnectionError(
                f"lost the connection to the journal database {self.location} ({type(exc).__name__}). Its "
                "claim on the job ended with it, so no further send was started; sends already in flight "
                "stay IN_FLIGHT for the next run to verify or hold. Retry the task once the database is "
                "reachable."
            )
            return self._lost
        # The session (and any claim it holds) is still there: a timeout, a cancel, a refused statement.
        return JournalError(
            f"the journal database {self.location} refused a statement ({type(exc).__name__}); nothing more "
            "was sent. Retry the task; if it persists, check the server's log and the role's privileges."
        )

    @contextlib.contextmanager
    def write(self, *, durable: bool) -> Iterator[PgTx]:
        """One short write transaction; under full durability its commit is synchronous."""
        conn = self._connection
        synchronous = durable and self.durability == "full"
        with self._guard(), conn.cursor() as cursor:
            # BEGIN and the commit's durability in one round trip (one simple query): this
            # transaction guards a send, so COMMIT returns only once the server's WAL is on disk.
            cursor.execute("BEGIN; SET LOCAL synchronous_commit = on" if synchronous else "BEGIN")
            try:
                yield PgTx(cursor)
            except BaseException:
                if not conn.broken:
                    conn.rollback()
                raise
            cursor.execute("COMMIT")
        self._committed(synchronous)

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """psycopg's errors as the journal's; an IntegrityError (the database's own rules) stays as it is."""
        try:
            yield
        except psycopg.IntegrityError:
            raise
        except psycopg.Error as exc:
            raise self._failed(exc) from None

    def _committed(self, synchronous: bool) -> None:
        self.commit_count += 1
        if synchronous:
            self.durable_commit_count += 1

    max_params = _MAX_PARAMS

    def upsert_statements(self, rows: Sequence[Sequence[Any]]) -> list[Statement]:
        # One JSON text of rows: the statement's text is the same whatever the number of rows.
        return [
            Statement(sql.UPSERT_JSON, [_ROWS_JSON.encode(part)])
            for part in sql.without_repeats(rows, UPSERT_JSON_ROWS)
        ]

    def apply(self, statements: Sequence[Statement], *, durable: bool) -> None:
        synchronous = durable and self.durability == "full"
        if len(statements) != 1 or statements[0].many:
            super().apply(statements, durable=durable)
            return
        # One statement is a transaction of its own (autocommit): one round trip instead of the
        # three of BEGIN, the statement and COMMIT. It commits with the session's
        # synchronous_commit=off, unless it guards a send: then the statement itself switches its
        # transaction's commit to synchronous (the marks' upsert, by far the most frequent case).
        statement = statements[0]
        if synchronous:
            if statement.sql is not sql.UPSERT_JSON:
                super().apply(statements, durable=durable)
                return
            statement = Statement(sql.UPSERT_JSON_SYNCHRONOUS, statement.params)
        conn = self._connection
        with self._guard():
            conn.execute(_pg(statement.sql), statement.params)
        self._committed(synchronous)

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[PgTx]:
        conn = self._connection
        with self._guard(), conn.cursor() as cursor:
            cursor.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            try:
                yield PgTx(cursor)
            finally:
                if not conn.broken:
                    cursor.execute("COMMIT")

    @contextlib.contextmanager
    def scratch(self) -> Iterator[PgTx]:
        conn = self._connection
        try:
            with conn.transaction(), conn.cursor() as cursor:
                yield PgTx(cursor)
        except psycopg.Error as exc:
            raise self._failed(exc) from None

    def seen_table_ddl(self, table: str) -> str:
        return f"CREATE TEMP TABLE {table} (n BIGSERIAL PRIMARY KEY, item_id TEXT NOT NULL UNIQUE, digest TEXT NOT NULL)"

    def incarnation(self) -> str:
        """The server's start: a crash-restart, or a standby promoted in its place, changes it."""
        ((started,),) = self.read("SELECT CAST(EXTRACT(EPOCH FROM pg_postmaster_start_time()) AS TEXT)")
        return f"postgres:{started}"

    def read(self, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        conn = self._connection
        try:
            rows: list[tuple[Any, ...]] = conn.execute(_pg(statement), params).fetchall()
            return rows
        except psycopg.Error as exc:
            raise self._failed(exc) from None

    # -- claims -------------------------------------------------------------------------------

    @staticmethod
    def _application_name(runner: str | None) -> str:
        # Other sessions read it to say who holds a job (63 bytes at most, PostgreSQL's limit).
        who = f"{os.getpid()}@{socket.gethostname()}"
        return f"resumable|{who}|{runner or ''}".encode()[:63].decode("utf-8", "ignore")

    def claim(self, job_id: str, *, runner: str | None, brief: bool = False) -> AdvisoryClaim:
        if job_id in self._claimed:
            busy = JobBusyError(
                f"job {job_id!r} is already running in this process (journal {self.location}). Nothing was "
                "sent; two runs of one job would send items twice.", holder=f"pid {os.getpid()} (this process)",
            )
            raise busy
        return AdvisoryClaim(self, job_id, runner)

    def _holder(self, key: int) -> tuple[str, str | None]:
        """Who holds the claim with this key: for messages, and the runner name it gave."""
        try:
            row = self._conn.execute(
                """SELECT a.application_name, host(a.client_addr), a.backend_start
                   FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
                   WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                     AND l.classid::bigint = %s AND l.objid::bigint = %s
                     AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())""",
                ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF),
            ).fetchone()
        except psycopg.Error:
            return "holder unknown", None
        if row is None:
            return "holder unknown", None
        name, address, since = row
        parts = (name or "").split("|", 2)
        if len(parts) == 3 and parts[0] == "resumable":
            runner = parts[2] or None
            who = f"pid {parts[1]}" + (f" from {address}" if address else "")
            who += f" since {since:%Y-%m-%d %H:%M:%S %Z}" if since else ""
            return who + (f", {runner}" if runner else ""), runner
        return f"session {name or 'without a name'}" + (f" from {address}" if address else ""), None


class AdvisoryClaim:
    """A job's claim: a session-level advisory lock on the journal's own connection."""

    def __init__(self, journal: PostgresBackend, job_id: str, runner: str | None) -> None:
        self.journal, self.job_id = journal, job_id
        self.key = _lock_key(journal.schema, job_id)
        conn = journal._connection
        try:
            conn.execute("SELECT set_config('application_name', %s, false)", (journal._application_name(runner),))
            taken = conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,)).fetchone()[0]
            if not taken:
                holder, holder_runner = journal._holder(self.key)
                busy = JobBusyError(
                    f"job {job_id!r} is already running ({holder}, journal {journal.location}). Nothing was "
                    "sent. Wait for that run to finish or stop it; two runs of one job would send items "
                    "twice." + ("" if holder_runner in BRIEF_HOLDERS else
                                f" A runner that vanished loses the job within {journal.claim_timeout:.0f} s."),
                    holder=holder, runner=holder_runner,
                )
                raise busy
            # The claim lives in the session; it only excludes anyone if the next transactions run
            # in that same session. A transaction-pooling proxy hands each one to any server session.
            held = conn.execute(
                """SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1
                   AND pid = pg_backend_pid() AND classid::bigint = %s AND objid::bigint = %s""",
                ((self.key >> 32) & 0xFFFFFFFF, self.key & 0xFFFFFFFF),
            ).fetchone()[0]
        except psycopg.Error as exc:
            raise journal._failed(exc) from None
        if not held:
            raise JournalError(
                f"the connection to the journal database {journal.location} does not keep one server "
                "session between transactions (a pooler such as PgBouncer in transaction or statement "
                "mode?), so a job's claim cannot be held. Connect directly, or through the pooler in "
                "session mode."
            )
        journal._claimed.add(job_id)
        self.since = time.time()

    def release(self, *, remove: bool = False) -> None:
        journal = self.journal
        if self.job_id not in journal._claimed:
            return
        journal._claimed.discard(self.job_id)
        conn = journal._conn
        if conn is None or journal._lost is not None or conn.broken:
            return  # the session is gone, and the claim with it
        with contextlib.suppress(psycopg.Error):
            conn.execute("SELECT pg_advisory_unlock(%s)", (self.key,))
            conn.execute("SELECT set_config('application_name', %s, false)", (journal._application_name(None),))


def redacted_db(location: str) -> str:
    return location.split(" (schema", 1)[0]
