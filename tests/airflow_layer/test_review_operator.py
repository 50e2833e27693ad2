"""ReviewHeldItemsOperator's parts that need no running Airflow: its arguments, the form and text it
puts before the human, and how a response becomes journal decisions (on a real SQLite journal). The
whole round trip through Airflow's Required actions is tests/faces/test_browser.py's."""

from __future__ import annotations

import json
from collections import Counter
from datetime import datetime, timezone

import pytest

from airflow_resumable.exceptions import ResolutionRefused
from airflow_resumable.journal import HeldReason, HeldStep, StepJournal
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
from tests.airflow_layer.test_sensor_journal import journal_arguments

pytestmark = pytest.mark.compat

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
                run_batch(journal, JOB, items, [Step("notify", notify, side_effect=True)], settle_in_task=False)
            fail.discard(next(r.item_id for r in journal.rows(JOB) if r.error_type and r.item_id in fail))
        held = run_batch(journal, JOB, items, [Step("notify", notify, side_effect=True)], settle_in_task=False).held
        assert [h.item_id for h in held] == ["a", "b", "c"]
        presented = [{"item_id": h.item_id, "step": h.step, "reason": h.reason.value, "version": h.version}
                     for h in journal.held(JOB)]

        for bad, message in [
            ({"item_1": "deliverd"}, "item_1 \\(a / notify, unknown_outcome\\): decision 'deliverd' is not one of"),
            ({"item_2": "use_new_input"}, "decision 'use_new_input' is not one of leave_held, delivered, not_delivered"),
            ({"note": 5}, "note must be text"),
        ]:
            with pytest.raises(ResolutionRefused, match=message):
                decisions_from(presented, bad, JOB)
        entries = decisions_from(presented, {"item_1": "delivered", "receipt_1": "R-1", "item_2": "not_delivered",
                                             "receipt_2": "ignored", "item_3": LEAVE_HELD, "note": "checked"}, JOB)
        # Each decision carries the version of the step as it was shown: the journal refuses it if it moved.
        assert entries == [
            {"job_id": JOB, "item_id": "a", "step": "notify", "decision": "delivered", "receipt": "R-1", "note": "checked",
             "version": presented[0]["version"]},
            {"job_id": JOB, "item_id": "b", "step": "notify", "decision": "not_delivered", "receipt": None,
             "note": "checked", "version": presented[1]["version"]},
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


# ------------------------------------------------------------------ the response path, on both engines


class TaskInstance:
    """What the review task reads and writes of its task instance: its XCom, stored as JSON as Airflow does."""

    map_index = -1

    def __init__(self) -> None:
        self.xcom: dict[str, object] = {}

    def xcom_push(self, key: str, value: object) -> None:
        self.xcom[key] = json.loads(json.dumps(value))

    def xcom_pull(self, task_ids: str, key: str, map_indexes: int | None = None) -> object:
        return self.xcom.get(key)


def response(user: str, **params_input: str) -> dict:
    """What Airflow hands the task when a person chose "Apply decisions" in Required actions."""
    return {"chosen_options": [APPLY], "params_input": params_input, "responded_at": datetime.now(timezone.utc),
            "responded_by_user": {"id": user, "name": user}}


@pytest.fixture
def waiting_for_a_human(monkeypatch):
    """HITLOperator.execute writes the Required action through Airflow's API and waits; here the review
    task hands over to "Airflow" at that point, and the test plays the human's response."""
    from airflow.providers.standard.operators.hitl import HITLOperator

    monkeypatch.setattr(HITLOperator, "execute", lambda self, context: "waiting for a human")


def test_the_review_task_refuses_a_response_to_a_hold_that_changed_since_it_was_shown(
    journal_location, monkeypatch, waiting_for_a_human,
):
    review_journal = journal_arguments(journal_location, monkeypatch)
    deliveries: Counter[str] = Counter()  # the receiver's own count of what it got, per idempotency key

    def send(item, ctx):
        deliveries[ctx.idempotency_key] += 1
        if ctx.item_id == "a":
            raise TimeoutError()  # it arrived; its reply never does: the outcome is unknown
        return f"rcpt-{ctx.item_id}"

    items, steps = [{"id": "a"}, {"id": "b"}], [Step("notify", send, side_effect=True)]
    key_a = idempotency_key(JOB, "a", "notify")
    with StepJournal(journal_location) as journal:
        with pytest.raises(TimeoutError):
            run_batch(journal, JOB, items, steps, settle_in_task=False)
        assert [h.item_id for h in run_batch(journal, JOB, items, steps, settle_in_task=False).held] == ["a"]

        # The review task shows item a to the on-call.
        review = ReviewHeldItemsOperator(task_id="review", job_id=JOB, **review_journal)
        ti = TaskInstance()
        assert review.execute({"ti": ti}) == "waiting for a human"

        # Meanwhile another person settles it "not delivered" (the receiver had not listed it yet), a run
        # sends it again, and that send's reply is lost too: it is held again - same reason, same key.
        journal.resolve(JOB, "a", "notify", delivered=False, resolved_by="carol", note="not in the receiver's list")
        with pytest.raises(TimeoutError):
            run_batch(journal, JOB, items, steps, settle_in_task=False)
        assert [h.item_id for h in run_batch(journal, JOB, items, steps, settle_in_task=False).held] == ["a"]
        assert deliveries[key_a] == 2
        before = (journal.rows(JOB), journal.resolutions(JOB))

        # The on-call's answer to what they were shown arrives now: applied, the next run would send item a
        # a third time.
        with pytest.raises(ResolutionRefused, match=f"{JOB} / a / notify changed since it was looked at") as refused:
            review.execute_complete({"ti": ti}, response("alice", item_1="not_delivered", note="not there"))
        message = str(refused.value)
        assert "refused as a whole" in message and "asks again about the holds as they are now" in message
        assert (journal.rows(JOB), journal.resolutions(JOB)) == before
        assert run_batch(journal, JOB, items, steps, settle_in_task=False).held  # still held: nothing is sent

        # The next try shows the hold as it is now; the answer to that is applied.
        retry = ReviewHeldItemsOperator(task_id="review", job_id=JOB, **review_journal)
        retry.execute({"ti": ti})
        done = retry.execute_complete({"ti": ti}, response("alice", item_1="delivered", receipt_1="rcpt-a"))
        assert (done["applied"], done["held"], done["responded_by"]) == (1, 0, "alice")
        assert run_batch(journal, JOB, items, steps, settle_in_task=False).status == "completed"
        assert [a.resolved_by for a in journal.resolutions(JOB)] == ["carol", "alice"]
    assert deliveries == {key_a: 2, idempotency_key(JOB, "b", "notify"): 1}  # the original and one re-send


def test_a_review_of_a_job_the_journal_does_not_have_fails_and_says_so(tmp_path, monkeypatch):
    """A mistyped job_id: the review must not succeed as "nothing held" (the DAG would go on as if the job had
    been reviewed); it fails naming the job, as the sensor does. A job with nothing held is still a success."""
    location = str(tmp_path / "journal.sqlite3")
    with StepJournal(location) as journal:
        run_batch(journal, JOB, [{"id": "a"}], [Step("notify", lambda item, ctx: "r", side_effect=True)],
                  settle_in_task=False)
    before = tmp_path.joinpath("journal.sqlite3").read_bytes()
    typo = ReviewHeldItemsOperator(task_id="review", job_id=JOB + "x", **journal_arguments(location, monkeypatch))
    with pytest.raises(ValueError, match=f"review: journal .* has no job '{JOB}x'; check the job_id"):
        typo.execute({})
    assert tmp_path.joinpath("journal.sqlite3").read_bytes() == before
    settled = ReviewHeldItemsOperator(task_id="review", job_id=JOB, **journal_arguments(location, monkeypatch))
    assert settled.execute({}) == {"job_id": JOB, "held": 0, "applied": 0}
