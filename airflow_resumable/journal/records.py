"""What the journal hands out: states, reasons and records (frozen dataclasses, no tuples)."""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Generic, NamedTuple, TypeVar


def idempotency_key(job_id: str, item_id: str, step: str, generation: int = 0) -> str:
    """A key deterministic in (job_id, item_id, step, generation), distinct across them, safe in an
    HTTP header. Generation 0 is the key of earlier releases (which had no generations)."""
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError(f"generation must be an integer >= 0, not {generation!r}")
    parts: list[object] = [job_id, item_id, step] if generation == 0 else [job_id, item_id, step, generation]
    material = json.dumps(parts, ensure_ascii=False, separators=(",", ":"))
    return "rsm1-" + hashlib.sha256(material.encode("utf-8")).hexdigest()


class Status(str, enum.Enum):
    IN_FLIGHT = "IN_FLIGHT"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    def __str__(self) -> str:
        return self.value


class HeldReason(str, enum.Enum):
    UNKNOWN_OUTCOME = "unknown_outcome"
    INPUT_CHANGED = "input_changed"

    def __str__(self) -> str:
        return self.value


# A human's decisions about a held step (the resolve DAG, the UI page, the CLI), by kind of hold. The
# first of each pair is the one that cannot cause a duplicate send (delivered needs the receiver's
# receipt; keep_previous_input sends nothing).
DECISIONS_BY_REASON = {
    HeldReason.UNKNOWN_OUTCOME: ("delivered", "not_delivered"),
    HeldReason.INPUT_CHANGED: ("keep_previous_input", "use_new_input"),
}
DECISIONS = tuple(d for pair in DECISIONS_BY_REASON.values() for d in pair)
# One entry of a bulk resolution (StepJournal.apply_decisions), and how many one call may carry.
ENTRY_FIELDS = frozenset({"job_id", "item_id", "step", "decision", "receipt", "note", "version"})
MAX_DECISIONS = 10_000
# Jobs one list of decisions may name: each job's claim is held until the whole list is applied (on
# SQLite an open lock file each, and a worker's limit on open files is often 1,024).
MAX_DECISION_JOBS = 500

# Limits of what a decision may carry, on every surface (the core refuses past them, with the same
# message whichever surface it came through). Item ids as the runner takes them; a job id may be longer
# (a DAG id, a task id and a run id); a step name is a Python identifier-ish label but who knows.
MAX_ID_LENGTH = 1024
MAX_JOB_ID_LENGTH = 64 * 1024
# The longest cursor a journal gives (a held step's: job id, item id, step): base64 of their JSON, where a
# character takes up to 6 bytes (a control character's \u0001 escape).
MAX_CURSOR_LENGTH = 4 * (6 * (MAX_JOB_ID_LENGTH + 2 * MAX_ID_LENGTH) + 64) // 3 + 4
MAX_NOTE_BYTES = 4 * 1024
MAX_RECEIPT_BYTES = 64 * 1024
MAX_PERSON_LENGTH = 1024  # resolved_by: a user name


@dataclass(frozen=True)
class StepRecord:
    job_id: str
    item_id: str
    step: str
    side_effect: bool
    status: Status
    digest: str
    receipt: str | None
    output: Any
    error_type: str | None
    held_reason: HeldReason | None
    new_digest: str | None
    attempts: int
    created_at: datetime
    updated_at: datetime
    # The send's key generation (0 unless a use_new_input resolution moved it on) and whether
    # this FAILED send provably never left the process (the next run sends it without verify).
    generation: int = 0
    not_sent: bool = False
    # Changes whenever the row changes: a decision about this row carries it (expected_version).
    version: str = ""

    @property
    def key_to_ask(self) -> str | None:
        """The idempotency key to ask the receiver about this send (its current generation's); None for
        a local step, which sends nothing."""
        return idempotency_key(self.job_id, self.item_id, self.step, self.generation) if self.side_effect else None


class StepState(NamedTuple):
    """The part of a step's row the runner's decision table reads (``output`` still JSON text)."""

    status: Status
    digest: str
    output: str | None
    held_reason: HeldReason | None
    generation: int = 0
    not_sent: bool = False


@dataclass(frozen=True)
class HeldStep:
    job_id: str
    item_id: str
    step: str
    reason: HeldReason
    generation: int = 0  # of the send's idempotency key (what to ask the receiver about)
    # The row's version as the journal showed it; None where the runner reports a hold it has just
    # buffered (read the journal's held() for the version to decide on).
    version: str | None = field(default=None, compare=False)

    @property
    def key_to_ask(self) -> str | None:
        """The idempotency key to ask the receiver about; None for changed input, which is about the
        item's data, not about a send."""
        if self.reason != HeldReason.UNKNOWN_OUTCOME:
            return None
        return idempotency_key(self.job_id, self.item_id, self.step, self.generation)


# Every JobSummary.status, most urgent first (the order the page's filter offers them).
JOB_STATUSES = ("needs_review", "incomplete", "unfinished", "completed", "pruned")


@dataclass(frozen=True)
class JobSummary:
    job_id: str
    counts: Mapping[str, int]  # rows per status
    items: int
    held: int  # rows with a held reason
    unresolved: int  # side-effect rows neither SUCCEEDED nor held (e.g. left IN_FLIGHT by a crash)
    created_at: datetime
    updated_at: datetime
    pruned_at: datetime | None
    # When a run last went through the whole batch; None while one is under way or after one that
    # stopped ("mark success", on_kill, a timeout) or died part way.
    finished_at: datetime | None = None
    # The DAG that owns the job (recorded by its first run in Airflow); None for a job written outside
    # Airflow or by a release before versions.
    dag_id: str | None = None

    @property
    def settled(self) -> bool:
        return self.held == 0 and self.unresolved == 0

    @property
    def status(self) -> str:
        """``pruned``, ``needs_review`` (held steps), ``incomplete`` (failed or unresolved steps),
        ``unfinished`` (no run has gone through the whole batch: running now, or stopped or killed part
        way) or ``completed``: what the CLI's ``jobs`` and the "Resumable jobs" page show."""
        if self.pruned_at is not None:
            return "pruned"
        if self.held:
            return "needs_review"
        if self.unresolved or self.counts.get("FAILED", 0):
            return "incomplete"
        if self.finished_at is None:
            return "unfinished"
        return "completed"


@dataclass(frozen=True)
class Resolution:
    id: int
    job_id: str
    item_id: str
    step: str
    decision: str
    receipt: str | None
    note: str
    resolved_by: str
    resolved_at: datetime
    previous_status: str | None
    previous_held_reason: str | None

    def as_json(self) -> dict[str, Any]:
        """The audit row as every surface reports it (the resolve DAG's result, the page and its JSON)."""
        return {"audit_id": self.id, "job_id": self.job_id, "item_id": self.item_id, "step": self.step,
                "decision": self.decision, "receipt": self.receipt, "note": self.note,
                "resolved_by": self.resolved_by, "resolved_at": self.resolved_at.isoformat()}


def ts(value: float) -> datetime:
    """A journal timestamp (seconds since the epoch, on both backends) as an aware UTC datetime."""
    return datetime.fromtimestamp(float(value), tz=timezone.utc)


# How much of a version tables print, and the least a decision may carry: 8 hex digits make an accidental
# match with the row's next version a 1-in-4-billion chance. ``held --json`` prints it whole.
SHORT_VERSION_LENGTH = 8


def version_matches(seen: str, version: str) -> bool:
    """Whether a decision made on ``seen`` (a whole version, or the short form a table shows) is about the
    row whose version is ``version`` now."""
    return seen == version or (SHORT_VERSION_LENGTH <= len(seen) < len(version) and version.startswith(seen))


def version_text(counter: Any, created_at: Any) -> str:
    """A step row's version as people and surfaces see it: opaque, 16 hex digits.

    Derived from the row's write counter and its creation time, so a row that was pruned and written
    anew never shows a version an old decision could still carry.
    """
    return hashlib.blake2b(f"{int(counter)}:{float(created_at)!r}".encode(), digest_size=8).hexdigest()


def step_record(row: Any) -> StepRecord:
    """A ``steps`` row selected as :data:`~airflow_resumable.journal.statements.RECORD_COLUMNS`."""
    return StepRecord(
        job_id=row[0],
        item_id=row[1],
        step=row[2],
        side_effect=bool(row[3]),
        status=Status(row[4]),
        digest=row[5],
        receipt=row[6],
        output=None if row[7] is None else json.loads(row[7]),
        error_type=row[8],
        held_reason=None if row[9] is None else HeldReason(row[9]),
        new_digest=row[10],
        attempts=int(row[11]),
        created_at=ts(row[12]),
        updated_at=ts(row[13]),
        generation=int(row[14]),
        not_sent=bool(row[15]),
        version=version_text(row[16], row[12]),
    )


T = TypeVar("T")

# The largest page a paged read hands out (the UI page, the CLI and the JSON ask for 100 by default).
MAX_PAGE = 10_000


class Page(list[T], Generic[T]):
    """One page of a listing: the records, and ``next_cursor`` for the next page (``None`` on the last).

    The cursor is opaque text: pass it back as ``cursor=`` with the same filters. Pages are cut by the
    records' keys (never by position), so paging through a list that changes meanwhile shows every
    record that stays in it exactly once.
    """

    def __init__(self, records: Any = (), next_cursor: str | None = None) -> None:
        super().__init__(records)
        self.next_cursor = next_cursor

    def __repr__(self) -> str:
        return f"Page({list.__repr__(self)}, next_cursor={self.next_cursor!r})"
