"""The "Resumable job" button on a batch task instance: a link to its job on the Resumable jobs page."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from airflow.sdk import BaseOperatorLink

from airflow_resumable._airflow import SUMMARY_XCOM_KEY

if TYPE_CHECKING:
    from airflow.sdk.types import TaskInstanceKey

# Kept in step with airflow_resumable.plugins.ui (not imported: that would load FastAPI on workers).
URL_PREFIX = "/resumable"


def job_url(job_id: str | None) -> str:
    """The job's page (or the jobs list) under ``[api] base_url``; every character of the id escaped."""
    from airflow_resumable._compat import conf

    base = (conf().get("api", "base_url", fallback="") or "").rstrip("/")
    path = f"{URL_PREFIX}/jobs/{quote(job_id, safe='')}" if job_id else f"{URL_PREFIX}/"
    return base + path


def default_job_id_for(ti_key: Any) -> str:
    job_id = f"{ti_key.dag_id}/{ti_key.task_id}/{ti_key.run_id}"
    map_index = getattr(ti_key, "map_index", -1)
    return job_id + (f"/{map_index}" if map_index is not None and map_index >= 0 else "")


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
                job_id = default_job_id_for(ti_key)
        return job_url(job_id)
