"""The decision table, row by row: what the runner does with one step, given its journal row.

| journal row                       | local step | side-effect step            |
|-----------------------------------|------------|-----------------------------|
| none                              | run        | run                         |
| digest differs from the input's   | hold item (input_changed)                |
| SUCCEEDED                         | skip       | skip                        |
| IN_FLIGHT or FAILED               | run again  | verify                      |

A held reason already on the row changes nothing here: the runner re-decides from status and digest
(a held send is verified again; an input that went back to the journaled one is skipped).
"""

from __future__ import annotations

import pytest

from airflow_resumable.journal import HeldReason, Status, StepState
from airflow_resumable.runner import Action, decide

pytestmark = pytest.mark.core

SAME, OTHER = "a" * 64, "b" * 64


def row(status: Status, digest: str = SAME, held: HeldReason | None = None) -> StepState:
    return StepState(status, digest, '"out"', held)


@pytest.mark.parametrize("side_effect", [False, True])
def test_no_row_runs_the_step(side_effect):
    assert decide(None, SAME, side_effect) is Action.RUN


@pytest.mark.parametrize("status", list(Status))
@pytest.mark.parametrize("side_effect", [False, True])
def test_a_different_digest_holds_the_item_whatever_the_status(status, side_effect):
    assert decide(row(status, OTHER), SAME, side_effect) is Action.HOLD_CHANGED


@pytest.mark.parametrize("side_effect", [False, True])
def test_succeeded_with_the_same_input_is_skipped(side_effect):
    assert decide(row(Status.SUCCEEDED), SAME, side_effect) is Action.SKIP


@pytest.mark.parametrize("status", [Status.IN_FLIGHT, Status.FAILED])
def test_an_unfinished_local_step_runs_again(status):
    assert decide(row(status), SAME, False) is Action.RUN


@pytest.mark.parametrize("status", [Status.IN_FLIGHT, Status.FAILED])
def test_an_unfinished_send_is_verified_never_sent(status):
    assert decide(row(status), SAME, True) is Action.VERIFY


@pytest.mark.parametrize(
    ("state", "side_effect", "action"),
    [
        (row(Status.IN_FLIGHT, held=HeldReason.UNKNOWN_OUTCOME), True, Action.VERIFY),  # asked again
        (row(Status.FAILED, held=HeldReason.UNKNOWN_OUTCOME), True, Action.VERIFY),
        (row(Status.SUCCEEDED, held=HeldReason.INPUT_CHANGED), False, Action.SKIP),  # input went back
        (row(Status.SUCCEEDED, OTHER, held=HeldReason.INPUT_CHANGED), True, Action.HOLD_CHANGED),  # still changed
    ],
)
def test_a_held_row_is_decided_again_from_its_status_and_digest(state, side_effect, action):
    assert decide(state, SAME, side_effect) is action


def test_every_cell_of_the_table_is_covered():
    """Control: the table has exactly these outcomes, so a new action cannot slip in untested."""
    outcomes = {
        decide(state, SAME, side)
        for side in (False, True)
        for state in [None, *(row(s, d) for s in Status for d in (SAME, OTHER))]
    }
    assert outcomes == set(Action)


def test_the_key_a_person_asks_the_receiver_about_is_the_sends_key_of_its_generation():
    from datetime import datetime, timezone

    from airflow_resumable.journal import HeldStep, StepRecord
    from airflow_resumable.runner import idempotency_key

    now = datetime.now(timezone.utc)

    def record(side_effect: bool, generation: int) -> StepRecord:
        return StepRecord("job", "i1", "notify", side_effect, Status.FAILED, SAME, None, None, "TimeoutError",
                          HeldReason.UNKNOWN_OUTCOME, None, 1, now, now, generation=generation)

    assert record(True, 0).key_to_ask == idempotency_key("job", "i1", "notify")
    assert record(True, 2).key_to_ask == idempotency_key("job", "i1", "notify", 2) != record(True, 0).key_to_ask
    assert record(False, 0).key_to_ask is None  # a local step sends nothing
    assert HeldStep("job", "i1", "notify", HeldReason.UNKNOWN_OUTCOME, 1).key_to_ask == idempotency_key(
        "job", "i1", "notify", 1)
    assert HeldStep("job", "i1", "notify", HeldReason.INPUT_CHANGED).key_to_ask is None  # about the data
