"""Runner processes share one journal: eight on a SQLite file (parallel tasks on one worker), and
sixteen on one PostgreSQL database (tasks on many workers).

They start together on a journal that does not exist yet (so they race to create and migrate it),
run different jobs with and without concurrency, at both durabilities, and write as fast as they
can. None may fail with "database is locked"; every item of every job reaches its receiver exactly
once and ends SUCCEEDED in the journal. A second round resumes all eight at once: nothing is sent.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from airflow_resumable.journal import Status, StepJournal
from tests.support.crash_child import EXIT_COMPLETED, ChildRun
from tests.support.receivers import DurableReceiver

pytestmark = pytest.mark.core

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


PG_PROCESSES, PG_JOBS_EACH, PG_ITEMS = 16, 2, 2000


@pytest.mark.slow
def test_sixteen_processes_two_jobs_each_share_one_postgres_journal(tmp_path, postgres_url):
    """16 runner processes, each running 2 jobs at once (a connection each), 2,000 items per job, one
    PostgreSQL database: no lock error, nothing lost, nothing sent twice; a second round sends nothing."""
    ids = [f"item-{i:03d}" for i in range(1, PG_ITEMS + 1)]

    def start_round() -> list[tuple[list[str], ChildRun, DurableReceiver]]:
        runs = []
        for n in range(PG_PROCESSES):
            jobs = [f"pg-shared/p{n:02d}-j{j}" for j in range(PG_JOBS_EACH)]
            receiver_path = tmp_path / f"receiver-{n}.sqlite3"
            receiver = DurableReceiver(receiver_path)
            child = ChildRun(tmp_path, postgres_url, receiver_path, jobs[0], durability=("full", "normal")[n % 2],
                             n_items=PG_ITEMS, concurrency=(1, 8)[(n // 2) % 2], also_jobs=tuple(jobs[1:]))
            runs.append((jobs, child, receiver))
        return runs

    def finish_round(runs) -> list[dict]:
        summaries = []
        for jobs, child, _ in runs:
            code, summary, err = child.finish(timeout=900)
            assert "lock" not in err.lower() and "deadlock" not in err.lower(), f"{jobs}: {err[-3000:]}"
            assert code == EXIT_COMPLETED, f"{jobs} exited {code}:\n{summary}\n{err[-3000:]}"
            summaries += [summary, *summary.get("also", {}).values()]
        return summaries

    first = finish_round(start_round())
    assert [(s["executed"], s["held"]) for s in first] == [(3 * PG_ITEMS, [])] * (PG_PROCESSES * PG_JOBS_EACH)
    again_runs = start_round()
    again = finish_round(again_runs)
    assert [(s["executed"], s["skipped"]) for s in again] == [(0, 3 * PG_ITEMS)] * (PG_PROCESSES * PG_JOBS_EACH)

    with StepJournal(postgres_url) as journal:
        jobs = {j.job_id: j for j in journal.jobs()}
        assert len(jobs) == PG_PROCESSES * PG_JOBS_EACH
        for job_ids, _, receiver in again_runs:
            for job in job_ids:
                assert receiver.counts(job) == dict.fromkeys(ids, 1), f"{job}: lost or duplicated sends"
                summary = jobs[job]
                assert (summary.counts["SUCCEEDED"], summary.items, summary.settled) == (3 * PG_ITEMS, PG_ITEMS, True)
