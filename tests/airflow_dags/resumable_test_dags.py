"""DAGs the Airflow tests run with `airflow dags test` (see tests/test_airflow_*.py)."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

from _article import (
    items,
    items_bad_once,
    notify,
    restore_journal_backup,
    steps,
    transform,
    unblock_journal,
    validate,
    verify,
    verify_three_way,
)
from airflow.sdk import DAG, task

from airflow_resumable._compat import airflow_version
from airflow_resumable.operators.resolve import ResolveOperator
from airflow_resumable.operators.resumable_batch import ResumableBatchOperator
from airflow_resumable.receivers.http import HttpReceiver
from airflow_resumable.sensors.held_items import HeldItemSensor

defaults = {"retries": 1, "retry_delay": timedelta(seconds=0)}
start = datetime(2026, 1, 1)

with DAG("article_verify", schedule=None, start_date=start, default_args=defaults, catchup=False):
    ResumableBatchOperator(task_id="send", items=items(), steps=steps(with_verify=True), settle_in_task=False)

with DAG("article_concurrent", schedule=None, start_date=start, default_args=defaults, catchup=False):
    ResumableBatchOperator(task_id="send", items=items(), steps=steps(with_verify=True), concurrency=8, settle_in_task=False)

# Three retries, but a hold with no verify fails at once: no retry can settle it.
with DAG("article_hold", schedule=None, start_date=start, default_args={**defaults, "retries": 3}, catchup=False):
    ResumableBatchOperator(task_id="send", items=items(), steps=steps(with_verify=False), settle_in_task=False)

with DAG("article_shorthand", schedule=None, start_date=start, default_args=defaults, catchup=False):
    ResumableBatchOperator(task_id="send", items=items(), validate=validate, transform=transform,
                           notify=notify, verify=verify, settle_in_task=False)

with DAG("article_sensor", schedule=None, start_date=start, default_args=defaults, catchup=False):
    first = ResumableBatchOperator(task_id="send", items=items(), steps=steps(with_verify=False),
                                   on_held="succeed", settle_in_task=False)
    wait = HeldItemSensor(task_id="wait_for_resolution", batch_task_id="send", poke_interval=1,
                          timeout=300)
    second = ResumableBatchOperator(
        task_id="second_pass", items=items(), steps=steps(with_verify=False),
        batch_task_id="send", settle_in_task=False
    )
    first >> wait >> second

with DAG("article_sensor_verify", schedule=None, start_date=start, default_args=defaults, catchup=False):
    first = ResumableBatchOperator(task_id="send", items=items(), steps=steps(with_verify=False),
                                   on_held="succeed", settle_in_task=False)
    first >> HeldItemSensor(task_id="wait_for_receipt", batch_task_id="send", verify=verify,
                            poke_interval=1, timeout=300)

with DAG("article_wrong_worker", schedule=None, start_date=start, default_args=defaults, catchup=False):
    ResumableBatchOperator(task_id="send", items=items(), steps=steps(with_verify=False), settle_in_task=False)

with DAG("article_wrong_worker_afresh", schedule=None, start_date=start, default_args=defaults, catchup=False):
    ResumableBatchOperator(task_id="send", items=items(), steps=steps(with_verify=False), start_afresh=True,
                           settle_in_task=False)

# Found in hardening: try 1 fails before writing anything; try 2 on the same worker must run.
with DAG("guard_bad_item_once", schedule=None, start_date=start, default_args=defaults, catchup=False):
    ResumableBatchOperator(task_id="send", items=items_bad_once, steps=steps(with_verify=False), settle_in_task=False)

with DAG("guard_journal_unopenable_once", schedule=None, start_date=start, default_args=defaults, catchup=False):
    ResumableBatchOperator(task_id="send", items=items(), steps=steps(with_verify=False),
                           on_retry_callback=unblock_journal, settle_in_task=False)

with DAG("article_mapped", schedule=None, start_date=start, default_args=defaults, catchup=False):
    chunks = [items(10, prefix=f"chunk{c}") for c in range(4)]
    ResumableBatchOperator.partial(task_id="send", steps=steps(with_verify=True)).expand(items=chunks)

# A shared journal on PostgreSQL: the connection comes from the environment (AIRFLOW_CONN_RESUMABLE_JOURNAL).
with DAG("article_shared", schedule=None, start_date=start, default_args=defaults, catchup=False):
    first = ResumableBatchOperator(task_id="send", items=items(), steps=steps(with_verify=False),
                                   journal_conn_id="resumable_journal", on_held="succeed", settle_in_task=False)
    wait = HeldItemSensor(task_id="wait_for_resolution", batch_task_id="send", journal_conn_id="resumable_journal",
                          poke_interval=1, timeout=300)
    second = ResumableBatchOperator(
        task_id="second_pass", items=items(), steps=steps(with_verify=False), journal_conn_id="resumable_journal",
        batch_task_id="send", settle_in_task=False
    )
    first >> wait >> second

with DAG("article_shared_plain", schedule=None, start_date=start, default_args=defaults, catchup=False):
    ResumableBatchOperator(task_id="send", items=items(), steps=steps(with_verify=False),
                           journal_conn_id="resumable_journal", settle_in_task=False)

# Found in hardening: a team's own resolve DAG settles only its DAGs' jobs.
with DAG("resolve_team_a", schedule=None, start_date=start, catchup=False):
    ResolveOperator(task_id="resolve", job_dag_ids=["article_verify", "article_hold"])


def slow_notify(item, ctx):
    time.sleep(0.02)  # 20 ms per send, as a real receiver might take
    return notify(item, ctx)


# Stop means stop: "mark failed" / "mark success" / Clear reach the task as SIGTERM (on_kill).
for _concurrency in (1, 16):
    with DAG(f"stop_c{_concurrency}", schedule=None, start_date=start, default_args={"retries": 0}, catchup=False):
        ResumableBatchOperator(task_id="send", items=items(300), validate=validate, notify=slow_notify,
                               concurrency=_concurrency, settle_in_task=False)


# A receiver that refuses a send for now (HTTP 429, Retry-After) more often than the try's attempts allow:
# the try ends with ReceiverUnavailableError, and the next try comes when the receiver asked, not after the
# task's 30-minute retry_delay (Airflow 3.3's retry_policy; the connection from the environment).
if airflow_version() >= (3, 3):
    from airflow_resumable.retry_policy import RetryAfterPolicy

    paced = HttpReceiver("paced_receiver", timeout=10)
    with DAG("paced_retry", schedule=None, start_date=start, catchup=False,
             default_args={"retries": 1, "retry_delay": timedelta(minutes=30)}):
        ResumableBatchOperator(task_id="send", items=[{"id": f"item-{n}"} for n in range(1, 6)],
                               notify=paced.notify, verify=paced.verify, max_attempts=2,
                               retry_policy=RetryAfterPolicy())

# 300 items through a real rate limit (nginx; the connection ``limited`` from the environment), with the
# defaults and no retries: settled in the task, the first try delivers them all.
_limited = HttpReceiver("limited", timeout=30)
with DAG("paced_limit", schedule=None, start_date=start, catchup=False, default_args={"retries": 0}):
    ResumableBatchOperator(task_id="send", items=[{"id": f"item-{n:03d}"} for n in range(300)],
                           notify=_limited.notify, verify=_limited.verify, concurrency=8)

# SPEC §13: 200 items whose journal a test restores from a backup; the look-up is authoritative.
with DAG("journal_behind", schedule=None, start_date=start, default_args={"retries": 0}, catchup=False):
    ResumableBatchOperator(task_id="send", items=items(200), validate=validate, transform=transform, notify=notify,
                           verify=verify_three_way, settle_in_task=False)

with DAG("journal_behind_shared", schedule=None, start_date=start, default_args={"retries": 0}, catchup=False):
    ResumableBatchOperator(task_id="send", items=items(200), validate=validate, transform=transform, notify=notify,
                           verify=verify_three_way, settle_in_task=False, journal_conn_id="resumable_journal")

# A later pass (batch_task_id) whose journal went back after the batch task finished.
with DAG("journal_behind_two_passes", schedule=None, start_date=start, default_args={"retries": 0}, catchup=False):
    sent = ResumableBatchOperator(task_id="send", items=items(200), validate=validate, transform=transform,
                                  notify=notify, verify=verify_three_way, settle_in_task=False)
    restored = task(task_id="restore_journal")(restore_journal_backup)()
    again = ResumableBatchOperator(task_id="second_pass", items=items(200), validate=validate, transform=transform,
                                   notify=notify, verify=verify_three_way, settle_in_task=False, batch_task_id="send")
    sent >> restored >> again
