"""The page's HTML: its templates, the formatting filters they use, and refusals as a browser or an API
client reads them."""

from __future__ import annotations

import socket
from datetime import datetime
from typing import Any

from fastapi import Request
from fastapi.responses import HTMLResponse, JSONResponse
from jinja2 import Environment, PackageLoader
from markupsafe import Markup, escape

from airflow_resumable import _time
from airflow_resumable._location import journal_display
from airflow_resumable.links import URL_PREFIX, job_path
from airflow_resumable.plugins.auth import login_url
from airflow_resumable.plugins.paths import (
    airflow_base,
    app_prefix,
    batch_task_path,
    resolve_path,
    rows_path,
    with_query,
)

_templates = Environment(
    loader=PackageLoader("airflow_resumable.plugins", "templates"),
    autoescape=True,  # every value is escaped; nothing is marked safe
    trim_blocks=True,
    lstrip_blocks=True,
)


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
                          batch_task_path=batch_task_path, with_query=with_query)


def render_page(request: Request, template: str, status_code: int = 200, **values: Any) -> HTMLResponse:
    """``template`` rendered with ``values`` and what every page shows (where it is, whose journal)."""
    html = _templates.get_template(template).render(
        prefix=app_prefix(request), airflow=airflow_base(request), nonce=request.state.csp_nonce,
        journal_path=journal_display(), hostname=socket.gethostname(), **values,
    )
    return HTMLResponse(html, status_code=status_code)


def _sayable(text: str) -> str:
    """``text`` as a response can carry it: a lone surrogate (which a JSON request body may hold and no
    encoder takes) is shown escaped rather than turning a refusal into a 500."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def refusal(request: Request, status_code: int, detail: Any, headers: Any = None) -> Any:
    """A refused request: JSON for the JSON endpoints and API clients, a page for browsers (the forms
    show a JSON refusal's detail as "Refused: ...")."""
    detail = _sayable(detail) if isinstance(detail, str) else detail
    json_endpoint = request.url.path.endswith("/jobs.json") or f"{URL_PREFIX}/api/" in request.url.path
    if json_endpoint or "text/html" not in request.headers.get("accept", ""):
        return JSONResponse({"detail": detail}, status_code=status_code, headers=headers)
    if not hasattr(request.state, "csp_nonce"):
        request.state.csp_nonce = ""
    return render_page(request, "error.html", status_code=status_code, message=str(detail),
                       login=login_url(request) if status_code == 401 else None)
