"""The article's experiment end to end through real Airflow: `python -m demo` (or `make demo`).

A temporary AIRFLOW_HOME with a SQLite metadata DB, the demo HTTP receiver on 127.0.0.1 (with
idempotency dedupe OFF, so every duplicate send is counted), `airflow dags test` with retries, the
resolve DAG, and a Clear. Every duplicate count is read from the receiver's own store. The Airflow
commands run as the tests' do: forks of one pre-imported Airflow (tests/support/airflow_forkserver.py;
RESUMABLE_TEST_AIRFLOW_FORK=0 starts a new `airflow` process for each).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from airflow_resumable.runner import idempotency_key
from tests.support.airflow_harness import REPO, Airflow, migrated_template

MODES = {"before_accept": "fault before accept", "after_accept": "fault after accept"}


class Receiver:
    def __init__(self, db: Path) -> None:
        db.parent.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "airflow_resumable.demo_receiver", "--port", "0", "--db", str(db), "--no-dedupe"],
            stdout=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline()  # "demo receiver on http://127.0.0.1:PORT (...)"
        self.url = line.split()[3]

    def call(self, path: str, body: dict | None = None) -> tuple[int, dict]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST" if data else "GET",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


def _airflow(template: Path, tmp: Path, receiver: Receiver) -> Airflow:
    airflow = Airflow.create(template, tmp)
    airflow.env["AIRFLOW_CONN_DEMO_RECEIVER"] = json.dumps({"conn_type": "http", "host": receiver.url})
    return airflow


def _must(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        sys.exit(f"demo step failed: {what}\n{(proc.stdout + proc.stderr)[-4000:]}")


def baseline(template: Path, tmp: Path, mode: str) -> dict:
    receiver = Receiver(tmp / "receiver.sqlite3")
    try:
        receiver.call("/faults", {"item_id": "item-041", "mode": mode})
        airflow = _airflow(template, tmp, receiver)
        started = time.perf_counter()
        _must(airflow.dags_test("article_rerun_everything"), "re-run-everything DAG")
        return {"executed": airflow.xcom("article_rerun_everything", "send"),
                "stats": receiver.call("/stats")[1], "wall": time.perf_counter() - started}
    finally:
        receiver.stop()


def resumable(template: Path, tmp: Path, mode: str) -> dict:
    receiver = Receiver(tmp / "receiver.sqlite3")
    try:
        receiver.call("/faults", {"item_id": "item-041", "mode": mode})
        airflow = _airflow(template, tmp, receiver)
        if airflow.dags_test("article_resumable").returncode == 0:
            sys.exit("demo: the resumable task should have ended failed with item-041 held")
        run_id = airflow.last_run_id("article_resumable")
        second = airflow.xcom("article_resumable", "send", key="resumable_summary")
        job_id = second["job_id"]
        # The on-call engineer asks the receiver about the held item, then records the answer.
        status, found = receiver.call("/notifications/" + idempotency_key(job_id, "item-041", "notify_external"))
        conf = {"job_id": job_id, "item_id": "item-041", "step": "notify_external"}
        if status == 200:
            conf.update(decision="delivered", receipt=found["receipt"], note="receiver has it")
        else:
            conf.update(decision="not_delivered", note="receiver has no record")
        _must(airflow.dags_test("resolve_held_item", conf), "resolve DAG")
        _must(airflow.run("tasks", "clear", "article_resumable", "-t", "send", "-y"), "tasks clear")
        _must(airflow.rerun("article_resumable", run_id), "re-run after Clear")
        third = airflow.xcom("article_resumable", "send", run_id=run_id)
        return {"second": second, "third": third, "decision": conf["decision"],
                "stats": receiver.call("/stats")[1]}
    finally:
        receiver.stop()


def settled(template: Path, tmp: Path, mode: str) -> dict:
    """The same fault with the defaults (settlement in the task): one try, nothing held."""
    receiver = Receiver(tmp / "receiver.sqlite3")
    try:
        receiver.call("/faults", {"item_id": "item-041", "mode": mode})
        airflow = _airflow(template, tmp, receiver)
        _must(airflow.dags_test("article_settled"), "settled-in-the-task DAG")
        summary = airflow.xcom("article_settled", "send", key="resumable_summary")
        return {"summary": summary, "tries": airflow.task_states("article_settled")[("send", -1)][1],
                "stats": receiver.call("/stats")[1]}
    finally:
        receiver.stop()


def main() -> None:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="resumable-demo-") as tmpdir:
        root = Path(tmpdir)
        print("Setting up Airflow (SQLite metadata DB) in", root, flush=True)
        template = migrated_template(root, sorted((REPO / "dags").glob("*.py")))
        results = {}
        for mode in MODES:
            print(f"Running the article's scenario, {MODES[mode]} ...", flush=True)
            results[mode] = (baseline(template, root / f"plain-{mode}", mode),
                             resumable(template, root / f"resumable-{mode}", mode),
                             settled(template, root / f"settled-{mode}", mode))
    rows = [("", "re-run everything", "resumable (this provider)")]
    for mode, (plain, ours, settling) in results.items():
        s2, s3 = ours["second"], ours["third"]
        rows += [
            (f"[{MODES[mode]}]", "", ""),
            ("steps executed on re-run", str(plain["executed"]),
             f"2nd run: {s2['executed_steps']}; 3rd run after resolution: {s3['executed_steps']}"),
            ("steps skipped on re-run", "0", f"2nd run: {s2['skipped_steps']}"),
            ("duplicate sends (receiver's count)", str(plain["stats"]["duplicates"]), str(ours["stats"]["duplicates"])),
            ("items received", str(plain["stats"]["items"]), str(ours["stats"]["items"])),
            ("item-041", "re-sent blindly",
             f"held ({', '.join(h['reason'] for h in s2['held'])}), then {ours['decision']} -> "
             + ("sent once" if ours["decision"] == "not_delivered" else "marked done, not re-sent")),
            ("with the defaults (settled in the task)", "",
             f"{settling['tries']} try, {len(settling['summary']['held'])} held, "
             f"{settling['stats']['duplicates']} duplicates, {settling['stats']['items']} items received"),
        ]
    print_table(rows, started)


def print_table(rows: list[tuple[str, str, str]], started: float) -> None:
    """The comparison table, its columns aligned, and how long the demo took."""
    width = [max(len(r[i]) for r in rows) for i in range(3)]
    print()
    for row in rows:
        print("  ".join(cell.ljust(width[i]) for i, cell in enumerate(row)))
    print(f"\nDemo finished in {time.perf_counter() - started:.0f} s.")


if __name__ == "__main__":
    main()
