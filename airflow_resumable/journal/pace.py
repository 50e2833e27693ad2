"""A send rate kept together by every run that names one limit key on one journal (SPEC §12).

A run does not commit per send: it reserves a block of send slots at a time (about a tenth of a second
of them) by moving the key's next free moment on, in one short transaction, and spaces its sends over
the block itself. A receiver's ``Retry-After`` moves the key's pause on the same way, and every run's
next block starts after it. The state is one row of ``meta`` per key (``pace:<key>``, a JSON pair of
epoch seconds): no schema change. Times are the journal's: the machine's clock for a SQLite file (every
run on it is on that machine), the server's for PostgreSQL (the fleet's clocks need not agree).
"""

from __future__ import annotations

import json
import time

from airflow_resumable.journal.backend import JournalBackend, Tx

__all__ = ["JournalPace"]


class JournalPace:
    """The pace of one limit key on one journal (:class:`~airflow_resumable.runner.settle.SharedPace`)."""

    def __init__(self, engine: JournalBackend, limit_key: str) -> None:
        self.engine = engine
        self.key = f"pace:{limit_key}"

    def _now(self, tx: Tx) -> float:
        if self.engine.kind == "postgresql":
            found = tx.one("SELECT extract(epoch FROM clock_timestamp())::float8")
            assert found is not None
            return float(found[0])
        return time.time()

    def _state(self, tx: Tx) -> tuple[float, float]:
        tx.run("INSERT INTO meta (key, value) VALUES (?, '[0, 0]') ON CONFLICT (key) DO NOTHING", (self.key,))
        lock = " FOR UPDATE" if self.engine.kind == "postgresql" else ""  # SQLite: BEGIN IMMEDIATE locks
        found = tx.one(f"SELECT value FROM meta WHERE key = ?{lock}", (self.key,))
        assert found is not None
        next_at, paused_until = json.loads(found[0])
        return float(next_at), float(paused_until)

    def reserve(self, count: int, interval: float) -> float:
        """Take ``count`` send slots ``interval`` seconds apart; the seconds from now until the first."""
        with self.engine.write(durable=False) as tx:
            now = self._now(tx)
            next_at, paused_until = self._state(tx)
            start = max(now, next_at, paused_until)
            tx.run("UPDATE meta SET value = ? WHERE key = ?",
                   (json.dumps([start + count * interval, paused_until]), self.key))
        return start - now

    def pause(self, seconds: float) -> None:
        """No run sends under this key for ``seconds`` from now (the receiver asked to wait)."""
        with self.engine.write(durable=False) as tx:
            now = self._now(tx)
            next_at, paused_until = self._state(tx)
            if now + seconds > paused_until:
                tx.run("UPDATE meta SET value = ? WHERE key = ?", (json.dumps([next_at, now + seconds]), self.key))
