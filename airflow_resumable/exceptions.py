"""Every error this provider raises on purpose, under one root: catch :class:`ResumableError` to catch
them all.

Pure Python: the journal core and the runner raise these without importing Airflow. Five errors must
also be Airflow exceptions (so that Airflow fails a task without spending its retries); they are
defined, and imported from, the module that raises them: ``WrongWorkerError``, ``HeldItemsError``,
``HeldItemsNeedAHumanError`` (:mod:`airflow_resumable.operators.resumable_batch`) and ``MailRejected``,
``InvalidMessage`` (:mod:`airflow_resumable.receivers.smtp`).

What a send's error says about the send, for the runner and for whoever catches it:

* :class:`NotSentError`: nothing left the process; the next run sends it again, unasked.
* :class:`OutcomeUnknownError`: it may have arrived; the receiver is asked (``verify``) before anything
  is sent again, and an item it cannot answer for is held for a person. Any other exception a send
  raises is treated the same way; this class names the case for code that catches it.

Each error is built with its fields: a caller reads ``exc.holder`` or ``exc.status``, never the message.
"""

from __future__ import annotations

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
    "JournalBehindError",
    "JournalError",
    "JournalLocationError",
    "JournalVersionError",
    "MailNotSent",
    "MailOutcomeUnknown",
    "NotHeldError",
    "NotSentError",
    "OutcomeUnknownError",
    "PageError",
    "ReceiverError",
    "ReceiverRefused",
    "ReceiverUnavailableError",
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


class JournalBehindError(JournalError):
    """The journal has fewer IN_FLIGHT marks for this job than a run of it saw (SPEC §13): it was restored
    from a backup, copied, or failed over to a standby that had not received everything. Items it
    forgot may have been sent; nothing was sent by this run.

    :param journal: the journal, as its location names it.
    :param journal_marks: the job's marks in the journal now.
    :param stored_marks: the count the high-water mark recorded.
    :param recorded_at: when the mark was recorded (ISO 8601), or None.
    :param recorded_by: the run (try) that recorded it, or None.
    """

    def __init__(self, message: str, *, journal: str, journal_marks: int, stored_marks: int,
                 recorded_at: str | None = None, recorded_by: str | None = None) -> None:
        super().__init__(message)
        self.journal = journal
        self.journal_marks = journal_marks
        self.stored_marks = stored_marks
        self.recorded_at = recorded_at
        self.recorded_by = recorded_by


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


class ReceiverUnavailableError(ResumableError):
    """The run settled what it could in the task and stopped with items still waiting for the receiver:
    it kept refusing or failing past the attempts allowed (or asked to wait longer than a run waits).
    Nothing waiting was held for a person: a retry of the task resumes them (a refused send is sent
    again, an unknown outcome is looked up first).

    :param items_waiting: the items this run left unfinished (read in, not completed nor held).
    :param items_unread: the items of the batch the run never reached (None when the batch's size is not
        known up front).
    :param retry_after: the seconds the receiver last asked to wait (its ``Retry-After``), or None;
        :class:`~airflow_resumable.retry_policy.RetryAfterPolicy` waits that long before the retry.
    :param reason: what stopped it: ``"receiver_failing"`` (it kept failing, every item's sends paused),
        ``"attempts_exhausted"`` (some items ran out of attempts while others went through) or
        ``"long_retry_after"`` (it asked to wait longer than ``Settlement.max_wait``).
    """

    def __init__(self, message: str, *, items_waiting: int, items_unread: int | None, retry_after: float | None,
                 reason: str) -> None:
        super().__init__(message)
        self.items_waiting = items_waiting
        self.items_unread = items_unread
        self.retry_after = retry_after
        self.reason = reason


class NotSentError(ResumableError):
    """Raised by a step to declare that nothing of its send left the process: the connection was
    refused, the name did not resolve, the connect timed out, a check before the request failed.

    The step is recorded FAILED with that fact (and the type name, as for any error) and the next run
    sends it again without verify or hold. Raise it only when that is certain: an error after any
    byte of the request may have been written is an unknown outcome, never a NotSentError."""


class OutcomeUnknownError(ResumableError):
    """Raised by a send when it cannot tell whether the receiver got it: the request may have been
    written, and its answer never came, or came as an error.

    The step is recorded FAILED with an unknown outcome: the next run asks the receiver (``verify``) and
    sends again only when the receiver says it never got it; otherwise the item is held for a person."""


# ---------------------------------------------------------------------------------- the receivers


class ReceiverError(OutcomeUnknownError):
    """The receiver answered with an error status (the exception names only the status code); a send
    it answers this way may have been taken.

    :param status: the HTTP status code of the answer.
    """

    def __init__(self, status: int) -> None:
        super().__init__(f"receiver answered HTTP {status}")
        self.status = status


class ReceiverRefused(NotSentError):
    """The receiver refused the send for now and said so (HTTP 429 unless configured otherwise): it did
    not take it. The next attempt sends it again with the same key, without a look-up or a hold.

    :param status: the HTTP status code of the refusal.
    :param retry_after: the seconds the receiver asked to wait (its ``Retry-After``, given in seconds or
        as an HTTP date), None when it named none.
    """

    def __init__(self, status: int, *, retry_after: float | None = None) -> None:
        wait = f"; it asked to wait {retry_after:g} s" if retry_after is not None else ""
        super().__init__(f"receiver refused the send for now: HTTP {status}{wait}; nothing was taken, the next "
                         "attempt sends it again")
        self.status = status
        self.retry_after = retry_after


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


class MailOutcomeUnknown(OutcomeUnknownError):
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

