"""The "Resumable job" button on a batch task instance: a link to its job on the Resumable jobs page.

Also where that page lives (``URL_PREFIX``, a job's path): the page imports them from here, as this
module loads on workers and must not import FastAPI, while the page may import this one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

from airflow_resumable._location import SUMMARY_XCOM_KEY, default_job_id_of

if TYPE_CHECKING:
    from airflow.sdk.types import TaskInstanceKey

# Where Airflow's API server mounts the Resumable jobs page (its app, airflow_resumable.plugins.webapp).
URL_PREFIX = "/resumable"


def job_path(job_id: str) -> str:
    """The job page relative to the page's app; every character of the id is escaped (ids hold '/' and '+')."""
    return f"/jobs/{quote(job_id, safe='')}"


def job_url(job_id: str | None) -> str:
    """The job's page (or the jobs list) under ``[api] base_url``; every character of the id escaped."""
    from airflow_resumable._compat import conf

    base = (conf().get("api", "base_url", fallback="") or "").rstrip("/")
    path = URL_PREFIX + (job_path(job_id) if job_id else "/")
    return base + path


class ResumableJobLink(BaseOperatorLink):
    """Airflow 3 evaluates this on the worker when the task ends (success or failure) and stores the URL."""

    name = "Resumable job"

    def get_link(self, operator: Any, *, ti_key: TaskInstanceKey) -> str:
        # The summary XCom names the job exactly as it ran (a custom or templated job_id included).
        job_id: str | None = None
        try:
            from airflow.sdk.execution_time.xcom import XCom

            summary = XCom.get_value(ti_key=ti_key, key=SUMMARY_XCOM_KEY)
            if isinstance(summary, dict) and isinstance(summary.get("job_id"), str):
                job_id = summary["job_id"]
        except Exception:  # noqa: BLE001 - no summary (the task failed before it ran a batch): fall back
            job_id = None
        if job_id is None:
            configured = getattr(operator, "job_id", None)
            # An unrendered template is not a job id; the default one is computable from the key.
            job_id = configured if isinstance(configured, str) and "{{" not in configured else None
            if job_id is None and not configured:
                job_id = default_job_id_of(ti_key)
        return job_url(job_id)
