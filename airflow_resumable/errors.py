"""The error root's first home, kept as an import path: every error now lives in
:mod:`airflow_resumable.exceptions`."""

from __future__ import annotations

from airflow_resumable.exceptions import ResumableError

__all__ = ["ResumableError"]
