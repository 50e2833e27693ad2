"""Receivers for core tests: they record every delivery durably in a SQLite file of their own."""

from __future__ import annotations

import sqlite3
from pathlib import Path


class AcceptedThenLost(Exception):
    """The receiver accepted the delivery but the reply never arrived (a timeout, say)."""


class RefusedBeforeAccept(Exception):
    """The receiver failed before it accepted anything."""


class DurableReceiver:
    """An outside system: counts deliveries per (job, item, step) and answers look-ups by key."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        with self._conn() as conn:
            conn.execute(
                """CREATE TABLE IF NOT EXISTS deliveries (
                       seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT, item_id TEXT, step TEXT,
                       idempotency_key TEXT, payload TEXT,
                       -- the receiver's own clock, epoch seconds (julianday: SQLite < 3.42 has no subsec)
                       received_at REAL DEFAULT ((julianday('now') - 2440587.5) * 86400.0))"""
            )

    def _conn(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        return conn

    def deliver(self, job_id: str, item_id: str, step: str, key: str, payload: str = "") -> str:
        conn = self._conn()
        try:
            cur = conn.execute(
                "INSERT INTO deliveries (job_id, item_id, step, idempotency_key, payload) VALUES (?,?,?,?,?)",
                (job_id, item_id, step, key, payload),
            )
            return f"rcpt-{cur.lastrowid}"
        finally:
            conn.close()

    def lookup(self, key: str) -> str | None:
        conn = self._conn()
        try:
            row = conn.execute(
                "SELECT seq FROM deliveries WHERE idempotency_key = ? ORDER BY seq LIMIT 1", (key,)
            ).fetchone()
            return None if row is None else f"rcpt-{row[0]}"
        finally:
            conn.close()

    def counts(self, job_id: str | None = None) -> dict[str, int]:
        conn = self._conn()
        try:
            sql = "SELECT item_id, count(*) FROM deliveries"
            params: tuple = ()
            if job_id is not None:
                sql += " WHERE job_id = ?"
                params = (job_id,)
            return dict(conn.execute(sql + " GROUP BY item_id", params).fetchall())
        finally:
            conn.close()

    def received_after(self, moment: float) -> int:
        """Deliveries the receiver's clock says arrived after ``moment`` (epoch seconds)."""
        conn = self._conn()
        try:
            return int(conn.execute("SELECT count(*) FROM deliveries WHERE received_at > ?", (moment,)).fetchone()[0])
        finally:
            conn.close()

    def duplicates(self, job_id: str | None = None) -> int:
        return sum(n - 1 for n in self.counts(job_id).values() if n > 1)
