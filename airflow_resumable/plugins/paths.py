"""The URLs of the Resumable jobs page: its own paths (relative to its app), where the browser sees the
app, and the Airflow UI's page of a job's batch task."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote, urlencode

from fastapi import Request

# One home for the mount prefix and a job's path, which the task's "Resumable job" link builds too.
from airflow_resumable.links import URL_PREFIX

__all__ = ["airflow_base", "app_prefix", "batch_task_path", "resolve_path", "rows_path", "with_query"]


def with_query(path: str, **values: Any) -> str:
    """``path`` with the query of ``values`` that are set (None and "" are left out)."""
    query = urlencode({k: v for k, v in values.items() if v not in (None, "")})
    return f"{path}?{query}" if query else path


def app_prefix(request: Request) -> str:
    """This app's URL path as the browser sees it (Airflow's base_url path + the mount prefix)."""
    return str(request.scope.get("root_path", "")).rstrip("/")


def airflow_base(request: Request) -> str:
    """The Airflow UI's URL path as the browser sees it (Airflow's base_url path)."""
    prefix = app_prefix(request)
    return prefix[: -len(URL_PREFIX)] if prefix.endswith(URL_PREFIX) else ""


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
