"""SPEC §12 at full size, against real servers started here: 2,000 items through ``HttpReceiver`` at
concurrency 16 to the demo receiver (dedupe off: a second delivery would count) behind Debian's nginx at
100 requests/s (``burst=10 nodelay``, 429 with ``Retry-After: 1``), and behind a proxy that fails 10 % of
requests at random. One run each, with the defaults: every item delivered exactly once, none held.

The sizes and the nginx limit are the issue's; each run takes ~20 s (2,000 sends at 100/s).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from airflow_resumable.demo_receiver import serve
from airflow_resumable.journal import StepJournal
from airflow_resumable.receivers.http import HttpReceiver
from airflow_resumable.runner import Settlement, Step, run_batch
from tests.support.fault_proxy import FaultProxy
from tests.support.nginx import HOW_TO_INSTALL, RateLimiter, nginx_binary

ROOT = Path(__file__).resolve().parents[2]
ITEMS = [{"id": f"item-{n:05d}"} for n in range(2000)]


def receiver_stats(server) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{server.server_address[1]}/stats", timeout=10) as answer:
        return json.loads(answer.read())


@pytest.fixture
def demo_receiver(tmp_path):
    servers = []

    def start(*, dedupe: bool = False):
        server = serve(0, tmp_path / f"receiver-{len(servers)}.sqlite3", dedupe=dedupe)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def limited(tmp_path, demo_receiver, monkeypatch):
    """The demo receiver behind nginx at 100 requests/s; the connection ``limited`` points at nginx."""
    if nginx_binary() is None:
        pytest.fail(f"no nginx: {HOW_TO_INSTALL}")
    receiver = demo_receiver()
    limiter = RateLimiter(tmp_path / "nginx", receiver.server_address[1], rate=100, burst=10, retry_after=1)
    monkeypatch.setenv("AIRFLOW_CONN_LIMITED", json.dumps({"conn_type": "http", "host": limiter.url}))
    yield receiver, limiter
    limiter.stop()


def sends(limiter: RateLimiter) -> Counter:
    """The POSTs nginx answered, by status (200: it reached the receiver; 429: refused)."""
    return Counter(status for method, _, status in limiter.requests() if method == "POST")


def test_defaults_only_2000_items_behind_a_100_per_second_limit_go_through_in_one_run(limited, tmp_path):
    receiver, limiter = limited
    http = HttpReceiver("limited", timeout=30)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify)]
    started = time.monotonic()
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        result = run_batch(journal, "paced/defaults", ITEMS, steps, concurrency=16)
        assert not journal.open_rows("paced/defaults")
    elapsed = time.monotonic() - started
    assert (result.status, result.held, result.items_completed, result.gave_up) == ("completed", [], 2000, 0)
    stats = receiver_stats(receiver)
    assert (stats["items"], stats["deliveries"], stats["duplicates"]) == (2000, 2000, 0), stats
    seen = limiter.requests()
    assert not [path for method, path, _ in seen if method == "GET" and path.startswith("/notifications/")], \
        "a refused send was looked up"
    posts = sends(limiter)
    assert posts[200] == 2000
    print(f"\ndefaults: 2,000 items in {elapsed:.1f} s ({2000 / elapsed:.0f}/s against a 100/s limit); "
          f"POSTs {sum(posts.values())}, 429s {posts[429]}; waits {result.waits}, re-sent {result.resent_in_task}")


def test_with_the_rate_configured_few_sends_are_refused(limited, tmp_path):
    receiver, limiter = limited
    http = HttpReceiver("limited", timeout=30)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify, max_sends_per_second=100)]
    started = time.monotonic()
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        result = run_batch(journal, "paced/rate", ITEMS, steps, concurrency=16)
    elapsed = time.monotonic() - started
    assert (result.status, result.held, result.items_completed) == ("completed", [], 2000)
    stats = receiver_stats(receiver)
    assert (stats["items"], stats["deliveries"], stats["duplicates"]) == (2000, 2000, 0), stats
    posts = sends(limiter)
    assert posts[429] <= 0.10 * sum(posts.values()), posts
    print(f"\nat 100/s configured: {elapsed:.1f} s, POSTs {sum(posts.values())}, 429s {posts[429]}")


def test_four_runners_on_one_postgresql_journal_share_one_limit(limited, postgres_url):
    receiver, limiter = limited
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    started = time.time()
    runners = [subprocess.Popen([sys.executable, "-m", "tests.support.paced_runner", postgres_url, f"fleet/{n}",
                                 str(n * 500), "500", "100"], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
               for n in range(4)]
    results = []
    for runner in runners:
        out, _ = runner.communicate(timeout=600)
        assert runner.returncode == 0, out
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [(r["status"], r["held"], r["items_completed"]) for r in results] == [("completed", 0, 500)] * 4
    stats = receiver_stats(receiver)
    assert (stats["items"], stats["deliveries"], stats["duplicates"]) == (2000, 2000, 0), stats
    timed = [(status, at) for method, _, status, at in limiter.timed_requests() if method == "POST" and at >= started]
    posts = Counter(status for status, _ in timed)
    assert posts[429] <= 0.10 * sum(posts.values()), posts
    delivered = sorted(at for status, at in timed if status == 200)
    rate = (len(delivered) - 1) / (delivered[-1] - delivered[0])
    # One limit for the fleet: four runners at 100/s each would go at up to 400/s.
    assert rate <= 100 * 1.1, f"{rate:.0f} sends/s reached nginx"
    print(f"\nfleet of 4: {rate:.0f} sends/s at nginx, POSTs {sum(posts.values())}, 429s {posts[429]}")


@pytest.fixture
def faulty(tmp_path, demo_receiver, monkeypatch):
    """Make the demo receiver (dedupe as asked) and a proxy failing 10 % of requests in front of it; the
    connection ``faulty`` points at the proxy, with the demo receiver's authoritative look-up."""
    proxies = []

    def start(*, dedupe: bool):
        receiver = demo_receiver(dedupe=dedupe)
        proxy = FaultProxy(receiver.server_address[1], failure_rate=0.10)
        proxies.append(proxy)
        monkeypatch.setenv("AIRFLOW_CONN_FAULTY", json.dumps(
            {"conn_type": "http", "host": proxy.url, "extra": {"lookup_authoritative": True}}))
        return receiver, proxy

    yield start
    for proxy in proxies:
        proxy.stop()


def test_a_receiver_failing_one_request_in_ten_is_settled_in_one_run_with_an_authoritative_look_up(faulty,
                                                                                                  tmp_path):
    receiver, proxy = faulty(dedupe=False)
    http = HttpReceiver("faulty", timeout=30)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify)]
    # An item's attempts (sends and look-ups) each fail about one time in six here (a send's failure takes
    # its look-up's chance too): six in a row for one of 1,000 items came up about once in 20 runs, and
    # the item was then (rightly) left for the next try. Twelve attempts make that about one in 10^6.
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        result = run_batch(journal, "faulty/lookup", ITEMS[:1000], steps, concurrency=16,
                           settle_in_task=Settlement(max_attempts=12))
    assert (result.status, result.held, result.items_completed) == ("completed", [], 1000)
    stats = receiver_stats(receiver)
    assert (stats["items"], stats["duplicates"]) == (1000, 0), stats
    assert proxy.counts["refused_503"] > 20 and proxy.counts["reply_dropped"] > 20, proxy.counts
    assert proxy.counts["GET"] > 0  # the unknown outcomes were looked up (and some look-ups failed too)
    print(f"\n10 % faults, authoritative look-up: {proxy.counts}; settled in the task {result.settled_in_task}")


def test_an_idempotent_step_and_a_deduping_receiver_need_no_look_up(faulty, tmp_path):
    receiver, proxy = faulty(dedupe=True)
    http = HttpReceiver("faulty", timeout=30)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify, idempotent=True)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        result = run_batch(journal, "faulty/idempotent", ITEMS[:1000], steps, concurrency=16)
    assert (result.status, result.held, result.items_completed) == ("completed", [], 1000)
    assert receiver_stats(receiver)["items"] == 1000
    assert proxy.counts["GET"] == 0 and result.resent_in_task > 0, proxy.counts


@pytest.mark.airflow
def test_through_airflow_a_batch_behind_the_limit_succeeds_in_its_first_try(airflow, demo_receiver, tmp_path):
    """``airflow dags test`` of a batch task with the defaults and no retries, behind nginx at 20/s."""
    from tests.airflow_layer.test_airflow_layer import output

    if nginx_binary() is None:
        pytest.fail(f"no nginx: {HOW_TO_INSTALL}")
    receiver = demo_receiver()
    limiter = RateLimiter(tmp_path / "nginx", receiver.server_address[1], rate=20, burst=5, retry_after=1)
    try:
        airflow.env["AIRFLOW_CONN_LIMITED"] = json.dumps({"conn_type": "http", "host": limiter.url})
        done = airflow.run("dags", "test", "paced_limit", timeout=300)
        assert done.returncode == 0, output(airflow)[-4000:]
    finally:
        limiter.stop()
    assert airflow.task_states("paced_limit") == {("send", -1): ("success", 1)}
    stats = receiver_stats(receiver)
    assert (stats["items"], stats["deliveries"], stats["duplicates"]) == (300, 300, 0), stats
    assert sends(limiter)[429] > 0, "the limit was never met: the test proves nothing"
    assert "settled in the task" in output(airflow)


def test_a_receiver_down_longer_than_the_attempts_stops_the_try_and_the_next_try_resumes(tmp_path, monkeypatch):
    """Nothing listens on the receiver's port: each send is refused before a byte is written. The try stops
    after a bounded number of attempts, says what to do, holds nothing; once the receiver is up, the next
    try delivers every item once."""
    from airflow_resumable.exceptions import ReceiverUnavailableError
    from tests.support.postgres_server import free_port

    port = free_port()
    monkeypatch.setenv("AIRFLOW_CONN_DOWN", json.dumps({"conn_type": "http", "host": f"http://127.0.0.1:{port}"}))
    http = HttpReceiver("down", timeout=5)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify)]
    settlement = Settlement(max_attempts=3, first_backoff=0.1, max_backoff=0.4)
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        started = time.monotonic()
        with pytest.raises(ReceiverUnavailableError, match="receiver unavailable: 200 item\\(s\\) waiting") as down:
            run_batch(journal, "down/job", ITEMS[:200], steps, concurrency=8, settle_in_task=settlement)
        assert time.monotonic() - started < 60
        assert (down.value.reason, down.value.items_waiting) == ("receiver_failing", 200)
        assert "retry of this task resumes them" in str(down.value)
        assert not journal.held("down/job") and all(r.not_sent for r in journal.rows("down/job"))
        tried = len(journal.rows("down/job"))  # a round of attempts takes at most concurrency + a quarter more
        assert tried <= (settlement.max_attempts + 1) * 10, f"{tried} of 200 items tried: a burn-through"
        server = serve(port, tmp_path / "receiver.sqlite3", dedupe=False)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            result = run_batch(journal, "down/job", ITEMS[:200], steps, concurrency=8)
            assert (result.status, result.held, result.items_completed) == ("completed", [], 200)
            stats = receiver_stats(server)
        finally:
            server.shutdown()
            server.server_close()
    assert (stats["items"], stats["deliveries"], stats["duplicates"]) == (200, 200, 0), stats
