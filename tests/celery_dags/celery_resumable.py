"""DAGs for the CeleryExecutor tests (tests/deployments/test_celery_deployment.py): 300 items to the demo HTTP
receiver (dedupe off), with a short pause per send so that a worker can be killed mid-batch.

* ``celery_shared``: the shared journal (connection ``resumable_journal``): a retry resumes on any worker.
* ``celery_local``: each worker's own SQLite journal ([resumable] journal_path differs per worker).
* ``celery_sensor``: a batch that leaves one send held, then a deferrable HeldItemSensor on the
  shared journal that waits in the triggerer until a human settles it.
"""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from airflow.sdk import DAG

from airflow_resumable.operators.resumable_batch import ResumableBatchOperator
from airflow_resumable.receivers.http import HttpReceiver
from airflow_resumable.runner import Step
from airflow_resumable.sensors.held_items import HeldItemSensor


def items(prefix: str, n: int = 300) -> list[dict]:
    """Item ids carry the DAG's prefix: the receiver counts deliveries per item id."""
    return [{"id": f"{prefix}-{i:03d}", "amount": i} for i in range(1, n + 1)]


receiver = HttpReceiver("celery_receiver", timeout=10)
retry_once = {"retries": 1, "retry_delay": timedelta(seconds=1)}


def validate(item, ctx):
    return {"ok": item["amount"] > 0}


def notify(item, ctx):
    time.sleep(0.03)  # a receiver that takes its time: the batch runs long enough to be interrupted
    return receiver.notify(item, ctx)


def steps(with_verify: bool) -> list[Step]:
    return [Step("validate", validate),
            Step("notify_external", notify, side_effect=True, verify=receiver.verify if with_verify else None)]


with DAG("celery_shared", schedule=None, start_date=datetime(2026, 1, 1), catchup=False, default_args=retry_once):
    ResumableBatchOperator(task_id="send", items=items("shared"), steps=steps(True), journal_conn_id="resumable_journal",
                           progress_interval=1.0, settle_in_task=False)

with DAG("celery_local", schedule=None, start_date=datetime(2026, 1, 1), catchup=False, default_args=retry_once):
    ResumableBatchOperator(task_id="send", items=items("local"), steps=steps(True), progress_interval=1.0,
                           settle_in_task=False)

with DAG("celery_sensor", schedule=None, start_date=datetime(2026, 1, 1), catchup=False, default_args=retry_once):
    # Try 1 fails at the send whose reply is lost; try 2 holds it (no verify) and succeeds.
    batch = ResumableBatchOperator(task_id="send", items=items("sensor", 20), steps=steps(False),
                                   journal_conn_id="resumable_journal", on_held="succeed", settle_in_task=False)
    wait = HeldItemSensor(task_id="wait_for_settled", batch_task_id="send", journal_conn_id="resumable_journal",
                          deferrable=True, poke_interval=2, timeout=600)
    batch >> wait
