"""A fleet on a real CeleryExecutor (tests/support/celery_deployment.py): 20,000 items sharded over 8 mapped
ResumableBatchOperator instances (tests/celery_dags/celery_fleet.py), 16 sends in flight each, to the
demo receiver taking 4 ms per notification with dedupe off. A quarter of the way in, every process of
one worker - its whole session - is SIGKILLed while it runs some shards. Those shards retry on the
other worker and resume from the shared journal; what was in flight at the kill and never arrived is
held, then settled for the whole run at once through the CLI with the receiver's look-up, and the
failed shards are Cleared. Every item arrives exactly once, by the receiver's own count.

The scenario's steps are :mod:`benchmarks.fleet`'s, which runs the same at a million items.
"""

from __future__ import annotations

import json
import sys
import time

import pytest

from benchmarks import fleet
from tests.celery_dags.celery_fleet import FLEET_DAG_ID, item_id
from tests.support.celery_deployment import require_redis_server

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

SIZE = fleet.FleetSize(items=20_000, shards=8)  # 2 workers x 4 Celery slots: every shard runs at once
KILL_AT = 0.25  # of the items delivered when the worker is killed
TIMEOUT = 300


@pytest.fixture(scope="module")
def deployment(postgres, tmp_path_factory):
    require_redis_server("the fleet test")
    started = time.monotonic()
    deploy = fleet.deployment(tmp_path_factory.mktemp("fleet"), postgres.admin_url, SIZE)
    try:
        deploy.start()
        yield deploy
    finally:
        deploy.stop()
        figures = {"module_s": round(time.monotonic() - started, 1), "peak_rss_mib": round(deploy.peak_rss_kib / 1024)}
        print(f"\nCelery fleet: {json.dumps(figures)}", file=sys.stderr)


def journal_rows_of(deployment, run_id: str, item: str) -> list[dict]:
    """Every journal row of an item, whichever shard holds it (for a failure's message)."""
    rows = []
    for shard in range(SIZE.shards):
        job_id = f"{FLEET_DAG_ID}/{fleet.TASK_ID}/{run_id}/{shard}"
        rows += json.loads(fleet.cli(deployment, "--json", "show", job_id, "--item", item).stdout)
    return rows


def test_a_sharded_batch_survives_a_worker_sigkill_and_delivers_every_item_exactly_once(deployment):
    run = fleet.run_with_kill(deployment, SIZE, KILL_AT, TIMEOUT)
    print(f"\nFleet run: {run}", file=sys.stderr)
    assert run.killed_pids >= 3, run  # the Celery worker, its pool, the task supervisors and runners
    assert run.delivered_at_kill < SIZE.items, run  # the kill came mid-batch

    # The killed worker's shards ran their first try there and their retry on the other worker.
    moved = [k for k in run.shards_on_killed_worker
             if run.hosts_by_shard[k][:2] == [run.killed_worker, run.survivor]]
    assert moved and moved == run.shards_on_killed_worker, run.hosts_by_shard

    # The receiver's own store: every item of the batch once, nothing twice, nothing else.
    counts = deployment.receiver_counts("fleet")
    expected = [item_id("fleet", i) for i in range(SIZE.items)]
    missing = [i for i in expected if i not in counts]
    twice = {i: n for i, n in counts.items() if n != 1}
    assert not missing and not twice, (
        f"{len(missing)} never delivered, {len(twice)} delivered more than once; e.g. "
        + json.dumps({i: journal_rows_of(deployment, run.run_id, i) for i in (missing[:3] + list(twice)[:3])}))
    assert len(counts) == SIZE.items

    # One job per shard in the shared journal, all done, nothing left held.
    jobs = json.loads(fleet.cli(deployment, "--json", "jobs", "--dag-id", FLEET_DAG_ID, "--all").stdout)
    assert sorted(j["job_id"] for j in jobs) == sorted(
        f"{FLEET_DAG_ID}/{fleet.TASK_ID}/{run.run_id}/{k}" for k in range(SIZE.shards))
    assert sum(j["items"] for j in jobs) == SIZE.items and all(j["held"] == 0 for j in jobs), jobs
