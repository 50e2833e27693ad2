"""The journal's errors, under one root a caller can catch. They live in :mod:`airflow_resumable.exceptions`
with every other error of the provider; this module keeps the journal's own import path."""

from __future__ import annotations

from airflow_resumable.exceptions import (
    JobBusyError,
    JobPrunedError,
    JournalConnectionError,
    JournalCorruptError,
    JournalDiskFullError,
    JournalError,
    JournalLocationError,
    JournalVersionError,
    NotHeldError,
    PageError,
    ResolutionError,
    StaleDecisionError,
)

__all__ = [
    "JobBusyError",
    "JobPrunedError",
    "JournalConnectionError",
    "JournalCorruptError",
    "JournalDiskFullError",
    "JournalError",
    "JournalLocationError",
    "JournalVersionError",
    "NotHeldError",
    "PageError",
    "ResolutionError",
    "StaleDecisionError",
]
