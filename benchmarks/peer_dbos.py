"""Peer: DBOS Transact recording the same three steps, against our journal at full durability.

Two comparisons, each in a section (and a child process) of its own:

* ``peer`` (:func:`measure`): DBOS's system database is a SQLite file (``system_database_url =
  "sqlite:///..."``) in a temporary directory, ours a SQLite journal; nothing listens on the
  network. DBOS leaves SQLite's defaults (rollback journal, ``synchronous=FULL``): every commit is
  on disk, the guarantee our ``durability="full"`` gives a send's ``IN_FLIGHT`` mark.
* ``peer_postgres`` (:func:`measure_postgres`): both on the SAME throwaway PostgreSQL server
  (:mod:`benchmarks.pg`), DBOS's system database a database of its own (``system_database_url =
  "postgresql://..."``; DBOS creates it and its tables on launch), ours a journal in another
  database. The server keeps its defaults, so every DBOS commit is synchronous
  (``synchronous_commit=on``); ours commits each send's ``IN_FLIGHT`` mark synchronously and
  everything else with ``synchronous_commit=off`` (see ``airflow_resumable/journal/postgres.py``).

DBOS shape (its idiomatic ways to make per-item work durable), both measured, the cheaper one used
for the ratio so the comparison never flatters us:

* ``per_item``: one ``@DBOS.workflow`` per item, started under ``SetWorkflowID(job/item)`` (the
  workflow ID makes a re-run of the item idempotent), calling three ``@DBOS.step`` functions;
* ``per_batch``: one workflow for the whole batch calling the three steps for every item.

Per-step cost = (run time - bare loop) / (items x 3), the same subtraction on both sides; DBOS's
workflow start/finish records are part of what its steps cost. Repetitions interleave DBOS's two
shapes and ours, so a noisy moment hits every side; each of our repetitions gets a fresh journal.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import run_batch
from benchmarks import workload

NOT_INSTALLED = "dbos is not installed (pip install -e '.[bench]', or run `make bench`)"


def dbos_version() -> str | None:
    try:
        return metadata.version("dbos")
    except metadata.PackageNotFoundError:
        return None


def _ours_full(journal: StepJournal, n: int) -> float:
    """Seconds for one first run of ``n`` items on a fresh full-durability journal."""
    return workload.timed(lambda: _checked(run_batch(journal, "peer", workload.items(n), workload.steps()), n))


def _checked(result: Any, n: int) -> Any:
    # A benchmark that silently did less work would report a flattering figure.
    if result.executed_steps != len(workload.STEP_NAMES) * n:
        raise AssertionError(f"ours executed {result.executed_steps} of {len(workload.STEP_NAMES) * n} steps")
    return result


# (seconds, the journal after the run) for one repetition of ours; called with (rep, n).
OursRun = Callable[[int, int], tuple[float, StepJournal]]
# DBOS's two shapes: seconds for one repetition of each; called with rep.
DbosShapes = tuple[Callable[[int], float], Callable[[int], float]]


@contextlib.contextmanager
def _dbos(n: int, system_database_url: str, app: str) -> Iterator[DbosShapes]:
    """DBOS launched on ``system_database_url`` with the batch's steps; destroyed on the way out."""
    from dbos import DBOS, SetWorkflowID  # imported here: an optional extra

    DBOS(config={"name": app, "system_database_url": system_database_url, "log_level": "WARNING"})

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
                if whole_batch(batch) != n:
                    raise AssertionError("DBOS's batch workflow did not run every item")
        return workload.timed(go)

    DBOS.launch()
    try:
        yield per_item, per_batch
    finally:
        DBOS.destroy(destroy_registry=True)


def _compare(n: int, reps: int, system_database_url: str | None, ours: OursRun, app: str) -> dict[str, Any]:
    """DBOS's two shapes and ours, ``reps`` times interleaved; per-step costs and the ratio.

    Without ``system_database_url`` (DBOS not installed) only ours is measured."""
    steps_per_item = len(workload.STEP_NAMES)
    dbos_item: list[float] = []
    dbos_batch: list[float] = []
    ours_seconds: list[float] = []
    journal: StepJournal | None = None
    with contextlib.ExitStack() as stack:
        dbos = None if system_database_url is None else stack.enter_context(_dbos(n, system_database_url, app))
        bare = workload.median_of(3, lambda: workload.bare_seconds(n))
        for rep in range(max(1, reps)):  # interleaved, so a noisy moment hits every side
            if dbos is not None:
                dbos_item.append(dbos[0](rep))
                dbos_batch.append(dbos[1](rep))
            seconds, journal = ours(rep, n)
            ours_seconds.append(seconds)
    assert journal is not None

    def per_step_us(seconds: list[float]) -> float:
        return (statistics.median(seconds) - bare) / (n * steps_per_item) * 1e6

    ours_us = per_step_us(ours_seconds)
    figures: dict[str, Any] = {"n": n, "reps": max(1, reps)}
    if dbos is not None:
        dbos_shapes = {"per_item": per_step_us(dbos_item), "per_batch": per_step_us(dbos_batch)}
        cheaper = min(dbos_shapes, key=lambda shape: dbos_shapes[shape])
        figures |= {"dbos_us_per_step": dbos_shapes[cheaper], "dbos_shape_used": cheaper,
                    "dbos_us_per_step_by_shape": dbos_shapes}
    figures["ours_full_us_per_step"] = ours_us
    if dbos is not None:
        figures["ratio"] = ours_us / figures["dbos_us_per_step"]
    return figures | {
        # Of the last repetition's journal (every repetition does the same work).
        "ours_full_commits_per_item": journal.commit_count / n,
        "ours_full_durable_commits_per_item": journal.durable_commit_count / n,
        "_journal": journal,
    }


def measure(n: int, reps: int = 3) -> dict[str, Any]:
    """Both on SQLite."""
    version = dbos_version()
    if version is None:
        return {"skipped": NOT_INSTALLED}
    with tempfile.TemporaryDirectory() as tmp:
        def ours(rep: int, n: int) -> tuple[float, StepJournal]:
            with StepJournal(Path(tmp) / f"ours-{rep}.sqlite3", durability="full") as journal:
                return _ours_full(journal, n), journal

        figures = _compare(n, reps, f"sqlite:///{Path(tmp) / 'dbos_system.sqlite'}", ours, "resumable-bench-peer")
    journal = figures.pop("_journal")
    return {"dbos_version": version} | figures | {"ours_full_fsyncs_per_item": journal.engine.fsync_count / n}


def measure_postgres(n: int, reps: int = 3) -> dict[str, Any]:
    """Both on one throwaway PostgreSQL server: DBOS's system database and our journal in databases of their own.

    Without DBOS, ours is still measured (the ratio is then missing and its row says why)."""
    from benchmarks import pg

    if (why := pg.unavailable()) is not None:
        return {"skipped": why}
    version = dbos_version()
    with pg.throwaway_server() as server:
        ours_url = server.new_database()

        def ours(rep: int, n: int) -> tuple[float, StepJournal]:
            # A fresh journal per repetition, as on SQLite: a schema of its own in our database.
            with StepJournal(ours_url, durability="full", schema=f"peer_{rep}") as journal:
                return _ours_full(journal, n), journal

        dbos_url = None if version is None else server.url("dbos_system")  # DBOS creates it on launch
        figures = _compare(n, reps, dbos_url, ours, "resumable-bench-peer-postgres")
        server_version = server.version()
    figures.pop("_journal")
    head: dict[str, Any] = {"dbos_version": version} if version else {"dbos_skipped": NOT_INSTALLED}
    return head | {"postgres_version": server_version} | figures
