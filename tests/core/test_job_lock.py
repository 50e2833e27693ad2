"""One runner per job: a second run of a running job fails at once and sends nothing; a
lock left by a SIGKILLed runner is taken over with no manual cleanup; other jobs are not blocked.
On both engines: a SQLite file (flock) and PostgreSQL (a session advisory lock)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from airflow_resumable.journal import JobBusyError, Status, StepJournal
from airflow_resumable.runner import Step, run_batch
from tests.support.crash_child import EXIT_BUSY, EXIT_COMPLETED, ChildRun
from tests.support.receivers import DurableReceiver

pytestmark = pytest.mark.core

JOB = "lock/job-1"
IDS = [f"item-{i:03d}" for i in range(1, 31)]


def _journal_state(path: Path, job: str) -> list[tuple]:
    with StepJournal(path) as journal:
        return [(r.item_id, r.step, r.status, r.attempts, r.updated_at) for r in journal.rows(job)]


def _all_succeeded(path: Path, job: str) -> None:
    with StepJournal(path) as journal:
        rows = journal.rows(job)
        assert len(rows) == 90 and {r.status for r in rows} == {Status.SUCCEEDED}
        assert journal.held(job) == []


def test_second_process_is_refused_at_once_then_takes_over_after_sigkill(tmp_path, journal_location):
    journal_path = journal_location
    on_sqlite = not journal_path.startswith("postgresql://")
    receiver_path = tmp_path / "receiver.sqlite3"
    receiver = DurableReceiver(receiver_path)

    first = ChildRun(tmp_path, journal_path, receiver_path, JOB, pause_at="local", pause_item="item-013")
    first.wait_ready()
    before = receiver.counts(JOB)
    assert len(before) == 12
    journal_before = _journal_state(journal_path, JOB)

    started = time.monotonic()
    code, summary, err = ChildRun(tmp_path, journal_path, receiver_path, JOB).finish(timeout=30)
    whole_process = time.monotonic() - started
    assert code == EXIT_BUSY, (code, summary, err)
    assert summary["busy"] is True
    # At once: no waiting on a lock or a busy timeout - inside the run (the claim, brief holders' 5 s), and
    # in the whole process (opening the journal: SQLite's busy timeout is 30 s), whose start-up alone takes
    # seconds on a loaded machine (2.1 s seen in CI).
    assert summary["elapsed"] < 2.0 and whole_process < 10.0, (summary["elapsed"], whole_process)
    assert "already running" in summary["message"] and f"pid {first.pid}" in summary["message"]
    assert first.proc.poll() is None, "the first run is still running"
    # ... and the refused run sent nothing and wrote nothing.
    assert receiver.counts(JOB) == before
    assert _journal_state(journal_path, JOB) == journal_before

    assert first.kill()
    if on_sqlite:
        lock_dir = Path(str(journal_path) + ".locks")
        stale = sorted(lock_dir.glob("*.lock"))
        assert stale, "the killed runner left its lock file behind"
        # ... and its receipt log: item 12's receipt was logged, not yet committed.
        assert list(lock_dir.glob("*.receipts"))

    # No cleanup: the next run simply gets the lock and finishes the job.
    code, summary, err = ChildRun(tmp_path, journal_path, receiver_path, JOB).finish()
    assert code == EXIT_COMPLETED, (code, summary, err)
    assert summary["status"] == "completed" and summary["skipped"] >= 12 * 3
    if on_sqlite:
        assert sorted(lock_dir.glob("*.lock")) == stale
        assert list(lock_dir.glob("*.receipts")) == [], "the next run folded the log and removed it"
    counts = receiver.counts(JOB)
    assert sorted(counts) == IDS and set(counts.values()) == {1}
    _all_succeeded(journal_path, JOB)


def test_two_journal_objects_in_one_process(journal_location):
    path = journal_location
    sent: list[str] = []
    steps = [Step("send", lambda item, ctx: sent.append(ctx.item_id) or "ok", side_effect=True)]
    items = [{"id": "a"}, {"id": "b"}]
    with StepJournal(path) as j1, StepJournal(path) as j2:
        run = j1.open_job(JOB)
        try:
            started = time.monotonic()
            with pytest.raises(JobBusyError, match="already running"):
                j2.open_job(JOB)
            assert time.monotonic() - started < 2.0
            with pytest.raises(JobBusyError):
                j1.open_job(JOB)  # the same journal object twice is refused too
            with pytest.raises(JobBusyError):
                run_batch(j2, JOB, items, steps, settle_in_task=False)
            assert sent == []
            assert j2.rows(JOB) == []
            # Another job in the same file is not blocked.
            assert run_batch(j2, "other-job", items, steps, settle_in_task=False).status == "completed"
            assert sent == ["a", "b"]
        finally:
            run.close()
        # Released: now the second journal gets the job.
        assert run_batch(j2, JOB, items, steps, settle_in_task=False).status == "completed"
        assert sent == ["a", "b", "a", "b"]


def test_different_jobs_in_one_journal_run_concurrently(tmp_path, journal_location):
    journal_path = journal_location
    receiver_path = tmp_path / "receiver.sqlite3"
    receiver = DurableReceiver(receiver_path)
    release = tmp_path / "release"

    # Job A stops mid-batch holding its lock; job B runs from start to end meanwhile.
    a = ChildRun(tmp_path, journal_path, receiver_path, "job-a", pause_at="local", pause_item="item-013",
                 release=release)
    a.wait_ready()
    code, summary, err = ChildRun(tmp_path, journal_path, receiver_path, "job-b", step_ms=(1, 2)).finish()
    assert code == EXIT_COMPLETED, (code, summary, err)
    assert a.proc.poll() is None, "job A is still running while B completed"
    release.touch()
    code, summary, err = a.finish()
    assert code == EXIT_COMPLETED, (code, summary, err)

    # Both jobs busy at the same time, writing the same file: each stops mid-batch (holding its own
    # lock) until both have got there, then both finish at once. (Started side by side without the
    # stop, one child could finish before the other's interpreter was up on a loaded machine.)
    both = tmp_path / "release-both"
    c = ChildRun(tmp_path, journal_path, receiver_path, "job-c", step_ms=(1, 3), pause_at="local",
                 pause_item="item-013", release=both)
    d = ChildRun(tmp_path, journal_path, receiver_path, "job-d", step_ms=(1, 3), pause_at="local",
                 pause_item="item-013", release=both)
    c.wait_ready()
    d.wait_ready()
    both.touch()
    for child in (c, d):
        code, summary, err = child.finish()
        assert code == EXIT_COMPLETED, (code, summary, err)
    with StepJournal(journal_path) as journal:
        spans = [(min(r.created_at for r in journal.rows(j)), max(r.updated_at for r in journal.rows(j)))
                 for j in ("job-c", "job-d")]
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], f"the runs did not overlap: {spans}"

    for job in ("job-a", "job-b", "job-c", "job-d"):
        counts = receiver.counts(job)
        assert sorted(counts) == IDS and set(counts.values()) == {1}, job
        _all_succeeded(journal_path, job)


def test_decisions_about_a_job_the_journal_does_not_have_leave_no_lock_file(tmp_path):
    """A mistyped job id is refused, and leaves nothing beside the journal (a lock file per typo, before);
    a decision about a real job keeps the job's lock file as a run does."""
    from airflow_resumable.journal import NotHeldError
    from tests.support.scenario import held_job

    path = tmp_path / "journal.sqlite3"
    job, item, step = "dag/send/run-1", "a", "send"
    held_job(path, job, item)
    lock_dir = Path(str(path) + ".locks")
    before = sorted(p.name for p in lock_dir.iterdir())
    with StepJournal(path) as journal:
        for typo in ("no/such/job", job + " ", job.upper()):
            with pytest.raises(NotHeldError, match="unknown job"):
                journal.resolve(typo, item, step, delivered=False, resolved_by="oncall")
            with pytest.raises(NotHeldError, match="unknown job"):
                journal.apply_decisions([{"job_id": typo, "item_id": item, "step": step,
                                          "decision": "not_delivered"}], resolved_by="oncall")
        assert sorted(p.name for p in lock_dir.iterdir()) == before
        journal.resolve(job, item, step, delivered=False, resolved_by="oncall")
        assert journal.held(job) == []
