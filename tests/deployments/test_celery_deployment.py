"""A real CeleryExecutor deployment (tests/support/celery_deployment.py): a worker dies mid-batch, the retry
lands on the other worker. On the shared journal it resumes; on worker-local SQLite journals the
wrong-worker guard refuses it (naming the dead worker) and it resumes once back on that worker. The
deferrable HeldItemSensor waits in the triggerer. The UI page and the CLI on the API server's host
read the shared journal with no journal file there.

One deployment for the module (it takes ~15 s to start); each test leaves both workers running.
Every count is the receiver's own (its SQLite store, read over HTTP).
"""

from __future__ import annotations

import html
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_resumable.runner import idempotency_key
from tests.support.celery_deployment import CeleryDeployment, require_redis_server
from tests.support.postgres_server import wait_until

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

WORKERS = ("worker-a", "worker-b")
CLI = str(Path(sys.executable).with_name("airflow-resumable"))


@pytest.fixture(scope="module")
def deployment(postgres, tmp_path_factory):
    require_redis_server("the Celery deployment tests")
    started = time.monotonic()
    deploy = CeleryDeployment(tmp_path_factory.mktemp("celery"), postgres.admin_url)
    try:
        deploy.start()
        deploy.startup_seconds = time.monotonic() - started
        yield deploy
    finally:
        deploy.stop()
        figures = {"startup_s": round(getattr(deploy, "startup_seconds", 0.0), 1),
                   "module_s": round(time.monotonic() - started, 1),
                   "peak_rss_mib": round(deploy.peak_rss_kib / 1024)}
        print(f"\nCelery deployment: {json.dumps(figures)}", file=sys.stderr)
        (deploy.root / "figures.json").write_text(json.dumps(figures))


@pytest.fixture
def celery(deployment):
    """The deployment with both workers up (a test may have killed or stopped one)."""
    for name in WORKERS:
        component = deployment.components.get(name)
        if component is None or component.proc.poll() is not None:
            deployment.start_worker(name)
    for name in WORKERS:
        deployment.wait_worker_ready(name)
    return deployment


def delivered(celery: CeleryDeployment, prefix: str) -> dict[str, int]:
    per_item = celery.receiver("/stats")["per_item"]
    return {item: n for item, n in per_item.items() if item.startswith(prefix + "-")}


def start_and_kill_first_worker(celery: CeleryDeployment, dag_id: str, prefix: str) -> tuple[str, str, str, int]:
    """Trigger the DAG; once try 1 has sent 40 items, SIGKILL its worker's whole session.

    Returns (run_id, worker of try 1, the other worker, deliveries at the kill)."""
    run_id = celery.trigger(dag_id)
    assert wait_until(lambda: len(delivered(celery, prefix)) >= 40, 180, 0.1), celery.components["scheduler"].tail()
    first = celery.task_instance(dag_id, run_id, "send")
    assert first["try_number"] == 1 and first["state"] == "running", first
    worker_a = first["hostname"]
    assert worker_a in WORKERS, worker_a
    worker_b = next(w for w in WORKERS if w != worker_a)
    killed = celery.components[worker_a].kill()
    assert len(killed) >= 3, killed  # the Celery worker, its pool, the task supervisor and the task runner
    at_kill = sum(delivered(celery, prefix).values())
    assert 40 <= at_kill < 300, at_kill
    return run_id, worker_a, worker_b, at_kill


def cli(celery: CeleryDeployment, *args: str) -> subprocess.CompletedProcess[str]:
    """airflow-resumable on the API server's host: the shared journal through the config, no file."""
    return subprocess.run([CLI, *args], env=celery.api_host_env(), capture_output=True, text=True, timeout=120,
                          check=False)


def settle_held(celery: CeleryDeployment, job_id: str, *where: str) -> int:
    """What the on-call engineer does: ask the receiver about each held send's key, then resolve it.
    ``where``: the CLI's journal options (default: the API server host's config, the shared journal)."""
    out = cli(celery, *where, "--json", "held", job_id)
    assert out.returncode == 0, out.stderr
    held = json.loads(out.stdout)
    for row in held:
        key = idempotency_key(job_id, row["item_id"], row["step"])
        try:
            receipt = celery.receiver(f"/notifications/{key}")["receipt"]
        except Exception:  # noqa: BLE001 - 404: the receiver never got it
            receipt = None
        decision = ["--delivered", "--receipt", receipt] if receipt else ["--not-delivered"]
        done = cli(celery, *where, "resolve", job_id, row["item_id"], row["step"], *decision, "--resolved-by",
                   "on-call")
        assert done.returncode == 0, done.stderr
    return len(held)


def run_to_success(celery: CeleryDeployment, dag_id: str, run_id: str, after_try: int, *where: str) -> dict:
    """Wait for the task's tries after ``after_try`` to end; while they end held (a send in flight at the
    kill that the receiver never got: verify cannot settle it), settle the held sends and Clear."""
    job_id = f"{dag_id}/send/{run_id}"
    for _ in range(3):
        ti = celery.wait_state(dag_id, run_id, "send", {"success", "failed"}, timeout=300, try_number=after_try + 1)
        if ti["state"] == "success":
            return ti
        log = celery.task_log(dag_id, run_id, "send", ti["try_number"])
        assert "HeldItems" in log and "WrongWorkerError" not in log, log[-3000:]  # HeldItems(NeedAHuman)Error
        assert settle_held(celery, job_id, *where) >= 1
        celery.clear(dag_id, run_id, "send")
        after_try = ti["try_number"]
    raise AssertionError(f"{job_id} did not succeed: {ti}")


def test_a_retry_on_another_worker_resumes_from_the_shared_journal(celery):
    dag_id = "celery_shared"
    run_id, worker_a, worker_b, at_kill = start_and_kill_first_worker(celery, dag_id, "shared")
    job_id = f"{dag_id}/send/{run_id}"

    celery.wait_state(dag_id, run_id, "send", {"success", "failed"}, timeout=300, try_number=2)
    tries = celery.tries(dag_id, run_id, "send")
    assert [t["hostname"] for t in tries[:2]] == [worker_a, worker_b], tries
    assert "WrongWorkerError" not in celery.task_log(dag_id, run_id, "send", 2)
    run_to_success(celery, dag_id, run_id, 1)

    counts = delivered(celery, "shared")
    assert celery.receiver("/stats")["duplicates"] == 0
    assert len(counts) == 300 and set(counts.values()) == {1}, {k: v for k, v in counts.items() if v != 1}
    # Try 2 resumed: it skipped what try 1 had sent before the kill (nothing started over).
    summary = celery.api("GET", f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/send/xcomEntries/"
                                "resumable_summary?deserialize=true")["value"]
    if isinstance(summary, str):
        summary = json.loads(summary)
    assert summary["journal_kind"] == "postgresql" and summary["hostname"] in WORKERS
    assert summary["skipped_steps"] >= at_kill, summary

    # The API server's host reads the job from the shared journal, and has no journal file.
    jobs = celery.api("GET", "/resumable/jobs.json")
    job = next(j for j in jobs["jobs"] if j["job_id"] == job_id)
    assert job["held"] == 0 and job["items"] == 300 and job["steps_succeeded"] == 600, job
    out = cli(celery, "--json", "jobs")
    assert out.returncode == 0, out.stderr
    assert any(j["job_id"] == job_id for j in json.loads(out.stdout))
    assert not celery.api_host_journal.exists()


def test_local_journals_refuse_the_retry_on_the_other_worker_until_it_is_back_on_the_first(celery):
    dag_id = "celery_local"
    run_id, worker_a, worker_b, at_kill = start_and_kill_first_worker(celery, dag_id, "local")
    celery.wait_state(dag_id, run_id, "send", {"failed"}, timeout=300, try_number=2)
    tries = celery.tries(dag_id, run_id, "send")
    assert [t["hostname"] for t in tries[:2]] == [worker_a, worker_b], tries
    log = celery.task_log(dag_id, run_id, "send", 2)
    assert "WrongWorkerError" in log and f"on host {worker_a!r}" in log and f"runs on {worker_b!r}" in log, log[-3000:]
    assert "Nothing was sent" in log
    assert sum(delivered(celery, "local").values()) == at_kill  # worker B sent nothing
    assert not (celery.root / worker_b / "journal.sqlite3").exists() or "local-" not in (
        celery.root / worker_b / "journal.sqlite3").read_bytes().decode(errors="replace")

    # Back on worker A's journal: B leaves the queue, A comes back with its disk, the on-call Clears.
    celery.components[worker_b].stop()
    celery.start_worker(worker_a)
    celery.wait_worker_ready(worker_a)
    celery.clear(dag_id, run_id, "send")
    run_to_success(celery, dag_id, run_id, 2, "--journal", str(celery.root / worker_a / "journal.sqlite3"))
    assert {t["hostname"] for t in celery.tries(dag_id, run_id, "send")[2:]} == {worker_a}
    counts = delivered(celery, "local")
    assert len(counts) == 300 and set(counts.values()) == {1}, {k: v for k, v in counts.items() if v != 1}


def test_deferrable_sensor_waits_in_the_triggerer_until_the_held_item_is_settled(celery):
    dag_id = "celery_sensor"
    celery.receiver("/faults", {"item_id": "sensor-005", "mode": "after_accept"})
    run_id = celery.trigger(dag_id)
    job_id = f"{dag_id}/send/{run_id}"
    batch = celery.wait_state(dag_id, run_id, "send", {"success", "failed"}, timeout=240, try_number=2)
    assert batch["state"] == "success"  # try 2 held the lost reply; on_held="succeed": the sensor waits
    sensor = celery.wait_state(dag_id, run_id, "wait_for_settled", {"deferred", "success", "failed"}, timeout=240)
    assert sensor["state"] == "deferred", sensor
    time.sleep(6)  # a few polls of the trigger: still waiting, in the triggerer, not on a worker
    sensor = celery.task_instance(dag_id, run_id, "wait_for_settled")
    assert sensor["state"] == "deferred" and sensor["trigger"] is not None, sensor
    assert sensor["triggerer_job"] is not None, sensor

    # The API server's host sees the held item, through the page and the CLI.
    jobs = celery.api("GET", "/resumable/jobs.json")
    assert [(h["job_id"], h["item_id"]) for h in jobs["held"] if h["job_id"] == job_id] == [(job_id, "sensor-005")]
    page = html.unescape(celery.api_text("/resumable/").replace("<wbr>", ""))
    assert job_id in page and "sensor-005" in page and "connection resumable_journal" in page
    assert settle_held(celery, job_id) == 1  # the receiver has it: resolved as delivered, with its receipt

    sensor = celery.wait_state(dag_id, run_id, "wait_for_settled", {"success", "failed"}, timeout=120)
    assert sensor["state"] == "success", sensor
    assert delivered(celery, "sensor") == {f"sensor-{i:03d}": 1 for i in range(1, 21)}
    assert not celery.api_host_journal.exists()
