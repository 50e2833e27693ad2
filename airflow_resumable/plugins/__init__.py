"""The "Resumable jobs" page in the Airflow UI: an Airflow plugin registered by this provider.

The page shows the step journal's jobs, held items and step rows, and settles held items: its Resolve
form and "Resolve several" post decisions that the journal applies as the signed-in user (with
Airflow's edit permission on the job's DAG). Page views write nothing; a decision (``POST
/api/resolve``, ``/api/resolve-many``) carries the row versions the page showed: a step that changed
since is refused (409), never settled blind. Every request is authenticated with Airflow's own machinery
(Airflow does not authenticate plugin apps). The app's parts:

* ``auth``: who is asking and what they may see and settle (``Viewer``, ``require_dag_read``);
* ``journal_access``: which journal, the ids a request may name, the records as the page shows them;
* ``paths`` and ``pager``: the page's URLs, and paging its lists;
* ``rendering``: the templates, their formatting filters, and refusals;
* ``views``: the reading routes; ``decisions``: the Resolve form and the settling routes;
* ``webapp``: the app itself (its security headers and error handlers) with those routes.

Loaded by Airflow's plugins manager through the ``airflow.plugins`` entry point (what Airflow 3.3
reads by default) and listed under ``plugins`` in the provider info (what it reads when
``[core] lazy_discover_providers`` is off). Importing this module stays cheap: workers load plugins
too, and the Airflow API security code is imported only when a request arrives.
"""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from airflow_resumable.links import URL_PREFIX
from airflow_resumable.plugins.webapp import app

# The UI shows the page in an iframe under /plugin/<url_route>; href is what the iframe loads.
# Relative (no leading slash), so it resolves against Airflow's <base href> and follows [api] base_url.
EXTERNAL_VIEW = {
    "name": "Resumable jobs",
    "href": URL_PREFIX.lstrip("/") + "/",
    "url_route": "resumable-jobs",
    "destination": "nav",
    "nav_top_level": True,  # its own entry in the navigation bar, not under a "Plugins" menu
}


class ResumableJobsPlugin(AirflowPlugin):
    """Jobs and held items of the step journal, and decisions that settle held items, behind Airflow's
    own authentication and DAG permissions (read to see a job, edit to settle it)."""

    name = "resumable_jobs"
    fastapi_apps = [{"app": app, "url_prefix": URL_PREFIX, "name": "Resumable jobs"}]
    external_views = [EXTERNAL_VIEW]
