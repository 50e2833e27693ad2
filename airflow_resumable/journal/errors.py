"""Every error the journal raises, under one root a caller can catch."""

from __future__ import annotations

from airflow_resumable.errors import ResumableError


class JournalError(ResumableError):
    """Base class of every error the journal raises."""


class JobBusyError(JournalError):
    """Another runner holds this job right now; nothing was sent."""

    holder = "holder unknown"  # who holds the job: pid, host, since when, which runner
    runner: str | None = None  # the holder's runner name, as it took the claim

    def __init__(self, message: str, *, holder: str | None = None, runner: str | None = None) -> None:
        super().__init__(message)
        if holder is not None:
            self.holder = holder
        self.runner = runner


class JobPrunedError(JournalError):
    """The job's history was pruned; running it again under the same job_id would re-send all."""


class JournalLocationError(JournalError):
    """The journal location is unusable: a network filesystem, or a URL that is not a journal's."""


class JournalCorruptError(JournalError):
    """The journal is not a readable step journal."""


class JournalDiskFullError(JournalError):
    """The disk holding the journal is full. Nothing is lost: free space and retry (never restore)."""


class JournalVersionError(JournalError):
    """The journal was written by a newer version of this provider, or (a shared journal) by an older
    one and not migrated yet: ``airflow-resumable migrate``."""


class PageError(JournalError, ValueError):
    """A paged read was asked for with a bad ``limit`` or a ``cursor`` this journal did not give."""


class JournalConnectionError(JournalError):
    """The journal's database server cannot be reached, or the connection to it was lost.

    A runner that lost its connection has lost its claim on the job with it: it starts no further
    send. Sends that were in flight stay IN_FLIGHT, to be verified or held by the next run.
    """


class NotHeldError(JournalError, ValueError):
    """The step to resolve does not exist or is not held / unresolved."""


class ResolutionError(JournalError, ValueError):
    """A resolution was asked for with missing or malformed arguments."""


class StaleDecisionError(ResolutionError):
    """A decision was made about a step row that has changed since (another person, a run, verify):
    nothing was changed. Look at the step again and decide on what it is now."""
