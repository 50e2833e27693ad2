"""Who is asking the Resumable jobs page, and what they may do with which DAG's jobs.

Airflow does not authenticate plugin apps, so the page does, with Airflow's own machinery: the JWT
of the request (``Authorization: Bearer`` or the ``_token`` cookie the Airflow UI sets for the
browser, which also reaches the page in the UI's iframe) and the auth manager's DAG permissions on
the DAG each job recorded (read to see it, edit to settle it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request

from airflow_resumable.journal import JobSummary


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


def login_url(request: Request) -> str | None:
    """Where the auth manager signs people in (SimpleAuthManager, FAB, Keycloak, ...), back to this request."""
    try:
        return str(_auth_manager().get_url_login(next_url=str(request.url)))
    except Exception:  # noqa: BLE001 - a missing link must not turn a 401 into a 500
        return None
