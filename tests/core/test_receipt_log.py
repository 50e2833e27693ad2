"""The receipt log: a delivered send's receipt survives a dead runner without a commit of its own.

The crash matrix kills real runners (tests/core/test_crash_matrix.py, boundary "local": the receipt of
the item before the kill is only in the log). These tests pin the fold rules: only the row the
receipt was logged for, still IN_FLIGHT with the same input and not held, is settled; a torn line
is ignored; a live runner's log is left alone.
"""

from __future__ import annotations

import json
import sqlite3
import stat
import threading
import time

import pytest

from airflow_resumable.journal import JobBusyError, JournalError, Status, StepJournal
from airflow_resumable.runner import Step, run_batch

pytestmark = pytest.mark.core

JOB = "receipts/job"
COLUMNS = "job_id, item_id, step, side_effect, status, digest, receipt, output, error_type, held_reason, " \
          "new_digest, attempts, created_at, updated_at"


def insert(path, *rows) -> None:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.executemany(f"INSERT INTO steps ({COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    conn.execute("INSERT OR IGNORE INTO jobs (job_id, created_at, updated_at) VALUES (?, 1, 1)", (JOB,))
    conn.close()


def row(item_id, status, digest, *, side_effect=1, held=None, receipt=None):
    return (JOB, item_id, "notify", side_effect, status, digest, receipt, None if receipt is None else
            json.dumps(receipt), None, held, None, 1, 1.0, 1.0)


def log_line(item_id, digest, receipt) -> bytes:
    return json.dumps([JOB, item_id, "notify", digest, json.dumps(receipt), receipt, time.time()]).encode() + b"\n"


def test_open_folds_a_dead_runners_log_into_exactly_the_rows_it_names(tmp_path):
    path = tmp_path / "journal.sqlite3"
    with StepJournal(path) as journal:
        log = journal.engine.receipt_log(JOB).path
    insert(path,
           row("in-flight", "IN_FLIGHT", "d1"),
           row("done", "SUCCEEDED", "d2", receipt="rcpt-old"),
           row("input-changed", "IN_FLIGHT", "d3-new"),
           row("held", "IN_FLIGHT", "d4", held="unknown_outcome"),
           row("local", "IN_FLIGHT", "d5", side_effect=0))
    log.parent.mkdir(exist_ok=True)
    log.write_bytes(
        log_line("in-flight", "d1", "rcpt-1") + log_line("done", "d2", "rcpt-new")
        + log_line("input-changed", "d3-old", "rcpt-3") + log_line("held", "d4", "rcpt-4")
        + log_line("local", "d5", "rcpt-5") + log_line("missing", "d6", "rcpt-6")
        + log_line("torn", "d7", "rcpt-7")[:25]
    )

    with StepJournal(path) as journal:
        rows = {r.item_id: r for r in journal.rows(JOB)}
    assert not log.exists(), "a folded log is removed"
    assert (rows["in-flight"].status, rows["in-flight"].receipt, rows["in-flight"].output) == (
        Status.SUCCEEDED, "rcpt-1", "rcpt-1")
    assert rows["done"].receipt == "rcpt-old"  # already settled: untouched
    assert rows["input-changed"].status == Status.IN_FLIGHT  # logged for another input
    assert rows["held"].status == Status.IN_FLIGHT and rows["held"].held_reason is not None
    assert rows["local"].status == Status.IN_FLIGHT
    assert sorted(rows) == ["done", "held", "in-flight", "input-changed", "local"]  # nothing invented


def test_a_live_runners_log_is_left_to_it(tmp_path):
    path = tmp_path / "journal.sqlite3"
    with StepJournal(path) as journal, journal.open_job(JOB) as run:
        run.mark_in_flight("a", "notify", "d")
        run.flush(durable=True)
        run.mark_succeeded("a", "notify", "d", side_effect=True, output='"r"', receipt="r", log_receipt=True)
        run.write_receipts()
        log = journal.engine.receipt_log(JOB).path
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        with StepJournal(path) as other:  # another process's view while the run goes on
            assert [r.status for r in other.rows(JOB)] == [Status.IN_FLIGHT]
        assert log.exists()
    with StepJournal(path) as journal:
        assert [(r.status, r.receipt) for r in journal.rows(JOB)] == [(Status.SUCCEEDED, "r")]
    assert not log.exists(), "a run that closes cleanly removes its log"


def test_a_send_costs_one_commit_and_its_receipt_one_log_line(tmp_path):
    sent = []
    steps = [Step("validate", lambda item, ctx: None), Step("notify", lambda item, ctx: sent.append(1) or "r",
                                                            side_effect=True)]
    with StepJournal(tmp_path / "journal.sqlite3", durability="full") as journal:
        engine = journal.engine
        commits, durable = engine.commit_count, engine.durable_commit_count
        run_batch(journal, JOB, [{"id": i} for i in range(50)], steps, settle_in_task=False)
        commits, durable = engine.commit_count - commits, engine.durable_commit_count - durable
    assert len(sent) == 50
    # One durable commit per send (its IN_FLIGHT mark, carrying the previous receipt), plus the close.
    assert durable == 50 and commits <= 52, (durable, commits)
    assert journal.engine.fsync_count == 50



def test_a_running_job_cannot_be_resolved(tmp_path):
    path = tmp_path / "journal.sqlite3"
    with StepJournal(path) as journal, journal.open_job(JOB) as run:
        run.mark_in_flight("a", "notify", "d")
        run.flush(durable=True)
        before = [(r.status, r.receipt) for r in journal.rows(JOB)]
        with StepJournal(path) as other:
            try:
                other.resolve(JOB, "a", "notify", delivered=False, resolved_by="oncall")
            except JobBusyError as exc:
                assert "running right now" in str(exc) and "nothing was changed" in str(exc)
            else:
                raise AssertionError("resolving a running job's in-flight send must be refused")
            assert [(r.status, r.receipt) for r in other.rows(JOB)] == before
            assert other.resolutions(JOB) == []
    with StepJournal(path) as journal:  # once the run is over, it can be resolved
        journal.resolve(JOB, "a", "notify", delivered=False, resolved_by="oncall")
        assert [(r.status.value, r.not_sent) for r in journal.rows(JOB)] == [("FAILED", True)]  # owed: sent next run


def test_a_failed_flush_keeps_every_record_for_the_next_one(tmp_path):
    """Another task holds the write lock past the busy timeout while item 2's mark is flushed: the
    run fails before item 2 is sent, and item 1's delivered send is still recorded SUCCEEDED."""
    path = tmp_path / "journal.sqlite3"
    delivered = []

    def hold_the_lock() -> None:
        conn = sqlite3.connect(path, isolation_level=None)
        conn.execute("BEGIN IMMEDIATE")
        time.sleep(0.5)
        conn.execute("COMMIT")
        conn.close()

    def local(item, ctx):
        if item["id"] == 2:
            threading.Thread(target=hold_the_lock).start()
            time.sleep(0.1)
        return 1

    def notify(item, ctx):
        delivered.append(item["id"])
        return f"r-{item['id']}"

    steps = [Step("local", local), Step("notify", notify, side_effect=True)]
    with StepJournal(path, busy_timeout=0.2) as journal:
        try:
            # The progress report on failure outlasts the other writer, so close() can flush.
            run_batch(journal, JOB, [{"id": 1}, {"id": 2}], steps, on_progress=lambda p: time.sleep(0.6),
                      progress_interval=3600, settle_in_task=False)
        except JournalError as exc:
            assert "locked" in str(exc)
        else:
            raise AssertionError("the flush must have failed")
    assert delivered == [1], "item 2 was never sent: its mark could not be committed"
    with StepJournal(path) as journal:
        rows = {(r.item_id, r.step): (r.status, r.receipt) for r in journal.rows(JOB)}
        assert rows[("1", "notify")] == (Status.SUCCEEDED, "r-1")
        assert ("2", "notify") not in rows
        result = run_batch(journal, JOB, [{"id": 1}, {"id": 2}], steps, settle_in_task=False)
    assert (result.status, delivered) == ("completed", [1, 2])


def test_upserts_fit_an_old_sqlite_variable_limit(tmp_path):
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        if not hasattr(journal.engine._connection, "setlimit"):
            return  # Python 3.10: the conservative 999 is assumed anyway
        journal.engine._connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)  # SQLite < 3.32
        steps = [Step("a", lambda item, ctx: 1), Step("b", lambda item, ctx: 2)]
        result = run_batch(journal, JOB, [{"id": i} for i in range(700)], steps, settle_in_task=False)  # 1,400 rows buffered
        assert result.executed_steps == 1400 and len(journal.rows(JOB)) == 1400


def test_a_run_waits_out_a_fold_that_holds_its_lock_for_a_moment(tmp_path):
    from airflow_resumable.journal.backend import FOLD_RUNNER as _FOLD_RUNNER
    from airflow_resumable.journal.sqlite import JobLock as _JobLock

    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        fold = _JobLock(journal.engine._lock_path(JOB), JOB, journal.engine.path, runner=_FOLD_RUNNER)
        threading.Timer(0.3, fold.release).start()
        started = time.monotonic()
        with journal.open_job(JOB):
            assert time.monotonic() - started >= 0.25
        # A real runner holding the job is still refused at once.
        with journal.open_job(JOB, runner="the other run"):
            started = time.monotonic()
            try:
                journal.open_job(JOB)
            except JobBusyError as exc:
                assert "the other run" in str(exc) and time.monotonic() - started < 0.2
            else:
                raise AssertionError("a second runner must be refused")
