"""What a run reports: :class:`BatchProgress` while it goes, :class:`BatchResult` when it ends."""

from __future__ import annotations

from dataclasses import dataclass, field

from airflow_resumable.journal import HeldStep


@dataclass(frozen=True)
class BatchProgress:
    """How far a run is, reported every ``progress_interval`` seconds, when a step fails, and at the end."""

    items_done: int  # items completed or held by this run so far (not those merely read in)
    items_total: int | None  # None when the items' count is not known up front (a generator)
    executed_steps: int
    skipped_steps: int
    held: int
    elapsed: float
    verified_steps: int = 0


@dataclass
class BatchResult:
    job_id: str
    status: str  # "completed" | "needs_review"
    executed_steps: int = 0
    skipped_steps: int = 0
    verified_steps: int = 0  # side-effect steps found by verify (counted in skipped_steps too)
    resent_steps: int = 0  # sends verify found NOT_DELIVERED, made again once (counted in executed_steps too)
    held: list[HeldStep] = field(default_factory=list)
    items_total: int = 0
    items_completed: int = 0
    elapsed: float = 0.0
