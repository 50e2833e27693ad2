"""Stop means stop under a real scheduler (`airflow standalone`).

"Mark failed" on a running batch task (through the REST API, as the UI's button does): the scheduler's
supervisor learns it at its next heartbeat and sends the task SIGTERM (its log says when); from then
at most ``concurrency`` sends reach the receiver (the receiver's own clock) and the task ends within
5 s. A Clear then completes the job, every item delivered once. "Mark success" on a running batch
leaves a green task and a job the CLI and the page's JSON show as unfinished.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from airflow_resumable.journal import StepJournal
from tests.support import airflow_server
from tests.support.airflow_harness import base_env, migrated_template
from tests.support.airflow_server import api
from tests.support.receivers import DurableReceiver

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

CLI = str(Path(sys.executable).with_name("airflow-resumable"))
SIGTERM_LINE = "shouldn't be running anymore"  # the supervisor, right before it sends SIGTERM
KILLED_LINE = "Task killed!"  # the supervisor, once the task process is gone


def wait_for(what: str, check, timeout: float, server) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}:\n{server.tail()}")


@pytest.fixture(scope="module")
def airflow_up(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("standalone-stop")
    home = migrated_template(tmp)
    port = airflow_server.free_port()
    env = airflow_server.server_env(base_env(home), home, port)
    env.update(
        AIRFLOW__RESUMABLE__JOURNAL_PATH=str(tmp / "worker" / "journal.sqlite3"),
        RESUMABLE_TEST_RECEIVER=str(tmp / "receiver.sqlite3"),
        # How soon a running task learns it was marked: at every turn of its supervisor's loop (a
        # 300-send batch at concurrency 16 is over in about a second).
        AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL="0",
        AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=str(airflow_server.free_port()),
        AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT=str(airflow_server.free_port()),
        AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5",
    )
    server = airflow_server.start(["standalone"], env, f"http://127.0.0.1:{port}", tmp / "standalone.log",
                                  timeout=300)
    try:
        server.env, server.home = env, home
        server.journal, server.receiver = tmp / "worker" / "journal.sqlite3", DurableReceiver(tmp / "receiver.sqlite3")
        yield server
    finally:
        server.stop()


def start_run(server, token: str, dag_id: str) -> tuple[str, str]:
    url = server.url
    wait_for(f"{dag_id} to be parsed", lambda: _exists(f"{url}/api/v2/dags/{dag_id}", token), 240, server)
    api(f"{url}/api/v2/dags/{dag_id}", token, "PATCH", {"is_paused": False})
    run_id = api(f"{url}/api/v2/dags/{dag_id}/dagRuns", token, "POST", {"logical_date": None})["dag_run_id"]
    return run_id, f"{url}/api/v2/dags/{dag_id}/dagRuns/{urllib.parse.quote(run_id, safe='')}"


def _exists(url: str, token: str) -> bool:
    try:
        api(url, token)
        return True
    except urllib.error.HTTPError:
        return False


class AirflowStalled(Exception):
    """Airflow's API server answered the mark with a 500 (seen once: its SQLite metadata DB stalled every
    writer for 60 s, the API's own action log included); nothing of ours was involved."""


def run_stopped_mid_batch(server, token: str, dag_id: str, new_state: str,
                          after_items: int) -> tuple[str, str, str, float, float]:
    """A new run of ``dag_id`` whose batch task is marked ``new_state`` mid-batch (:func:`stop_mid_batch`):
    its run id and URL, and what stop_mid_batch found. If Airflow's API fails the mark itself, that run
    is left to end and one more run is marked instead."""
    for attempt in (1, 2):
        run_id, run_url = start_run(server, token, dag_id)
        try:
            return run_id, run_url, *stop_mid_batch(server, token, dag_id, run_url, run_id, new_state, after_items)
        except AirflowStalled:
            if attempt == 2:
                raise
            print(f"{dag_id}: Airflow's API failed the mark (HTTP 500); that run is left to end, marking a new one")
            wait_for("the unmarked run to end", lambda url=run_url: api(url, token)["state"] in ("success", "failed"),
                     300, server)
    raise AssertionError("unreachable")


def stop_mid_batch(server, token: str, dag_id: str, run_url: str, run_id: str, new_state: str,
                   after_items: int) -> tuple[str, float, float]:
    """Mark the running batch task ``new_state`` once ``after_items`` items arrived; the task log, when
    the task process received the SIGTERM and when it wrote its last line (epoch seconds)."""
    job_id = f"{dag_id}/send/{run_id}"
    wait_for(f"{after_items} items at the receiver",
             lambda: sum(server.receiver.counts(job_id).values()) >= after_items, 300, server)
    try:
        api(f"{run_url}/taskInstances/send", token, "PATCH", {"new_state": new_state})
    except urllib.error.HTTPError as exc:
        if exc.code >= 500:
            raise AirflowStalled(f"PATCH taskInstances/send: HTTP {exc.code}") from exc
        raise
    print(f"{dag_id}: marked {new_state} with {sum(server.receiver.counts(job_id).values())} items sent")
    log_file = server.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / "task_id=send" / "attempt=1.log"

    def killed() -> str | None:
        text = log_file.read_text(errors="replace") if log_file.exists() else ""
        return text if KILLED_LINE in text else None
    log = str(wait_for("the task process to be stopped", killed, 120, server))
    records = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    sigterm = next(n for n, r in enumerate(records) if SIGTERM_LINE in str(r.get("event")))
    stopped = next(n for n, r in enumerate(records) if "Stopped on request" in str(r.get("event")))
    # The task process's own lines carry their source file (the supervisor's do not). Its last one is
    # its runner closing "Post Execute": the task went through to its end, not cut off by SIGKILL.
    # (Airflow 3.3.2's supervisor reaps a task whose output closed before it exited only when its 5 s
    # SIGTERM window runs out: its "Task killed!" line comes 5 s after the SIGTERM whatever the task did.)
    last = max(n for n, r in enumerate(records) if "filename" in r)
    assert sigterm < stopped < last and records[last]["event"] == "::endgroup::", records[sigterm:]
    # When the task process got the SIGTERM: its on_kill notes the time, the "Stopped on request" line says it.
    received = re.search(r"Stopped on request \([^)]*\) at (\S+):", records[stopped]["event"])
    assert received, records[stopped]["event"]
    received_at = datetime.fromisoformat(received.group(1)).timestamp()
    assert _moment(records[sigterm]) <= received_at, (records[sigterm], records[stopped])
    return log, received_at, _moment(records[last])


def _moment(record: dict) -> float:
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


def jobs_in_cli(server) -> dict[str, str]:
    proc = subprocess.run([CLI, "jobs", "--json"], env=server.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return {j["job_id"]: j["status"] for j in json.loads(proc.stdout)}


@pytest.mark.parametrize("concurrency", [1, 16])
def test_mark_failed_then_clear_and_mark_success_under_a_real_scheduler(airflow_up, concurrency):
    """300 items, 20 ms per send (stop_c1, stop_c16). At concurrency 16 the batch lasts about a second:
    it is marked once 16 items arrived."""
    dag_id, after_items = f"stop_c{concurrency}", (60 if concurrency == 1 else 16)
    server, receiver = airflow_up, airflow_up.receiver
    token = airflow_server.token(server.url, "admin")

    # "Mark failed" mid-batch: at most `concurrency` sends after the SIGTERM; the task ends within 5 s.
    run_id, run_url, log, sigterm_at, ended_at = run_stopped_mid_batch(server, token, dag_id, "failed", after_items)
    job_id = f"{dag_id}/send/{run_id}"
    assert "Stopped on request" in log, log[-4000:]
    after = receiver.received_after(sigterm_at)
    print(f"{dag_id}: {after} sends after the SIGTERM, {sum(receiver.counts(job_id).values())} in all, task ended "
          f"{ended_at - sigterm_at:.3f} s after it")
    assert after <= concurrency, (after, concurrency)
    assert ended_at - sigterm_at < 5, ended_at - sigterm_at
    sent = sum(receiver.counts(job_id).values())
    assert after_items <= sent < 300 and receiver.duplicates(job_id) == 0  # stopped mid-batch
    assert jobs_in_cli(server)[job_id] == "unfinished"
    wait_for("the run to fail", lambda: api(run_url, token)["state"] == "failed", 120, server)

    # Clear: the job resumes and completes, every item delivered once.
    api(f"{server.url}/api/v2/dags/{dag_id}/clearTaskInstances", token, "POST",
        {"dry_run": False, "task_ids": ["send"], "dag_run_id": run_id, "only_failed": False, "reset_dag_runs": True})
    wait_for("the cleared run to succeed", lambda: api(run_url, token)["state"] == "success", 300, server)
    counts = receiver.counts(job_id)
    assert len(counts) == 300 and set(counts.values()) == {1}
    with StepJournal(server.journal) as journal:
        assert journal.job(job_id).status == "completed"

    # "Mark success" mid-batch: a green task, and a job the CLI and the page's JSON call unfinished.
    run_id, run_url, *_ = run_stopped_mid_batch(server, token, dag_id, "success", after_items)
    job_id = f"{dag_id}/send/{run_id}"
    wait_for("the run to end", lambda: api(run_url, token)["state"] in ("success", "failed"), 120, server)
    assert api(f"{run_url}/taskInstances/send", token)["state"] == "success"
    assert jobs_in_cli(server)[job_id] == "unfinished"
    page = api(f"{server.url}/resumable/api/jobs/{urllib.parse.quote(job_id, safe='')}", token)
    assert page["job"]["status"] == "unfinished" and page["job"]["finished_at"] is None, page["job"]
    assert after_items <= sum(receiver.counts(job_id).values()) < 300 and receiver.duplicates(job_id) == 0
