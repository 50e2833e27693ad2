"""What differs between the Airflow 3 minors this provider supports (3.1, 3.2, 3.3), in one place.

Official providers keep such a module (``version_compat.py``); everything else imports from here
rather than trying imports of its own. Features that exist only on newer minors degrade as the
README says, never by failing a task:

* ``task_state_store`` (3.3+): without it the wrong-worker guard falls back to "a retry whose
  journal never saw the job" (see the operator).
* metrics: 3.3 has module-level functions in ``airflow.sdk.observability.stats``, 3.2 the ``Stats``
  class there, 3.1 ``airflow.stats.Stats``.
* config: ``airflow.sdk.conf`` (3.2+), ``airflow.configuration.conf`` (3.1).
* the API server's ``get_user`` takes the OAuth token as ``_oauth_token`` (3.3) or ``oauth_token``.
* ``AirflowFailException`` (fail without retrying): ``airflow.sdk.exceptions`` (3.2+), ``airflow.exceptions`` (3.1).
"""

from __future__ import annotations

import inspect
from functools import cache
from importlib.metadata import PackageNotFoundError, version
from typing import Any


@cache
def airflow_version() -> tuple[int, int]:
    """(major, minor) of the installed Airflow, from package metadata (no Airflow import)."""
    for dist in ("apache-airflow-core", "apache-airflow"):
        try:
            text = version(dist)
        except PackageNotFoundError:
            continue
        parts = [int("".join(ch for ch in p if ch.isdigit()) or 0) for p in text.split(".")[:2]]
        return parts[0], parts[1]
    return 0, 0


def conf() -> Any:
    """Airflow's configuration as a task, the triggerer or the API server reads it."""
    try:
        from airflow.sdk import conf as sdk_conf  # 3.2+
    except ImportError:
        from airflow.configuration import conf as core_conf  # 3.1

        return core_conf
    return sdk_conf


def stats_incr(name: str, count: int, tags: dict[str, str]) -> None:
    """Increment an Airflow metric (StatsD, Datadog, OpenTelemetry: whatever ``[metrics]`` sets up)."""
    try:
        from airflow.sdk.observability.stats import incr  # 3.3+
    except ImportError:
        try:
            from airflow.sdk.observability.stats import Stats  # 3.2
        except ImportError:
            from airflow.stats import Stats  # 3.1
        incr = Stats.incr
    incr(name, count=count, tags=tags)


def store_forever(store: Any, key: str, value: Any) -> None:
    """Set ``key`` in the task state store past the store's default retention, where Airflow allows it."""
    try:
        from airflow.sdk.execution_time.context import NEVER_EXPIRE
    except ImportError:
        store.set(key, value)
    else:
        store.set(key, value, retention=NEVER_EXPIRE)


def airflow_fail_exception() -> type[Exception]:
    """The exception that fails a task without spending its remaining retries."""
    try:
        from airflow.sdk.exceptions import AirflowFailException  # 3.2+
    except ImportError:
        from airflow.exceptions import AirflowFailException  # 3.1
    return AirflowFailException  # type: ignore[no-any-return]


async def get_user(request: Any, bearer_credentials: Any) -> Any:
    """The signed-in user of an API-server request (JWT header or cookie), or Airflow's 401/403."""
    from airflow.api_fastapi.core_api.security import get_user as airflow_get_user

    token_parameter = "_oauth_token" if "_oauth_token" in _parameters(airflow_get_user) else "oauth_token"
    return await airflow_get_user(request, bearer_credentials=bearer_credentials, **{token_parameter: None})


@cache
def _parameters(function: Any) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)
