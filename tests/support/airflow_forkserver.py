"""A pre-imported Airflow that forks: the tests' `airflow ...` commands without Airflow's start-up each time.

An `airflow dags test` of a 50-item DAG costs ~13 s of CPU here, and ~10 of them are the same in every
run: importing Airflow and building the in-process execution API (its versioned routes). Each pytest
process starts this server once (``python -m tests.support.airflow_forkserver``, in the same virtual environment):
it imports what every command imports and builds the execution API that ``in_process_api_server()``
caches for the process (Airflow 3.3's own cache; on 3.1 and 3.2, which build it for every task, the
server adds that cache). Each command is then a fork of it that takes the test's environment,
working directory and argv, sets Airflow up again from that environment (``settings.initialize()``,
as at import) and runs ``airflow.__main__.main()`` (or a module, as ``python -m`` does) with its
output in files. Its exit code is the command's, as ``subprocess.run`` reports it.

Only commands run to completion go through here (:meth:`tests.support.airflow_harness.Airflow.run` and
``rerun``); a command a test signals or waits beside (``Airflow.popen``) is a process of its own. A
test that sets Airflow settings of its own (statsd, the state store) gets a server started with them.
``RESUMABLE_TEST_AIRFLOW_FORK=0`` turns the server off: every command is then a new process.

The protocol, one JSON line each way on the server's stdin/stdout: a request ``{"argv", "env", "cwd",
"stdout", "stderr"}`` -> ``{"pid"}`` at once, then ``{"returncode", "cpu"}`` when the fork ended (its
user and system seconds: the tests' CPU report counts them, tests/support/cpu_report.py).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ENV_SWITCH = "RESUMABLE_TEST_AIRFLOW_FORK"

# What every command imports, in the order Airflow imports it; a name a minor lacks is skipped.
WARM_MODULES = (
    "airflow.__main__", "airflow.cli.cli_parser", "airflow.cli.commands.dag_command",
    "airflow.cli.commands.task_command", "airflow.models.dagrun", "airflow.sdk",
    "airflow.sdk.execution_time.supervisor", "airflow.sdk.execution_time.task_runner",
    "airflow.api_fastapi.execution_api.app", "airflow.dag_processing.dagbag", "a2wsgi",
    "airflow_resumable.operators.resumable_batch", "airflow_resumable.operators.resolve",
)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0" and hasattr(os, "fork")


# ----------------------------------------------------------------------------------- the server


def _warm() -> None:
    import importlib

    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    from airflow.sdk.execution_time import supervisor

    if not hasattr(supervisor.in_process_api_server, "cache_info"):
        # Airflow 3.1 and 3.2 build the in-process execution API again for every task; 3.3 builds it
        # once per process (functools.lru_cache), as one API server serves every task of a deployment.
        # The forks do as 3.3 does: the same API, built once.
        supervisor.in_process_api_server = functools.lru_cache(maxsize=1)(supervisor.in_process_api_server)
    _initialise_versioned_apps(supervisor.in_process_api_server().app, set())
    if threading.active_count() != 1:  # a fork copies only the thread that forks
        raise RuntimeError(f"the fork server must not start threads: {threading.enumerate()}")


def _initialise_versioned_apps(app, seen: set[int]) -> None:
    """Generate the versioned routes now, not in the first request of every fork (Cadwyn does it lazily)."""
    if id(app) in seen:
        return
    seen.add(id(app))
    if getattr(app, "_cadwyn_initialized", True) is False:
        app._cadwyn_initialize()
    for route in getattr(app, "routes", ()):
        if hasattr(route, "app"):
            _initialise_versioned_apps(route.app, seen)


def _child(request: dict) -> int:
    """In the fork: become the command the request describes, then return its exit code."""
    devnull = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for fd, target in ((devnull, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    env = request["env"]
    os.environ.clear()
    os.environ.update(env)
    os.chdir(request["cwd"])
    sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]

    import airflow.configuration
    from airflow import settings

    airflow.configuration.AIRFLOW_HOME = settings.AIRFLOW_HOME = env["AIRFLOW_HOME"]
    if settings.engine is not None:
        settings.engine.dispose(close=False)  # the server's connections stay the server's
    settings.initialize()
    argv = request["argv"]
    try:
        if argv[0] == "-m":
            import runpy

            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            from airflow.__main__ import main

            sys.argv = ["airflow", *argv]
            main()
        return 0
    except SystemExit as stop:
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1


def serve() -> None:
    replies = os.fdopen(os.dup(1), "w")  # the protocol's; whatever Airflow prints goes to stderr
    os.dup2(2, 1)
    _warm()
    cpu = os.times()

    def reply(**fields) -> None:
        replies.write(json.dumps(fields) + "\n")
        replies.flush()

    reply(ready=[cpu.user, cpu.system])
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                replies.close()
                code = _child(request)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                try:
                    import logging

                    logging.shutdown()
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        reply(pid=pid)
        _, status, usage = os.wait4(pid, 0)
        reply(returncode=os.waitstatus_to_exitcode(status), cpu=[usage.ru_utime, usage.ru_stime])


# ----------------------------------------------------------------------------------- the client


class ForkServer:
    """The client of one server process (one per process and set of Airflow settings: :func:`server`)."""

    def __init__(self, env: dict[str, str], cwd: Path, log: Path) -> None:
        with log.open("w") as stderr:  # the server's own output (Airflow's start-up): for a post-mortem
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.support.airflow_forkserver"], env=env, cwd=cwd,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, text=True)
        self.log = log
        self._pending = b""  # read from the server, not yet a whole line
        ready = self._reply(timeout=300)
        self._count_cpu(ready["ready"])

    def _reply(self, timeout: float) -> dict:
        """The server's next line, read from the pipe's descriptor (a buffered reader could hold the
        next line where select() does not see it)."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._pending:
            readable, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not readable:
                raise TimeoutError
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the Airflow fork server ended (exit {self.proc.wait()}); see {self.log}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    @staticmethod
    def _count_cpu(cpu: list[float]) -> None:
        from tests.support import cpu_report

        cpu_report.count_foreign(*cpu)

    def run(self, argv: list[str], env: dict[str, str], cwd: Path, output: Path,
            timeout: float) -> subprocess.CompletedProcess[str]:
        """Like ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)`` of ``airflow argv``
        (or ``python -m`` when argv starts with "-m"); the output passes through files under ``output``."""
        assert self.proc.stdin is not None
        output.mkdir(parents=True, exist_ok=True)
        stdout, stderr = output / "fork-stdout.txt", output / "fork-stderr.txt"
        request = {"argv": argv, "env": env, "cwd": str(cwd), "stdout": str(stdout), "stderr": str(stderr)}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        pid = self._reply(timeout=60)["pid"]
        try:
            done = self._reply(timeout=timeout)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                os.kill(pid, signal.SIGKILL)
            self._count_cpu(self._reply(timeout=60)["cpu"])
            raise subprocess.TimeoutExpired(argv, timeout, stdout.read_text(errors="replace"),
                                            stderr.read_text(errors="replace")) from None
        self._count_cpu(done["cpu"])
        return subprocess.CompletedProcess(argv, done["returncode"], stdout.read_text(errors="replace"),
                                           stderr.read_text(errors="replace"))

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# What makes one test's Airflow home differ from another's: set again in every fork. Airflow reads most
# other settings once, at import (metrics, the state store, executors), so a fork takes them from its
# server, and each set of them gets a server of its own; what Airflow and this provider read at each use
# (the [resumable] section, connections) may differ between forks of one server.
HOME_SETTINGS = ("AIRFLOW_HOME", "AIRFLOW__CORE__DAGS_FOLDER", "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
                 "AIRFLOW__LOGGING__BASE_LOG_FOLDER")
READ_AT_USE = ("AIRFLOW__RESUMABLE__", "AIRFLOW_CONN_")

_SERVERS: dict[tuple[tuple[str, str], ...], ForkServer] = {}


def server(env: dict[str, str], cwd: Path) -> ForkServer | None:
    """The fork server for ``env``'s Airflow settings (started now if need be), or None when switched off."""
    if not enabled():
        return None
    key = tuple(sorted((k, v) for k, v in env.items() if k.startswith("AIRFLOW") and k not in HOME_SETTINGS
                       and not k.startswith(READ_AT_USE)))
    if key not in _SERVERS or _SERVERS[key].proc.poll() is not None:
        if not _SERVERS:  # waited for at the latest when this process exits (a demo, say): its CPU counted
            atexit.register(stop)
        log = Path(tempfile.mkstemp(prefix="airflow-forkserver-", suffix=".log")[1])
        _SERVERS[key] = ForkServer(env, cwd, log)
    return _SERVERS[key]


def stop() -> None:
    while _SERVERS:
        _SERVERS.popitem()[1].stop()


if __name__ == "__main__":
    serve()
