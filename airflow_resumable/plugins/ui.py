"""The FastAPI app behind the "Resumable jobs" page: jobs, held items, their step rows, and the
decisions that settle held items (a pre-filled Resolve form, and two JSON endpoints that apply them).

Page views write nothing; a decision (``POST /api/resolve``, ``/api/resolve-many``) is applied by the
journal as the signed-in user, with Airflow's edit permission on the job's DAG and the row versions the
page showed: a step that changed since is refused (409), never settled blind. Every request is
authenticated with Airflow's own machinery (Airflow does not authenticate plugin apps).

This module assembles the app from its parts and is the name the plugin and other code import:

* ``auth``: who is asking and what they may see and settle (``Viewer``, ``require_dag_read``);
* ``journal_access``: which journal, the ids a request may name, the records as the page shows them;
* ``paths`` and ``pager``: the page's URLs, and paging its lists (``Paging``, ``page_links``);
* ``rendering``: the templates, their formatting filters, and refusals;
* ``views``: the reading routes; ``decisions``: the Resolve form and the settling routes;
* ``webapp``: the app itself (its security headers and error handlers) with those routes.
"""

from __future__ import annotations

from airflow_resumable.plugins.auth import Viewer, ViewerDep, require_dag_read
from airflow_resumable.plugins.decisions import (
    MAX_DECISIONS_PER_REQUEST,
    resolve_json,
    resolve_many_json,
    resolve_page,
)
from airflow_resumable.plugins.journal_access import MAX_RESOLUTIONS, ROW_STATUSES
from airflow_resumable.plugins.pager import (
    DEFAULT_PAGE,
    MAX_TRAIL_CHARS,
    PageLinks,
    Paging,
    PagingDep,
    page_links,
    paging,
)
from airflow_resumable.plugins.paths import URL_PREFIX, batch_task_path, job_path, resolve_path, rows_path
from airflow_resumable.plugins.views import (
    JobsListing,
    job_json,
    job_page,
    jobs_json,
    jobs_page,
    rows_json,
    rows_page,
)
from airflow_resumable.plugins.webapp import app

__all__ = [
    "DEFAULT_PAGE",
    "MAX_DECISIONS_PER_REQUEST",
    "MAX_RESOLUTIONS",
    "MAX_TRAIL_CHARS",
    "ROW_STATUSES",
    "URL_PREFIX",
    "JobsListing",
    "PageLinks",
    "Paging",
    "PagingDep",
    "Viewer",
    "ViewerDep",
    "app",
    "batch_task_path",
    "job_json",
    "job_page",
    "job_path",
    "jobs_json",
    "jobs_page",
    "page_links",
    "paging",
    "require_dag_read",
    "resolve_json",
    "resolve_many_json",
    "resolve_page",
    "resolve_path",
    "rows_json",
    "rows_page",
    "rows_path",
]
