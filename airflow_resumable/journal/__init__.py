"""The step journal: per job, item and step, what was done - on SQLite or PostgreSQL.

``StepJournal(path)`` opens a SQLite file on the worker's disk (the embedded default);
``StepJournal("postgresql://...")`` a schema in a PostgreSQL database that every worker reaches.
The runner talks to both through :class:`JobRun`; the engines differ only below the seam described
in :mod:`airflow_resumable.journal.backend` (``StepJournal.engine``). This package imports nothing from Airflow.

The journal's other errors (``JobPrunedError``, ``StaleDecisionError``, ...) are in
:mod:`airflow_resumable.exceptions`, with every error of the provider; the four a caller of the journal
catches most are importable from here too.
"""

# One statement a line, not ruff's merged column of names: the face reads as the list of what it exports.
from airflow_resumable.exceptions import JobBusyError, JournalError, JournalLocationError, NotHeldError  # noqa: I001
from airflow_resumable.journal.base import StepJournal, migrate
from airflow_resumable.journal.engines import is_postgres_url
from airflow_resumable.journal.jobrun import JobRun
from airflow_resumable.journal.records import DECISIONS, DECISIONS_BY_REASON, JOB_STATUSES, HeldReason, HeldStep
from airflow_resumable.journal.records import JobSummary, Page, Resolution, Status, StepRecord, StepState
from airflow_resumable.journal.schema import SCHEMA_VERSION

__all__ = [
    "DECISIONS", "DECISIONS_BY_REASON", "JOB_STATUSES", "SCHEMA_VERSION",
    "HeldReason", "HeldStep", "JobRun", "JobSummary", "Page", "Resolution", "Status", "StepJournal", "StepRecord",
    "StepState", "is_postgres_url", "migrate",
    "JobBusyError", "JournalError", "JournalLocationError", "NotHeldError",
]
