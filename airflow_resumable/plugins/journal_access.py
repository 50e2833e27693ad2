"""The journal as the Resumable jobs page reads it: which journal, the ids and filters a request may
name, the jobs a viewer may see, and the records as the page shows them (state, never data).

Every question goes through the journal's API (no SQL here). The journal is the one the operators use
on this host (``[resumable] journal_conn_id`` or ``journal_path``), never a location from the request.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import HTTPException

from airflow_resumable._location import journal_target
from airflow_resumable.exceptions import PageError
from airflow_resumable.journal import JobSummary, JournalError, Page, Status, StepJournal, StepRecord
from airflow_resumable.journal.checks import text_problem
from airflow_resumable.journal.records import MAX_ID_LENGTH, MAX_JOB_ID_LENGTH
from airflow_resumable.plugins.auth import Viewer

MAX_RESOLUTIONS = 50
# The filters the pages offer: JobSummary.status (JOB_STATUSES) for jobs, and the row statuses.
ROW_STATUSES = tuple(Status.__members__)


@contextmanager
def open_journal(*, readonly: bool = True) -> Iterator[StepJournal | None]:
    """This host's journal, or None when nothing ran here yet (an empty page; no file is created)."""
    try:
        target = journal_target()  # [resumable] journal_conn_id (a shared journal) or journal_path
        if not target.exists():  # nothing ran on this host yet: show an empty page, never create a file
            yield None
            return
        journal = target.open(readonly=readonly)  # a page view writes nothing; only a resolution does
    except (JournalError, ValueError) as exc:
        # The type only: journal messages name paths and are meant for the worker's log.
        raise HTTPException(status_code=503, detail=f"the journal cannot be read ({type(exc).__name__})") from None
    with journal:
        try:
            yield journal
        except JournalError as exc:  # one the page did not answer itself: locked past the busy timeout, lost
            raise HTTPException(status_code=503, detail=(
                f"the journal failed ({type(exc).__name__}); reload and look again - a decision is applied "
                "only to the version you saw")) from None


def job_dict(job: JobSummary) -> dict[str, Any]:
    total = sum(job.counts.values())
    return {
        "job_id": job.job_id,
        "dag_id": job.dag_id,  # the DAG that owns it (who may see and settle it); None: not recorded
        "status": job.status,
        "counts": dict(job.counts),
        "steps_journaled": total,
        "steps_succeeded": job.counts.get("SUCCEEDED", 0),
        "items": job.items,
        "held": job.held,
        "unresolved": job.unresolved,
        "created_at": job.created_at.isoformat(),
        "updated_at": job.updated_at.isoformat(),
        "pruned_at": job.pruned_at.isoformat() if job.pruned_at else None,
        "finished_at": job.finished_at.isoformat() if job.finished_at else None,  # None: not gone through
    }


def row_dict(row: StepRecord) -> dict[str, Any]:
    # No step output and no payload: the page shows state, never data. Error types only (no messages).
    return {
        "item_id": row.item_id,
        "step": row.step,
        "side_effect": row.side_effect,
        "status": row.status.value,
        "held_reason": row.held_reason.value if row.held_reason else None,
        "attempts": row.attempts,
        "error_type": row.error_type,
        "receipt": row.receipt,
        "idempotency_key": row.key_to_ask,  # what to ask the receiver about (side-effect steps only)
        "generation": row.generation,
        "not_sent": row.not_sent,  # a FAILED send that provably never left: the next run sends it
        "updated_at": row.updated_at.isoformat(),
        # The row as shown: a decision about it carries this, and is refused if the row changed since.
        "version": row.version,
    }


def id_problem(value: str, limit: int) -> str | None:
    """Why ``value`` cannot name anything in the journal (the journal's own limits), or None."""
    if not value:
        return "is empty"
    if len(value) > limit:
        return f"is {len(value)} characters; at most {limit}"
    return text_problem(value)


def check_id(value: str, what: str) -> str:
    # Checked before any look-up: such an id names nothing, and neither engine can even be asked about
    # it. Item ids are at most MAX_ID_LENGTH (the runner refuses longer ones); job ids may be longer
    # (a DAG id, a task id and a run id), so any job the list shows has a page.
    if id_problem(value, MAX_JOB_ID_LENGTH if what == "job" else MAX_ID_LENGTH):
        raise HTTPException(status_code=404, detail=f"unknown {what}")
    return value


def readable_job(journal: StepJournal | None, job_id: str, viewer: Viewer) -> JobSummary:
    """The job, if it exists and the viewer may read its DAG's jobs; else the same 404 either way."""
    check_id(job_id, "job")
    job = journal.job(job_id) if journal is not None else None
    if job is None or not viewer.may_read(job):
        raise HTTPException(status_code=404, detail="unknown job")
    return job


def checked_filter(value: str, allowed: tuple[str, ...], what: str) -> str | None:
    if not value:
        return None
    if value not in allowed:
        raise HTTPException(status_code=400, detail=f"unknown {what}; use one of {', '.join(allowed)}")
    return value


@contextmanager
def pages_of_the_journal() -> Iterator[None]:
    """A cursor the journal refuses (another list's, or edited) is the caller's mistake: a short 400,
    never the journal's message (which quotes the cursor)."""
    try:
        yield
    except PageError:
        raise HTTPException(status_code=400, detail="the cursor is not one this page gave; start again from "
                            "the first page") from None


def held_records(journal: StepJournal, job_id: str, *, limit: int, cursor: str | None = None) -> Page[StepRecord]:
    """One page of a job's held steps, each as its whole row: what the table shows (status, attempts,
    error type, receipt) besides the hold."""
    with pages_of_the_journal():
        return journal.held_rows(job_id, limit=limit, cursor=cursor)


def latest_resolutions(journal: StepJournal, job_id: str) -> list[dict[str, Any]]:
    """The job's latest ``MAX_RESOLUTIONS`` resolutions, oldest first."""
    return [
        r.as_json() for r in reversed(journal.resolutions(job_id, limit=MAX_RESOLUTIONS, newest_first=True))
    ]
