"""The page's settling routes: the pre-filled Resolve form of one held step, and the two endpoints that
apply decisions (``POST /api/resolve``: one held step; ``/api/resolve-many``: several of one job).

A decision is applied by the journal as the signed-in user, only with Airflow's edit permission on the
job's DAG, and with the row versions the page showed: a step that changed since is refused (409), never
settled blind. Each applied decision leaves an audit row naming the user.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse
from pydantic import BaseModel

from airflow_resumable._location import RESOLVE_DAG_ID
from airflow_resumable.exceptions import ResolutionError, StaleDecisionError
from airflow_resumable.journal import DECISIONS_BY_REASON, JobBusyError, JobSummary, NotHeldError
from airflow_resumable.journal.records import MAX_JOB_ID_LENGTH, MAX_PAGE
from airflow_resumable.plugins.auth import Viewer, ViewerDep
from airflow_resumable.plugins.journal_access import check_id, id_problem, open_journal, readable_job, row_dict
from airflow_resumable.plugins.rendering import render_page

# "Resolve several" posts the rows given a decision (at most the page's); each becomes an audit row.
MAX_DECISIONS_PER_REQUEST = 500

router = APIRouter()


class _Decision(BaseModel):
    job_id: str
    item_id: str
    step: str = ""
    decision: str
    receipt: str = ""
    note: str = ""
    version: str | None = None  # the row's version as shown; none: decides about the row as it is now


class _Entry(BaseModel):
    item_id: str
    step: str = ""
    decision: str
    receipt: str = ""
    version: str | None = None  # as in _Decision


class _Decisions(BaseModel):
    job_id: str
    decisions: list[_Entry]
    note: str = ""


def _settleable_job(request: Request, viewer: Viewer, job_id: str) -> JobSummary:
    """JSON only, a job the user may read, and edit permission on its DAG: else refused, before any write.

    The job's text fields are checked by the journal as it applies the decision (with its message);
    the job id only here, as it is looked up first."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise HTTPException(status_code=415, detail="send the decision as application/json")
    problem = id_problem(job_id, MAX_JOB_ID_LENGTH)
    if problem:
        raise HTTPException(status_code=422, detail=f"job_id {problem}; nothing was changed")
    with open_journal() as journal:
        job = readable_job(journal, job_id, viewer)
    if not viewer.may_settle(job):
        dag = (f"DAG {job.dag_id!r}" if job.dag_id is not None else
               "all DAGs (this job has no recorded DAG: it was written outside Airflow or by an older release)")
        raise HTTPException(status_code=403, detail=(
            f"you may read this job but not act on {dag}: settling a held item needs Airflow's edit "
            "permission on the job's DAG (as Clear does); nothing was changed"))
    return job


def _nothing_changed(exc: Exception) -> str:
    message = str(exc)
    return message if "nothing was changed" in message.lower() else f"{message}; nothing was changed"


@router.post("/api/resolve")
def resolve_json(request: Request, body: _Decision, viewer: ViewerDep) -> dict[str, Any]:
    """Settle one held step as the signed-in user, after checking that they may act on the job's DAG.

    The API server applies it through the journal API (one transaction and an audit row naming the
    user), only if the row is still the ``version`` the person saw. JSON only: a cross-site form
    cannot post it (the browser would need CORS to send JSON)."""
    _settleable_job(request, viewer, body.job_id)
    with open_journal(readonly=False) as journal:
        if journal is None:
            raise HTTPException(status_code=404, detail="unknown job")
        try:
            resolution = journal.apply_decision(
                body.job_id, body.item_id, body.step or None, body.decision, resolved_by=viewer.name,
                receipt=body.receipt.strip() or None, note=body.note, expected_version=body.version or None,
            )
        except StaleDecisionError as exc:  # the step changed since it was shown: look again
            raise HTTPException(status_code=409, detail=_nothing_changed(exc)) from None
        except NotHeldError as exc:
            raise HTTPException(status_code=404, detail=_nothing_changed(exc)) from None
        except JobBusyError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except ResolutionError as exc:
            raise HTTPException(status_code=422, detail=_nothing_changed(exc)) from None
    return resolution.as_json()


@router.post("/api/resolve-many")
def resolve_many_json(request: Request, body: _Decisions, viewer: ViewerDep) -> dict[str, Any]:
    """Settle several held steps of one job as the signed-in user, all or nothing (the job page's form).

    Checked like ``/api/resolve``; every entry is checked, then all are applied in one transaction,
    each with its own audit row; one refused entry (named: ``entry 2: ...``), or one whose step
    changed since it was shown (409), changes nothing."""
    if len(body.decisions) > MAX_DECISIONS_PER_REQUEST:
        raise HTTPException(status_code=422, detail=(
            f"{len(body.decisions)} decisions in one request; at most {MAX_DECISIONS_PER_REQUEST} (the page's "
            "rows); nothing was changed"))
    _settleable_job(request, viewer, body.job_id)
    entries = [{"job_id": body.job_id, "item_id": e.item_id, "step": e.step or None, "decision": e.decision,
                "receipt": e.receipt.strip() or None, "note": body.note, "version": e.version or None}
               for e in body.decisions]
    with open_journal(readonly=False) as journal:
        if journal is None:
            raise HTTPException(status_code=404, detail="unknown job")
        try:
            done = journal.apply_decisions(entries, resolved_by=viewer.name)
        except StaleDecisionError as exc:
            raise HTTPException(status_code=409, detail=_nothing_changed(exc)) from None
        except JobBusyError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except (ResolutionError, NotHeldError) as exc:
            raise HTTPException(status_code=422, detail=_nothing_changed(exc)) from None
    return {"job_id": body.job_id, "count": len(done), "resolved_by": viewer.name,
            "resolved": [r.as_json() for r in done]}


@router.get("/resolve", response_class=HTMLResponse)
def resolve_page(
    request: Request, viewer: ViewerDep, job_id: str = "", item_id: str = "", step: str = "",
) -> HTMLResponse:
    """The Resolve form of one held step, pre-filled from the journal (its decisions, its idempotency key)."""
    # The query names a held step; it is looked up in the journal and only ever used as an identifier.
    for value, what in ((job_id, "job"), (item_id, "item"), (step, "step")):
        check_id(value, what)
    with open_journal() as journal:
        job = readable_job(journal, job_id, viewer)
        assert journal is not None
        rows = journal.rows(job_id, item_id, limit=MAX_PAGE)  # the item's steps (a few), by its key
    row = next((r for r in rows if r.step == step and r.held_reason), None)
    if row is None or row.held_reason is None:
        raise HTTPException(status_code=404, detail="no such held step (it may be resolved already)")
    return render_page(
        request, "resolve.html", job_id=job_id, dag_id=job.dag_id, row=row_dict(row),
        decisions=DECISIONS_BY_REASON[row.held_reason],
        idempotency_key=row.key_to_ask, resolve_dag_id=RESOLVE_DAG_ID,
        viewer=viewer, may_settle=viewer.may_settle(job),
    )
