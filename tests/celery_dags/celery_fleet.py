"""A fleet: one big batch sharded over mapped task instances (tests/deployments/test_celery_fleet.py,
``make bench-fleet``).

* ``celery_fleet``: ``plan_shards`` returns a few small shard descriptors (``{"shard", "first",
  "count"}``); ``send`` is ``ResumableBatchOperator.partial(...).expand(items=...)`` over them, one
  mapped instance per shard on the shared journal. Each instance gets a *callable* that builds its
  shard's items when it runs: the items never pass through XCom, only the descriptors do. Each shard
  is a job of its own, ``celery_fleet/send/<run_id>/<map_index>``.
* ``celery_fleet_plain``: the same shards, mapped the same way, sent by a ``PythonOperator`` with a
  plain thread pool and no journal: what the sends cost without resumability.

Sizes come from the environment the deployment gives every component: ``RESUMABLE_FLEET_ITEMS``,
``RESUMABLE_FLEET_SHARDS``, ``RESUMABLE_FLEET_CONCURRENCY`` (sends in flight per instance). Both DAGs
send to the demo receiver (connection ``celery_receiver``) over one keep-alive connection per thread.
"""

from __future__ import annotations

import http.client
import json
import os
import threading
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta
from functools import cache
from typing import Any

from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG, BaseHook, task

from airflow_resumable.exceptions import ReceiverError
from airflow_resumable.operators.resumable_batch import ResumableBatchOperator
from airflow_resumable.receivers.http import HttpReceiver
from airflow_resumable.runner import Step, StepContext, idempotency_key

FLEET_DAG_ID = "celery_fleet"
PLAIN_DAG_ID = "celery_fleet_plain"
RECEIVER_CONN_ID = "celery_receiver"


def fleet_setting(name: str, default: int) -> int:
    return int(os.environ.get(f"RESUMABLE_FLEET_{name}", default))


@cache
def _receiver_address() -> tuple[str, int]:
    url = urllib.parse.urlsplit(BaseHook.get_connection(RECEIVER_CONN_ID).host)
    return url.hostname or "127.0.0.1", url.port or 80


class KeepAliveSender:
    """POSTs to the demo receiver, one keep-alive connection per thread. Not HttpHook: it opens a new
    session (and a new TCP connection) per send, which at thousands of sends a second would be most
    of what is measured. A reply that does not come is raised: the outcome is unknown."""

    def __init__(self) -> None:
        self._local = threading.local()

    def notify(self, item: Mapping[str, Any], ctx: StepContext) -> str:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(*_receiver_address(), timeout=30)
        body = json.dumps({"item_id": ctx.item_id, "step": ctx.step, "item": dict(item)})
        try:
            conn.request("POST", "/notifications", body=body,
                         headers={"Idempotency-Key": ctx.idempotency_key, "Content-Type": "application/json"})
            response = conn.getresponse()
            reply = response.read()
        except BaseException:
            self._local.conn = None  # a broken keep-alive connection is not reused
            conn.close()
            raise
        if response.status != 200:
            raise ReceiverError(response.status)
        return str(json.loads(reply)["receipt"])


sender = KeepAliveSender()
# The look-up by key after a crash: the demo receiver's GET /notifications/<key>. Its 404 is "cannot
# tell" here (lookup_authoritative is off): a send in flight at the kill that never arrived is held
# for a human, who settles it with the same look-up through the CLI.
receiver = HttpReceiver(RECEIVER_CONN_ID, timeout=10)


def validate(item: Mapping[str, Any], ctx: object) -> dict[str, bool]:
    return {"ok": item["amount"] >= 0}


def item_id(prefix: str, number: int) -> str:
    """Ids carry the DAG's prefix: the receiver counts deliveries per item id."""
    return f"{prefix}-{number:07d}"


def shard_items(prefix: str, shard: Mapping[str, int]) -> Iterator[dict[str, Any]]:
    """The shard's items, built where they are sent (a real DAG would read its slice of a file or a
    table here)."""
    for i in range(shard["first"], shard["first"] + shard["count"]):
        yield {"id": item_id(prefix, i), "amount": i}


def fleet_items(shard: Mapping[str, int]) -> Callable[[], Iterator[dict[str, Any]]]:
    """Mapped over the descriptors in the worker: the instance's ``items`` is this callable, called
    when the batch starts."""
    return lambda: shard_items("fleet", shard)


def plain_send(shard: int, first: int, count: int, **context: Any) -> int:
    """The same sends with no journal: validate and notify each item on a thread pool as wide as the
    resumable instance's ``concurrency``, the key worked out as the runner does."""
    job_id = f"{PLAIN_DAG_ID}/send/{context['run_id']}/{shard}"

    def one(item: dict[str, Any]) -> str:
        item_id = item["id"]
        validate(item, None)
        ctx = StepContext(job_id, item_id, "notify", "", idempotency_key(job_id, item_id, "notify"))
        return sender.notify(item, ctx)

    with ThreadPoolExecutor(max_workers=fleet_setting("CONCURRENCY", 16), thread_name_prefix="plain-send") as pool:
        sent = sum(1 for _ in pool.map(one, shard_items("plain", {"first": first, "count": count})))
    if sent != count:
        raise RuntimeError(f"shard {shard}: {sent} of {count} sends answered")
    return sent


@task
def plan_shards() -> list[dict[str, int]]:
    """The shard descriptors: a few integers each, all that goes through XCom."""
    total, shards = fleet_setting("ITEMS", 2_000), fleet_setting("SHARDS", 4)
    bounds = [total * k // shards for k in range(shards + 1)]
    return [{"shard": k, "first": bounds[k], "count": bounds[k + 1] - bounds[k]} for k in range(shards)]


retry_once = {"retries": 1, "retry_delay": timedelta(seconds=1)}

with DAG(FLEET_DAG_ID, schedule=None, start_date=datetime(2026, 1, 1), catchup=False, default_args=retry_once):
    ResumableBatchOperator.partial(
        task_id="send",
        steps=[Step("validate", validate), Step("notify", sender.notify, side_effect=True, verify=receiver.verify)],
        journal_conn_id="resumable_journal",
        concurrency=fleet_setting("CONCURRENCY", 16),
        progress_interval=10.0,
    ).expand(items=plan_shards().map(fleet_items))

with DAG(PLAIN_DAG_ID, schedule=None, start_date=datetime(2026, 1, 1), catchup=False):
    PythonOperator.partial(task_id="send", python_callable=plain_send).expand(op_kwargs=plan_shards())
