"""ReviewHeldItemsOperator's parts that need no running Airflow: its arguments, the form and text it
puts before the human, and how a response becomes journal decisions (on a real SQLite journal). The
whole round trip through Airflow's Required actions is tests/test_browser.py's."""

from __future__ import annotations

import pytest

from airflow_resumable.journal import HeldReason, HeldStep, StepJournal
from airflow_resumable.operators.resolve import ResolutionRefused
from airflow_resumable.operators.review import (
    APPLY,
    LEAVE,
    LEAVE_HELD,
    ReviewHeldItemsOperator,
    decisions_from,
    review_body,
    review_params,
)
from airflow_resumable.runner import Step, idempotency_key, run_batch

JOB = "billing/send/manual__1"
UO, IC = HeldReason.UNKNOWN_OUTCOME, HeldReason.INPUT_CHANGED


def test_arguments_are_checked():
    from airflow.sdk import DAG

    with DAG("with_params", params={"region": "eu"}, schedule=None):  # a DAG's params reach every task
        ReviewHeldItemsOperator(task_id="review", batch_task_id="send")
    op = ReviewHeldItemsOperator(task_id="review", batch_task_id="send", assigned_users=[{"id": "a", "name": "a"}])
    assert (op.options, op.defaults, op.multiple) == ([APPLY, LEAVE], [LEAVE], False)
    assert {"job_id", "batch_task_id", "subject"} <= set(op.template_fields)
    for kwargs, message in [
        ({}, "exactly one of job_id= or batch_task_id="),
        ({"job_id": "j", "batch_task_id": "send"}, "exactly one of"),
        ({"job_id": "j", "options": ["x"]}, "options are set by ReviewHeldItemsOperator"),
        ({"job_id": "j", "body": "x"}, "body are set by"),
        ({"job_id": "j", "max_items": 0}, "max_items must be an integer from 1 to 200"),
        ({"job_id": "j", "max_items": True}, "max_items"),
    ]:
        with pytest.raises(ValueError, match=message):
            ReviewHeldItemsOperator(task_id="review", **kwargs)


def test_the_form_asks_one_decision_per_item_and_a_receipt_per_send():
    held = [HeldStep(JOB, "item-041", "notify", UO), HeldStep(JOB, "c", "validate", IC)]
    params = {name: p.serialize() for name, p in review_params(held).items()}
    assert list(params) == ["item_1", "receipt_1", "item_2", "note"]
    assert params["item_1"]["schema"]["enum"] == [LEAVE_HELD, "delivered", "not_delivered"]
    assert params["item_2"]["schema"]["enum"] == [LEAVE_HELD, "keep_previous_input", "use_new_input"]
    assert params["item_1"]["value"] == LEAVE_HELD and params["item_1"]["schema"]["title"] == "1. item-041 / notify"
    # Optional fields: Airflow's form requires a field whose type is only "string".
    assert params["receipt_1"]["schema"]["type"] == params["note"]["schema"]["type"] == ["null", "string"]


def test_the_text_names_each_item_and_the_key_of_its_generation():
    held = [HeldStep(JOB, "item-041", "notify", UO, generation=1), HeldStep(JOB, "x<img src=1>*y*", "validate", IC)]
    body = review_body(JOB, held, {}, more=3)
    assert idempotency_key(JOB, "item-041", "notify", 1) in body
    assert idempotency_key(JOB, "item-041", "notify") not in body
    assert "**item-041** / notify: unknown_outcome" in body
    assert "x\\<img src=1\\>\\*y\\*" in body and body.count("<") == body.count("\\<")  # an id is text, not markup
    assert "3 more held item(s)" in body and f"`{JOB}`" in body


def test_a_response_becomes_journal_decisions_all_or_nothing(tmp_path):
    items = [{"id": i} for i in ("a", "b", "c", "d")]

    def notify(item, ctx):
        if ctx.item_id in fail:
            raise TimeoutError()
        return f"r-{ctx.item_id}"

    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        fail = {"a", "b", "c"}
        for _ in range(3):  # each run fails at the next of a, b, c
            with pytest.raises(TimeoutError):
                run_batch(journal, JOB, items, [Step("notify", notify, side_effect=True)])
            fail.discard(next(r.item_id for r in journal.rows(JOB) if r.error_type and r.item_id in fail))
        held = run_batch(journal, JOB, items, [Step("notify", notify, side_effect=True)]).held
        assert [h.item_id for h in held] == ["a", "b", "c"]
        presented = [[h.item_id, h.step, h.reason.value, h.generation] for h in held]
        now = {(h.item_id, h.step): (h.reason.value, h.generation) for h in journal.held(JOB)}

        for bad, message in [
            ({"item_1": "deliverd"}, "item_1 \\(a / notify, unknown_outcome\\): decision 'deliverd' is not one of"),
            ({"item_2": "use_new_input"}, "decision 'use_new_input' is not one of leave_held, delivered, not_delivered"),
            ({"note": 5}, "note must be text"),
        ]:
            with pytest.raises(ResolutionRefused, match=message):
                decisions_from(presented, bad, JOB, now)
        # A hold that is no longer what was shown (here: another key generation) refuses the response.
        moved = {**now, ("b", "notify"): ("unknown_outcome", 1)}
        with pytest.raises(ResolutionRefused, match="item_2 \\(b / notify\\) changed since the review was asked"):
            decisions_from(presented, {"item_2": "not_delivered"}, JOB, moved)
        entries = decisions_from(presented, {"item_1": "delivered", "receipt_1": "R-1", "item_2": "not_delivered",
                                             "receipt_2": "ignored", "item_3": LEAVE_HELD, "note": "checked"}, JOB,
                                 now)
        assert entries == [
            {"job_id": JOB, "item_id": "a", "step": "notify", "decision": "delivered", "receipt": "R-1", "note": "checked"},
            {"job_id": JOB, "item_id": "b", "step": "notify", "decision": "not_delivered", "receipt": None,
             "note": "checked"},
        ]
        # A delivered without its receipt refuses the whole response: nothing changes.
        missing = decisions_from(presented, {"item_1": "not_delivered", "item_2": "delivered"}, JOB)
        with pytest.raises(ValueError):
            journal.apply_decisions(missing, resolved_by="admin")
        assert journal.resolutions(JOB) == [] and len(journal.held(JOB)) == 3
        done = journal.apply_decisions(entries, resolved_by="admin")
        assert [(r.item_id, r.decision, r.resolved_by) for r in done] == [("a", "delivered", "admin"),
                                                                          ("b", "not_delivered", "admin")]
        assert [h.item_id for h in journal.held(JOB)] == ["c"]
