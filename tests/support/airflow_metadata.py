"""Reading Airflow's metadata DB in the tests: the one place that knows Airflow's tables.

Airflow's public CLIs cover part of this (``airflow dags list-runs -o json``, ``airflow tasks
states-for-dag-run -o json``), but each call pays seconds of Airflow start-up and none shows a try's
hostname or an XCom value. So the reads stay SQL on the SQLite metadata DB the harness creates, behind
a check of the Airflow version and of the columns they use: a schema change in a new Airflow fails
here, once, with a message saying what to update, instead of as a puzzling assertion in a test.
"""

from __future__ import annotations

import json
import sqlite3
from functools import cached_property
from pathlib import Path
from typing import Any

from airflow_resumable._compat import airflow_version

# The Airflow minors whose metadata tables these reads were checked against (the CI matrix).
CHECKED_MINORS = ((3, 1), (3, 2), (3, 3))
COLUMNS = {
    "dag_run": {"id", "dag_id", "run_id", "state"},
    "task_instance": {"dag_id", "run_id", "task_id", "map_index", "state", "try_number", "hostname"},
    "xcom": {"dag_id", "run_id", "task_id", "map_index", "key", "value"},
}


class MetadataDB:
    """Look-ups (SELECT only) in the metadata DB at ``path``: runs, task states, hostnames, XComs."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @cached_property
    def _checked(self) -> bool:
        if airflow_version() not in CHECKED_MINORS:
            raise AssertionError(
                f"tests/support/airflow_metadata.py reads Airflow's tables as of {CHECKED_MINORS}; Airflow "
                f"{airflow_version()} is not checked: compare its tables and extend CHECKED_MINORS")
        with self._connect() as db:
            for table, wanted in COLUMNS.items():
                have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
                if not wanted <= have:
                    raise AssertionError(f"Airflow {airflow_version()} changed table {table}: missing columns "
                                         f"{sorted(wanted - have)}; update tests/support/airflow_metadata.py")
        return True

    def _connect(self) -> sqlite3.Connection:
        # Not mode=ro: after a SIGKILLed writer a read-only connection cannot roll back its hot journal.
        return sqlite3.connect(self.path, timeout=30)

    def _one(self, sql: str, params: tuple[Any, ...]) -> tuple[Any, ...] | None:
        assert self._checked
        with self._connect() as db:
            return db.execute(sql, params).fetchone()

    def last_run_id(self, dag_id: str) -> str:
        row = self._one("SELECT run_id FROM dag_run WHERE dag_id=? ORDER BY id DESC LIMIT 1", (dag_id,))
        assert row is not None, f"no run of {dag_id}"
        return str(row[0])

    def run_state(self, dag_id: str) -> str:
        row = self._one("SELECT state FROM dag_run WHERE dag_id=? ORDER BY id DESC LIMIT 1", (dag_id,))
        assert row is not None, f"no run of {dag_id}"
        return str(row[0])

    def task_states(self, dag_id: str, run_id: str) -> dict[tuple[str, int], tuple[str, int]]:
        assert self._checked
        with self._connect() as db:
            rows = db.execute(
                "SELECT task_id, map_index, state, try_number FROM task_instance WHERE dag_id=? AND run_id=?",
                (dag_id, run_id),
            ).fetchall()
        return {(t, m): (s, n) for t, m, s, n in rows}

    def hostname(self, dag_id: str, task_id: str, run_id: str) -> str:
        row = self._one("SELECT hostname FROM task_instance WHERE dag_id=? AND run_id=? AND task_id=?",
                        (dag_id, run_id, task_id))
        assert row and row[0], "Airflow recorded no hostname"
        return str(row[0])

    def xcom(self, dag_id: str, task_id: str, run_id: str, key: str = "return_value", map_index: int = -1) -> Any:
        row = self._one("SELECT value FROM xcom WHERE dag_id=? AND task_id=? AND key=? AND map_index=? AND run_id=?",
                        (dag_id, task_id, key, map_index, run_id))
        if row is None:
            return None
        value = row[0]
        return json.loads(value) if isinstance(value, (str, bytes)) else value
