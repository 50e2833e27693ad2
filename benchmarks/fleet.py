"""A fleet run, ``python -m benchmarks.fleet`` (``make bench-fleet``): one batch sharded over mapped
task instances on a real CeleryExecutor, a worker SIGKILLed midway.

The deployment is the tests' (:mod:`tests.support.celery_deployment`): PostgreSQL metadata DB and shared
journal (connection ``resumable_journal``) in a throwaway cluster of its own, Redis, api-server,
scheduler, dag-processor, triggerer and two Celery workers, each a Unix session of its own. The
receiver is the demo receiver (dedupe off: every duplicate counts) taking 4 ms per notification. The
DAGs are ``tests/celery_dags/celery_fleet.py``.

1. ``celery_fleet``: ``--items`` over ``--shards`` mapped ResumableBatchOperator instances,
   ``concurrency=16`` each. Each worker has ``--worker-concurrency`` slots (default: half the shards,
   so every shard runs at once on the two workers). Once half of the items are delivered, every
   process of the worker running the lowest-numbered running shard - its whole session: Celery pool,
   task supervisors, task runners - is SIGKILLed. Its instances are found dead by their missing
   heartbeat, retry on the other worker and resume from the shared journal. A send that was in flight
   at the kill and that the receiver never got is held (the look-up cannot tell "not yet" from
   "never"): the on-call engineer settles every held send of the run at once - ``held --json``, the
   receiver's look-up by key, ``resolve --file`` - and Clears the failed instances.
2. The killed worker is started again, and ``celery_fleet_plain`` sends the same number of items
   over the same shards with a ``PythonOperator`` and a plain thread pool of 16: no journal.

Every count is the receiver's own (its SQLite store). Prints a table and writes
``benchmarks/fleet_results.json``. Try it small: ``--items 20000 --shards 8``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from tests.celery_dags.celery_fleet import FLEET_DAG_ID, PLAIN_DAG_ID, item_id
from tests.support.celery_deployment import CeleryDeployment
from tests.support.postgres_server import wait_until

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "fleet_results.json"
CLI = str(Path(sys.executable).with_name("airflow-resumable"))
WORKERS = ("worker-a", "worker-b")
REPLY_MS = 4.0
SEND_CONCURRENCY = 16
TASK_ID = "send"
MIB = 1024 * 1024


@dataclass(frozen=True)
class FleetSize:
    items: int
    shards: int
    concurrency: int = SEND_CONCURRENCY  # sends in flight per mapped instance
    worker_concurrency: int = 0  # Celery slots per worker; 0: enough for every shard at once on two

    @property
    def slots(self) -> int:
        return self.worker_concurrency or math.ceil(self.shards / len(WORKERS))


def deployment(root: Path, postgres_admin_url: str, size: FleetSize) -> CeleryDeployment:
    """The fleet's deployment (not started): the fleet DAGs only, the 4 ms receiver, the sizes in the env."""
    return CeleryDeployment(root, postgres_admin_url, worker_concurrency=size.slots, receiver_reply_ms=REPLY_MS,
                            dag_files=("celery_fleet.py",),
                            extra_env={"RESUMABLE_FLEET_ITEMS": str(size.items),
                                       "RESUMABLE_FLEET_SHARDS": str(size.shards),
                                       "RESUMABLE_FLEET_CONCURRENCY": str(size.concurrency),
                                       # The killed worker's retries wait for the survivor's slots (as
                                       # long as its own shards take): queued is not stuck here.
                                       "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "14400"})


@dataclass
class FleetRun:
    """What one run of a fleet DAG did, as Airflow and the receiver tell it."""

    dag_id: str
    run_id: str
    seconds: float  # from the run's creation until every instance succeeded
    killed_worker: str | None = None
    survivor: str | None = None
    killed_pids: int = 0
    delivered_at_kill: int = 0
    seconds_to_kill: float = 0.0
    shards_on_killed_worker: list[int] = field(default_factory=list)  # running there at the kill
    hosts_by_shard: dict[int, list[str]] = field(default_factory=dict)  # each try's hostname, first first
    held_settled: int = 0
    settle_rounds: int = 0  # how many times the on-call engineer settled and Cleared


def cli(deploy: CeleryDeployment, *args: str) -> subprocess.CompletedProcess[str]:
    """airflow-resumable on the API server's host: the shared journal through the config, no file."""
    out = subprocess.run([CLI, *args], env=deploy.api_host_env(), capture_output=True, text=True, timeout=600,
                         check=False)
    if out.returncode != 0:
        raise AssertionError(f"airflow-resumable {' '.join(args)}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return out


def receiver_lookup(deploy: CeleryDeployment, key: str) -> str | None:
    """The receiver's receipt for an idempotency key, or None when it has no record of it."""
    try:
        return str(deploy.receiver(f"/notifications/{key}")["receipt"])
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise


def settle_held_of_run(deploy: CeleryDeployment, dag_id: str, run_id: str) -> int:
    """What the on-call engineer does for the whole run at once: list every held send (``held --json
    --all``), keep those of the run's jobs (``<dag_id>/<task_id>/<run_id>/<map_index>``), ask the
    receiver about each key, and hand every decision to one ``resolve --file`` (all or nothing)."""
    prefix = f"{dag_id}/{TASK_ID}/{run_id}/"
    held = [h for h in json.loads(cli(deploy, "--json", "held", "--all").stdout) if h["job_id"].startswith(prefix)]
    if not held:
        return 0
    decisions = []
    for entry in held:
        receipt = receiver_lookup(deploy, entry["idempotency_key"])
        decisions.append({**entry, "decision": "delivered", "receipt": receipt} if receipt
                         else {**entry, "decision": "not_delivered"})
    file = deploy.root / f"decisions-{run_id.replace(':', '_')}-{time.monotonic_ns()}.json"
    file.write_text(json.dumps(decisions))
    cli(deploy, "resolve", "--file", str(file), "--resolved-by", "fleet-on-call")
    return len(held)


def run_to_success(deploy: CeleryDeployment, run: FleetRun, shards: int, timeout: float, rounds: int = 3) -> None:
    """Wait for every instance to end; while some end failed - held sends no retry can settle -
    settle the run's held sends and Clear the failed instances."""
    for _ in range(rounds + 1):
        instances = deploy.wait_mapped_done(run.dag_id, run.run_id, TASK_ID, shards, timeout)
        failed = [t["map_index"] for t in instances if t["state"] == "failed"]
        if not failed:
            return
        if run.settle_rounds == rounds:
            break
        for map_index in failed:
            ti = next(t for t in instances if t["map_index"] == map_index)
            log = deploy.task_log(run.dag_id, run.run_id, TASK_ID, ti["try_number"], map_index)
            if "HeldItems" not in log or "WrongWorkerError" in log:
                raise AssertionError(f"shard {map_index} failed for another reason than held sends:\n{log[-3000:]}")
        run.held_settled += settle_held_of_run(deploy, run.dag_id, run.run_id)
        run.settle_rounds += 1
        deploy.clear(run.dag_id, run.run_id, TASK_ID, only_failed=True)
    raise AssertionError(f"{run.dag_id} run {run.run_id}: shards {failed} still failed after "
                         f"{run.settle_rounds} settle rounds")


def run_with_kill(deploy: CeleryDeployment, size: FleetSize, kill_fraction: float, timeout: float) -> FleetRun:
    """Trigger the fleet DAG; once ``kill_fraction`` of its items are delivered, SIGKILL the whole
    session of a worker running some shards; drive the run to success as the on-call engineer would."""
    deploy.wait_dag(FLEET_DAG_ID)
    before = deploy.receiver_deliveries()
    started = time.monotonic()
    run_id = deploy.trigger(FLEET_DAG_ID)
    kill_at = max(1, int(size.items * kill_fraction))
    reached = wait_until(lambda: deploy.receiver_deliveries() - before >= kill_at, timeout, 0.2)
    assert reached, f"{kill_at} deliveries not reached:\n{deploy.components['scheduler'].tail()}"
    running = [t for t in deploy.mapped_instances(FLEET_DAG_ID, run_id, TASK_ID)
               if t["state"] == "running" and t["hostname"] in WORKERS]
    assert running, "no shard running at the kill"
    victim = running[0]["hostname"]
    run = FleetRun(FLEET_DAG_ID, run_id, 0.0, killed_worker=victim,
                   survivor=next(w for w in WORKERS if w != victim),
                   shards_on_killed_worker=[t["map_index"] for t in running if t["hostname"] == victim])
    run.killed_pids = len(deploy.components[victim].kill())
    run.seconds_to_kill = time.monotonic() - started
    run.delivered_at_kill = deploy.receiver_deliveries() - before
    run_to_success(deploy, run, size.shards, timeout)
    run.seconds = time.monotonic() - started
    run.hosts_by_shard = {k: [t["hostname"] for t in deploy.mapped_tries(FLEET_DAG_ID, run_id, TASK_ID, k)]
                          for k in range(size.shards)}
    return run


def run_plain(deploy: CeleryDeployment, size: FleetSize, timeout: float) -> FleetRun:
    """The same batch with no journal, nothing killed."""
    deploy.wait_dag(PLAIN_DAG_ID)
    started = time.monotonic()
    run = FleetRun(PLAIN_DAG_ID, deploy.trigger(PLAIN_DAG_ID), 0.0)
    instances = deploy.wait_mapped_done(PLAIN_DAG_ID, run.run_id, TASK_ID, size.shards, timeout)
    run.seconds = time.monotonic() - started
    failed = [t["map_index"] for t in instances if t["state"] != "success"]
    assert not failed, f"plain shards {failed} failed"
    return run


@dataclass(frozen=True)
class Delivery:
    """Who received what how many times, from the receiver's own store."""

    items: int  # distinct expected item ids received
    deliveries: int
    duplicates: int  # deliveries beyond the first of an item
    never_delivered: int
    unexpected: int  # ids the batch does not have

    @property
    def exactly_once(self) -> bool:
        return self.duplicates == 0 and self.never_delivered == 0 and self.unexpected == 0


def delivery(deploy: CeleryDeployment, prefix: str, n: int) -> Delivery:
    counts = deploy.receiver_counts(prefix)
    expected = {item_id(prefix, i) for i in range(n)}
    found = counts.keys() & expected
    return Delivery(items=len(found), deliveries=sum(counts.values()),
                    duplicates=sum(c - 1 for c in counts.values()), never_delivered=len(expected - found),
                    unexpected=len(counts.keys() - expected))


def _mib(kib_by_component: dict[str, int]) -> dict[str, float]:
    return {name: round(kib / 1024, 1) for name, kib in sorted(kib_by_component.items())}


def measure(size: FleetSize, postgres_admin_url: str, root: Path, kill_fraction: float = 0.5,
            timeout: float = 4 * 3600) -> dict[str, Any]:
    deploy = deployment(root, postgres_admin_url, size)
    try:
        started = time.monotonic()
        deploy.start()
        startup = time.monotonic() - started
        fleet = run_with_kill(deploy, size, kill_fraction, timeout)
        fleet_delivery = delivery(deploy, "fleet", size.items)
        fleet_rss = _mib(deploy.peak_rss_by_component_kib)
        journal = deploy.journal_size_bytes()
        jobs = json.loads(cli(deploy, "--json", "jobs", "--dag-id", FLEET_DAG_ID, "--all").stdout)

        assert fleet.killed_worker is not None
        deploy.start_worker(fleet.killed_worker)
        deploy.wait_worker_ready(fleet.killed_worker)
        deploy.peak_rss_by_component_kib.clear()
        plain = run_plain(deploy, size, timeout)
        plain_delivery = delivery(deploy, "plain", size.items)
        plain_rss = _mib(deploy.peak_rss_by_component_kib)
    finally:
        deploy.stop()
    fleet_rate, plain_rate = size.items / fleet.seconds, size.items / plain.seconds
    before_kill_rate = fleet.delivered_at_kill / fleet.seconds_to_kill
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cores": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "items": size.items, "shards": size.shards, "concurrency_per_instance": size.concurrency,
        "workers": len(WORKERS), "worker_concurrency": size.slots, "receiver_reply_ms": REPLY_MS,
        "startup_s": round(startup, 1),
        "fleet": {
            "seconds": round(fleet.seconds, 1), "items_per_second": round(fleet_rate, 1),
            "items_per_second_before_kill": round(before_kill_rate, 1),
            "delivery": asdict(fleet_delivery), "exactly_once": fleet_delivery.exactly_once,
            "run": asdict(fleet) | {"hosts_by_shard": {str(k): v for k, v in fleet.hosts_by_shard.items()}},
            "jobs": len(jobs), "jobs_held": sum(j["held"] for j in jobs), "journal_items": sum(j["items"] for j in jobs),
            "peak_rss_mib": fleet_rss,
        },
        "plain": {
            "seconds": round(plain.seconds, 1), "items_per_second": round(plain_rate, 1),
            "delivery": asdict(plain_delivery), "peak_rss_mib": plain_rss,
        },
        "ratio": round(fleet_rate / plain_rate, 3),
        "ratio_before_kill": round(before_kill_rate / plain_rate, 3),
        "journal_mb": {"tables": round(journal["tables"] / 1e6, 1), "database": round(journal["database"] / 1e6, 1)},
    }


def table(figures: dict[str, Any]) -> str:
    fleet, plain = figures["fleet"], figures["plain"]
    run = fleet["run"]
    moved = [k for k, hosts in run["hosts_by_shard"].items()
             if hosts[:1] == [run["killed_worker"]] and run["survivor"] in hosts[1:]]
    rows = [
        ("items / shards / concurrency per instance",
         f"{figures['items']:,} / {figures['shards']} / {figures['concurrency_per_instance']}"),
        ("workers x Celery slots", f"{figures['workers']} x {figures['worker_concurrency']}"),
        ("resumable, end to end (kill, retries, settling included)",
         f"{fleet['items_per_second']:,.0f} items/s ({fleet['seconds']:,.0f} s)"),
        ("resumable, before the kill", f"{fleet['items_per_second_before_kill']:,.0f} items/s"),
        ("plain PythonOperator, no journal, nothing killed",
         f"{plain['items_per_second']:,.0f} items/s ({plain['seconds']:,.0f} s)"),
        ("ratio resumable / plain (end to end; before the kill)",
         f"{figures['ratio']:.2f}; {figures['ratio_before_kill']:.2f}"),
        ("SIGKILLed", f"{run['killed_worker']}: {run['killed_pids']} processes, at "
                      f"{run['delivered_at_kill']:,} delivered; its shards {run['shards_on_killed_worker']}"),
        ("shards retried on the other worker", f"{len(moved)} ({', '.join(moved)})"),
        ("held sends settled through the CLI (rounds)", f"{run['held_settled']} ({run['settle_rounds']})"),
        ("duplicates (receiver's count)", f"{fleet['delivery']['duplicates']}"),
        ("items never delivered", f"{fleet['delivery']['never_delivered']}"),
        ("journal size (tables; database)",
         f"{figures['journal_mb']['tables']:,.1f} MB; {figures['journal_mb']['database']:,.1f} MB"),
    ]
    rows += [(f"peak RSS {name} (resumable; plain)", f"{mib:,.0f} MiB; {plain['peak_rss_mib'].get(name, 0):,.0f} MiB")
             for name, mib in fleet["peak_rss_mib"].items()]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet", description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--worker-concurrency", type=int, default=0,
                        help="Celery slots per worker (default: half the shards, every shard at once)")
    parser.add_argument("--kill-at", type=float, default=0.5, help="the fraction of items delivered at the kill")
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if shutil.which("redis-server") is None:
        print("the fleet run needs redis-server (Debian: apt-get install redis-server)", file=sys.stderr)
        return 1
    from benchmarks import pg

    if (why := pg.unavailable()) is not None:
        print(why, file=sys.stderr)
        return 1
    size = FleetSize(args.items, args.shards, worker_concurrency=args.worker_concurrency)
    with pg.throwaway_server() as server, tempfile.TemporaryDirectory(prefix="fleet-") as tmp:
        figures = measure(size, server.url(), Path(tmp), args.kill_at)
        figures["postgres_version"] = server.version()
    figures["command"] = "make bench-fleet" if argv is None and sys.argv[1:] == [] else (
        "python -m benchmarks.fleet " + " ".join(sys.argv[1:] if argv is None else argv))
    args.output.write_text(json.dumps(figures, indent=2) + "\n")
    print(table(figures))
    print(f"\nwritten to {args.output}")
    return 0 if figures["fleet"]["exactly_once"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
