"""The FastAPI app behind the "Resumable jobs" page: jobs, held items, and a pre-filled Resolve form.

Every question goes through the journal's API (no SQL here). Page views write nothing; a decision
(``POST /api/resolve``, ``/api/resolve-many``) is applied by the journal as the signed-in user, with
the row versions the page showed: a step that changed since is refused (409), never settled blind.
The journal is the one the operators use on this host (``[resumable] journal_conn_id`` or
``journal_path``), never a location from the request.

Airflow does not authenticate plugin apps, so this one does, with Airflow's own machinery: the JWT
of the request (``Authorization: Bearer`` or the ``_token`` cookie the Airflow UI sets for the
browser, which also reaches this app in the UI's iframe) and the auth manager's DAG permissions on
the DAG each job recorded (read to see it, edit to settle it).
"""

from __future__ import annotations

import secrets
import socket
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Annotated, Any
from urllib.parse import quote, urlencode

from fastapi import Depends, FastAPI, HTTPException, Query, Request
from fastapi.exceptions import RequestValidationError
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
    Page,
    PageError,
    Resolution,
    ResolutionError,
    StaleDecisionError,
    Status,
    StepJournal,
    StepRecord,
)
from airflow_resumable.journal.records import JOB_STATUSES, MAX_ID_LENGTH, MAX_JOB_ID_LENGTH, MAX_PAGE
from airflow_resumable.runner import idempotency_key

URL_PREFIX = "/resumable"
# Every list the page and its JSON show is one page of the journal's keyset pages: what a view costs
# stays the same however big the journal grows. ``?limit=`` asks for up to MAX_PAGE.
DEFAULT_PAGE = 100
MAX_RESOLUTIONS = 50
# "Resolve several" posts the rows given a decision (at most the page's); each becomes an audit row.
MAX_DECISIONS_PER_REQUEST = 500
# "Previous" links carry the cursors of the pages before (the journal's pages only go forward). The
# trail is bounded so that the URL stays short; past it, "Previous" goes back to the first page.
MAX_TRAIL_CHARS = 4000
# The filters the jobs list offers: JobSummary.status (JOB_STATUSES) and the row statuses.
ROW_STATUSES = tuple(Status.__members__)

_templates = Environment(
    loader=PackageLoader("airflow_resumable.plugins", "templates"),
    autoescape=True,  # every value is escaped; nothing is marked safe
    trim_blocks=True,
    lstrip_blocks=True,
)


# --------------------------------------------------------------------------------- authentication


def _auth_manager() -> Any:
    from airflow.api_fastapi.app import get_auth_manager

    return get_auth_manager()


class Viewer:
    """Who is asking, and what they may do with which DAG's jobs (the auth manager's answers, asked
    once per request and DAG).

    A job belongs to the DAG its first run recorded in the journal (``JobSummary.dag_id``), never to
    the first segment of its id: a custom job_id may start with any other DAG's id. A job with no
    recorded DAG (written outside Airflow, or by an older release) needs the permission on all DAGs.
    """

    def __init__(self, name: str, user: Any) -> None:
        self.name = name
        self.user = user
        self._on_all: dict[str, bool] = {}
        self._on_dag: dict[tuple[str, str], bool] = {}

    def __repr__(self) -> str:
        return f"Viewer({self.name!r})"

    def on_all_dags(self, method: str) -> bool:
        if method not in self._on_all:
            # No details: the question is about every DAG (the auth manager's "DAGs" resource as a whole).
            self._on_all[method] = bool(_auth_manager().is_authorized_dag(method=method, user=self.user))
        return self._on_all[method]

    @property
    def all_dags(self) -> bool:
        """May read every DAG's jobs (those with no recorded DAG too)."""
        return self.on_all_dags("GET")

    def allowed(self, method: str, dag_ids: Iterable[str | None]) -> set[str | None]:
        """Those of ``dag_ids`` the user may access with ``method`` (None: a job with no recorded DAG)."""
        wanted = set(dag_ids)
        if self.on_all_dags(method):
            return wanted
        named = {d for d in wanted if d is not None}
        unasked = {d for d in named if (method, d) not in self._on_dag}
        if unasked:
            # One question for the lot: auth managers answer it in one query where they can.
            granted = _auth_manager().filter_authorized_dag_ids(dag_ids=unasked, user=self.user, method=method)
            self._on_dag.update({(method, d): d in granted for d in unasked})
        return {d for d in named if self._on_dag[(method, d)]}

    def may_read(self, job: JobSummary) -> bool:
        return job.dag_id in self.allowed("GET", [job.dag_id])

    def may_settle(self, job: JobSummary) -> bool:
        """Settling a held item is acting on the job's DAG: Airflow's edit permission on it (as Clear)."""
        return job.dag_id in self.allowed("PUT", [job.dag_id])


async def require_dag_read(request: Request) -> Viewer:
    """Airflow's own authentication (JWT from header or cookie) and DAG read permission."""
    # Imported here: workers import this module when they load plugins and need none of it.
    from fastapi.security import HTTPBearer

    from airflow_resumable._compat import get_user

    credentials = await HTTPBearer(auto_error=False)(request)
    user = await get_user(request, credentials)  # Airflow answers 401/403 itself
    viewer = Viewer(user.get_name(), user)
    if not viewer.on_all_dags("GET") and not _auth_manager().get_authorized_dag_ids(user=user, method="GET"):
        raise HTTPException(status_code=403, detail="Forbidden: DAG read permission is required")
    return viewer


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
        # The row as shown: a decision about it carries this, and is refused if the row changed since.
        "version": row.version,
    }


def _id_problem(value: str, limit: int) -> str | None:
    """Why ``value`` cannot name anything in the journal (the journal's own limits), or None."""
    if not value:
        return "is empty"
    if len(value) > limit:
        return f"is {len(value)} characters; at most {limit}"
    if "\x00" in value:
        return "contains a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "contains a lone surrogate (not valid Unicode text)"
    return None


def _check_id(value: str, what: str) -> str:
    # Checked before any look-up: such an id names nothing, and neither engine can even be asked about
    # it. Item ids are at most MAX_ID_LENGTH (the runner refuses longer ones); job ids may be longer
    # (a DAG id, a task id and a run id), so any job the list shows has a page.
    if _id_problem(value, MAX_JOB_ID_LENGTH if what == "job" else MAX_ID_LENGTH):
        raise HTTPException(status_code=404, detail=f"unknown {what}")
    return value


def _readable_job(journal: StepJournal | None, job_id: str, viewer: Viewer) -> JobSummary:
    """The job, if it exists and the viewer may read its DAG's jobs; else the same 404 either way."""
    _check_id(job_id, "job")
    job = journal.job(job_id) if journal is not None else None
    if job is None or not viewer.may_read(job):
        raise HTTPException(status_code=404, detail="unknown job")
    return job


def _resolutions(journal: StepJournal, job_id: str) -> list[dict[str, Any]]:
    return [
        {"item_id": r.item_id, "step": r.step, "decision": r.decision, "receipt": r.receipt,
         "note": r.note, "resolved_by": r.resolved_by, "resolved_at": r.resolved_at.isoformat()}
        for r in reversed(journal.resolutions(job_id, limit=MAX_RESOLUTIONS, newest_first=True))
    ]


# ------------------------------------------------------------------------------------ paging


@dataclass(frozen=True)
class Paging:
    """Which page of a list is asked for: at most ``limit`` records after ``cursor`` (None: the first
    page), and ``back``, the cursors of the pages between the first and this one, for "Previous"."""

    limit: int
    cursor: str | None
    back: tuple[str, ...]

    @property
    def previous(self) -> tuple[str | None, tuple[str, ...]] | None:
        """(cursor, back) of the page before this one (cursor None: the first page); None on the first."""
        if self.cursor is None:
            return None
        if not self.back:
            return None, ()
        return self.back[-1], self.back[:-1]

    def following(self, next_cursor: str) -> tuple[str, tuple[str, ...]]:
        """(cursor, back) of the page after this one."""
        back = [*self.back, self.cursor] if self.cursor is not None else []
        while len(".".join(back)) > MAX_TRAIL_CHARS:
            del back[0]  # the oldest: "Previous" from the oldest page kept goes to the first page
        return next_cursor, tuple(back)


def _cursor_text(value: str, what: str) -> str:
    # The journal's cursors are URL-safe base64 ('.' separates those of the trail); anything else is
    # refused here, before the journal is asked, with a message that does not repeat it.
    if len(value) > 4 * MAX_JOB_ID_LENGTH or value.strip("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"):
        raise HTTPException(status_code=400, detail=f"{what} is not one this page gave; start again from the first page")
    return value


def paging(
    limit: Annotated[int, Query()] = DEFAULT_PAGE, cursor: Annotated[str, Query()] = "",
    back: Annotated[str, Query()] = "",
) -> Paging:
    """The ``limit``, ``cursor`` and ``back`` of a listing's URL, checked."""
    if not 1 <= limit <= MAX_PAGE:
        raise HTTPException(status_code=400, detail=f"limit must be from 1 to {MAX_PAGE}")
    trail = tuple(_cursor_text(c, "back") for c in back.split(".") if c)
    return Paging(limit, _cursor_text(cursor, "cursor") or None, trail)


PagingDep = Annotated[Paging, Depends(paging)]


@contextmanager
def _pages_of_the_journal() -> Iterator[None]:
    """A cursor the journal refuses (another list's, or edited) is the caller's mistake: a short 400,
    never the journal's message (which quotes the cursor)."""
    try:
        yield
    except PageError:
        raise HTTPException(status_code=400, detail="the cursor is not one this page gave; start again from "
                            "the first page") from None


def _checked_filter(value: str, allowed: tuple[str, ...], what: str) -> str | None:
    if not value:
        return None
    if value not in allowed:
        raise HTTPException(status_code=400, detail=f"unknown {what}; use one of {', '.join(allowed)}")
    return value


# ------------------------------------------------------------------------------------- links


def _with_query(path: str, **values: Any) -> str:
    """``path`` with the query of ``values`` that are set (None and "" are left out)."""
    query = urlencode({k: v for k, v in values.items() if v not in (None, "")})
    return f"{path}?{query}" if query else path


@dataclass(frozen=True)
class PageLinks:
    """The links of a listing page: first, previous and next (None where there is none), all keeping the
    listing's filters and page size."""

    first: str | None
    previous: str | None
    next: str | None


def page_links(path: str, paging: Paging, next_cursor: str | None, **filters: Any) -> PageLinks:
    size = {"limit": paging.limit if paging.limit != DEFAULT_PAGE else None}

    def link(cursor: str | None, back: tuple[str, ...]) -> str:
        return _with_query(path, **filters, **size, cursor=cursor, back=".".join(back) if cursor else None)

    previous = paging.previous
    following = paging.following(next_cursor) if next_cursor is not None else None
    return PageLinks(
        first=link(None, ()) if paging.cursor is not None else None,
        previous=link(*previous) if previous is not None else None,
        next=link(*following) if following is not None else None,
    )


def _prefix(request: Request) -> str:
    """This app's URL path as the browser sees it (Airflow's base_url path + the mount prefix)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def _airflow_base(request: Request) -> str:
    prefix = _prefix(request)
    return prefix[: -len(URL_PREFIX)] if prefix.endswith(URL_PREFIX) else ""


def job_path(job_id: str) -> str:
    """The job page relative to this app; every character of the id is escaped (ids hold '/' and '+')."""
    return f"/jobs/{quote(job_id, safe='')}"


def rows_path(job_id: str) -> str:
    """The job's step rows, relative to this app."""
    return f"/rows/{quote(job_id, safe='')}"


def resolve_path(job_id: str, item_id: str, step: str) -> str:
    return "/resolve?" + urlencode({"job_id": job_id, "item_id": item_id, "step": step})


def batch_task_path(job_id: str, dag_id: str | None = None) -> str | None:
    """The batch task instance in the Airflow UI, when the job uses the default job_id (of ``dag_id``,
    the DAG the job recorded, when there is one: a custom id may start with another DAG's id)."""
    parts = job_id.split("/")
    if dag_id is not None and parts[0] != dag_id:
        return None
    if len(parts) == 4 and parts[3].isdigit():
        dag, task_id, run_id, map_index = parts
        return f"/dags/{quote(dag)}/runs/{quote(run_id, safe='')}/tasks/{quote(task_id)}/mapped/{map_index}"
    if len(parts) == 3:
        dag, task_id, run_id = parts
        return f"/dags/{quote(dag)}/runs/{quote(run_id, safe='')}/tasks/{quote(task_id)}"
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
_templates.globals.update(job_path=job_path, rows_path=rows_path, resolve_path=resolve_path,
                          batch_task_path=batch_task_path, with_query=_with_query)


def _page(request: Request, template: str, status_code: int = 200, **values: Any) -> HTMLResponse:
    html = _templates.get_template(template).render(
        prefix=_prefix(request), airflow=_airflow_base(request), nonce=request.state.csp_nonce,
        journal_path=journal_display(), hostname=socket.gethostname(), **values,
    )
    return HTMLResponse(html, status_code=status_code)


def _sayable(text: str) -> str:
    """``text`` as a response can carry it: a lone surrogate (which a JSON request body may hold and no
    encoder takes) is shown escaped rather than turning a refusal into a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _refusal(request: Request, status_code: int, detail: Any, headers: Any = None) -> Any:
    # JSON for the JSON endpoints and API clients, a page for browsers (the forms show a JSON refusal's
    # detail as "Refused: ...").
    detail = _sayable(detail) if isinstance(detail, str) else detail
    json_endpoint = request.url.path.endswith("/jobs.json") or f"{URL_PREFIX}/api/" in request.url.path
    if json_endpoint or "text/html" not in request.headers.get("accept", ""):
        return JSONResponse({"detail": detail}, status_code=status_code, headers=headers)
    if not hasattr(request.state, "csp_nonce"):
        request.state.csp_nonce = ""
    return _page(request, "error.html", status_code=status_code, message=str(detail),
                 login=_login_url(request) if status_code == 401 else None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Any:
    # Short, fixed messages, or the journal's refusal of a decision (which names no secret).
    return _refusal(request, exc.status_code, exc.detail, getattr(exc, "headers", None))


@app.exception_handler(RequestValidationError)
async def _malformed_request(request: Request, exc: RequestValidationError) -> Any:
    # Where and what only: FastAPI's own answer echoes the input back (up to a whole list of
    # decisions, and text no encoder takes), and the forms show a text detail, not a list.
    problems = [
        f"{'.'.join(str(part) for part in error.get('loc', ())[1:]) or 'body'}: {error.get('msg', 'invalid')}"
        for error in exc.errors()[:5]
    ]
    return _refusal(request, 422, f"malformed request ({'; '.join(problems)}); nothing was changed")


def _login_url(request: Request) -> str | None:
    from airflow.api_fastapi.app import get_auth_manager

    try:  # the auth manager knows where its login page is (SimpleAuthManager, FAB, Keycloak, ...)
        return str(get_auth_manager().get_url_login(next_url=str(request.url)))
    except Exception:  # noqa: BLE001 - a missing link must not turn a 401 into a 500
        return None


# ------------------------------------------------------------------------------------ routes


def _visible_jobs(
    journal: StepJournal | None, viewer: Viewer, paging: Paging, *, status: str | None, dag_id: str | None,
) -> Page[JobSummary]:
    """One page of the jobs the viewer may read, newest first.

    A viewer of some DAGs only gets the readable jobs among the journal's pages, read on until the page
    is full or the list ends. Each read asks for exactly as many jobs as the page still lacks, so a full
    page ends at a readable job and its next cursor (the journal's, of the last job read) names only a
    job the viewer may see; a page that is not full is the last. Every request moves on, so paging ends.
    """
    if journal is None or (dag_id is not None and dag_id not in viewer.allowed("GET", [dag_id])):
        return Page()
    with _pages_of_the_journal():
        if viewer.all_dags:
            return journal.jobs(limit=paging.limit, cursor=paging.cursor, status=status, dag_id=dag_id)
        shown: list[JobSummary] = []
        cursor = paging.cursor
        while True:
            read = journal.jobs(limit=paging.limit - len(shown), cursor=cursor, status=status, dag_id=dag_id)
            readable = viewer.allowed("GET", {j.dag_id for j in read})
            shown += [j for j in read if j.dag_id in readable]
            cursor = read.next_cursor
            if cursor is None:
                return Page(shown)
            if len(shown) == paging.limit:
                return Page(shown, cursor)


def _held_records(journal: StepJournal, job_id: str, *, limit: int, cursor: str | None = None) -> Page[StepRecord]:
    """One page of a job's held steps, each as its whole row: what the table shows (status, attempts,
    error type, receipt) besides the hold."""
    with _pages_of_the_journal():
        return journal.held_rows(job_id, limit=limit, cursor=cursor)


def _held_of_jobs(journal: StepJournal | None, jobs: list[JobSummary], limit: int) -> list[dict[str, Any]]:
    """The held steps of ``jobs`` (one page of the jobs list), at most ``limit`` in all."""
    rows: list[dict[str, Any]] = []
    for job in jobs:
        if journal is None or not job.held or len(rows) >= limit:
            continue
        rows += [{"job_id": job.job_id, **_row_dict(r)} for r in _held_records(journal, job.job_id, limit=limit - len(rows))]
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
    wanted_status = _checked_filter(status, JOB_STATUSES, "status")
    wanted_dag = dag_id or None
    if wanted_dag is not None and _id_problem(wanted_dag, MAX_JOB_ID_LENGTH):
        raise HTTPException(status_code=400, detail="dag_id cannot name a DAG")
    with _journal() as journal:
        jobs = _visible_jobs(journal, viewer, paging, status=wanted_status, dag_id=wanted_dag)
        held = _held_of_jobs(journal, jobs, paging.limit)
        exists = journal is not None
    return JobsListing([_job_dict(j) for j in jobs], held, sum(j.held for j in jobs), jobs.next_cursor, exists)


@app.get("/jobs.json")
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


@app.get("/", response_class=HTMLResponse)
def jobs_page(
    request: Request, viewer: ViewerDep, paging: PagingDep, status: Annotated[str, Query()] = "",
    dag_id: Annotated[str, Query()] = "",
) -> HTMLResponse:
    listing = _jobs_listing(viewer, paging, status, dag_id)
    links = page_links(_prefix(request) + "/", paging, listing.next_cursor, status=status, dag_id=dag_id)
    return _page(request, "jobs.html", jobs=listing.jobs, held=listing.held, held_total=listing.held_total,
                 journal_exists=listing.journal_exists, viewer=viewer, links=links, statuses=JOB_STATUSES,
                 status=status, dag_id=dag_id, filtered=bool(status or dag_id), paging=paging)


def _job_detail(job: JobSummary, held: Page[StepRecord], resolutions: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [_row_dict(r) for r in held]
    return {
        "job": _job_dict(job),
        "held": rows, "held_total": job.held, "next": held.next_cursor,  # the next page of held steps
        "unresolved_total": job.unresolved,  # sends with an unknown outcome, not held: the job's rows
        # As before paging: the open rows are the held ones (this page of them) and the unresolved sends.
        "open_rows": rows, "open_rows_total": job.held + job.unresolved,
        "resolutions": resolutions,
    }


# Not "/jobs/{job_id}.json": a job whose id ends in ".json" would open another job's JSON.
@app.get("/api/jobs/{job_id:path}")
def job_json(job_id: str, viewer: ViewerDep, paging: PagingDep) -> dict[str, Any]:
    """A job, one page of its held steps (``limit``, ``cursor``: ``next``) and its latest resolutions."""
    with _journal() as journal:
        job = _readable_job(journal, job_id, viewer)
        assert journal is not None
        return _job_detail(job, _held_records(journal, job_id, limit=paging.limit, cursor=paging.cursor),
                           _resolutions(journal, job_id))


@app.get("/jobs/{job_id:path}", response_class=HTMLResponse)
def job_page(request: Request, job_id: str, viewer: ViewerDep, paging: PagingDep) -> HTMLResponse:
    with _journal() as journal:
        job = _readable_job(journal, job_id, viewer)
        assert journal is not None
        held = _held_records(journal, job_id, limit=paging.limit, cursor=paging.cursor)
        detail = _job_detail(job, held, _resolutions(journal, job_id))
    for row in detail["held"]:
        row["decisions"] = DECISIONS_BY_REASON[HeldReason(row["held_reason"])]
    links = page_links(_prefix(request) + job_path(job_id), paging, held.next_cursor)
    return _page(request, "job.html", **detail, viewer=viewer, held_rows=detail["held"], links=links,
                 may_settle=bool(held) and viewer.may_settle(job), row_statuses=ROW_STATUSES)


def _rows_listing(
    journal: StepJournal | None, job_id: str, viewer: Viewer, paging: Paging, status: str,
) -> tuple[JobSummary, Page[StepRecord]]:
    wanted = _checked_filter(status, ROW_STATUSES, "status")
    job = _readable_job(journal, job_id, viewer)
    assert journal is not None
    if wanted is not None and not job.counts.get(wanted, 0):  # the kept counts say none: no need to look
        return job, Page()
    with _pages_of_the_journal():
        return job, journal.rows(job_id, status=wanted, limit=paging.limit, cursor=paging.cursor)


@app.get("/api/rows/{job_id:path}")
def rows_json(
    job_id: str, viewer: ViewerDep, paging: PagingDep, status: Annotated[str, Query()] = "",
) -> dict[str, Any]:
    """One page of a job's step rows (by item, then step), ``status`` one of IN_FLIGHT, SUCCEEDED, FAILED."""
    with _journal() as journal:
        job, rows = _rows_listing(journal, job_id, viewer, paging, status)
    return {"job_id": job.job_id, "rows": [_row_dict(r) for r in rows], "limit": paging.limit,
            "next": rows.next_cursor}


@app.get("/rows/{job_id:path}", response_class=HTMLResponse)
def rows_page(
    request: Request, job_id: str, viewer: ViewerDep, paging: PagingDep, status: Annotated[str, Query()] = "",
) -> HTMLResponse:
    with _journal() as journal:
        job, rows = _rows_listing(journal, job_id, viewer, paging, status)
    links = page_links(_prefix(request) + rows_path(job_id), paging, rows.next_cursor, status=status)
    return _page(request, "rows.html", job=_job_dict(job), rows=[_row_dict(r) for r in rows], links=links,
                 viewer=viewer, status=status, row_statuses=ROW_STATUSES, paging=paging)


class _Decision(BaseModel):
    job_id: str
    item_id: str
    step: str = ""
    decision: str
    receipt: str = ""
    note: str = ""
    version: str | None = None  # the row's version as shown; none: decides about the row as it is now


def _settleable_job(request: Request, viewer: Viewer, job_id: str) -> JobSummary:
    """JSON only, a job the user may read, and edit permission on its DAG: else refused, before any write.

    The job's text fields are checked by the journal as it applies the decision (with its message);
    the job id only here, as it is looked up first."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise HTTPException(status_code=415, detail="send the decision as application/json")
    problem = _id_problem(job_id, MAX_JOB_ID_LENGTH)
    if problem:
        raise HTTPException(status_code=422, detail=f"job_id {problem}; nothing was changed")
    with _journal() as journal:
        job = _readable_job(journal, job_id, viewer)
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


@app.post("/api/resolve")
def resolve_json(request: Request, body: _Decision, viewer: ViewerDep) -> dict[str, Any]:
    """Settle one held step as the signed-in user, after checking that they may act on the job's DAG.

    The API server applies it through the journal API (one transaction and an audit row naming the
    user), only if the row is still the ``version`` the person saw. JSON only: a cross-site form
    cannot post it (the browser would need CORS to send JSON)."""
    _settleable_job(request, viewer, body.job_id)
    with _journal(readonly=False) as journal:
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
    return _resolution_dict(resolution)


def _resolution_dict(r: Resolution) -> dict[str, Any]:
    return {"job_id": r.job_id, "item_id": r.item_id, "step": r.step, "decision": r.decision,
            "resolved_by": r.resolved_by, "resolved_at": r.resolved_at.isoformat(), "audit_id": r.id}


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


@app.post("/api/resolve-many")
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
    with _journal(readonly=False) as journal:
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
            "resolved": [_resolution_dict(r) for r in done]}


@app.get("/resolve", response_class=HTMLResponse)
def resolve_page(
    request: Request, viewer: ViewerDep, job_id: str = "", item_id: str = "", step: str = "",
) -> HTMLResponse:
    # The query names a held step; it is looked up in the journal and only ever used as an identifier.
    for value, what in ((job_id, "job"), (item_id, "item"), (step, "step")):
        _check_id(value, what)
    with _journal() as journal:
        job = _readable_job(journal, job_id, viewer)
        assert journal is not None
        rows = journal.rows(job_id, item_id, limit=MAX_PAGE)  # the item's steps (a few), by its key
    row = next((r for r in rows if r.step == step and r.held_reason), None)
    if row is None or row.held_reason is None:
        raise HTTPException(status_code=404, detail="no such held step (it may be resolved already)")
    return _page(
        request, "resolve.html", job_id=job_id, dag_id=job.dag_id, row=_row_dict(row),
        decisions=DECISIONS_BY_REASON[row.held_reason],
        idempotency_key=idempotency_key(job_id, item_id, step, row.generation), resolve_dag_id=RESOLVE_DAG_ID,
        viewer=viewer, may_settle=viewer.may_settle(job),
    )
