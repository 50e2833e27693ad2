"""The decision table: what the runner does with one step, given the step's journal row.

The whole per-step state machine is :func:`decide`; everything else in the runner carries out its
answer.
"""

from __future__ import annotations

import enum

from airflow_resumable.journal import Status, StepState


class Action(str, enum.Enum):
    """What the runner does with one step."""

    RUN = "run"
    SKIP = "skip"
    VERIFY = "verify"
    HOLD_CHANGED = "hold_input_changed"


RUN, SKIP, VERIFY, HOLD_CHANGED = Action.RUN, Action.SKIP, Action.VERIFY, Action.HOLD_CHANGED


def decide(row: StepState | None, digest: str, side_effect: bool) -> Action:
    """What to do with one step, given its journal row (or None) and the item's digest now.

    | journal row                       | local step | side-effect step            |
    |-----------------------------------|------------|-----------------------------|
    | none                              | run        | run                         |
    | digest differs from the input's   | hold item (input_changed)                |
    | SUCCEEDED                         | skip       | skip                        |
    | FAILED, provably not sent         | run again  | run again (same key)        |
    | IN_FLIGHT or FAILED               | run again  | verify: receipt -> skip,    |
    |                                   |            | NOT_DELIVERED -> send once, |
    |                                   |            | else hold (unknown_outcome) |
    """
    if row is None:
        return RUN
    if row.digest != digest:
        return HOLD_CHANGED
    if row.status == Status.SUCCEEDED:
        return SKIP
    if row.not_sent and row.status == Status.FAILED:
        return RUN
    return VERIFY if side_effect else RUN
