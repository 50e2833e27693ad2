"""The baseline: a step journal kept the way the seed article keeps it.

Written from the article's described behaviour, not from its code: one table; every state change
(IN_FLIGHT before *every* step, SUCCEEDED or FAILED after it) is its own committed transaction; one
SELECT per step to find its row. The decisions on resume are the article's (and the same as ours):
skip SUCCEEDED, re-run local steps, verify-or-hold a send found IN_FLIGHT/FAILED, hold a changed input.

``durability`` sets what a commit costs, so both sides are compared at the same guarantee:
``"normal"`` = WAL + ``synchronous=NORMAL`` (the article's setting), ``"full"`` = WAL +
``synchronous=FULL`` (every commit fsyncs the WAL, as our full durability does for a send's mark).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from airflow_resumable.runner import Step, StepContext, idempotency_key

Durability = Literal["normal", "full"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS step_journal (
    job_id     TEXT NOT NULL,
    item_id    TEXT NOT NULL,
    step       TEXT NOT NULL,
    status     TEXT NOT NULL CHECK (status IN ('IN_FLIGHT', 'SUCCEEDED', 'FAILED')),
    digest     TEXT NOT NULL,
    receipt    TEXT,
    error_type TEXT,
    updated_at REAL NOT NULL,
    PRIMARY KEY (job_id, item_id, step)
)
"""

_WRITE = """
INSERT INTO step_journal (job_id, item_id, step, status, digest, receipt, error_type, updated_at)
VALUES (?, ?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (job_id, item_id, step) DO UPDATE SET
    status = excluded.status, digest = excluded.digest, receipt = excluded.receipt,
    error_type = excluded.error_type, updated_at = excluded.updated_at
"""

_READ = "SELECT status, digest FROM step_journal WHERE job_id = ? AND item_id = ? AND step = ?"


@dataclass
class ArticleResult:
    status: str  # "completed" | "needs_review"
    executed_steps: int = 0
    skipped_steps: int = 0
    held: list[tuple[str, str, str]] = field(default_factory=list)  # (item_id, step, reason)


class ArticleStyleJournal:
    """One SQLite file, one table, one committed transaction per state change."""

    def __init__(self, path: str | Path, *, durability: Durability = "normal") -> None:
        if durability not in ("normal", "full"):
            raise ValueError(f"durability must be 'normal' or 'full', not {durability!r}")
        self.durability = durability
        self.commits = 0  # one per state change: the figure that makes this baseline slow
        self.conn = sqlite3.connect(str(path))
        self.conn.execute("PRAGMA journal_mode = WAL")
        self.conn.execute(f"PRAGMA synchronous = {durability.upper()}")
        with self.conn:
            self.conn.execute(_SCHEMA)

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> ArticleStyleJournal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def mark(self, key: tuple[str, str, str], status: str, digest: str, *, receipt: str | None = None,
             error_type: str | None = None) -> None:
        with self.conn:  # the article's way: the row's new state is committed before going on
            self.conn.execute(_WRITE, (*key, status, digest, receipt, error_type, time.time()))
        self.commits += 1

    def row(self, key: tuple[str, str, str]) -> tuple[str, str] | None:
        found = self.conn.execute(_READ, key).fetchone()
        return None if found is None else (found[0], found[1])

    def resolve(self, job_id: str, item_id: str, step: str, *, delivered: bool, receipt: str | None = None) -> None:
        """A human's decision on a held send: delivered -> SUCCEEDED; confirmed not delivered -> row cleared."""
        key = (job_id, item_id, step)
        found = self.row(key)
        if found is None or found[0] == "SUCCEEDED":
            raise ValueError(f"{key} is not an unresolved step")
        if delivered and not receipt:
            raise ValueError("delivered=True needs the receiver's receipt")
        with self.conn:
            if delivered:
                self.conn.execute(
                    "UPDATE step_journal SET status = 'SUCCEEDED', receipt = ?, error_type = NULL, updated_at = ? "
                    "WHERE job_id = ? AND item_id = ? AND step = ?",
                    (receipt, time.time(), *key),
                )
            else:
                self.conn.execute("DELETE FROM step_journal WHERE job_id = ? AND item_id = ? AND step = ?", key)
        self.commits += 1


def _digest(item: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(item, sort_keys=True).encode("utf-8")).hexdigest()


def run_article_style(
    journal: ArticleStyleJournal, job_id: str, items: Iterable[Mapping[str, Any]], steps: list[Step],
    *, id_field: str = "id",
) -> ArticleResult:
    """Run ``steps`` over ``items``, resuming from ``journal`` the article's way.

    Step functions get ``ctx=None``: the article hands its steps only the item. That makes the
    baseline cheaper than building a context per step, never dearer.
    """
    result = ArticleResult(status="completed")
    for item in items:
        item_id = str(item[id_field])
        digest = _digest(item)
        for step in steps:
            key = (job_id, item_id, step.name)
            found = journal.row(key)  # one SELECT per step
            if found is not None:
                status, journaled_digest = found
                if journaled_digest != digest:
                    result.held.append((item_id, step.name, "input_changed"))
                    break
                if status == "SUCCEEDED":
                    result.skipped_steps += 1
                    continue
                if step.side_effect:
                    # Unknown outcome: ask the receiver, never send blindly.
                    ctx = StepContext(job_id, item_id, step.name, digest,
                                      idempotency_key(job_id, item_id, step.name), {})
                    receipt = step.verify(ctx) if step.verify else None
                    if receipt:
                        journal.mark(key, "SUCCEEDED", digest, receipt=receipt)
                        result.skipped_steps += 1
                        continue
                    result.held.append((item_id, step.name, "unknown_outcome"))
                    break
                # A local step found IN_FLIGHT/FAILED touches nothing outside: run it again.
            journal.mark(key, "IN_FLIGHT", digest)
            result.executed_steps += 1
            try:
                value = step.fn(item, None)  # type: ignore[arg-type]
            except Exception as exc:
                journal.mark(key, "FAILED", digest, error_type=type(exc).__name__)
                raise
            journal.mark(key, "SUCCEEDED", digest, receipt=str(value) if step.side_effect else None)
    result.status = "needs_review" if result.held else "completed"
    return result
