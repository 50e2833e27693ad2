"""Real Airflow servers for tests: `airflow api-server` / `airflow standalone` on 127.0.0.1 in a
temporary AIRFLOW_HOME, SimpleAuthManager with known users, each started in its own process group
(setsid) so that stopping it kills every child (uvicorn workers, scheduler, dag-processor...)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.support.airflow_harness import AIRFLOW, base_env

USERS = {"admin": "admin-password", "viewer": "viewer-password"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(env: dict[str, str], home: Path, port: int) -> dict[str, str]:
    """Auth with known users and passwords, the API on `port`, secrets shared by all processes."""
    passwords = home / "passwords.json"
    passwords.write_text(json.dumps(USERS))
    env = dict(env)
    # `airflow standalone` starts its components as `airflow ...` from PATH: this venv's.
    env["PATH"] = os.pathsep.join([str(Path(AIRFLOW).parent), env.get("PATH", "")])
    env.update(
        AIRFLOW__CORE__AUTH_MANAGER="airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS="admin:admin,viewer:viewer",
        AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE=str(passwords),
        AIRFLOW__API__HOST="127.0.0.1",
        AIRFLOW__API__PORT=str(port),
        AIRFLOW__API__BASE_URL=f"http://127.0.0.1:{port}",
        AIRFLOW__API__WORKERS="1",
        AIRFLOW__CORE__EXECUTION_API_SERVER_URL=f"http://127.0.0.1:{port}/execution/",
        AIRFLOW__API_AUTH__JWT_SECRET=secrets.token_urlsafe(32),
        AIRFLOW__API__SECRET_KEY=secrets.token_urlsafe(32),
    )
    return env


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        try:  # children that outlived the leader
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def tail(self, chars: int = 6000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


def start(args: list[str], env: dict[str, str], url: str, log: Path, timeout: float = 240) -> Server:
    """Start `airflow <args>` and wait until the API answers its health check."""
    handle = log.open("wb")
    proc = subprocess.Popen([AIRFLOW, *args], env=env, stdout=handle, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    server = Server(proc, url, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"airflow {' '.join(args)} exited with {proc.returncode}:\n{server.tail()}")
        try:
            with urllib.request.urlopen(url + "/api/v2/monitor/health", timeout=5) as response:
                if response.status == 200:
                    return server
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    server.stop()
    raise AssertionError(f"airflow {' '.join(args)} did not answer within {timeout:.0f} s:\n{server.tail()}")


def api_server(template: Path, folder: Path, config: dict[str, str]) -> Server:
    """`airflow api-server` on 127.0.0.1 as a host of its own: an AIRFLOW_HOME copied from ``template``
    into ``folder``, with ``config`` added to its environment (where the journal is, connections)."""
    home = folder / "airflow"
    shutil.copytree(template, home)
    port = free_port()
    env = server_env({**base_env(home), **config}, home, port)
    return start(["api-server", "--port", str(port), "--host", "127.0.0.1", "--workers", "1"], env,
                 f"http://127.0.0.1:{port}", folder / "api-server.log")


# How long a call to a busy server may take before the test gives up on it: generous, since these calls
# wait on an API server that shares a loaded machine with other tests' servers; no call is timed.
CALL_TIMEOUT = 120


def token(url: str, username: str = "admin") -> str:
    """A JWT from Airflow's own login endpoint (what the UI's login form posts to)."""
    body = json.dumps({"username": username, "password": USERS[username]}).encode()
    request = urllib.request.Request(url + "/auth/token", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=CALL_TIMEOUT) as response:
        return json.loads(response.read())["access_token"]


def api(url: str, token: str, method: str = "GET", body: dict | None = None) -> dict:
    """A JSON call to Airflow's REST API (or this provider's page API) with a bearer token."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Content-Type": "application/json", "Accept": "application/json"})
    with urllib.request.urlopen(request, timeout=CALL_TIMEOUT) as response:
        return json.loads(response.read() or b"{}")


def get(url: str, *, bearer: str | None = None, cookie: str | None = None,
        accept: str = "application/json") -> tuple[int, dict[str, str], str]:
    headers = {"Accept": accept}
    if bearer:
        headers["Authorization"] = f"Bearer {bearer}"
    if cookie:
        headers["Cookie"] = f"_token={cookie}"
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=CALL_TIMEOUT) as response:
            return response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read().decode()
