"""The HTTP receiver behind a real rate limiter (Debian's nginx, ``limit_req``, 429 with ``Retry-After``):
a refused send is the receiver's word that it did not take it, so every run resumes with it - sent
again with the same key, never looked up, never held - and every item arrives exactly once."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from airflow_resumable.demo_receiver import serve
from airflow_resumable.exceptions import ReceiverRefused
from airflow_resumable.journal import StepJournal
from airflow_resumable.receivers.http import HttpReceiver
from airflow_resumable.runner import Step, run_batch
from tests.support.nginx import HOW_TO_INSTALL, RateLimiter, nginx_binary

pytestmark = pytest.mark.compat


@pytest.fixture
def limited_receiver(tmp_path, monkeypatch):
    """The demo receiver (no dedupe: a second delivery would count) behind nginx at 5 requests/s,
    burst 2; the Airflow connection ``limited`` points at nginx."""
    if nginx_binary() is None:
        pytest.fail(f"no nginx: {HOW_TO_INSTALL}")
    receiver = serve(0, tmp_path / "receiver.sqlite3", dedupe=False)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    limiter = RateLimiter(tmp_path / "nginx", receiver.server_address[1], rate=5, burst=2, retry_after=1)
    monkeypatch.setenv("AIRFLOW_CONN_LIMITED", json.dumps({"conn_type": "http", "host": limiter.url}))
    yield receiver, limiter
    limiter.stop()
    receiver.shutdown()
    receiver.server_close()


def test_a_batch_through_a_rate_limit_resumes_with_each_refused_send_and_delivers_once(limited_receiver, tmp_path):
    receiver, limiter = limited_receiver
    http = HttpReceiver("limited", timeout=10)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify)]
    items = [{"id": f"item-{n:02d}"} for n in range(20)]
    runs, refusals = 0, []
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        while True:
            runs += 1
            assert runs <= 40, "the batch never finished"
            try:
                result = run_batch(journal, "limited/job", items, steps, concurrency=4, settle_in_task=False)
                break
            except ReceiverRefused as refused:
                refusals.append(refused)
                time.sleep(refused.retry_after or 1)  # as a retry (RetryAfterPolicy) would wait
        assert (result.status, result.held) == ("completed", [])
        assert not journal.held("limited/job")
    seen = limiter.requests()
    assert refusals and all((r.status, r.retry_after) == (429, 1.0) for r in refusals)
    assert sum(status == 429 for _, _, status in seen) >= len(refusals)
    assert not [path for _, path, _ in seen if path.startswith("/notifications/")], "a refused send was looked up"
    with urllib.request.urlopen(f"http://127.0.0.1:{receiver.server_address[1]}/stats", timeout=5) as answer:
        delivered = json.loads(answer.read())  # the receiver's own count, behind nginx
    assert (delivered["items"], delivered["deliveries"], delivered["duplicates"]) == (20, 20, 0), delivered
    assert sum(method == "POST" and status == 200 for method, _, status in seen) == 20
