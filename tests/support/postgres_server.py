"""A throwaway PostgreSQL cluster for the tests: initdb in a temporary folder, a free port, trust auth.

Started once per test session (or taken from ``RESUMABLE_TEST_POSTGRES_URL``, a URL of a role that
may create databases); each test gets a database of its own. As root, the server runs as the
``postgres`` OS user, as PostgreSQL requires.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

ENV_URL = "RESUMABLE_TEST_POSTGRES_URL"
HOW_TO_ENABLE = (
    "PostgreSQL tests SKIPPED: no PostgreSQL server binaries found (initdb, pg_ctl). Install them "
    "(Debian: apt-get install postgresql) or set RESUMABLE_TEST_POSTGRES_URL=postgresql://user:pw@host/db "
    "(a role that may create databases) to run the journal's contract tests on PostgreSQL too."
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_bindir() -> Path | None:
    candidates = []
    if shutil.which("pg_config"):
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False).stdout.strip()
        candidates.append(out)
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    for folder in candidates:
        if folder and (Path(folder) / "initdb").exists() and (Path(folder) / "pg_ctl").exists():
            return Path(folder)
    return None


class PostgresCluster:
    """One local cluster; ``url(db)`` gives a libpq URL to a database of it."""

    def __init__(self, bindir: Path, *, listen: str = "127.0.0.1") -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="resumable-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.host = "127.0.0.1"
        self.listen = listen
        self._as_postgres = os.geteuid() == 0
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-instructions")
        settings = {"max_connections": "300", "shared_buffers": "'64MB'", "listen_addresses": f"'{listen}'",
                    "unix_socket_directories": f"'{self.root}'", "port": str(self.port)}
        with open(self.data / "postgresql.conf", "a", encoding="utf-8") as conf:
            conf.write("".join(f"{key} = {value}\n" for key, value in settings.items()))
        if listen != "127.0.0.1":
            with open(self.data / "pg_hba.conf", "a", encoding="utf-8") as hba:
                hba.write("host all all 0.0.0.0/0 trust\n")
        self.start()

    @classmethod
    def standby_of(cls, primary: PostgresCluster) -> PostgresCluster:
        """A streaming standby of ``primary`` (``pg_basebackup -R``: asynchronous, as a replica is by
        default), started on a port of its own."""
        self = cls.__new__(cls)
        self.bindir, self.host, self.listen = primary.bindir, primary.host, primary.listen
        self.root = Path(tempfile.mkdtemp(prefix="resumable-pg-standby-"))
        self.data = self.root / "data"
        self.port = free_port()
        self._as_postgres = primary._as_postgres
        if self._as_postgres:
            entry = pwd.getpwnam("postgres")
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
        self._run("pg_basebackup", "-h", primary.host, "-p", str(primary.port), "-U", "postgres", "-D",
                  str(self.data), "-R", "-X", "stream", "-c", "fast")
        with open(self.data / "postgresql.conf", "a", encoding="utf-8") as conf:  # later lines win
            conf.write(f"port = {self.port}\nunix_socket_directories = '{self.root}'\n")
        self.start()
        return self

    def promote(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

    def kill(self) -> None:
        """Stop the server as a crash would (``pg_ctl stop -m immediate``), and leave it stopped."""
        self._run("pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop", check=False)

    def _run(self, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.bindir / tool), *args]
        if self._as_postgres:
            cmd = ["runuser", "-u", "postgres", "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
        if check and done.returncode != 0:
            raise RuntimeError(f"{tool} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done

    def start(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-w", "-t", "60", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop", check=False)

    def crash_restart(self) -> None:
        """Kill the server as a crash would (no checkpoint), then start it again: crash recovery."""
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.root / "server.log"), "-m", "immediate",
                  "-w", "-t", "60", "restart")

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/{dbname}"

    def new_database(self) -> str:
        return create_database(self.url())

    def postmaster_cpu(self) -> list[float] | None:
        """(user, system, 0) seconds the server has used so far: its postmaster and every backend it reaped."""
        from tests.support.cpu_report import process_tree_cpu

        try:
            pid = int((self.data / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None
        return process_tree_cpu(pid)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def create_database(admin_url: str) -> str:
    """A new empty database next to ``admin_url``'s; returns its URL."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    params = conninfo_to_dict(admin_url)
    params["dbname"] = name
    user = params.get("user", "")
    password = f":{params['password']}" if params.get("password") else ""
    host = params.get("host", "localhost")
    port = f":{params['port']}" if params.get("port") else ""
    extra = {k: v for k, v in params.items() if k not in ("user", "password", "host", "port", "dbname")}
    query = ("?" + "&".join(f"{k}={v}" for k, v in extra.items())) if extra else ""
    return f"postgresql://{user}{password}{'@' if user else ''}{host}{port}/{name}{query}"


def catch_up_and_cut_off(primary_url: str, standby_url: str, timeout: float = 60.0) -> None:
    """Wait until the standby has replayed everything the primary has written so far, then cut it off
    (its WAL receiver pointed at a port nobody listens on): what it has is what a promotion keeps."""
    import psycopg

    with psycopg.connect(primary_url, autocommit=True) as primary:
        target = primary.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
    with psycopg.connect(standby_url, autocommit=True) as standby:
        caught_up = wait_until(lambda: standby.execute(
            "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (str(target),)).fetchone()[0], timeout)
        assert caught_up, "the standby did not catch up"
        standby.execute("ALTER SYSTEM SET primary_conninfo = 'host=127.0.0.1 port=1 user=postgres'")
        standby.execute("SELECT pg_reload_conf()")
        assert wait_until(lambda: standby.execute(
            "SELECT count(*) FROM pg_stat_wal_receiver WHERE status = 'streaming'").fetchone()[0] == 0, timeout), (
            "the standby still streams")


def wait_until(predicate, timeout: float, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()
