"""The FastAPI app behind the "Resumable jobs" page: jobs, held items, and a pre-filled Resolve form.

Read-only. Every question goes through the journal's read API (no SQL here); resolutions are
triggered runs of the ``resolve_held_item`` DAG, made by the user's browser through Airflow's own
REST API and permissions. The journal is the one the operators use on this host
(``[resumable] journal_path``), never a path from the request.

Airflow does not authenticate plugin apps, so this one does, with Airflow's own machinery: the JWT
of the request (``Authorization: Bearer`` or the ``_token`` cookie the Airflow UI sets for the
browser, which also reaches this app in the UI's iframe) and the auth manager's DAG read permission.
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse
from jinja2 import Environment, PackageLoader
from markupsafe import Markup, escape
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_resumable import _time
from airflow_resumable._airflow import RESOLVE_DAG_ID, journal_display, journal_target
from airflow_resumable.journal import (
    DECISIONS_BY_REASON,
    HeldReason,
    JobBusyError,
    JobSummary,
    JournalError,
    NotHeldError,
    Resolution,
    ResolutionError,
    StepJournal,
    StepRecord,
)
from airflow_resumable.runner import MAX_ID_LENGTH, idempotency_key

URL_PREFIX = "/resumable"
# The page stays small for a job with 50,000 held items; the JSON says how many were left out.
MAX_OPEN_ROWS = 500
MAX_RESOLUTIONS = 50
MAX_JOB_ID_LENGTH = 64 * 1024

_templates = Environment(
    loader=PackageLoader("airflow_resumable.plugins", "templates"),
    autoescape=True,  # every value is escaped; nothing is marked safe
    trim_blocks=True,
    lstrip_blocks=True,
)


# --------------------------------------------------------------------------------- authentication


def _authorized_dags(user: Any, method: str) -> tuple[bool, frozenset[str]]:
    """(all DAGs?, else the DAG ids) the auth manager lets ``user`` access with ``method``."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails

    auth_manager = get_auth_manager()
    if auth_manager.is_authorized_dag(method=method, user=user, details=DagDetails()):
        return True, frozenset()
    return False, frozenset(auth_manager.get_authorized_dag_ids(user=user, method=method))


@dataclass(frozen=True)
class Viewer:
    """Who is asking, and which jobs they may see."""

    name: str
    all_dags: bool
    dag_ids: frozenset[str]
    user: Any = field(default=None, compare=False, repr=False)

    def may_see(self, job_id: str) -> bool:
        # A default job_id starts with its DAG id; a custom one is shown to users who read all DAGs.
        return self.all_dags or job_id.split("/", 1)[0] in self.dag_ids

    @cached_property
    def _editable(self) -> tuple[bool, frozenset[str]]:
        # Asked only by the resolve form and endpoint, not by every page view.
        return _authorized_dags(self.user, "PUT")

    def may_settle(self, job_id: str) -> bool:
        """Settling a held item is acting on the job's DAG: Airflow's edit permission on it (as Clear)."""
        edit_all, edit_ids = self._editable
        return edit_all or job_id.split("/", 1)[0] in edit_ids


async def require_dag_read(request: Request) -> Viewer:
    """Airflow's own authentication (JWT from header or cookie) and DAG read permission."""
    # Imported here: workers import this module when they load plugins and need none of it.
    from fastapi.security import HTTPBearer

    from airflow_resumable._compat import get_user

    credentials = await HTTPBearer(auto_error=False)(request)
    user = await get_user(request, credentials)  # Airflow answers 401/403 itself
    all_dags, dag_ids = _authorized_dags(user, "GET")
    if not all_dags and not dag_ids:
        raise HTTPException(status_code=403, detail="Forbidden: DAG read permission is required")
    return Viewer(user.get_name(), all_dags, dag_ids, user)


ViewerDep = Annotated[Viewer, Depends(require_dag_read)]

app = FastAPI(
    title="Resumable jobs", docs_url=None, redoc_url=None, openapi_url=None,
    dependencies=[Depends(require_dag_read)],
)


@app.middleware("http")
async def _security_headers(request: Request, call_next: Any) -> Any:
    nonce = secrets.token_urlsafe(16)
    request.state.csp_nonce = nonce
    response = await call_next(request)
    # Only the Airflow UI (same origin) may frame the page; scripts only with this response's nonce.
    response.headers["Content-Security-Policy"] = (
        f"default-src 'none'; script-src 'nonce-{nonce}'; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data:; form-action 'self'; frame-ancestors 'self'; base-uri 'none'"
    )
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-store"
    return response


# ----------------------------------------------------------------------------------- reading


@contextmanager
def _journal(*, readonly: bool = True) -> Iterator[StepJournal | None]:
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
        yield journal


def _job_dict(job: JobSummary) -> dict[str, Any]:
    total = sum(job.counts.values())
    return {
        "job_id": job.job_id,
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


def _row_dict(row: StepRecord) -> dict[str, Any]:
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
        # What to ask the receiver about (side-effect steps only), and of which key generation (SPEC §9).
        "idempotency_key": idempotency_key(row.job_id, row.item_id, row.step, row.generation) if row.side_effect else None,
        "generation": row.generation,
        "not_sent": row.not_sent,  # a FAILED send that provably never left: the next run sends it
        "updated_at": row.updated_at.isoformat(),
    }


def _check_id(value: str, what: str) -> str:
    # Item ids are at most MAX_ID_LENGTH (the runner refuses longer ones); job ids may be longer (a
    # DAG id, a task id and a run id), so any job the list shows has a page.
    limit = MAX_JOB_ID_LENGTH if what == "job" else MAX_ID_LENGTH
    if not value or len(value) > limit:
        raise HTTPException(status_code=404, detail=f"unknown {what}")
    return value


def _job_detail(journal: StepJournal | None, job_id: str, viewer: Viewer) -> dict[str, Any]:
    _check_id(job_id, "job")
    job = journal.job(job_id) if journal is not None and viewer.may_see(job_id) else None
    if job is None:
        raise HTTPException(status_code=404, detail="unknown job")
    assert journal is not None
    open_rows = journal.open_rows(job_id)
    resolutions = journal.resolutions(job_id)
    return {
        "job": _job_dict(job),
        "open_rows": [_row_dict(r) for r in open_rows[:MAX_OPEN_ROWS]],
        "open_rows_total": len(open_rows),
        "resolutions": [
            {"item_id": r.item_id, "step": r.step, "decision": r.decision, "receipt": r.receipt,
             "note": r.note, "resolved_by": r.resolved_by, "resolved_at": r.resolved_at.isoformat()}
            for r in resolutions[-MAX_RESOLUTIONS:]
        ],
    }


# ------------------------------------------------------------------------------------- links


def _prefix(request: Request) -> str:
    """This app's URL path as the browser sees it (Airflow's base_url path + the mount prefix)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def _airflow_base(request: Request) -> str:
    prefix = _prefix(request)
    return prefix[: -len(URL_PREFIX)] if prefix.endswith(URL_PREFIX) else ""


def job_path(job_id: str) -> str:
    """The job page relative to this app; every character of the id is escaped (ids hold '/' and '+')."""
    return f"/jobs/{quote(job_id, safe='')}"


def resolve_path(job_id: str, item_id: str, step: str) -> str:
    return "/resolve?" + urlencode({"job_id": job_id, "item_id": item_id, "step": step})


def batch_task_path(job_id: str) -> str | None:
    """The batch task instance in the Airflow UI, when the job uses the default job_id."""
    parts = job_id.split("/")
    if len(parts) == 4 and parts[3].isdigit():
        dag_id, task_id, run_id, map_index = parts
        return f"/dags/{quote(dag_id)}/runs/{quote(run_id, safe='')}/tasks/{quote(task_id)}/mapped/{map_index}"
    if len(parts) == 3:
        dag_id, task_id, run_id = parts
        return f"/dags/{quote(dag_id)}/runs/{quote(run_id, safe='')}/tasks/{quote(task_id)}"
    return None


def _when(value: datetime | str | None) -> Markup:
    """Date and time in Airflow's ``[core] default_timezone`` and how long ago; the exact UTC instant on hover.
    Date, time and the relative part each stay on one line (a narrow column wraps between them)."""
    if value is None:
        return Markup("")
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    moment = _time.local(value)
    return Markup('<time datetime="{}" title="{}"><span class="nowrap">{}</span> <span class="nowrap">{}</span> '
                  '<span class="nowrap muted">({})</span></time>').format(
        value.isoformat(), value.isoformat(), moment.format("YYYY-MM-DD"), moment.format("HH:mm:ss zz"),
        _time.ago(value))


def _age(value: datetime | str) -> Markup:
    """How long ago, e.g. "3 hours" (for "held for 3 hours"); the local time on hover."""
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return Markup('<time datetime="{}" title="{}">{}</time>').format(
        value.isoformat(), _time.local(value).format("YYYY-MM-DD HH:mm:ss zz"), _time.age(value))


def _breakable(value: str) -> Markup:
    """Long job ids wrap after their slashes rather than mid-word (each part still escaped)."""
    return Markup("/<wbr>").join(escape(part) for part in str(value).split("/"))


_templates.filters["when"] = _when
_templates.filters["age"] = _age
_templates.filters["breakable"] = _breakable
_templates.globals.update(job_path=job_path, resolve_path=resolve_path, batch_task_path=batch_task_path)


def _page(request: Request, template: str, status_code: int = 200, **values: Any) -> HTMLResponse:
    html = _templates.get_template(template).render(
        prefix=_prefix(request), airflow=_airflow_base(request), nonce=request.state.csp_nonce,
        journal_path=journal_display(), hostname=socket.gethostname(), **values,
    )
    return HTMLResponse(html, status_code=status_code)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Any:
    # Short, fixed messages only; JSON for the JSON endpoints and API clients, a page for browsers.
    headers = getattr(exc, "headers", None)
    json_endpoint = request.url.path.endswith("/jobs.json") or f"{URL_PREFIX}/api/" in request.url.path
    if json_endpoint or "text/html" not in request.headers.get("accept", ""):
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code, headers=headers)
    if not hasattr(request.state, "csp_nonce"):
        request.state.csp_nonce = ""
    return _page(request, "error.html", status_code=exc.status_code, message=str(exc.detail),
                 login=_login_url(request) if exc.status_code == 401 else None)


def _login_url(request: Request) -> str | None:
    from airflow.api_fastapi.app import get_auth_manager

    try:  # the auth manager knows where its login page is (SimpleAuthManager, FAB, Keycloak, ...)
        return str(get_auth_manager().get_url_login(next_url=str(request.url)))
    except Exception:  # noqa: BLE001 - a missing link must not turn a 401 into a 500
        return None


# ------------------------------------------------------------------------------------ routes


def _visible_jobs(journal: StepJournal | None, viewer: Viewer) -> list[JobSummary]:
    return [j for j in (journal.jobs() if journal else []) if viewer.may_see(j.job_id)]


def _held_rows(journal: StepJournal | None, jobs: list[JobSummary]) -> tuple[list[dict[str, Any]], int]:
    rows: list[dict[str, Any]] = []
    total = 0
    for job in jobs:
        if journal is None or not job.held:
            continue
        held = [r for r in journal.open_rows(job.job_id) if r.held_reason is not None]
        total += len(held)
        rows += [{"job_id": job.job_id, **_row_dict(r)} for r in held[: max(0, MAX_OPEN_ROWS - len(rows))]]
    return rows, total


@app.get("/jobs.json")
def jobs_json(viewer: ViewerDep) -> dict[str, Any]:
    with _journal() as journal:
        jobs = _visible_jobs(journal, viewer)
        held, held_total = _held_rows(journal, jobs)
    return {
        "journal_path": journal_display(), "hostname": socket.gethostname(),
        "jobs": [_job_dict(j) for j in jobs], "held": held, "held_total": held_total,
    }


# Not "/jobs/{job_id}.json": a job whose id ends in ".json" would open another job's JSON.
@app.get("/api/jobs/{job_id:path}")
def job_json(job_id: str, viewer: ViewerDep) -> dict[str, Any]:
    with _journal() as journal:
        return _job_detail(journal, job_id, viewer)


@app.get("/", response_class=HTMLResponse)
def jobs_page(request: Request, viewer: ViewerDep) -> HTMLResponse:
    with _journal() as journal:
        jobs = _visible_jobs(journal, viewer)
        held, held_total = _held_rows(journal, jobs)
        exists = journal is not None
    return _page(request, "jobs.html", jobs=[_job_dict(j) for j in jobs], held=held, held_total=held_total,
                 journal_exists=exists, viewer=viewer)


@app.get("/jobs/{job_id:path}", response_class=HTMLResponse)
def job_page(request: Request, job_id: str, viewer: ViewerDep) -> HTMLResponse:
    with _journal() as journal:
        detail = _job_detail(journal, job_id, viewer)
    held = [r for r in detail["open_rows"] if r["held_reason"]]
    for row in held:
        row["decisions"] = DECISIONS_BY_REASON[HeldReason(row["held_reason"])]
    return _page(request, "job.html", **detail, max_rows=MAX_OPEN_ROWS, viewer=viewer, held_rows=held,
                 may_settle=bool(held) and viewer.may_settle(job_id))


class _Decision(BaseModel):
    job_id: str
    item_id: str
    step: str = ""
    decision: str
    receipt: str = ""
    note: str = ""


def _check_settle(request: Request, viewer: Viewer, job_id: str, item_ids: list[str]) -> None:
    """JSON only, well-formed ids, and the signed-in user may act on the job's DAG: else refused."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise HTTPException(status_code=415, detail="send the decision as application/json")
    _check_id(job_id, "job")
    for item_id in item_ids:
        _check_id(item_id, "item")
    if not viewer.may_see(job_id):
        raise HTTPException(status_code=404, detail="unknown job")
    if not viewer.may_settle(job_id):
        raise HTTPException(status_code=403, detail=(
            f"you may read this job but not act on DAG {job_id.split('/', 1)[0]!r}: settling a held item "
            "needs Airflow's edit permission on the job's DAG (as Clear does); nothing was changed"))


@app.post("/api/resolve")
def resolve_json(request: Request, body: _Decision, viewer: ViewerDep) -> dict[str, Any]:
    """Settle one held step as the signed-in user, after checking that they may act on the job's DAG.

    The API server applies it through the journal API (one transaction and an audit row naming the
    user). JSON only: a cross-site form cannot post it (the browser would need CORS to send JSON)."""
    _check_settle(request, viewer, body.job_id, [body.item_id])
    with _journal(readonly=False) as journal:
        if journal is None:
            raise HTTPException(status_code=404, detail="unknown job")
        try:
            resolution = journal.apply_decision(
                body.job_id, body.item_id, body.step or None, body.decision, resolved_by=viewer.name,
                receipt=body.receipt.strip() or None, note=body.note,
            )
        except NotHeldError as exc:
            raise HTTPException(status_code=404, detail=f"{exc}; nothing was changed") from None
        except JobBusyError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except ResolutionError as exc:
            raise HTTPException(status_code=422, detail=f"{exc}; nothing was changed") from None
    return _resolution_dict(resolution)


def _resolution_dict(r: Resolution) -> dict[str, Any]:
    return {"job_id": r.job_id, "item_id": r.item_id, "step": r.step, "decision": r.decision,
            "resolved_by": r.resolved_by, "resolved_at": r.resolved_at.isoformat(), "audit_id": r.id}


class _Entry(BaseModel):
    item_id: str
    step: str = ""
    decision: str
    receipt: str = ""


class _Decisions(BaseModel):
    job_id: str
    decisions: list[_Entry]
    note: str = ""


@app.post("/api/resolve-many")
def resolve_many_json(request: Request, body: _Decisions, viewer: ViewerDep) -> dict[str, Any]:
    """Settle several held steps of one job as the signed-in user, all or nothing (the job page's form).

    Checked like ``/api/resolve``; every entry is checked, then all are applied in one transaction,
    each with its own audit row; one refused entry (named: ``entry 2: ...``) changes nothing."""
    _check_settle(request, viewer, body.job_id, [e.item_id for e in body.decisions])
    if len(body.decisions) > MAX_OPEN_ROWS:
        raise HTTPException(status_code=422, detail=(
            f"{len(body.decisions)} decisions in one request; at most {MAX_OPEN_ROWS} (the page's rows); "
            "nothing was changed"))
    entries = [{"job_id": body.job_id, "item_id": e.item_id, "step": e.step or None, "decision": e.decision,
                "receipt": e.receipt.strip() or None, "note": body.note} for e in body.decisions]
    with _journal(readonly=False) as journal:
        if journal is None:
            raise HTTPException(status_code=404, detail="unknown job")
        try:
            done = journal.apply_decisions(entries, resolved_by=viewer.name)
        except JobBusyError as exc:
            raise HTTPException(status_code=409, detail=str(exc)) from None
        except (ResolutionError, NotHeldError) as exc:
            raise HTTPException(status_code=422, detail=f"{exc}; nothing was changed") from None
    return {"job_id": body.job_id, "count": len(done), "resolved_by": viewer.name,
            "resolved": [_resolution_dict(r) for r in done]}


@app.get("/resolve", response_class=HTMLResponse)
def resolve_page(
    request: Request, viewer: ViewerDep, job_id: str = "", item_id: str = "", step: str = "",
) -> HTMLResponse:
    # The query names a held step; it is looked up in the journal and only ever used as an identifier.
    for value, what in ((job_id, "job"), (item_id, "item"), (step, "step")):
        _check_id(value, what)
    with _journal() as journal:
        rows = journal.open_rows(job_id) if journal is not None and viewer.may_see(job_id) else []
    row = next((r for r in rows if r.item_id == item_id and r.step == step and r.held_reason), None)
    if row is None or row.held_reason is None:
        raise HTTPException(status_code=404, detail="no such held step (it may be resolved already)")
    return _page(
        request, "resolve.html", job_id=job_id, row=_row_dict(row), decisions=DECISIONS_BY_REASON[row.held_reason],
        idempotency_key=idempotency_key(job_id, item_id, step, row.generation), resolve_dag_id=RESOLVE_DAG_ID, viewer=viewer,
        may_settle=viewer.may_settle(job_id),
    )
