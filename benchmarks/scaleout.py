"""Scale-out: 8 runner processes, each running its own job, on ONE PostgreSQL journal, vs 1 process.

Informational (no target). Each runner is a process of its own (``python -m benchmarks.scaleout
--worker``) with its own connection, running ``run_batch`` at full durability over the cost
benchmarks' batch (:mod:`benchmarks.workload`: three no-op steps, ``notify`` a side effect), so
the figure is the journal's own throughput, nothing else's: every item is a synchronous commit
(its ``IN_FLIGHT`` mark) plus an asynchronous one (its receipt). The runners open the journal,
say they are ready, and start together on one word from the parent; aggregate throughput = items
of all runners / (start -> last runner done), timed by the parent. One throwaway cluster
(:mod:`benchmarks.pg`), one database and one journal schema for all runs. On a machine with fewer
cores than runners, the runners and the server share the CPUs: the figure says how far the journal
scales there, not on a server of its own.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import run_batch
from benchmarks import workload

REPO = Path(__file__).resolve().parents[1]
SCHEMA = "scaleout"


def _worker(url: str, job_id: str, n: int) -> None:
    """One runner: open the journal, say ready, wait for the word, run its job, print what it did."""
    logging.getLogger("airflow_resumable").setLevel(logging.ERROR)
    with StepJournal(url, durability="full", schema=SCHEMA) as journal:
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        start = time.perf_counter()
        result = run_batch(journal, job_id, workload.items(n), workload.steps(), runner=job_id)
        seconds = time.perf_counter() - start
        print(json.dumps({
            "seconds": seconds, "status": result.status, "executed_steps": result.executed_steps,
            "skipped_steps": result.skipped_steps, "commits": journal.commit_count,
            "durable_commits": journal.durable_commit_count,
        }), flush=True)


def _run_level(url: str, processes: int, n: int, tag: str) -> dict[str, Any]:
    """``processes`` runners at once, each its own job of ``n`` items; aggregate items per second."""
    workers = [
        subprocess.Popen([sys.executable, "-m", "benchmarks.scaleout", "--worker", url, f"scaleout-{tag}-{k}", str(n)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)
        for k in range(processes)
    ]
    try:
        for w in workers:
            assert w.stdout is not None
            if w.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a scale-out runner did not start (exit {w.wait(timeout=30)})")
        start = time.perf_counter()
        for w in workers:
            assert w.stdin is not None
            w.stdin.write("go\n")
            w.stdin.flush()
        done = []
        for w in workers:
            assert w.stdout is not None
            line = w.stdout.readline()
            if not line:
                raise RuntimeError(f"a scale-out runner failed (exit {w.wait(timeout=30)}); see its output above")
            done.append(json.loads(line))
        seconds = time.perf_counter() - start
    finally:
        for w in workers:  # our own children, by their handles
            if w.stdin is not None:
                w.stdin.close()
            try:
                w.wait(timeout=30)
            except subprocess.TimeoutExpired:
                w.kill()
                w.wait()
    steps = len(workload.STEP_NAMES)
    for d in done:
        # A benchmark that silently did less work would report a flattering figure.
        if d["status"] != "completed" or d["executed_steps"] != steps * n or d["skipped_steps"] != 0:
            raise AssertionError(f"a scale-out runner did not run its whole job: {d}")
    items = processes * n
    return {
        "processes": processes,
        "items": items,
        "seconds": seconds,
        "items_per_second": items / seconds,
        "runner_seconds": [d["seconds"] for d in done],
        "commits_per_item": sum(d["commits"] for d in done) / items,
        "durable_commits_per_item": sum(d["durable_commits"] for d in done) / items,
    }


def measure(n: int, processes: int = 8, reps: int = 1) -> dict[str, Any]:
    """Aggregate throughput of ``processes`` runners vs one, ``n`` items per runner, ``reps`` times interleaved."""
    from benchmarks import pg

    if (why := pg.unavailable()) is not None:
        return {"skipped": why}
    levels = (1, processes)
    runs: dict[int, list[dict[str, Any]]] = {level: [] for level in levels}
    with pg.throwaway_server() as server:
        url = server.new_database()
        with StepJournal(url, schema=SCHEMA):
            pass  # the schema is created here, not by runners racing each other inside the timed part
        for rep in range(max(1, reps)):
            for level in levels:
                runs[level].append(_run_level(url, level, n, f"{level}x{rep}"))
        with StepJournal(url, schema=SCHEMA) as journal:
            jobs = journal.jobs()
        version = server.version()
    # Read back from the journal: every job of every runner is there, every item settled.
    expected_jobs = max(1, reps) * sum(levels)
    if len(jobs) != expected_jobs or any(job.items != n or not job.settled for job in jobs):
        raise AssertionError(f"the journal does not hold {expected_jobs} settled jobs of {n} items each")

    def median_run(level: int) -> dict[str, Any]:
        # The median repetition itself (the lower of the two middle ones for an even count), so its
        # seconds and items per second belong together; every repetition's rate beside it.
        chosen = sorted(runs[level], key=lambda run: run["items_per_second"])[(len(runs[level]) - 1) // 2]
        return chosen | {"items_per_second_all": [run["items_per_second"] for run in runs[level]]}

    one, many = median_run(1), median_run(processes)
    return {
        "engine": "postgresql",
        "postgres_version": version,
        "durability": "full",
        "n_per_process": n,
        "processes": processes,
        "reps": max(1, reps),
        "jobs_in_journal": len(jobs),
        "runs": {"1": one, str(processes): many},
        "throughput_ratio": many["items_per_second"] / one["items_per_second"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="one runner process of the scale-out benchmark")
    parser.add_argument("--worker", nargs=3, metavar=("URL", "JOB", "N"), required=True)
    args = parser.parse_args()
    _worker(args.worker[0], args.worker[1], int(args.worker[2]))
