"""The IN_FLIGHT mark is committed - and under full durability fsync'd -
before the send starts."""

from __future__ import annotations

import os
import sqlite3

import pytest

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, run_batch

pytestmark = pytest.mark.core


def _spy_fsync(monkeypatch):
    """Wrap the real os.fsync and os.fdatasync and note which file each call synced."""
    calls: list[str] = []

    def spy(real):
        def spying(fd: int) -> None:
            real(fd)
            calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        return spying

    for name in ("fsync", "fdatasync"):
        monkeypatch.setattr(os, name, spy(getattr(os, name)))
    return calls


@pytest.mark.parametrize("durability", ["full", "normal"])
def test_in_flight_is_committed_and_synced_before_the_send(tmp_path, monkeypatch, durability):
    path = tmp_path / "journal.sqlite3"
    fsyncs = _spy_fsync(monkeypatch)
    seen_by_other_connection: list[tuple] = []
    fsyncs_before_send: list[list[str]] = []

    def notify(item, ctx):
        # A separate connection (as another process would) already sees the mark.
        other = sqlite3.connect(path)
        try:
            seen_by_other_connection.append(
                other.execute(
                    "SELECT status, attempts FROM steps WHERE job_id=? AND item_id=? AND step=?",
                    (ctx.job_id, ctx.item_id, ctx.step),
                ).fetchone()
            )
        finally:
            other.close()
        fsyncs_before_send.append(list(fsyncs))
        return f"receipt-{ctx.item_id}"

    with StepJournal(path, durability=durability) as journal:
        run_batch(journal, "job", [{"id": "a"}, {"id": "b"}, {"id": "c"}],
                  [Step("prepare", lambda item, ctx: 1), Step("notify", notify, side_effect=True)], settle_in_task=False)
        count = journal.engine.fsync_count

    assert seen_by_other_connection == [("IN_FLIGHT", 1)] * 3
    if durability == "full":
        # One fsync of the WAL per guarded send, each made before that send started.
        assert count == 3
        wal = str(path) + "-wal"
        assert [calls.count(wal) for calls in fsyncs_before_send] == [1, 2, 3]
    else:
        assert count == 0
        assert all(wal_calls == [] for wal_calls in fsyncs_before_send)


def test_records_that_guard_nothing_need_no_fsync(tmp_path, monkeypatch):
    fsyncs = _spy_fsync(monkeypatch)
    with StepJournal(tmp_path / "journal.sqlite3", durability="full") as journal:
        run_batch(journal, "job", [{"id": i} for i in range(200)],
                  [Step("a", lambda item, ctx: 1), Step("b", lambda item, ctx: 2)], settle_in_task=False)
        assert journal.engine.fsync_count == 0
    assert not [f for f in fsyncs if f.endswith("-wal")]
