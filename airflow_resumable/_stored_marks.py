"""The high-water marks (SPEC §13) Airflow's task state store keeps, read from its metadata database for
the CLI and the page: which task instances ran a job, and the count each last recorded.

Only the metastore backend keeps them there (Airflow's default); with a custom ``[workers]
state_store_backend`` none are found. Nothing is written, and no database is created: a SQLite metadata
database that does not exist is reported, not opened.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from airflow_resumable._location import HIGH_WATER_STORE_KEY


@dataclass(frozen=True)
class StoredMark:
    dag_id: str
    run_id: str
    task_id: str
    map_index: int
    marks: int
    at: str | None
    by: str | None
    open: bool
    behind: dict[str, Any] | None

    def journal_behind(self, journal_marks: int) -> bool:
        """Whether tries of this task are refused: the journal has fewer marks, or a try found it so and
        no try with on_journal_behind="verify" has finished since."""
        return self.behind is not None or journal_marks < self.marks


def stored_marks(job_id: str) -> list[StoredMark] | str:
    """The marks recorded for ``job_id``, one per task instance that ran it; or why none can be read here."""
    try:
        from airflow import settings
        from airflow.models.task_state_store import TaskStateStoreModel
        from sqlalchemy import select
        from sqlalchemy.orm import Session
    except ImportError:
        return "no task state store here (Airflow >= 3.3 keeps the mark)"
    engine = getattr(settings, "engine", None)
    if engine is None:
        return "Airflow's metadata database is not configured here"
    database = engine.url.database
    if engine.url.get_backend_name() == "sqlite" and database and not os.path.exists(database):
        return f"Airflow's metadata database {database} does not exist here"
    model = TaskStateStoreModel
    query = select(model.dag_id, model.run_id, model.task_id, model.map_index, model.value).where(
        model.key == HIGH_WATER_STORE_KEY)
    try:
        with Session(engine) as session:
            rows = session.execute(query).all()
    except Exception as exc:  # noqa: BLE001 - a reader: say what failed, never a stack
        return f"Airflow's metadata database could not be read ({type(exc).__name__})"
    found = []
    for dag_id, run_id, task_id, map_index, value in rows:
        try:
            record = json.loads(value) if isinstance(value, str) else value
        except ValueError:
            continue
        if not isinstance(record, dict) or record.get("job") != job_id or type(record.get("marks")) is not int:
            continue
        behind = record.get("behind")
        found.append(StoredMark(dag_id, run_id, task_id, int(map_index), record["marks"], record.get("at"),
                                record.get("by"), bool(record.get("open")), behind if isinstance(behind, dict) else None))
    return found
