"""What the operators and the sensor share: where the journal is, and how a job is named."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

DEFAULT_RELATIVE_PATH = Path("resumable") / "journal.sqlite3"
SUMMARY_XCOM_KEY = "resumable_summary"
STATE_STORE_KEY = "resumable_journal"


def _conf_get(option: str) -> str | None:
    # The environment wins in Airflow's config too; reading it first spares an Airflow import.
    from_env = os.environ.get(f"AIRFLOW__RESUMABLE__{option.upper()}")
    if from_env:
        return from_env
    try:
        from airflow.sdk import conf
    except ImportError:  # Airflow < 3.1 or no SDK: fall back to the environment only
        return os.environ.get(f"AIRFLOW__RESUMABLE__{option.upper()}") or None
    value = conf.get("resumable", option, fallback=None)
    return value or None


def default_journal_path() -> Path:
    """``[resumable] journal_path``, else ``$AIRFLOW_HOME/resumable/journal.sqlite3``.

    Never anything from ``dag_run.conf``: a run's conf must not choose which file a worker writes.
    """
    configured = _conf_get("journal_path")
    if configured:
        return Path(configured).expanduser()
    home = os.environ.get("AIRFLOW_HOME") or str(Path("~/airflow").expanduser())
    return Path(home) / DEFAULT_RELATIVE_PATH


def default_durability() -> str:
    value = (_conf_get("durability") or "full").strip().lower()
    if value not in ("full", "normal"):
        raise ValueError(f"[resumable] durability must be 'full' or 'normal', not {value!r}")
    return value


def default_job_id(context: Any) -> str:
    """``dag_id/task_id/run_id`` (+ ``/map_index`` when mapped): the same on retry and on Clear."""
    ti = context["ti"]
    job_id = f"{ti.dag_id}/{ti.task_id}/{ti.run_id}"
    map_index = getattr(ti, "map_index", -1)
    if map_index is not None and map_index >= 0:
        job_id += f"/{map_index}"
    return job_id
