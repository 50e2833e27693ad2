"""The FastAPI app of the Resumable jobs page: every request authenticated (Airflow does not
authenticate plugin apps), every response with the page's security headers, every refusal in one shape,
and the routes of ``views`` (reading) and ``decisions`` (settling held steps)."""

from __future__ import annotations

import secrets
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from airflow_resumable.plugins.auth import require_dag_read
from airflow_resumable.plugins.decisions import router as decision_routes
from airflow_resumable.plugins.rendering import refusal
from airflow_resumable.plugins.views import router as reading_routes

app = FastAPI(
    title="Resumable jobs", docs_url=None, redoc_url=None, openapi_url=None,
    dependencies=[Depends(require_dag_read)],
)
# Starlette tries the routes in the order they were added (reading first, as they were declared); the
# two sets share no path, so neither hides the other.
app.include_router(reading_routes)
app.include_router(decision_routes)


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


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> Any:
    # Short, fixed messages, or the journal's refusal of a decision (which names no secret).
    return refusal(request, exc.status_code, exc.detail, getattr(exc, "headers", None))


@app.exception_handler(RequestValidationError)
async def _malformed_request(request: Request, exc: RequestValidationError) -> Any:
    # Where and what only: FastAPI's own answer echoes the input back (up to a whole list of
    # decisions, and text no encoder takes), and the forms show a text detail, not a list.
    problems = [
        f"{'.'.join(str(part) for part in error.get('loc', ())[1:]) or 'body'}: {error.get('msg', 'invalid')}"
        for error in exc.errors()[:5]
    ]
    return refusal(request, 422, f"malformed request ({'; '.join(problems)}); nothing was changed")
