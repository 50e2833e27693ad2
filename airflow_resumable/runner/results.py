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
    # Settlement in the task (SPEC §12): waits before a re-send or a look-up, sends made again in the
    # task (after a refusal, or an unknown outcome of an idempotent step), unknown outcomes the receiver
    # settled in the task, and items left for the next try after their attempts ran out.
    waits: int = 0
    resent_in_task: int = 0
    settled_in_task: int = 0
    gave_up: int = 0
    paused: float = 0.0  # seconds the receiver's pause has still to run (it asked to wait; 0: none)


@dataclass
class BatchResult:
    job_id: str
    status: str  # "completed" | "needs_review"
    executed_steps: int = 0
    skipped_steps: int = 0
    verified_steps: int = 0  # side-effect steps found by verify (counted in skipped_steps too)
    resent_steps: int = 0  # sends verify found NOT_DELIVERED, made again once (counted in executed_steps too)
    waits: int = 0  # waits before a re-send or a look-up in the task (settlement, SPEC §12)
    resent_in_task: int = 0  # sends made again in the task after a refusal (or an idempotent step's unknown outcome)
    settled_in_task: int = 0  # unknown outcomes of this run the receiver settled in the task (receipt or not delivered)
    gave_up: int = 0  # items left for the next try: their attempts ran out (FAILED, not held)
    held: list[HeldStep] = field(default_factory=list)
    items_total: int = 0
    items_completed: int = 0
    elapsed: float = 0.0
