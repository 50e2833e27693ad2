"""Eight runner processes share one journal file (parallel tasks on one worker).

They start together on a journal that does not exist yet (so they race to create and migrate it),
run different jobs with and without concurrency, at both durabilities, and write as fast as they
can. None may fail with "database is locked"; every item of every job reaches its receiver exactly
once and ends SUCCEEDED in the journal. A second round resumes all eight at once: nothing is sent.
"""

from __future__ import annotations

from pathlib import Path

from airflow_resumable.journal import Status, StepJournal
from tests.crash_child import EXIT_COMPLETED, ChildRun
from tests.receivers import DurableReceiver

PROCESSES = 8
ITEMS = 1000


def start_all(tmp_path: Path, journal: Path) -> list[tuple[str, ChildRun, DurableReceiver]]:
    runs = []
    for n in range(PROCESSES):
        job = f"shared/job-{n}"
        receiver_path = tmp_path / f"receiver-{n}.sqlite3"
        receiver = DurableReceiver(receiver_path)
        child = ChildRun(tmp_path, journal, receiver_path, job, durability=("full", "normal")[n % 2],
                         n_items=ITEMS, concurrency=(1, 8)[(n // 2) % 2])
        runs.append((job, child, receiver))
    return runs


def finish_all(runs: list[tuple[str, ChildRun, DurableReceiver]]) -> list[dict]:
    summaries = []
    for job, child, _ in runs:
        code, summary, err = child.finish(timeout=300)
        assert "locked" not in err.lower(), f"{job}: {err}"
        assert code == EXIT_COMPLETED, f"{job} exited {code}:\n{summary}\n{err}"
        summaries.append(summary)
    return summaries


def test_eight_processes_share_one_journal(tmp_path):
    journal_path = tmp_path / "journal" / "journal.sqlite3"
    ids = [f"item-{i:03d}" for i in range(1, ITEMS + 1)]

    first = finish_all(start_all(tmp_path, journal_path))
    assert [(s["executed"], s["skipped"], s["held"]) for s in first] == [(3 * ITEMS, 0, [])] * PROCESSES
    with StepJournal(journal_path) as journal:
        jobs = journal.jobs()
    # They really ran side by side: every job had written its first rows before any had finished.
    assert max(j.created_at for j in jobs) < min(j.updated_at for j in jobs), jobs

    runs = start_all(tmp_path, journal_path)
    again = finish_all(runs)
    assert [(s["executed"], s["skipped"]) for s in again] == [(0, 3 * ITEMS)] * PROCESSES

    with StepJournal(journal_path) as journal:
        for job, _, receiver in runs:
            assert receiver.counts(job) == dict.fromkeys(ids, 1), f"{job}: lost or duplicated sends"
            rows = journal.rows(job)
            assert len(rows) == 3 * ITEMS and {r.status for r in rows} == {Status.SUCCEEDED}, job
        assert sorted(j.job_id for j in journal.jobs()) == sorted(job for job, _, _ in runs)
