"""Every error this provider raises on purpose, under one root: catch :class:`ResumableError` to catch
them all.

Pure Python: the journal core and the runner raise these without importing Airflow. The few errors
that must also be Airflow exceptions (so that Airflow fails a task without spending its retries) are
defined beside the code that raises them and are reachable from here too, imported on first use:
``WrongWorkerError``, ``HeldItemsError``, ``HeldItemsNeedAHumanError`` (the batch operator) and
``MailRejected``, ``InvalidMessage`` (the SMTP receiver).

Each error is built with its fields: a caller reads ``exc.holder`` or ``exc.status``, never the message.
"""

from __future__ import annotations

import importlib
from typing import Any

# The Airflow-bound errors (below) are left out: a star import must not import Airflow.
__all__ = [
    "ArchiveError",
    "BatchStopped",
    "DecisionInputError",
    "DurationError",
    "InvalidItemError",
    "InvalidStepOutputError",
    "JobBusyError",
    "JobPrunedError",
    "JournalConfigError",
    "JournalConnectionError",
    "JournalCorruptError",
    "JournalDiskFullError",
    "JournalError",
    "JournalLocationError",
    "JournalVersionError",
    "MailNotSent",
    "MailOutcomeUnknown",
    "NotHeldError",
    "NotSentError",
    "PageError",
    "ReceiverError",
    "ReceiverUnreachable",
    "ResolutionError",
    "ResolutionRefused",
    "ResumableError",
    "StaleDecisionError",
]


class ResumableError(Exception):
    """Base class of every error this provider raises on purpose."""


# ------------------------------------------------------------------------------------ the journal


class JournalError(ResumableError):
    """Base class of every error the journal raises."""


class JobBusyError(JournalError):
    """Another runner holds this job right now; nothing was sent.

    :param holder: who holds the job: pid, host, since when, which runner.
    :param runner: the holder's runner name, as it took the claim (None if unknown).
    """

    def __init__(self, message: str, *, holder: str | None = None, runner: str | None = None) -> None:
        super().__init__(message)
        self.holder = holder if holder is not None else "holder unknown"
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


class DecisionInputError(ResolutionError):
    """Decision input that cannot be read as decisions (a file, an argument): nothing was applied."""


# ------------------------------------------------------------------------------------- the runner


class InvalidItemError(ResumableError, ValueError):
    """An item (or a step's output for it) is not usable; the message names the item."""


class InvalidStepOutputError(InvalidItemError):
    """A step returned something that is not JSON or is over 64 KiB."""


class BatchStopped(ResumableError):
    """The run was asked to stop (``stop`` was set: Airflow's on_kill, "mark failed/success", Clear).
    No send was started after that; the sends already in flight were recorded as they finished. The
    job is left unfinished: run it again (a retry or a Clear) to resume."""


class NotSentError(ResumableError):
    """Raised by a step to declare that nothing of its send left the process: the connection was
    refused, the name did not resolve, the connect timed out, a check before the request failed.

    The step is recorded FAILED with that fact (and the type name, as for any error) and the next run
    sends it again without verify or hold. Raise it only when that is certain: an error after any
    byte of the request may have been written is an unknown outcome, never a NotSentError."""


# ---------------------------------------------------------------------------------- the receivers


class ReceiverError(ResumableError):
    """The receiver answered with an error status (the exception names only the status code).

    :param status: the HTTP status code of the answer.
    """

    def __init__(self, status: int) -> None:
        super().__init__(f"receiver answered HTTP {status}")
        self.status = status


class ReceiverUnreachable(NotSentError):
    """The connection to the receiver could not be opened: no byte of the request was written."""


class MailNotSent(NotSentError):
    """Nothing of this message was delivered: the session broke before the end-of-data marker was
    written, or the server refused it for now (4xx). The next run sends it again.

    :param stage: the SMTP command the session had reached.
    :param cause: what broke, by type name or reply code (never a server's text).
    """

    def __init__(self, stage: str, cause: str, *, message: str | None = None) -> None:
        super().__init__(message or f"e-mail not sent: {cause} at {stage}; nothing was delivered, the next run "
                                    "sends it again")
        self.stage, self.cause = stage, cause


class MailOutcomeUnknown(ResumableError):
    """The end-of-data marker was written but its reply never came (the exception names only the
    error's type): the server may have the message. The next run verifies it, never re-sends blindly."""

    def __init__(self, cause: str) -> None:
        super().__init__(f"e-mail outcome unknown: {cause} after the end-of-data marker was written")
        self.cause = cause


class ArchiveError(ResumableError):
    """The archive mailbox could not be searched (the IMAP answer names only the command)."""


# ------------------------------------------------------------------------- configuration and input


class JournalConfigError(ResumableError, ValueError):
    """The configured journal connection cannot be used (unknown, not Postgres, malformed)."""


class ResolutionRefused(ResumableError, ValueError):
    """The resolve DAG's conf asked for something the journal refuses; the journal is unchanged."""


class DurationError(ResumableError, ValueError):
    """A duration that cannot be read; the message says what to write instead."""


# The errors that are Airflow exceptions too: defined where they are raised, so that importing this
# module (as the core does) never imports Airflow.
_AIRFLOW_BOUND = {
    "WrongWorkerError": "airflow_resumable.operators.resumable_batch",
    "HeldItemsError": "airflow_resumable.operators.resumable_batch",
    "HeldItemsNeedAHumanError": "airflow_resumable.operators.resumable_batch",
    "MailRejected": "airflow_resumable.receivers.smtp",
    "InvalidMessage": "airflow_resumable.receivers.smtp",
}


def __getattr__(name: str) -> Any:
    module = _AIRFLOW_BOUND.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
