"""Row layouts: bytes per item (3 steps, rows + indexes) of the journal's layout and of candidates for it.

Measured before choosing how to store compact rows: each layout is a table of its own, filled with the
same items as the journal-size section's (its job id, ``order-00001234`` ids, a random SHA-256 input
digest per item shared by its 3 steps, the send's receipt and outputs as a run writes them), with its
primary key and its held-steps index, on SQLite (``dbstat``) and PostgreSQL (``pg_total_relation_size``
after ``VACUUM``). Only the layout's size is measured here: none but ``today`` is the journal's.

    python -m benchmarks.row_layouts [--items 200000]
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.journal_size import Shape

# (step, side effect, position): the journal-size section's three steps.
STEPS = (("validate", 0, 0), ("transform", 0, 1), ("notify", 1, 2))
JOB_ID = Shape(10_000_000, 300).job_id(105)  # dag_05/send_orders/scheduled__2026-...#105
JOB_NO = 105
T0 = 1.8e9


@dataclass(frozen=True)
class Layout:
    """A table (``{real}``/``{blob}``/``{without_rowid}`` filled in per engine) and one item's rows in it."""

    name: str
    what: str
    table: str
    held_index: str
    rows: Callable[[int, bytes], list[tuple[Any, ...]]]


def _times(i: int, position: int, side_effect: int) -> tuple[float, float]:
    created = T0 + i * 0.002 + position * 0.0001
    return created, created + side_effect * 0.001


def _today(i: int, digest: bytes) -> list[tuple[Any, ...]]:
    return [(JOB_ID, f"order-{i:08d}", step, side_effect, "SUCCEEDED", digest.hex(), "receipt" if side_effect else None,
             '"receipt"' if side_effect else "null", None, None, None, 1, *_times(i, position, side_effect), 0, 0,
             1 + side_effect) for step, side_effect, position in STEPS]


def _job_number(i: int, digest: bytes) -> list[tuple[Any, ...]]:
    return [(JOB_NO, *row[1:]) for row in _today(i, digest)]


def _coded(i: int, digest: bytes) -> list[tuple[Any, ...]]:
    return [(JOB_NO, f"order-{i:08d}", position, 2, digest, "receipt" if side_effect else None,
             '"receipt"' if side_effect else "null", None, None, None, 1, *_times(i, position, side_effect), 0, 0,
             1 + side_effect) for _, side_effect, position in STEPS]


def _per_item(i: int, digest: bytes) -> list[tuple[Any, ...]]:
    created, _ = _times(i, 0, 0)
    return [(JOB_NO, f"order-{i:08d}", digest, "SSS", '[null,null,"receipt"]', '[null,null,"receipt"]', None, None,
             "111", created, created + 0.0012, 0, 0, 3)]


def _per_item_settled(i: int, digest: bytes) -> list[tuple[Any, ...]]:
    created, _ = _times(i, 0, 0)
    return [(JOB_NO, f"order-{i:08d}", digest[:16], "SSS", '"receipt"', None, None, None, None, created,
             created + 0.0012, 0, 0, 3)]


def _per_step(job: str, step: str, status: str, digest: str, held: str) -> tuple[str, str]:
    """A row per step (the journal's way): the table and its held-steps index, with these column types."""
    table = f"""CREATE TABLE t (job_id {job} NOT NULL, item_id TEXT NOT NULL, {step}, status {status} NOT NULL,
        digest {digest} NOT NULL, receipt TEXT, output TEXT, error_type TEXT, held_reason {held}, new_digest {digest},
        attempts INTEGER NOT NULL, created_at {{real}} NOT NULL, updated_at {{real}} NOT NULL,
        generation INTEGER NOT NULL, not_sent SMALLINT NOT NULL, version INTEGER NOT NULL,
        PRIMARY KEY (job_id, item_id, step)) {{without_rowid}}"""
    return table, "CREATE INDEX t_held ON t (job_id, item_id, step) WHERE held_reason IS NOT NULL"


_NAMED_STEP = "step TEXT NOT NULL, side_effect SMALLINT NOT NULL"
# A row per item: the steps' states, receipts, outputs and attempts in step order.
_PER_ITEM = (
    """CREATE TABLE t (job_id INTEGER NOT NULL, item_id TEXT NOT NULL, digest {blob} NOT NULL,
    statuses TEXT NOT NULL, receipts TEXT, outputs TEXT, held_reason SMALLINT, new_digest {blob}, attempts TEXT,
    created_at {real} NOT NULL, updated_at {real} NOT NULL, generation INTEGER NOT NULL, not_sent SMALLINT NOT NULL,
    version INTEGER NOT NULL, PRIMARY KEY (job_id, item_id)) {without_rowid}""",
    "CREATE INDEX t_held ON t (job_id, item_id) WHERE held_reason IS NOT NULL",
)

LAYOUTS = (
    Layout("today", "a row per step, the job's text id in every row and index entry (schema 7)",
           *_per_step("TEXT", _NAMED_STEP, "TEXT", "TEXT", "TEXT"), _today),
    Layout("job_number", "a row per step, the job as a number (its text id once, in jobs)",
           *_per_step("INTEGER", _NAMED_STEP, "TEXT", "TEXT", "TEXT"), _job_number),
    Layout("coded", "a row per step: job, step, status and hold as numbers, the digest as 32 bytes",
           *_per_step("INTEGER", "step SMALLINT NOT NULL", "SMALLINT", "{blob}", "SMALLINT"), _coded),
    Layout("per_item", "a row per item: the steps' states, receipts and outputs as arrays, digest 32 bytes",
           *_PER_ITEM, _per_item),
    Layout("per_item_settled", "a row per item; a settled item keeps its digest (16 bytes) and receipts only",
           *_PER_ITEM, _per_item_settled),
)


def _sqlite_bytes(layout: Layout, items: int, folder: str) -> float:
    path = Path(folder) / f"{layout.name}.sqlite3"
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute(layout.table.format(real="REAL", blob="BLOB", without_rowid="WITHOUT ROWID"))
        conn.execute(layout.held_index)
        conn.execute("BEGIN")
        for i in range(items):
            rows = layout.rows(i, os.urandom(32))
            conn.executemany(f"INSERT INTO t VALUES ({','.join('?' * len(rows[0]))})", rows)
        conn.execute("COMMIT")
        (size,) = conn.execute("SELECT sum(pgsize) FROM dbstat WHERE name IN ('t', 't_held')").fetchone()
    finally:
        conn.close()
        path.unlink()
    return float(size) / items


def _postgres_bytes(layout: Layout, items: int, url: str) -> float:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(layout.table.format(real="DOUBLE PRECISION", blob="BYTEA", without_rowid=""))
        conn.execute(layout.held_index)
        with conn.cursor() as cur, cur.copy("COPY t FROM STDIN") as copy:
            for i in range(items):
                for row in layout.rows(i, os.urandom(32)):
                    copy.write_row(row)
        conn.execute("VACUUM ANALYZE t")
        (size,) = conn.execute("SELECT pg_total_relation_size('t')").fetchone()  # type: ignore[misc]
        conn.execute("DROP TABLE t")
    return float(size) / items


def measure(items: int) -> dict[str, Any]:
    """Bytes per item of every layout on SQLite, and on PostgreSQL where a server can be started here."""
    from benchmarks import pg

    layouts: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="row-layouts-") as folder:
        for layout in LAYOUTS:
            layouts[layout.name] = {"what": layout.what, "sqlite": _sqlite_bytes(layout, items, folder)}
    skipped = pg.unavailable()
    if skipped is None:
        with pg.throwaway_server() as server:
            url = server.new_database()
            for layout in LAYOUTS:
                layouts[layout.name]["postgresql"] = _postgres_bytes(layout, items, url)
    return {"items": items, "layouts": layouts, "postgresql_skipped": skipped}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.row_layouts", description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=200_000)
    args = parser.parse_args(argv)
    results = measure(args.items)
    print(f"bytes per item, {args.items:,} items of 3 steps (rows + indexes)")
    print(f"{'layout':18} {'SQLite':>7} {'PostgreSQL':>11}  what")
    for name, figures in results["layouts"].items():
        postgres = f"{figures['postgresql']:11,.0f}" if "postgresql" in figures else f"{'-':>11}"
        print(f"{name:18} {figures['sqlite']:7,.0f} {postgres}  {figures['what']}")
    if results["postgresql_skipped"]:
        print(f"PostgreSQL: {results['postgresql_skipped']}")


if __name__ == "__main__":
    main()
