"""The article's scenario as DAGs: 50 items x 3 steps against the demo HTTP receiver.

* ``article_resumable``: ResumableBatchOperator with the HTTP notifier (retries=1). Arm a fault for
  item-041 on the receiver (``POST /faults``) to see try 1 fail there and try 2 resume.
* ``article_rerun_everything``: the same work with no journal: a retry starts again from item 1.
* ``article_review``: held items go to Airflow's own "Required actions" (``ReviewHeldItemsOperator``),
  then a second pass of the same job resumes.
* ``article_settled``: the same batch with the defaults: a fault is settled in the try it happens in
  (SPEC §12), by asking the receiver (its look-up is authoritative: it records before it answers).

The article's DAGs run with ``settle_in_task=False``: a failing send fails the try, as the article's
experiment (and its table) has it.

The receiver is the Airflow connection ``demo_receiver`` (e.g. ``AIRFLOW_CONN_DEMO_RECEIVER``).
Simulated waits as in the article: 1.5 ms per local step; the send is a real HTTP call.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pendulum
from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG

from airflow_resumable.operators.resumable_batch import ResumableBatchOperator
from airflow_resumable.operators.review import ReviewHeldItemsOperator
from airflow_resumable.receivers.http import HttpReceiver
from airflow_resumable.runner import Step, StepContext, idempotency_key

ITEMS = [{"id": f"item-{i:03d}", "amount": i * 100, "to": f"user{i}@example.test"} for i in range(1, 51)]
receiver = HttpReceiver("demo_receiver", timeout=5)
settling_receiver = HttpReceiver("demo_receiver", timeout=5, lookup_authoritative=True)
retry_once = {"retries": 1, "retry_delay": timedelta(seconds=0)}
START = pendulum.datetime(2026, 1, 1, tz="UTC")


def validate(item, ctx):
    time.sleep(0.0015)
    return {"ok": item["amount"] >= 0}


def transform(item, ctx):
    time.sleep(0.0015)
    return {"cents": item["amount"] * 100}


def rerun_everything(**context):
    """No journal: every try sends every item again. Returns the steps this try executed."""
    executed = 0
    job_id = f"article_rerun_everything/{context['run_id']}"
    for item in ITEMS:
        outputs: dict = {}
        for name, fn in (("validate", validate), ("transform", transform), ("notify_external", receiver.notify)):
            ctx = StepContext(job_id, item["id"], name, "", idempotency_key(job_id, item["id"], name), outputs)
            outputs[name] = fn(item, ctx)
            executed += 1
    return executed


with DAG("article_resumable", schedule=None, start_date=START, catchup=False,
         default_args=retry_once, tags=["resumable", "demo"]) as article_resumable:
    ResumableBatchOperator(
        task_id="send",
        items=ITEMS,
        steps=[Step("validate", validate), Step("transform", transform),
               Step("notify_external", receiver.notify, side_effect=True)],
        settle_in_task=False,
    )

with DAG("article_resumable_verify", schedule=None, start_date=START, catchup=False,
         default_args=retry_once, tags=["resumable", "demo"]) as article_resumable_verify:
    ResumableBatchOperator(task_id="send", items=ITEMS, validate=validate, transform=transform,
                           notify=receiver.notify, verify=receiver.verify, settle_in_task=False)

with DAG("article_rerun_everything", schedule=None, start_date=START, catchup=False,
         default_args=retry_once, tags=["demo"]) as article_rerun_everything:
    PythonOperator(task_id="send", python_callable=rerun_everything)

with DAG("article_review", schedule=None, start_date=START, catchup=False,
         default_args=retry_once, tags=["resumable", "demo"]) as article_review:
    article_steps = [Step("validate", validate), Step("transform", transform),
                     Step("notify_external", receiver.notify, side_effect=True)]
    send = ResumableBatchOperator(task_id="send", items=ITEMS, steps=article_steps, on_held="succeed",
                                  settle_in_task=False)
    # Who may answer: this DAG's permissions, narrowed further with assigned_users=[{"id": ..., "name": ...}].
    review = ReviewHeldItemsOperator(task_id="review", batch_task_id="send",
                                     subject="Held items of the article's batch")
    second_pass = ResumableBatchOperator(
        task_id="second_pass", items=ITEMS, steps=article_steps,
        batch_task_id="send", settle_in_task=False,
    )
    send >> review >> second_pass

with DAG("article_settled", schedule=None, start_date=START, catchup=False,
         default_args={"retries": 0}, tags=["resumable", "demo"]) as article_settled:
    ResumableBatchOperator(task_id="send", items=ITEMS, validate=validate, transform=transform,
                           notify=settling_receiver.notify, verify=settling_receiver.verify)
