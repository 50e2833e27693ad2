"""Journal size: what an on-call's reads, a new job and a prune cost in a big journal vs a small one.

One child process per engine measures, in one run, a big journal (``n_big`` items, default
10,000,000, in ``jobs_big`` jobs) against a small one (``n_small`` = 10,000 items in ``jobs_small``
jobs), both of the same shape: 3 steps per item (``validate``, ``transform``, the side effect
``notify``), realistic ids (``dag_07/send_orders/scheduled__2026-...``, ``order-00001234``), the
older half of the jobs finished and settled (what a prune takes), the newer half each holding a few
sends for a person (what the held page shows). The journals are filled here in SQL, one
``INSERT ... SELECT`` per job, through the very triggers that keep each job's counts, so the filled
journal is what runs and ``compact()`` would have left, and no faster to read than theirs: every finished
item compacted (schema 8: one row of ``compacted`` per item, its ``data`` packed by
:func:`~airflow_resumable.journal.compaction.compact_item` from the rows a run writes for such an item),
the held items' rows live in ``steps``.

* **Reads**: jobs page (``jobs(limit=100)``), held page (``held(limit=100)``), one job's page
  (``job(id)`` + ``rows(id, limit=100)``), the CLI's ``jobs`` and ``held`` (a process each, as an
  on-call runs them, ``--limit 100`` where the CLI has it): the median of ``reps``, big / small.
  ``jobs_small`` is above the page size, so both journals fill their pages and the ratio is about the
  journal, not about how much a page shows. The "Resumable jobs" page itself, as the API server serves
  it: the jobs page (``/``: jobs and their held sends), one job's page (``/jobs/{id}``) and the jobs
  JSON (``/jobs.json``), rendered by the plugin's own FastAPI app in this process (each request opens
  the journal as the page does, read-only; Airflow's sign-in is replaced by a viewer of every DAG).
* **A new job**: ``new_items`` items at durability ``full`` (a synchronous commit before each send),
  per-item cost in the big journal / in the small one, ``new_reps`` times interleaved, medians.
* **Bytes per item**: the journal's tables with their indexes (steps, compacted, step_sets, jobs) over the
  items (SQLite: ``dbstat``, else the file size; PostgreSQL: ``pg_total_relation_size``), as filled, as a
  run writes them, and that run's journal once ``compact()`` went through it.
* **Pruning at scale**: ``prune(timedelta(0))`` of the big journal's finished half, in a process of its
  own, while a runner in this process sends on the same journal; each durable commit (the ``IN_FLIGHT``
  marks) is timed around the engine's ``apply``. The first prune process is SIGKILLed once half the
  finished jobs are gone and one is part way (tombstoned, rows left); a second prune finishes it.
  Then every job's counts are checked against a recount of its rows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from airflow_resumable.journal import StepJournal
from airflow_resumable.journal.compaction import compact_item, step_set_key
from airflow_resumable.journal.schema import recount_statement
from airflow_resumable.runner import BatchStopped, run_batch
from benchmarks import workload

REPO = Path(__file__).resolve().parents[1]
PAGE = 100  # what the UI page, its JSON and the CLI ask for
HELD_PER_JOB = 5  # held sends in each of the newer half's jobs
DAYS = 30  # the jobs' creation times spread over this many days before now
READS = ("jobs_page", "held_page", "job_page", "ui_jobs", "ui_job", "ui_jobs_json", "cli_jobs", "cli_held")
MIDWAY = "midway"  # what the first prune process says when it waits to be killed


@dataclass(frozen=True)
class Shape:
    """One journal's contents: ``jobs`` jobs of (about) ``items // jobs`` items, 3 steps each."""

    items: int
    jobs: int

    @property
    def per_job(self) -> int:
        return max(1, self.items // self.jobs)

    @property
    def finished_jobs(self) -> int:
        """The older half: finished, settled, prunable."""
        return self.jobs // 2

    def job_id(self, k: int) -> str:
        day = k * DAYS // self.jobs
        run_id = f"scheduled__2026-{1 + day // 28:02d}-{1 + day % 28:02d}T{k % 24:02d}:00:00+00:00#{k}"
        return f"dag_{k % 20:02d}/send_orders/{run_id}"

    def dag_id(self, k: int) -> str:
        return f"dag_{k % 20:02d}"

    def held(self, k: int) -> int:
        return 0 if k < self.finished_jobs else min(HELD_PER_JOB, self.per_job)


# ------------------------------------------------------------------------------ filling, in SQL

# One job's rows: per item one digest shared by its 3 steps, rows in primary-key order; a held item's
# send IN_FLIGHT and held (unknown outcome), every other row SUCCEEDED as the runner writes it. Only the
# held items' rows are filled as rows (_HELD_ONLY); the others are compacted (_SQLITE_COMPACTED_FILL).
_SQLITE_FILL = """
WITH RECURSIVE n(i, d) AS (
    SELECT 0, lower(hex(randomblob(32)))
    UNION ALL SELECT i + 1, lower(hex(randomblob(32))) FROM n WHERE i + 1 < :items
), s(step, side_effect, pos) AS (VALUES ('notify', 1, 2), ('transform', 0, 1), ('validate', 0, 0))
INSERT INTO steps (job_id, item_id, step, side_effect, status, digest, receipt, output, error_type, held_reason,
                   new_digest, attempts, created_at, updated_at, generation, not_sent, version)
SELECT :job, 'order-' || printf('%08d', :base + n.i), s.step, s.side_effect,
       CASE WHEN s.side_effect = 1 AND n.i % :stride = 0 AND n.i / :stride < :held THEN 'IN_FLIGHT' ELSE 'SUCCEEDED' END,
       n.d,
       CASE WHEN s.side_effect = 1 AND NOT (n.i % :stride = 0 AND n.i / :stride < :held) THEN 'receipt' END,
       CASE WHEN s.side_effect = 0 THEN 'null' WHEN NOT (n.i % :stride = 0 AND n.i / :stride < :held) THEN '"receipt"' END,
       NULL,
       CASE WHEN s.side_effect = 1 AND n.i % :stride = 0 AND n.i / :stride < :held THEN 'unknown_outcome' END,
       NULL, 1, :t0 + n.i * 0.002 + s.pos * 0.0001, :t0 + n.i * 0.002 + s.pos * 0.0001 + s.side_effect * 0.001,
       0, 0, 1 + s.side_effect
FROM n CROSS JOIN s
WHERE :live OR (n.i % :stride = 0 AND n.i / :stride < :held)
"""

# The finished items as compact() leaves them: one row each, the job's template of packed rows.
_SQLITE_COMPACTED_FILL = """
WITH RECURSIVE n(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM n WHERE i + 1 < :items)
INSERT INTO compacted (job_no, step_set, n_steps, item_id, digest, data)
SELECT :job_no, :step_set, 3, 'order-' || printf('%08d', :base + n.i), randomblob(32), :data
FROM n WHERE NOT :live AND NOT (n.i % :stride = 0 AND n.i / :stride < :held)
"""

_POSTGRES_FILL = """
INSERT INTO steps (job_id, item_id, step, side_effect, status, digest, receipt, output, error_type, held_reason,
                   new_digest, attempts, created_at, updated_at, generation, not_sent, version)
SELECT %(job)s, 'order-' || lpad((%(base)s + n.i)::text, 8, '0'), s.step, s.side_effect::smallint,
       CASE WHEN n.held THEN 'IN_FLIGHT' ELSE 'SUCCEEDED' END,
       n.d,
       CASE WHEN s.side_effect = 1 AND NOT n.held THEN 'receipt' END,
       CASE WHEN s.side_effect = 0 THEN 'null' WHEN NOT n.held THEN '"receipt"' END,
       NULL,
       CASE WHEN n.held AND s.side_effect = 1 THEN 'unknown_outcome' END,
       NULL, 1, %(t0)s + n.i * 0.002 + s.pos * 0.0001, %(t0)s + n.i * 0.002 + s.pos * 0.0001 + s.side_effect * 0.001,
       0, 0, 1 + s.side_effect
FROM (SELECT i, md5(random()::text) || md5(random()::text) AS d, i %% %(stride)s = 0 AND i / %(stride)s < %(held)s AS held
      FROM generate_series(%(first)s::integer, %(last)s::integer) AS i) AS n
CROSS JOIN (VALUES ('notify', 1, 2), ('transform', 0, 1), ('validate', 0, 0)) AS s(step, side_effect, pos)
WHERE %(live)s OR n.held
ORDER BY n.i, s.step
"""

_POSTGRES_COMPACTED_FILL = """
INSERT INTO compacted (job_no, step_set, n_steps, item_id, digest, data)
SELECT %(job_no)s, %(step_set)s, 3, 'order-' || lpad((%(base)s + i)::text, 8, '0'),
       decode(md5(random()::text) || md5(random()::text), 'hex'), %(data)s
FROM generate_series(%(first)s::integer, %(last)s::integer) AS i
WHERE NOT %(live)s AND NOT (i %% %(stride)s = 0 AND i / %(stride)s < %(held)s)
ORDER BY i
"""

_JOB_ROW = """INSERT INTO jobs (job_id, created_at, updated_at, last_runner, finished_at, dag_id, job_no, compacted_at)
              VALUES ({p}, {p}, {p}, 'fill', {p}, {p}, {p}, {p})"""
_STEP_SET = "INSERT INTO step_sets (id, hash, names) VALUES (1, {p}, {p})"
_TABLES = "'steps', 'compacted', 'step_sets', 'jobs'"  # what a journal's size is made of


def _job_row(p: dict[str, Any], dag_id: str) -> tuple[Any, ...]:
    return p["job"], p["t0"], p["finished"], p["finished"], dag_id, p["job_no"], p["finished"]


def _packed_item(p: dict[str, Any]) -> bytes:
    """What compact() writes for one of the job's finished items: the rows _SQLITE_FILL gives one, packed."""
    t = p["t0"] + p["items"] // 2 * 0.002
    rows = [(p["job"], "order-00000000", step, side_effect, "SUCCEEDED", "ab" * 32,
             "receipt" if side_effect else None, '"receipt"' if side_effect else "null", None, None, None, 1,
             t + pos * 0.0001, t + pos * 0.0001 + side_effect * 0.001, 0, 0, 1 + side_effect)
            for step, side_effect, pos in (("notify", 1, 2), ("transform", 0, 1), ("validate", 0, 0))]
    packed = compact_item(p["job"], "order-00000000", rows)
    assert packed is not None
    return packed.data


def _job_params(shape: Shape, k: int, now: float) -> dict[str, Any]:
    t0 = now - DAYS * 86400 + k * (DAYS * 86400 / shape.jobs)
    held = shape.held(k)
    p = {"job": shape.job_id(k), "items": shape.per_job, "base": k * shape.per_job, "t0": t0,
         "held": held, "stride": max(1, shape.per_job // max(1, held)),
         "finished": t0 + shape.per_job * 0.002 + 1.0, "job_no": k + 1, "step_set": 1}
    return p | {"data": _packed_item(p)}


def fill(engine: Engine, shape: Shape, *, compacted: bool = True) -> float:
    """Fill an empty journal with ``shape``, job by job; returns the seconds it took. ``compacted=False``:
    every item's rows live in ``steps`` (as a run leaves them, before compaction)."""
    now = time.time()
    start = time.perf_counter()
    with engine.connection() as conn:
        conn.execute(_STEP_SET.format(p=engine.placeholder), step_set_key(workload.STEP_NAMES)[::-1])
        for k in range(shape.jobs):
            p = _job_params(shape, k, now) | {"live": not compacted}
            engine.fill_job(conn, p, shape.dag_id(k))
        engine.after_fill(conn)
    return time.perf_counter() - start


# What points Airflow at a journal: cleared while a benchmark journal stands in as the deployment's.
_JOURNAL_SETTINGS = ("AIRFLOW__RESUMABLE__JOURNAL_PATH", "AIRFLOW__RESUMABLE__JOURNAL_CONN_ID",
                     "AIRFLOW__RESUMABLE__JOURNAL_SCHEMA", "AIRFLOW_CONN_BENCH_JOURNAL")


class Engine:
    """Where a journal lives, how it is filled and sized, and how the CLI is pointed at it."""

    kind = ""
    placeholder = "?"

    def __init__(self, location: str) -> None:
        self.location = location

    def open(self, **options: Any) -> StepJournal:
        return StepJournal(self.location, **options)

    def cli_args(self) -> list[str]:
        return ["--journal", self.location]

    def configuration(self) -> dict[str, str]:
        """Airflow configuration (environment variables) naming this journal as a deployment would."""
        return {"AIRFLOW__RESUMABLE__JOURNAL_PATH": self.location}

    @contextlib.contextmanager
    def as_configured_journal(self) -> Iterator[None]:
        """This journal is the deployment's for the duration (the page reads Airflow's configuration)."""
        saved = {name: os.environ.get(name) for name in (*self.configuration(), *_JOURNAL_SETTINGS)}
        for name in _JOURNAL_SETTINGS:
            os.environ.pop(name, None)
        os.environ.update(self.configuration())
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def connection(self) -> contextlib.AbstractContextManager[Any]:
        raise NotImplementedError

    def fill_job(self, conn: Any, p: dict[str, Any], dag_id: str) -> None:
        raise NotImplementedError

    def after_fill(self, conn: Any) -> None:
        pass

    def after_compact(self) -> None:
        """Give the space of the rows compaction deleted back, as the engine's own maintenance would."""

    def bytes(self) -> tuple[int, str]:
        raise NotImplementedError

    def count(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with self.connection() as conn:
            return list(conn.execute(query, params).fetchall())


class SqliteEngine(Engine):
    kind = "sqlite"

    @contextlib.contextmanager
    def connection(self) -> Iterator[sqlite3.Connection]:
        conn = sqlite3.connect(self.location, isolation_level=None)
        try:
            conn.execute("PRAGMA busy_timeout = 60000")
            yield conn
        finally:
            conn.close()

    def fill_job(self, conn: Any, p: dict[str, Any], dag_id: str) -> None:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute(_JOB_ROW.format(p="?"), _job_row(p, dag_id))
        conn.execute(_SQLITE_FILL, p)
        conn.execute(_SQLITE_COMPACTED_FILL, p)
        conn.execute("COMMIT")

    def bytes(self) -> tuple[int, str]:
        with self.connection() as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            names = [n for (n,) in conn.execute(
                f"SELECT name FROM sqlite_master WHERE tbl_name IN ({_TABLES}) AND type IN ('table', 'index')")]
            try:
                (size,) = conn.execute(
                    f"SELECT sum(pgsize) FROM dbstat WHERE name IN ({','.join('?' * len(names))})", names).fetchone()
                return int(size), f"dbstat ({_TABLES.replace(chr(39), '')} and their indexes)"
            except sqlite3.OperationalError:  # a SQLite built without dbstat
                return os.path.getsize(self.location), "file size"

    def count(self, query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        return super().count(query.replace("%s", "?"), params)


class PostgresEngine(Engine):
    kind = "postgresql"
    placeholder = "%s"
    SCHEMA = "resumable"  # the journal's default

    def open(self, **options: Any) -> StepJournal:
        return StepJournal(self.location, schema=self.SCHEMA, **options)

    def cli_args(self) -> list[str]:
        return ["--journal", self.location, "--schema", self.SCHEMA]

    def configuration(self) -> dict[str, str]:
        url = urlsplit(self.location)
        connection = {"conn_type": "postgres", "host": url.hostname, "port": url.port, "login": url.username,
                      "password": unquote(url.password or ""), "schema": url.path.lstrip("/"),
                      "extra": {"journal_schema": self.SCHEMA}}
        return {"AIRFLOW__RESUMABLE__JOURNAL_CONN_ID": "bench_journal", "AIRFLOW_CONN_BENCH_JOURNAL": json.dumps(connection)}

    @contextlib.contextmanager
    def connection(self) -> Iterator[Any]:
        import psycopg

        with psycopg.connect(self.location, autocommit=True) as conn:
            conn.execute(f"SET search_path TO {self.SCHEMA}")
            yield conn

    # Items per INSERT: the counters' statement trigger joins the statement's rows with themselves, and its
    # cost grows faster than the statement (one INSERT of 100,000 rows ran for minutes); a run writes at
    # most a few hundred rows per statement anyway.
    FILL_CHUNK = 10_000

    def fill_job(self, conn: Any, p: dict[str, Any], dag_id: str) -> None:
        with conn.transaction():
            conn.execute(_JOB_ROW.format(p="%s"), _job_row(p, dag_id))
            conn.execute("SELECT compacted_partition(%s)", (p["job_no"],))  # as compaction does, numbering a job
            for first in range(0, p["items"], self.FILL_CHUNK):
                chunk = p | {"first": first, "last": min(p["items"], first + self.FILL_CHUNK) - 1}
                conn.execute(_POSTGRES_FILL, chunk)
                conn.execute(_POSTGRES_COMPACTED_FILL, chunk)

    def after_fill(self, conn: Any) -> None:
        # What autovacuum would do by itself a little later: statistics for the planner.
        for table in ("steps", "compacted", "jobs"):
            conn.execute(f"VACUUM ANALYZE {table}")
        # The fill numbered the jobs itself: the next compaction numbers on after them.
        conn.execute("SELECT setval('job_numbers', (SELECT max(job_no) FROM jobs))")

    def after_compact(self) -> None:
        with self.connection() as conn:
            conn.execute("VACUUM FULL steps")  # autovacuum reuses the space; only FULL shows it here

    def bytes(self) -> tuple[int, str]:
        # compacted is partitioned: its size is its partitions' (pg_partition_tree has no rows for a plain table)
        sizes = " + ".join(f"coalesce((SELECT sum(pg_total_relation_size(relid)) FROM pg_partition_tree('{t}')), "
                           f"pg_total_relation_size('{t}'))" for t in _TABLES.replace("'", "").split(", "))
        with self.connection() as conn:
            (size,) = conn.execute(f"SELECT {sizes}").fetchone()
        return int(size), f"pg_total_relation_size ({_TABLES.replace(chr(39), '')}; compacted's partitions)"


# ------------------------------------------------------------------------------------- reading


def _cli_command() -> list[str]:
    script = Path(sys.executable).parent / "airflow-resumable"
    return [str(script)] if script.exists() else [sys.executable, "-m", "airflow_resumable.cli"]


def cli_has_limit() -> bool:
    """Whether this CLI takes ``--limit`` yet (without it, ``jobs`` and ``held`` list everything)."""
    shown = subprocess.run([*_cli_command(), "jobs", "--help"], capture_output=True, text=True, timeout=120)
    return "--limit" in shown.stdout


def _cli(engine: Engine, command: str, limit: bool) -> Callable[[], object]:
    argv = [*_cli_command(), *engine.cli_args(), command, *(["--limit", str(PAGE)] if limit else [])]

    def run() -> object:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv[-3:])} failed (exit {done.returncode}): {done.stderr[-500:]}")
        return done.stdout

    return run


def _page_reads(engine: Engine, job_id: str, jobs_shown: int) -> dict[str, Callable[[], object]]:
    """The page's own views of this engine's journal: GET requests to the plugin's FastAPI app."""
    from fastapi.testclient import TestClient

    from airflow_resumable.links import job_path
    from airflow_resumable.plugins.auth import Viewer, require_dag_read
    from airflow_resumable.plugins.paths import rows_path
    from airflow_resumable.plugins.webapp import app

    class EveryDag(Viewer):  # what an admin's sign-in resolves to, without an auth manager to ask
        def on_all_dags(self, method: str) -> bool:
            return True

    app.dependency_overrides[require_dag_read] = lambda: EveryDag("bench", None)
    client = TestClient(app)

    def get(path: str, must_hold: str) -> Callable[[], object]:
        def run() -> object:
            with engine.as_configured_journal():
                response = client.get(path)
            if response.status_code != 200 or must_hold not in response.text:
                raise AssertionError(f"GET {path}: {response.status_code}, {response.text[:300]}")
            return response.text
        return run

    def jobs_json() -> object:
        with engine.as_configured_journal():
            listed = client.get("/jobs.json").json()
        if len(listed["jobs"]) != jobs_shown:
            raise AssertionError(f"the jobs JSON listed {len(listed['jobs'])} jobs, {jobs_shown} expected")
        return listed

    return {  # each checked for what it must show: a page that read less would flatter the figure
        "ui_jobs": get("/", job_path(job_id)),  # the newest job: listed, its held sends shown
        "ui_job": get(job_path(job_id), f'href="{rows_path(job_id)}"'),
        "ui_jobs_json": jobs_json,
    }


def _reads(journal: StepJournal, engine: Engine, shape: Shape, limit: bool) -> dict[str, Callable[[], object]]:
    job_id = shape.job_id(shape.jobs - 1)  # the newest filled job (held sends, a page of rows)

    def job_page() -> object:
        summary = journal.job(job_id)
        rows = journal.rows(job_id, limit=PAGE)
        # A benchmark that silently read less would report a flattering figure.
        if summary is None or len(rows) != min(PAGE, 3 * shape.per_job):
            raise AssertionError(f"one job's page of {job_id} came back short")
        return rows

    def full(read: Callable[[], list[Any]], expected: int) -> Callable[[], object]:
        def run() -> object:
            page = read()
            if len(page) != expected:
                raise AssertionError(f"a page of {len(page)} records, {expected} expected")
            return page
        return run

    held = sum(shape.held(k) for k in range(shape.jobs))
    return {
        "jobs_page": full(lambda: journal.jobs(limit=PAGE), min(PAGE, shape.jobs)),
        "held_page": full(lambda: journal.held(limit=PAGE), min(PAGE, held)),
        "job_page": job_page,
        **_page_reads(engine, job_id, min(PAGE, shape.jobs)),
        "cli_jobs": _cli(engine, "jobs", limit),
        "cli_held": _cli(engine, "held", limit),
    }


def _seconds(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def measure_reads(journals: dict[str, tuple[StepJournal, Engine, Shape]], reps: int, limit: bool) -> dict[str, Any]:
    """Median milliseconds of each read in each journal, big and small interleaved (a warm-up first)."""
    reads = {size: _reads(*journals[size], limit) for size in journals}
    taken: dict[str, dict[str, list[float]]] = {size: {name: [] for name in READS} for size in journals}
    for name in READS:
        for size in journals:
            reads[size][name]()  # warm-up: caches and the plan, as an on-call's second look has them
    for _ in range(max(1, reps)):
        for name in READS:
            for size in journals:
                taken[size][name].append(_seconds(reads[size][name]) * 1000)
    return {size: {name: statistics.median(ms) for name, ms in by_read.items()} for size, by_read in taken.items()}


# --------------------------------------------------------------------------------- a new job


def order_items(n: int, prefix: str) -> Iterator[dict[str, Any]]:
    for i in range(n):
        yield {"id": f"{prefix}-{i:08d}", "payload": "x" * 32}


def run_new_job(journal: StepJournal, job_id: str, n: int) -> float:
    """Seconds of one new job of ``n`` items (checked: every step executed, nothing skipped)."""
    started = time.perf_counter()
    result = run_batch(journal, job_id, order_items(n, "order"), workload.steps(), runner="bench")
    seconds = time.perf_counter() - started
    if result.status != "completed" or result.executed_steps != 3 * n or result.skipped_steps:
        raise AssertionError(f"the new job did not run every step: {result}")
    return seconds


def measure_new_job(journals: dict[str, StepJournal], n: int, reps: int) -> dict[str, Any]:
    per_item: dict[str, list[float]] = {size: [] for size in journals}
    for rep in range(max(1, reps)):
        for size, journal in journals.items():
            per_item[size].append(run_new_job(journal, f"bench_new_job/send/manual__{rep}", n) / n * 1e6)
    big, small = (statistics.median(per_item[s]) for s in ("big", "small"))
    return {"items": n, "reps": max(1, reps), "big_us_per_item": big, "small_us_per_item": small,
            "big_us_per_item_all": per_item["big"], "small_us_per_item_all": per_item["small"], "ratio": big / small}


# ------------------------------------------------------------------------------------- pruning


def _hook(journal: StepJournal, name: str) -> tuple[Any, str]:
    """What runs a journal's statements (its engine) and the name of the primitive to wrap."""
    return journal.engine, name


class MarkTimer:
    """Times every durable commit of one journal (a send's IN_FLIGHT mark before the send starts)."""

    def __init__(self, journal: StepJournal) -> None:
        self.marks: list[tuple[float, float]] = []  # (start, seconds)
        target, name = _hook(journal, "apply")
        apply = getattr(target, name)

        def timed(statements: Any, *, durable: bool) -> None:
            start = time.perf_counter()
            apply(statements, durable=durable)
            if durable:
                self.marks.append((start, time.perf_counter() - start))

        setattr(target, name, timed)


def _runner(journal: StepJournal, n: int, stop: threading.Event, done: list[int], failed: list[BaseException]) -> None:
    """New jobs of ``n`` items, one after the other, until ``stop``."""
    k = 0
    try:
        while not stop.is_set():
            try:
                run_batch(journal, f"bench_during_prune/send/manual__{k}", order_items(n, "during"), workload.steps(),
                          runner="bench", stop=stop)
                done.append(n)
            except BatchStopped:
                return
            k += 1
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        failed.append(exc)


def _prune_process(engine: Engine, stop_midway: bool) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.journal_size", "--prune", engine.kind, engine.location,
         *(["--stop-midway"] if stop_midway else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)] if ordered else 0.0


def measure_prune(engine: Engine, shape: Shape, runner_items: int) -> dict[str, Any]:
    """Prune the finished half while a runner sends on the same journal; the first prune is killed midway."""
    finished = [shape.job_id(k) for k in range(shape.finished_jobs)]
    kept = {shape.job_id(k): shape.per_job for k in range(shape.finished_jobs, shape.jobs)}
    with engine.open(durability="full") as journal:
        timer = MarkTimer(journal)
        stop, done, failed = threading.Event(), [], []  # type: ignore[var-annotated]
        runner = threading.Thread(target=_runner, args=(journal, runner_items, stop, done, failed), daemon=True)
        runner.start()
        while not timer.marks and runner.is_alive():
            time.sleep(0.01)  # the runner is sending before the prune starts
        started = time.perf_counter()
        first = _prune_process(engine, stop_midway=True)
        assert first.stdout is not None
        said = first.stdout.readline().strip()
        killed_at = time.perf_counter()
        interrupted = said == MIDWAY
        if interrupted:
            first.send_signal(signal.SIGKILL)  # our own child, by its handle
        first.wait(timeout=60)
        with engine.open(readonly=True) as reader:
            under_way = [j.job_id for j in reader.jobs(status="pruned") if j.items > 0]
        second = _prune_process(engine, stop_midway=False)
        out, _ = second.communicate(timeout=24 * 3600)
        ended = time.perf_counter()
        stop.set()
        runner.join(timeout=600)
    if failed:
        raise RuntimeError(f"the runner failed during the prune: {failed[0]!r}")
    if second.returncode != 0:
        raise RuntimeError(f"the second prune failed (exit {second.returncode})")
    resumed = json.loads(out.strip().splitlines()[-1])
    during = [seconds * 1000 for start, seconds in timer.marks if start >= started and start <= ended]

    # Exact counts: every finished job pruned to its tombstone, every other filled job untouched, and
    # every job's kept counts equal to a recount of its rows.
    with engine.open(readonly=True) as reader:
        jobs = {j.job_id: j for j in reader.jobs()}
    recount = {row[0]: row[1:] for row in engine.count(recount_statement())}
    # PostgreSQL: items of pruned jobs whose partition also holds jobs kept wait there, no job's, until those go.
    ((unowned,),) = engine.count("SELECT count(*) FROM compacted k WHERE NOT EXISTS "
                                 "(SELECT 1 FROM jobs j WHERE j.job_no = k.job_no)")
    problems = [j for j in finished if jobs[j].pruned_at is None or jobs[j].items or j in recount]
    problems += [j for j, items in kept.items() if jobs[j].items != items or recount[j][0] != items]
    for job in jobs.values():
        counted = recount.get(job.job_id, (0, 0, 0, 0, 0, 0))
        kept_counts = (job.items, job.counts["IN_FLIGHT"], job.counts["SUCCEEDED"], job.counts["FAILED"], job.held,
                       job.unresolved)
        if tuple(int(c) for c in counted) != kept_counts:
            problems.append(job.job_id)
    return {
        "items": shape.finished_jobs * shape.per_job,
        "jobs": shape.finished_jobs,
        "seconds": ended - started,
        "first_prune_seconds": killed_at - started,
        "interrupted_mid_job": interrupted and bool(under_way),
        "resumed_jobs": len(resumed["resumed"]),
        "pruned_by_second": len(resumed["pruned"]),
        "items_left_for_their_partition": int(unowned),
        "counts_exact": not problems,
        "problems": problems[:5],
        "marks": len(during),
        "runner_items": sum(done),
        "max_mark_ms": max(during, default=0.0),
        "p99_mark_ms": _percentile(during, 0.99),
        "median_mark_ms": statistics.median(during) if during else 0.0,
    }


def _prune_main(kind: str, location: str, stop_midway: bool) -> None:
    """One prune process. With ``stop_midway``: once half the finished jobs are gone and one is part way
    (tombstoned, rows left), say so and wait to be killed."""
    engine = _engine(kind, location)
    with engine.open() as journal:
        resumed = [j.job_id for j in journal.jobs(status="pruned") if j.items > 0]
        if stop_midway:
            half = len(journal.jobs(status="completed")) // 2  # of the jobs this prune takes
            target, name = _hook(journal, "write")
            write = getattr(target, name)

            @contextlib.contextmanager
            def watched(*, durable: bool) -> Iterator[Any]:
                with write(durable=durable) as tx:
                    yield tx
                pruned = journal.jobs(status="pruned")
                if sum(1 for j in pruned if not j.items) >= half and any(j.items for j in pruned):
                    print(MIDWAY, flush=True)
                    sys.stdin.readline()  # the parent SIGKILLs us here
                    os._exit(3)

            setattr(target, name, watched)
        pruned = journal.prune(timedelta(0))
    print(json.dumps({"pruned": pruned, "resumed": resumed}), flush=True)


# ----------------------------------------------------------------------------------- the section


def _engine(kind: str, location: str) -> Engine:
    return PostgresEngine(location) if kind == "postgresql" else SqliteEngine(location)


def _bytes_per_item(engine: Engine, items: int) -> dict[str, Any]:
    size, method = engine.bytes()
    return {"bytes": size, "items": items, "bytes_per_item": size / items, "method": method}


def _run(engines: Mapping[str, Engine], runner_engine: Engine, p: dict[str, int]) -> dict[str, Any]:
    shapes = {"big": Shape(p["n_big"], p["jobs_big"]), "small": Shape(p["n_small"], p["jobs_small"])}
    for engine in (*engines.values(), runner_engine):
        with engine.open():
            pass  # the schema (version 7, its triggers) is created here
    fill_seconds = {size: fill(engines[size], shape) for size, shape in shapes.items()}
    sizes = {size: _bytes_per_item(engines[size], shape.jobs * shape.per_job) for size, shape in shapes.items()}
    # The same items as a run writes them, in a journal of their own.
    with runner_engine.open(durability="normal") as journal:
        run_new_job(journal, "bench_bytes/send/manual__0", p["new_items"])
    sizes["runner"] = _bytes_per_item(runner_engine, p["new_items"])
    with runner_engine.open() as journal:  # ... and once compaction went through them
        if journal.compact(timedelta(0)) != {"bench_bytes/send/manual__0": p["new_items"]}:
            raise AssertionError("compact() did not take every finished item of the run")
    runner_engine.after_compact()
    sizes["runner_compacted"] = _bytes_per_item(runner_engine, p["new_items"])

    limit = cli_has_limit()
    with contextlib.ExitStack() as stack:
        journals = {size: stack.enter_context(engines[size].open(durability="full")) for size in shapes}
        reads = measure_reads({size: (journals[size], engines[size], shapes[size]) for size in shapes},
                              p["reps"], limit)
        new_job = measure_new_job(journals, p["new_items"], p["new_reps"])
    prune = measure_prune(engines["big"], shapes["big"], p["new_items"])
    ratios = {name: reads["big"][name] / reads["small"][name] for name in READS}
    return {
        "engine": next(iter(engines.values())).kind,
        "n_big": shapes["big"].jobs * shapes["big"].per_job, "jobs_big": shapes["big"].jobs,
        "n_small": shapes["small"].jobs * shapes["small"].per_job, "jobs_small": shapes["small"].jobs,
        "steps_per_item": len(workload.STEP_NAMES),
        "held_rows": {size: sum(s.held(k) for k in range(s.jobs)) for size, s in shapes.items()},
        "fill_seconds": fill_seconds,
        "reads_ms": reads,
        "read_ratios": ratios,
        "cli_limit_flag": limit,
        "new_job": new_job,
        "bytes_per_item": sizes,
        "prune": prune,
    }


def measure(p: dict[str, int]) -> dict[str, Any]:
    """The section on SQLite: two journal files (and a third for a run's own rows)."""
    with tempfile.TemporaryDirectory(prefix="journal-size-") as tmp:
        engines = {size: SqliteEngine(str(Path(tmp) / f"{size}.sqlite3")) for size in ("big", "small")}
        return _run(engines, SqliteEngine(str(Path(tmp) / "runner.sqlite3")), p)


def measure_postgres(p: dict[str, int]) -> dict[str, Any]:
    """The section on PostgreSQL: a throwaway cluster, a database per journal."""
    from benchmarks import pg

    if (why := pg.unavailable()) is not None:
        return {"skipped": why}
    with pg.throwaway_server() as server:
        engines = {size: PostgresEngine(server.new_database()) for size in ("big", "small")}
        result = _run(engines, PostgresEngine(server.new_database()), p)
        return result | {"postgres_version": server.version()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a prune process of the journal-size benchmark")
    parser.add_argument("--prune", nargs=2, metavar=("ENGINE", "LOCATION"), required=True)
    parser.add_argument("--stop-midway", action="store_true")
    args = parser.parse_args()
    import logging

    logging.getLogger("airflow_resumable").setLevel(logging.ERROR)
    _prune_main(args.prune[0], args.prune[1], args.stop_midway)
