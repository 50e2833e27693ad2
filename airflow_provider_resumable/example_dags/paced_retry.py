"""A batch to a receiver that limits its rate. A try settles the receiver's "not now" itself (HTTP 429:
sent again after its ``Retry-After``, at its pace); when the receiver keeps refusing past the try's
attempts, or asks to wait longer than a try waits, the try fails with ``ReceiverUnavailableError``
carrying the receiver's last ``Retry-After`` - and the next try comes when the receiver asked, not
after the task's ``retry_delay`` (Airflow 3.3's task ``retry_policy``), and resumes where this one
stopped.

* ``receiver_paced_retry``: 50 items to the demo receiver (Airflow connection ``demo_receiver``).
"""

from __future__ import annotations

from datetime import timedelta

import pendulum
from airflow.sdk import DAG

from airflow_resumable._compat import airflow_version
from airflow_resumable.operators.resumable_batch import ResumableBatchOperator
from airflow_resumable.receivers.http import HttpReceiver

if airflow_version() >= (3, 3):
    from airflow_resumable.retry_policy import RetryAfterPolicy

    receiver = HttpReceiver("demo_receiver", timeout=5)
    with DAG(
        "receiver_paced_retry",
        schedule=None,
        start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
        catchup=False,
        default_args={"retries": 5, "retry_delay": timedelta(minutes=5)},
        tags=["resumable", "example"],
    ) as dag:
        ResumableBatchOperator(
            task_id="send",
            items=[{"id": f"item-{i:03d}", "amount": i * 100} for i in range(1, 51)],
            notify=receiver.notify,
            verify=receiver.verify,
            retry_policy=RetryAfterPolicy(max_delay=timedelta(minutes=10)),
        )
