"""Where the journal is and how a job is named: what the operators, the sensor, the CLI and the page share.

Where the journal is, in this order: the task's own ``journal_conn_id``, then its ``journal_path``;
then the Airflow config's ``[resumable] journal_conn_id``, then ``[resumable] journal_path``; else
``$AIRFLOW_HOME/resumable/journal.sqlite3``. A connection id names an Airflow connection (resolved
through Airflow's connection API, so secrets backends work): a Postgres one holding a shared journal, or
a SQLite one naming a file on the worker. Never anything from ``dag_run.conf`` or XCom: a run's conf must
not choose where a worker writes.

Tasks reach all this through :class:`airflow_resumable.hooks.journal.ResumableJournalHook`; the CLI and
the page, which run without Airflow's hook machinery, call :func:`journal_target` here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

from airflow_resumable.exceptions import JournalConfigError

DEFAULT_RELATIVE_PATH = Path("resumable") / "journal.sqlite3"
SUMMARY_XCOM_KEY = "resumable_summary"
RESOLVE_DAG_ID = "resolve_held_item"  # the shipped resolve DAG (dags/resolve_held_item.py)
STATE_STORE_KEY = "resumable_journal"
# Set by every try before it opens its journal: a later try that finds it, and no journal recorded under
# STATE_STORE_KEY, knows an earlier try started and never got as far as sending.
STARTED_STORE_KEY = "resumable_try_started"
# The task state store key of the high-water mark of the job's IN_FLIGHT marks (SPEC §13).
HIGH_WATER_STORE_KEY = "resumable_high_water"
POSTGRES_CONN_TYPES = ("postgres", "postgresql")
SQLITE_CONN_TYPES = ("sqlite",)
# libpq options an Airflow Postgres connection may carry in its extra (TLS, timeouts, routing).
LIBPQ_EXTRA_OPTIONS = (
    "sslmode", "sslrootcert", "sslcert", "sslkey", "sslcrl", "sslpassword", "connect_timeout",
    "target_session_attrs", "gssencmode", "channel_binding",
)


def _conf_get(option: str) -> str | None:
    # The environment wins in Airflow's config too; reading it first spares an Airflow import.
    from_env = os.environ.get(f"AIRFLOW__RESUMABLE__{option.upper()}")
    if from_env:
        return from_env
    try:
        from airflow_resumable._compat import conf

        value = conf().get("resumable", option, fallback=None)
    except ImportError:  # no Airflow (the core used on its own): the environment only
        return None
    return value or None


def default_journal_path() -> Path:
    """``[resumable] journal_path``, else ``$AIRFLOW_HOME/resumable/journal.sqlite3``."""
    configured = _conf_get("journal_path")
    if configured:
        return Path(configured).expanduser()
    home = os.environ.get("AIRFLOW_HOME") or str(Path("~/airflow").expanduser())
    return Path(home) / DEFAULT_RELATIVE_PATH


def default_settle_in_task() -> bool:
    """``[resumable] settle_in_task``: whether batch tasks settle refusals and failed sends in the task
    (SPEC §12) unless a task says otherwise; true by default."""
    value = (_conf_get("settle_in_task") or "true").strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise JournalConfigError(f"[resumable] settle_in_task must be true or false, not {value[:40]!r}")


def default_on_journal_behind() -> str:
    """``[resumable] on_journal_behind``: what a batch task does when its journal is behind the high-water
    mark kept outside it (SPEC §13) unless the task says: ``refuse`` (default) or ``verify``."""
    value = (_conf_get("on_journal_behind") or "refuse").strip().lower()
    if value not in ("refuse", "verify"):
        raise JournalConfigError(f"[resumable] on_journal_behind must be refuse or verify, not {value[:40]!r}")
    return value


def default_max_attempts() -> int:
    """``[resumable] max_attempts``: sends and look-ups one step of one item gets in a try (default 6)."""
    value = (_conf_get("max_attempts") or "6").strip()
    if not value.isdigit() or int(value) < 1:
        raise JournalConfigError(f"[resumable] max_attempts must be a whole number of at least 1, not {value[:40]!r}")
    return int(value)


def default_allow_network_filesystem() -> bool:
    """``[resumable] allow_network_filesystem``: every surface that opens a SQLite journal (the tasks, the
    CLI, the page) opens one on a network or cloud-sync filesystem when it is true."""
    value = (_conf_get("allow_network_filesystem") or "false").strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off", ""):
        return False
    raise JournalConfigError(f"[resumable] allow_network_filesystem must be true or false, not {value[:40]!r}")


def default_durability() -> str:
    # Imported here, as StepJournal is in open(): the extra link and the page import this module, and
    # need none of the journal.
    from airflow_resumable.journal.backend import checked_durability

    return checked_durability((_conf_get("durability") or "full").strip().lower(), "[resumable] durability")


@dataclass(frozen=True)
class JournalTarget:
    """Where a task's journal is. ``location`` may hold a password: pass it to StepJournal, never log it."""

    location: str
    shared: bool  # True: a PostgreSQL journal every worker reaches
    display: str  # for logs and pages: the path, "connection <id>", or "<path> (connection <id>)"
    options: dict[str, Any] = field(default_factory=dict)  # StepJournal keywords (schema, claim_timeout)
    conn_id: str | None = None  # the Airflow connection the journal was found through

    def open(self, **kwargs: Any) -> Any:
        from airflow_resumable.journal import StepJournal

        if self.shared:
            kwargs.pop("allow_network_filesystem", None)
        return StepJournal(self.location, **{**self.options, **kwargs})

    def exists(self) -> bool:
        """Whether there is a journal to read (a read never creates a SQLite file)."""
        try:
            return self.shared or Path(self.location).exists()
        except OSError as exc:  # a name too long, a folder on the way that may not be looked into
            from airflow_resumable.journal import JournalLocationError

            raise JournalLocationError(
                f"cannot look at the journal path {self.location[:100]!r}: {exc.strerror}; check the path"
            ) from None


def journal_target(*, conn_id: str | None = None, path: str | os.PathLike[str] | None = None) -> JournalTarget:
    """The task's journal: its own conn id, its own path, the config's conn id, the config's path."""
    chosen_conn_id, chosen_path = _choose(conn_id, path)
    if chosen_conn_id is not None:
        return _connection_target(chosen_conn_id)
    assert chosen_path is not None
    return _file_target(chosen_path, str(chosen_path))


def _file_target(path: Path, display: str, conn_id: str | None = None) -> JournalTarget:
    """A SQLite journal on the worker's disk, opened on a network filesystem only if the config allows it."""
    options = {"allow_network_filesystem": True} if default_allow_network_filesystem() else {}
    return JournalTarget(str(path), False, display, options, conn_id)


def journal_display(*, conn_id: str | None = None, path: str | os.PathLike[str] | None = None) -> str:
    """What :func:`journal_target` would name, without looking a connection up (for pages and logs)."""
    chosen_conn_id, chosen_path = _choose(conn_id, path)
    return f"connection {chosen_conn_id}" if chosen_conn_id is not None else str(chosen_path)


def _choose(conn_id: str | None, path: str | os.PathLike[str] | None) -> tuple[str | None, Path | None]:
    """(connection id, None) or (None, file path), in the order the module docstring gives."""
    if conn_id:
        return conn_id, None
    if path:
        return None, Path(path).expanduser()
    configured = _conf_get("journal_conn_id")
    if configured:
        return configured, None
    return None, default_journal_path()


def _get_connection(conn_id: str) -> Any:
    """The Airflow connection ``conn_id``: in a task through the Task SDK; elsewhere (API server,
    CLI) through the secrets backends and the metadata database."""
    failures: list[str] = []
    try:
        from airflow.sdk import BaseHook

        return BaseHook.get_connection(conn_id)
    except Exception as exc:  # noqa: BLE001 - outside a task the SDK may have no way to ask
        failures.append(type(exc).__name__)
    try:
        from airflow.models.connection import Connection

        return Connection.get_connection_from_secrets(conn_id)
    except Exception as exc:  # noqa: BLE001
        failures.append(type(exc).__name__)
    raise JournalConfigError(
        f"the journal connection {conn_id!r} cannot be found ({', '.join(failures)}); create an Airflow Postgres "
        "(or SQLite) connection with that id, or fix journal_conn_id= / [resumable] journal_conn_id"
    )


def _connection_target(conn_id: str) -> JournalTarget:
    if not isinstance(conn_id, str) or not conn_id.strip():
        raise JournalConfigError("journal_conn_id must be a non-empty connection id")
    conn = _get_connection(conn_id)
    conn_type = (conn.conn_type or "").lower()
    if conn_type in SQLITE_CONN_TYPES:
        return _sqlite_target(conn_id, conn)
    if conn_type not in POSTGRES_CONN_TYPES:
        raise JournalConfigError(
            f"connection {conn_id!r} is a {conn.conn_type!r} connection; a journal needs a Postgres connection "
            "(conn_type 'postgres', shared by every worker) or a SQLite one (conn_type 'sqlite', the file in host)"
        )
    return _postgres_target(conn_id, conn)


def _sqlite_target(conn_id: str, conn: Any) -> JournalTarget:
    """A journal file on the worker, named by a SQLite connection's host (as Airflow's sqlite provider
    reads it: ``sqlite:////path/to/journal.sqlite3``)."""
    if not conn.host:
        raise JournalConfigError(f"connection {conn_id!r} has no host; set it to the journal file's path")
    path = Path(conn.host).expanduser()
    return _file_target(path, f"{path} (connection {conn_id})", conn_id)


def _postgres_target(conn_id: str, conn: Any) -> JournalTarget:
    if not conn.host:
        raise JournalConfigError(f"connection {conn_id!r} has no host; set the PostgreSQL server's host name")
    extra = conn.extra_dejson if isinstance(getattr(conn, "extra_dejson", None), dict) else {}
    user = quote(conn.login or "", safe="")
    password = quote(conn.password or "", safe="")
    credentials = f"{user}{':' + password if conn.password else ''}@" if conn.login else ""
    host = f"[{conn.host}]" if ":" in conn.host else conn.host
    port = f":{int(conn.port)}" if conn.port else ""
    database = quote(conn.schema or "", safe="")  # an Airflow connection's "schema" is the database
    query = "&".join(f"{key}={quote(str(extra[key]), safe='')}" for key in LIBPQ_EXTRA_OPTIONS if extra.get(key))
    url = f"postgresql://{credentials}{host}{port}/{database}" + (f"?{query}" if query else "")
    options: dict[str, Any] = {}
    schema = extra.get("journal_schema") or _conf_get("journal_schema")
    if schema:
        options["schema"] = schema
    claim_timeout = extra.get("claim_timeout") or _conf_get("claim_timeout")
    if claim_timeout:
        try:
            options["claim_timeout"] = float(claim_timeout)
        except (TypeError, ValueError):
            raise JournalConfigError(f"claim_timeout must be a number of seconds, not {claim_timeout!r}") from None
    return JournalTarget(url, True, journal_display(conn_id=conn_id), options, conn_id)


def default_job_id(context: Any) -> str:
    """The job of the running task instance when the operator is given no ``job_id``."""
    return default_job_id_of(context["ti"])


def default_job_id_of(ti: Any) -> str:
    """``dag_id/task_id/run_id`` (+ ``/map_index`` when mapped) of a task instance or its key: the same
    on retry and on Clear."""
    job_id = f"{ti.dag_id}/{ti.task_id}/{ti.run_id}"
    map_index = getattr(ti, "map_index", -1)
    if map_index is not None and map_index >= 0:
        job_id += f"/{map_index}"
    return job_id


def batch_job(context: Any, *, owner: str, job_id: str | None, batch_task_id: str | None) -> tuple[str, str | None]:
    """The job a sensor or review task is about: ``job_id`` if given, else the one the batch task's
    XCom summary names; with the journal id that summary recorded (None when not known). The journal
    itself is never taken from XCom."""
    if job_id is not None:
        return job_id, None
    summary = context["ti"].xcom_pull(task_ids=batch_task_id, key=SUMMARY_XCOM_KEY)
    if not isinstance(summary, dict) or not isinstance(summary.get("job_id"), str):
        raise ValueError(
            f"{owner}: task {batch_task_id!r} left no resumable summary in XCom; "
            "is it a ResumableBatchOperator that ran in this DAG run?"
        )
    recorded = summary.get("journal_id")
    return summary["job_id"], recorded if isinstance(recorded, str) else None

