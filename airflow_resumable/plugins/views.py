"""The page's reading routes: the jobs list, a job with its held steps, and a job's step rows, each as
an HTML page and as JSON. Reading writes nothing: the journal is opened read-only."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import HTMLResponse

from airflow_resumable._location import journal_display
from airflow_resumable.journal import DECISIONS_BY_REASON, HeldReason, JobSummary, Page, StepJournal, StepRecord
from airflow_resumable.journal.records import JOB_STATUSES, MAX_JOB_ID_LENGTH
from airflow_resumable.links import job_path
from airflow_resumable.plugins.auth import Viewer, ViewerDep
from airflow_resumable.plugins.journal_access import (
    ROW_STATUSES,
    checked_filter,
    held_records,
    id_problem,
    job_dict,
    latest_resolutions,
    open_journal,
    pages_of_the_journal,
    readable_job,
    row_dict,
)
from airflow_resumable.plugins.pager import Paging, PagingDep, page_links
from airflow_resumable.plugins.paths import app_prefix, rows_path
from airflow_resumable.plugins.rendering import render_page

router = APIRouter()


def _visible_jobs(
    journal: StepJournal | None, viewer: Viewer, paging: Paging, *, status: str | None, dag_id: str | None,
) -> Page[JobSummary]:
    """One page of the jobs the viewer may read, newest first.

    A viewer of some DAGs only gets the readable jobs among the journal's pages, read a full page at a
    time until the page is full or the list ends. The next cursor (the journal's) must name the last job
    shown: when the page fills before a read ends, that read is made again up to its last shown job, which
    the journal's cursor then names. So a page costs a read per page of jobs passed over, plus one.
    """
    if journal is None or (dag_id is not None and dag_id not in viewer.allowed("GET", [dag_id])):
        return Page()
    with pages_of_the_journal():
        if viewer.all_dags:
            return journal.jobs(limit=paging.limit, cursor=paging.cursor, status=status, dag_id=dag_id)
        shown: list[JobSummary] = []
        cursor = paging.cursor
        while True:
            read = journal.jobs(limit=paging.limit, cursor=cursor, status=status, dag_id=dag_id)
            readable = viewer.allowed("GET", {j.dag_id for j in read})
            positions = [n for n, j in enumerate(read) if j.dag_id in readable]
            wanted = paging.limit - len(shown)
            if len(positions) >= wanted and positions[wanted - 1] < len(read) - 1:
                read = journal.jobs(limit=positions[wanted - 1] + 1, cursor=cursor, status=status, dag_id=dag_id)
                readable = viewer.allowed("GET", {j.dag_id for j in read})
            shown += [j for j in read if j.dag_id in readable]
            cursor = read.next_cursor
            if cursor is None or len(shown) >= paging.limit:
                return Page(shown, cursor)


def _held_of_jobs(journal: StepJournal | None, jobs: list[JobSummary], limit: int) -> list[dict[str, Any]]:
    """The held steps of ``jobs`` (one page of the jobs list), at most ``limit`` in all."""
    rows: list[dict[str, Any]] = []
    for job in jobs:
        if journal is None or not job.held or len(rows) >= limit:
            continue
        rows += [{"job_id": job.job_id, **row_dict(r)} for r in held_records(journal, job.job_id, limit=limit - len(rows))]
    return rows


@dataclass(frozen=True)
class JobsListing:
    """One page of the jobs list, its held steps, and where the list goes on."""

    jobs: list[dict[str, Any]]
    held: list[dict[str, Any]]
    held_total: int  # held steps of the page's jobs (their kept counts); ``held`` shows up to the limit
    next_cursor: str | None
    journal_exists: bool


def _jobs_listing(viewer: Viewer, paging: Paging, status: str, dag_id: str) -> JobsListing:
    wanted_status = checked_filter(status, JOB_STATUSES, "status")
    wanted_dag = dag_id or None
    if wanted_dag is not None and id_problem(wanted_dag, MAX_JOB_ID_LENGTH):
        raise HTTPException(status_code=400, detail="dag_id cannot name a DAG")
    with open_journal() as journal:
        jobs = _visible_jobs(journal, viewer, paging, status=wanted_status, dag_id=wanted_dag)
        held = _held_of_jobs(journal, jobs, paging.limit)
        exists = journal is not None
    return JobsListing([job_dict(j) for j in jobs], held, sum(j.held for j in jobs), jobs.next_cursor, exists)


@router.get("/jobs.json")
def jobs_json(
    viewer: ViewerDep, paging: PagingDep, status: Annotated[str, Query()] = "", dag_id: Annotated[str, Query()] = "",
) -> dict[str, Any]:
    """One page of jobs (``limit``, default 100; ``cursor``: ``next`` of the page before; filters
    ``status`` and ``dag_id``) with their held steps."""
    listing = _jobs_listing(viewer, paging, status, dag_id)
    return {
        "journal_path": journal_display(), "hostname": socket.gethostname(),
        "jobs": listing.jobs, "held": listing.held, "held_total": listing.held_total,
        "limit": paging.limit, "next": listing.next_cursor,  # None: the last page
    }


@router.get("/", response_class=HTMLResponse)
def jobs_page(
    request: Request, viewer: ViewerDep, paging: PagingDep, status: Annotated[str, Query()] = "",
    dag_id: Annotated[str, Query()] = "",
) -> HTMLResponse:
    listing = _jobs_listing(viewer, paging, status, dag_id)
    links = page_links(app_prefix(request) + "/", paging, listing.next_cursor, status=status, dag_id=dag_id)
    return render_page(request, "jobs.html", jobs=listing.jobs, held=listing.held, held_total=listing.held_total,
                       journal_exists=listing.journal_exists, viewer=viewer, links=links, statuses=JOB_STATUSES,
                       status=status, dag_id=dag_id, filtered=bool(status or dag_id), paging=paging)


def _high_water(journal: StepJournal, job_id: str) -> dict[str, Any]:
    """The job's IN_FLIGHT marks in the journal beside the marks Airflow keeps for it (SPEC §13)."""
    from airflow_resumable._stored_marks import stored_marks

    count = journal.marks(job_id)
    stored = stored_marks(job_id)
    marks = [] if isinstance(stored, str) else [
        {"dag_id": m.dag_id, "run_id": m.run_id, "task_id": m.task_id, "map_index": m.map_index, "marks": m.marks,
         "recorded_at": m.at, "recorded_by": m.by, "window_open": m.open,
         "journal_behind": m.journal_behind(count)} for m in stored]
    return {"journal_marks": count, "stored": marks, "stored_unavailable": stored if isinstance(stored, str) else None,
            "behind": [m for m in marks if m["journal_behind"]]}


def _job_detail(job: JobSummary, held: Page[StepRecord], resolutions: list[dict[str, Any]],
                high_water: dict[str, Any]) -> dict[str, Any]:
    rows = [row_dict(r) for r in held]
    return {
        "job": job_dict(job),
        "held": rows, "held_total": job.held, "next": held.next_cursor,  # the next page of held steps
        "unresolved_total": job.unresolved,  # sends with an unknown outcome, not held: the job's rows
        # The open rows: the held ones (this page of them) and the unresolved sends.
        "open_rows": rows, "open_rows_total": job.held + job.unresolved,
        "resolutions": resolutions,
        "high_water": high_water,  # a journal restored or failed over is behind a mark: its tries are refused
    }


# Not "/jobs/{job_id}.json": a job whose id ends in ".json" would open another job's JSON.
@router.get("/api/jobs/{job_id:path}")
def job_json(job_id: str, viewer: ViewerDep, paging: PagingDep) -> dict[str, Any]:
    """A job, one page of its held steps (``limit``, ``cursor``: ``next``) and its latest resolutions."""
    with open_journal() as journal:
        job = readable_job(journal, job_id, viewer)
        assert journal is not None
        return _job_detail(job, held_records(journal, job_id, limit=paging.limit, cursor=paging.cursor),
                           latest_resolutions(journal, job_id), _high_water(journal, job_id))


@router.get("/jobs/{job_id:path}", response_class=HTMLResponse)
def job_page(request: Request, job_id: str, viewer: ViewerDep, paging: PagingDep) -> HTMLResponse:
    with open_journal() as journal:
        job = readable_job(journal, job_id, viewer)
        assert journal is not None
        held = held_records(journal, job_id, limit=paging.limit, cursor=paging.cursor)
        detail = _job_detail(job, held, latest_resolutions(journal, job_id), _high_water(journal, job_id))
    for row in detail["held"]:
        row["decisions"] = DECISIONS_BY_REASON[HeldReason(row["held_reason"])]
    links = page_links(app_prefix(request) + job_path(job_id), paging, held.next_cursor)
    return render_page(request, "job.html", **detail, viewer=viewer, held_rows=detail["held"], links=links,
                       may_settle=bool(held) and viewer.may_settle(job), row_statuses=ROW_STATUSES)


def _rows_listing(
    journal: StepJournal | None, job_id: str, viewer: Viewer, paging: Paging, status: str,
) -> tuple[JobSummary, Page[StepRecord]]:
    wanted = checked_filter(status, ROW_STATUSES, "status")
    job = readable_job(journal, job_id, viewer)
    assert journal is not None
    if wanted is not None and not job.counts.get(wanted, 0):  # the kept counts say none: no need to look
        return job, Page()
    with pages_of_the_journal():
        return job, journal.rows(job_id, status=wanted, limit=paging.limit, cursor=paging.cursor)


@router.get("/api/rows/{job_id:path}")
def rows_json(
    job_id: str, viewer: ViewerDep, paging: PagingDep, status: Annotated[str, Query()] = "",
) -> dict[str, Any]:
    """One page of a job's step rows (by item, then step), ``status`` one of IN_FLIGHT, SUCCEEDED, FAILED."""
    with open_journal() as journal:
        job, rows = _rows_listing(journal, job_id, viewer, paging, status)
    return {"job_id": job.job_id, "rows": [row_dict(r) for r in rows], "limit": paging.limit,
            "next": rows.next_cursor}


@router.get("/rows/{job_id:path}", response_class=HTMLResponse)
def rows_page(
    request: Request, job_id: str, viewer: ViewerDep, paging: PagingDep, status: Annotated[str, Query()] = "",
) -> HTMLResponse:
    with open_journal() as journal:
        job, rows = _rows_listing(journal, job_id, viewer, paging, status)
    links = page_links(app_prefix(request) + rows_path(job_id), paging, rows.next_cursor, status=status)
    return render_page(request, "rows.html", job=job_dict(job), rows=[row_dict(r) for r in rows], links=links,
                       viewer=viewer, status=status, row_statuses=ROW_STATUSES, paging=paging)
