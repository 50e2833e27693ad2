"""A real multi-worker Airflow for tests: CeleryExecutor, PostgreSQL metadata DB and result backend,
a Redis broker, api-server + scheduler + dag-processor + triggerer and two Celery workers that are
different hosts as far as Airflow can tell (own ``--celery-hostname``, own ``hostname_callable``
answer, own log-server port, own worker-local journal folder).

Every component starts in a session of its own, so "kill a worker" can kill everything it started:
the Celery pool, the task supervisor and the task runner (which sits in a process group of its own
inside the worker's session). Everything listens on 127.0.0.1 on free ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.support import airflow_server
from tests.support.airflow_harness import AIRFLOW, REPO, base_env
from tests.support.postgres_server import create_database, wait_until

WORKER_NAME_ENV = "RESUMABLE_TEST_WORKER_NAME"


def require_redis_server(who: str) -> None:
    """Skip ``who`` (a test module) where redis-server is missing - but fail under CI, which installs it."""
    import pytest

    if shutil.which("redis-server") is None:
        why = f"{who} needs redis-server (Debian: apt-get install redis-server)"
        if os.environ.get("CI"):
            pytest.fail(why + "; .ci/run installs it, so CI must run it")
        pytest.skip(why)


def worker_hostname() -> str:
    """``[core] hostname_callable`` of the deployment: a worker answers with its own name."""
    return os.environ.get(WORKER_NAME_ENV) or socket.getfqdn()


def _session_pids(sid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        if int(fields[3]) == sid:  # state ppid pgrp session ...
            pids.append(int(entry))
    return pids


def _children(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        try:
            kids = Path(f"/proc/{parent}/task/{parent}/children").read_text().split()
        except OSError:
            continue
        found += [int(k) for k in kids]
        todo += [int(k) for k in kids]
    return found


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


@dataclass
class Component:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def pids(self) -> list[int]:
        """Every process of this component's session (the leader's pid is the session id)."""
        return _session_pids(self.proc.pid)

    def kill(self) -> list[int]:
        """SIGKILL every process of the session, as a host that vanished would leave things."""
        killed = []
        for _ in range(5):  # a process may fork while we kill: repeat until the session is empty
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)
        self.proc.wait(timeout=30)
        return killed

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


@dataclass
class CeleryDeployment:
    """The deployment. ``worker_concurrency``: Celery slots per worker (the scheduler's parallelism
    follows, so every slot can be busy); ``receiver_reply_ms``: the demo receiver takes this long per
    notification; ``dag_files``: which of ``tests/celery_dags`` to deploy (default all); ``extra_env``:
    more environment for every component (the fleet DAG's sizes)."""

    root: Path
    postgres_admin_url: str
    components: dict[str, Component] = field(default_factory=dict)
    peak_rss_kib: int = 0
    _sampling: bool = False
    worker_concurrency: int = 2
    receiver_reply_ms: float = 0.0
    dag_files: Sequence[str] | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # Peak RSS of each component's session (the PostgreSQL server as "postgresql"), and of the whole.
    peak_rss_by_component_kib: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.home = self.root / "airflow"
        (self.home / "dags").mkdir(parents=True)
        folder = REPO / "tests" / "celery_dags"
        dags = folder.glob("*.py") if self.dag_files is None else [folder / name for name in self.dag_files]
        for source in [*dags, REPO / "dags" / "resolve_held_item.py"]:
            shutil.copy(source, self.home / "dags" / source.name)
        self.metadata_url = create_database(self.postgres_admin_url)
        self.journal_url = create_database(self.postgres_admin_url)
        self.port = airflow_server.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.redis_port = airflow_server.free_port()
        self.receiver_db = self.root / "receiver" / "receiver.sqlite3"
        self.receiver_db.parent.mkdir()
        self.env = self._env()
        self._token: str | None = None

    # -- configuration ---------------------------------------------------------------------------

    def _env(self) -> dict[str, str]:
        env = airflow_server.server_env(base_env(self.home), self.home, self.port)
        meta = self.metadata_url.replace("postgresql://", "postgresql+psycopg2://", 1)
        pg = urllib.parse.urlsplit(self.journal_url)
        env.update(
            AIRFLOW__CORE__EXECUTOR="CeleryExecutor",
            AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=meta,
            # SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3; Celery's result backend wants psycopg2.
            AIRFLOW__CELERY__RESULT_BACKEND="db+" + meta,
            AIRFLOW__CELERY__BROKER_URL=f"redis://127.0.0.1:{self.redis_port}/0",
            AIRFLOW__CELERY__WORKER_CONCURRENCY=str(self.worker_concurrency),
            AIRFLOW__CORE__HOSTNAME_CALLABLE="tests.support.celery_deployment.worker_hostname",
            AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION="False",
            AIRFLOW__CORE__PARALLELISM=str(max(8, 2 * self.worker_concurrency)),
            # A killed worker's task is found by its missing heartbeat: wait 20 s, not the default 300.
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT="20",
            AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL="3",
            AIRFLOW__TRIGGERER__CAPACITY="50",
            AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT=str(airflow_server.free_port()),
            AIRFLOW_CONN_RESUMABLE_JOURNAL=json.dumps({
                "conn_type": "postgres", "host": pg.hostname, "port": pg.port, "login": pg.username or "",
                "schema": pg.path.lstrip("/"),
            }),
        )
        env.update(self.extra_env)
        return env

    # -- lifecycle -------------------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Component:
        log = self.root / f"{name}.log"
        handle = log.open("ab")
        proc = subprocess.Popen(args, env=env or self.env, stdout=handle, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.root)
        component = Component(name, proc, log)
        self.components[name] = component
        return component

    def start(self) -> None:
        self._spawn("redis", ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no", "--dir", str(self.root)])
        self._spawn("receiver", [sys.executable, "-u", "-m", "airflow_resumable.demo_receiver", "--port", "0",
                                 "--db", str(self.receiver_db), "--no-dedupe",
                                 "--reply-ms", str(self.receiver_reply_ms)])
        receiver_line = wait_for_line(self.components["receiver"].log, "demo receiver on", 30)
        self.receiver_url = receiver_line.split()[3]
        self.env["AIRFLOW_CONN_CELERY_RECEIVER"] = json.dumps({"conn_type": "http", "host": self.receiver_url})
        assert wait_until(self._redis_answers, 30), self.components["redis"].tail()
        migrate = subprocess.run([AIRFLOW, "db", "migrate"], env=self.env, capture_output=True, text=True,
                                 timeout=600, check=False)
        assert migrate.returncode == 0, migrate.stdout[-3000:] + migrate.stderr[-3000:]
        self._spawn("api-server", [AIRFLOW, "api-server"], env=self.api_host_env())
        for name in ("scheduler", "dag-processor", "triggerer"):
            self._spawn(name, [AIRFLOW, name])
        for name in ("worker-a", "worker-b"):
            self.start_worker(name)
        threading.Thread(target=self._sample_memory, daemon=True).start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            for component in self.components.values():
                if component.proc.poll() is not None:
                    raise AssertionError(f"{component.name} exited with {component.proc.returncode}:\n{component.tail()}")
            if self._healthy():
                return
            time.sleep(1)
        raise AssertionError("the deployment did not come up:\n" + self.components["api-server"].tail())

    def api_host_env(self) -> dict[str, str]:
        """The API server's host: the shared journal through the config, and no journal file of its own."""
        return {**self.env, "AIRFLOW__RESUMABLE__JOURNAL_CONN_ID": "resumable_journal",
                "AIRFLOW__RESUMABLE__JOURNAL_PATH": str(self.api_host_journal)}

    @property
    def api_host_journal(self) -> Path:
        return self.root / "api-host" / "journal.sqlite3"

    def worker_env(self, name: str) -> dict[str, str]:
        folder = self.root / name
        folder.mkdir(exist_ok=True)
        return {
            **self.env,
            WORKER_NAME_ENV: name,
            "AIRFLOW__RESUMABLE__JOURNAL_PATH": str(folder / "journal.sqlite3"),
            "AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT": str(airflow_server.free_port()),
        }

    def start_worker(self, name: str) -> Component:
        return self._spawn(name, [AIRFLOW, "celery", "worker", "--celery-hostname", f"{name}@%h",
                                  "--queues", "default", "--concurrency", str(self.worker_concurrency)],
                           env=self.worker_env(name))

    def wait_worker_ready(self, name: str, timeout: float = 120) -> None:
        assert wait_for_line(self.components[name].log, "ready.", timeout), self.components[name].tail()

    def _redis_answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.redis_port), timeout=2) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/api/v2/monitor/health", timeout=5) as response:
                health = json.loads(response.read())
        except (urllib.error.URLError, OSError, ValueError):
            return False
        return (health.get("scheduler", {}).get("status") == "healthy"
                and health.get("triggerer", {}).get("status") == "healthy"
                and health.get("dag_processor", {}).get("status") == "healthy")

    def _sample_memory(self) -> None:
        """Peak summed RSS of the whole deployment: every component's session and the PostgreSQL server."""
        self._sampling = True
        postmaster = _postmaster_pid(self.postgres_admin_url)
        while self._sampling:
            sessions = {c.name: c.pids() for c in list(self.components.values())}
            if postmaster:
                sessions["postgresql"] = [postmaster, *_children(postmaster)]
            rss = {name: sum(_rss_kib(pid) for pid in pids) for name, pids in sessions.items()}
            for name, kib in rss.items():
                self.peak_rss_by_component_kib[name] = max(self.peak_rss_by_component_kib.get(name, 0), kib)
            self.peak_rss_kib = max(self.peak_rss_kib, sum(rss.values()))
            time.sleep(0.5)

    def stop(self) -> None:
        self._sampling = False
        for component in reversed(list(self.components.values())):
            component.stop()

    # -- the REST API (what the UI and an operator's scripts use) ----------------------------------

    def api(self, method: str, path: str, body: Any = None) -> Any:
        if self._token is None:
            self._token = airflow_server.token(self.url, "admin")
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method, headers={
            "Authorization": f"Bearer {self._token}", "Content-Type": "application/json",
            "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=airflow_server.CALL_TIMEOUT) as response:
                return json.loads(response.read() or b"null")
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"{method} {path}: HTTP {exc.code} {exc.read()[:2000]!r}") from None

    def api_text(self, path: str) -> str:
        """A page of the API server as a signed-in browser gets it (HTML)."""
        if self._token is None:
            self._token = airflow_server.token(self.url, "admin")
        status, _, body = airflow_server.get(self.url + path, bearer=self._token, accept="text/html")
        assert status == 200, (status, body[:2000])
        return body

    def wait_dag(self, dag_id: str, timeout: float = 240) -> None:
        """Until the dag-processor has parsed the DAG (a run cannot be triggered before)."""
        def parsed() -> bool:
            try:
                self.api("GET", f"/api/v2/dags/{dag_id}")
                return True
            except AssertionError:
                return False
        assert wait_until(parsed, timeout, 1), self.components["dag-processor"].tail()

    def trigger(self, dag_id: str) -> str:
        self.wait_dag(dag_id)
        run = self.api("POST", f"/api/v2/dags/{dag_id}/dagRuns", {"logical_date": None})
        return str(run["dag_run_id"])

    def task_instance(self, dag_id: str, run_id: str, task_id: str) -> dict[str, Any]:
        return dict(self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}"))

    def tries(self, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
        """Every try of the task instance, first first (with the hostname Airflow recorded for each)."""
        history = self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/tries")
        return sorted(history["task_instances"], key=lambda t: t["try_number"])

    def wait_state(self, dag_id: str, run_id: str, task_id: str, states: set[str], timeout: float = 240,
                   try_number: int | None = None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        ti: dict[str, Any] = {}
        while time.monotonic() < deadline:
            ti = self.task_instance(dag_id, run_id, task_id)
            if ti["state"] in states and (try_number is None or ti["try_number"] >= try_number):
                return ti
            time.sleep(1)
        raise AssertionError(f"{dag_id}.{task_id} still {ti.get('state')} (try {ti.get('try_number')}) "
                             f"after {timeout:.0f} s; scheduler log:\n{self.components['scheduler'].tail()}")

    def clear(self, dag_id: str, run_id: str, task_id: str, *, only_failed: bool = False) -> None:
        """The UI's "Clear" on the task in the run (``only_failed``: on its failed mapped instances)."""
        self.api("POST", f"/api/v2/dags/{dag_id}/clearTaskInstances", {
            "dry_run": False, "task_ids": [task_id], "dag_run_id": run_id, "only_failed": only_failed,
            "reset_dag_runs": True})

    def mapped_instances(self, dag_id: str, run_id: str, task_id: str) -> list[dict[str, Any]]:
        """Every mapped instance of the task in the run, by map index."""
        found = self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/listMapped"
                                "?limit=1000&order_by=map_index")
        return sorted(found["task_instances"], key=lambda t: t["map_index"])

    def mapped_tries(self, dag_id: str, run_id: str, task_id: str, map_index: int) -> list[dict[str, Any]]:
        """Every try of one mapped instance, first first."""
        history = self.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/{map_index}/tries")
        return sorted(history["task_instances"], key=lambda t: t["try_number"])

    def wait_mapped_done(self, dag_id: str, run_id: str, task_id: str, count: int, timeout: float = 600
                         ) -> list[dict[str, Any]]:
        """Until all ``count`` mapped instances have ended (success or failed, retries spent)."""
        deadline = time.monotonic() + timeout
        instances: list[dict[str, Any]] = []
        while time.monotonic() < deadline:
            instances = self.mapped_instances(dag_id, run_id, task_id)
            if len(instances) == count and all(t["state"] in ("success", "failed") for t in instances):
                return instances
            time.sleep(2)
        states = {t["map_index"]: (t["state"], t["try_number"]) for t in instances}
        raise AssertionError(f"{dag_id}.{task_id}: not all {count} instances ended after {timeout:.0f} s: {states}; "
                             f"scheduler log:\n{self.components['scheduler'].tail()}")

    def journal_size_bytes(self) -> dict[str, int]:
        """The shared journal's size: its tables with their indexes and TOAST, and its whole database."""
        import psycopg

        with psycopg.connect(self.journal_url, autocommit=True) as conn:
            tables = conn.execute(
                "SELECT coalesce(sum(pg_total_relation_size(c.oid)), 0) FROM pg_class c "
                "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = 'resumable' AND c.relkind = 'r'"
            ).fetchone()
            database = conn.execute("SELECT pg_database_size(current_database())").fetchone()
        assert tables is not None and database is not None
        return {"tables": int(tables[0]), "database": int(database[0])}

    def task_log(self, dag_id: str, run_id: str, task_id: str, try_number: int, map_index: int | None = None) -> str:
        folder = self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}"
        if map_index is not None:
            folder /= f"map_index={map_index}"
        return "".join(p.read_text(errors="replace") for p in sorted(folder.glob(f"attempt={try_number}*")))

    # -- the receiver's own counts --------------------------------------------------------------

    def receiver(self, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.receiver_url + path, data=data, method="POST" if data else "GET",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def receiver_store(self) -> sqlite3.Connection:
        """The receiver's own store, read-only (its /stats would carry a million item ids over HTTP)."""
        return sqlite3.connect(f"file:{self.receiver_db}?mode=ro", uri=True, timeout=30)

    def receiver_deliveries(self) -> int:
        """How many deliveries the receiver has recorded so far, of every DAG (cheap: its last row number)."""
        with contextlib.closing(self.receiver_store()) as store:
            return int(store.execute("SELECT coalesce(max(seq), 0) FROM deliveries").fetchone()[0])

    def receiver_counts(self, prefix: str) -> dict[str, int]:
        """Deliveries per item id, of the item ids that start with ``prefix-``."""
        with contextlib.closing(self.receiver_store()) as store:
            return dict(store.execute(
                "SELECT item_id, count(*) FROM deliveries WHERE substr(item_id, 1, ?) = ? GROUP BY item_id",
                (len(prefix) + 1, prefix + "-")))


def wait_for_line(log: Path, needle: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.exists():
            for line in log.read_text(errors="replace").splitlines():
                if needle in line:
                    return line
        time.sleep(0.2)
    return ""


def _postmaster_pid(admin_url: str) -> int | None:
    import psycopg

    try:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            row = conn.execute("SELECT setting FROM pg_settings WHERE name = 'data_directory'").fetchone()
        assert row is not None
        return int((Path(row[0]) / "postmaster.pid").read_text().split()[0])
    except Exception:  # noqa: BLE001 - a server elsewhere (RESUMABLE_TEST_POSTGRES_URL): not counted
        return None

