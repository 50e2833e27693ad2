"""The one error root of airflow-provider-resumable: catch :class:`ResumableError` to catch them all.

Pure Python (the journal core imports it). Under it: the journal's errors (``JournalError`` and its
subclasses), ``InvalidItemError`` (a bad item, nothing sent), ``JournalConfigError`` (where the journal
is configured), ``ReceiverError`` (the HTTP receiver answered an error), ``ResolutionRefused`` (the
resolve DAG), ``WrongWorkerError`` and ``HeldItemsError`` with ``HeldItemsNeedAHumanError`` (the batch
operator; also AirflowExceptions).
"""

from __future__ import annotations


class ResumableError(Exception):
    """Base class of every error this provider raises on purpose."""
