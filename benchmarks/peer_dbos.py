"""Peer: DBOS Transact recording the same three steps in SQLite, against our journal at full durability.

DBOS shape (its idiomatic ways to make per-item work durable), both measured, the cheaper one used
for the ratio so the comparison never flatters us:

* ``per_item``: one ``@DBOS.workflow`` per item, started under ``SetWorkflowID(job/item)`` (the
  workflow ID makes a re-run of the item idempotent), calling three ``@DBOS.step`` functions;
* ``per_batch``: one workflow for the whole batch calling the three steps for every item.

DBOS's system database is a SQLite file (``system_database_url = "sqlite:///..."``) in a temporary
directory; nothing listens on the network. DBOS leaves SQLite's defaults (rollback journal,
``synchronous=FULL``): every commit is on disk, the guarantee our ``durability="full"`` gives a send's
``IN_FLIGHT`` mark. Per-step cost = (run time - bare loop) / (items x 3), the same subtraction on
both sides; DBOS's workflow start/finish records are part of what its steps cost.
"""

from __future__ import annotations

import statistics
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import run_batch
from benchmarks import workload


def dbos_version() -> str | None:
    try:
        return metadata.version("dbos")
    except metadata.PackageNotFoundError:
        return None


def _ours_full_seconds(n: int) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as tmp, StepJournal(Path(tmp) / "ours.sqlite3", durability="full") as journal:
        seconds = workload.timed(lambda: run_batch(journal, "peer", workload.items(n), workload.steps()))
        return seconds, journal.fsync_count


def measure(n: int, reps: int = 3) -> dict[str, Any]:
    version = dbos_version()
    if version is None:
        return {"skipped": "dbos is not installed (pip install -e '.[bench]', or run `make bench`)"}
    from dbos import DBOS, SetWorkflowID  # imported here: an optional extra

    steps_per_item = len(workload.STEP_NAMES)
    with tempfile.TemporaryDirectory() as tmp:
        DBOS(config={
            "name": "resumable-bench-peer",
            "system_database_url": f"sqlite:///{Path(tmp) / 'dbos_system.sqlite'}",
            "log_level": "WARNING",
        })

        # The same no-op bodies as ours: validate and transform return nothing, notify a receipt.
        @DBOS.step()
        def validate(item: dict[str, Any]) -> None:
            return None

        @DBOS.step()
        def transform(item: dict[str, Any]) -> None:
            return None

        @DBOS.step()
        def notify(item: dict[str, Any]) -> str:
            return "receipt"

        @DBOS.workflow()
        def one_item(item: dict[str, Any]) -> str:
            validate(item)
            transform(item)
            return notify(item)

        @DBOS.workflow()
        def whole_batch(batch: list[dict[str, Any]]) -> int:
            for item in batch:
                validate(item)
                transform(item)
                notify(item)
            return len(batch)

        DBOS.launch()
        try:
            def per_item(rep: int) -> float:
                def go() -> None:
                    for item in workload.items(n):
                        with SetWorkflowID(f"peer-{rep}/{item['id']}"):
                            one_item(item)
                return workload.timed(go)

            def per_batch(rep: int) -> float:
                batch = list(workload.items(n))

                def go() -> None:
                    with SetWorkflowID(f"peer-batch-{rep}"):
                        whole_batch(batch)
                return workload.timed(go)

            bare = workload.median_of(3, lambda: workload.bare_seconds(n))
            dbos_item, dbos_batch, ours = [], [], []
            fsyncs = 0
            for rep in range(reps):  # interleaved, so a noisy moment hits both sides
                dbos_item.append(per_item(rep))
                dbos_batch.append(per_batch(rep))
                seconds, fsyncs = _ours_full_seconds(n)
                ours.append(seconds)
        finally:
            DBOS.destroy(destroy_registry=True)

    def per_step_us(seconds: list[float]) -> float:
        return (statistics.median(seconds) - bare) / (n * steps_per_item) * 1e6

    dbos_shapes = {"per_item": per_step_us(dbos_item), "per_batch": per_step_us(dbos_batch)}
    cheaper = min(dbos_shapes, key=lambda shape: dbos_shapes[shape])
    ours_us = per_step_us(ours)
    return {
        "dbos_version": version,
        "n": n,
        "reps": reps,
        "dbos_us_per_step": dbos_shapes[cheaper],
        "dbos_shape_used": cheaper,
        "dbos_us_per_step_by_shape": dbos_shapes,
        "ours_full_us_per_step": ours_us,
        "ours_full_fsyncs_per_item": fsyncs / n,
        "ratio": ours_us / dbos_shapes[cheaper],
    }
