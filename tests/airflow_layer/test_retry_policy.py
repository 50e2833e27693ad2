"""RetryAfterPolicy (Airflow 3.3's task ``retry_policy``): the next try comes when the receiver asked,
not after the task's ``retry_delay`` - in ``airflow dags test`` against a real HTTP receiver that
refuses one send with a 429 and ``Retry-After: 2`` while the task's retry_delay is 30 minutes."""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from airflow_resumable._compat import airflow_version
from airflow_resumable.exceptions import ReceiverError, ReceiverRefused
from tests.airflow_layer.test_airflow_layer import output

if airflow_version() < (3, 3):
    pytest.skip("a task's retry_policy is Airflow 3.3's", allow_module_level=True)

from airflow.sdk import RetryAction, RetryDecision, RetryPolicy  # noqa: E402

from airflow_resumable.retry_policy import RetryAfterPolicy  # noqa: E402


def decide(policy, error):
    return policy.evaluate(error, try_number=1, max_tries=3)


def test_it_waits_what_the_receiver_asked_between_its_bounds():
    policy = RetryAfterPolicy(min_delay=timedelta(seconds=2), max_delay=timedelta(minutes=10))
    for asked, waited in ((7, 7), (0, 2), (86_400, 600)):
        decision = decide(policy, ReceiverRefused(429, retry_after=asked))
        assert (decision.action, decision.retry_delay) == (RetryAction.RETRY, timedelta(seconds=waited))
        assert f"asked to wait {asked:g} s" in decision.reason


def test_the_wait_is_found_on_the_error_a_task_error_was_raised_from():
    try:
        try:
            raise ReceiverRefused(429, retry_after=5)
        except ReceiverRefused as refused:
            raise RuntimeError("wrapped") from refused
    except RuntimeError as error:
        assert decide(RetryAfterPolicy(), error).retry_delay == timedelta(seconds=5)


def test_any_other_failure_retries_as_the_task_or_the_fallback_says():
    assert decide(RetryAfterPolicy(), ReceiverError(503)).action == RetryAction.DEFAULT
    assert decide(RetryAfterPolicy(), ReceiverRefused(429)).action == RetryAction.DEFAULT  # no Retry-After

    class FailFast(RetryPolicy):
        def evaluate(self, exception, try_number, max_tries, context=None):
            return RetryDecision.fail("no")

    assert decide(RetryAfterPolicy(fallback=FailFast()), ValueError("x")).action == RetryAction.FAIL


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_delay": timedelta(seconds=-1)}, "min_delay must be a timedelta of 0 or more"),
    ({"max_delay": 30}, "max_delay must be a timedelta"),
    ({"min_delay": timedelta(hours=1), "max_delay": timedelta(minutes=1)}, "is longer than max_delay"),
    ({"fallback": "retry"}, "fallback must be a RetryPolicy"),
])
def test_bad_bounds_are_refused_when_the_dag_is_parsed(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RetryAfterPolicy(**kwargs)


class Paced:
    """A receiver on 127.0.0.1 that refuses its third and fourth POSTs with a 429 and ``Retry-After: 2`` (the
    third item's two attempts: the try's ``max_attempts``) and takes every other one; it records when each
    POST came and with which key."""

    def __init__(self) -> None:
        self.posts: list[tuple[float, str, int]] = []  # (when, idempotency key, status answered)
        posts = self.posts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = 429 if len(posts) in (2, 3) else 200
                posts.append((time.monotonic(), self.headers["Idempotency-Key"], status))
                body = json.dumps({"receipt": f"r-{len(posts)}"} if status == 200 else {"error": "slow down"}).encode()
                self.send_response(status)
                if status == 429:
                    self.send_header("Retry-After", "2")
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def connection(self) -> str:
        return json.dumps({"conn_type": "http", "host": f"http://127.0.0.1:{self.server.server_address[1]}"})

    def taken(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for _, key, status in self.posts:
            if status == 200:
                counts[key] = counts.get(key, 0) + 1
        return counts

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.airflow
def test_the_next_try_comes_when_the_receiver_asked_not_after_the_retry_delay(airflow):
    receiver = Paced()
    try:
        airflow.env["AIRFLOW_CONN_PACED_RECEIVER"] = receiver.connection()
        done = airflow.run("dags", "test", "paced_retry", timeout=240)  # the task's retry_delay is 30 minutes
        assert done.returncode == 0, output(airflow)[-4000:]
    finally:
        receiver.close()
    assert airflow.task_states("paced_retry") == {("send", -1): ("success", 2)}
    log = output(airflow)
    assert "asked to wait 2 s (Retry-After)" in log, log[-4000:]
    assert "ReceiverUnavailableError" in log and "None of them was held" in log, log[-4000:]
    # Five items taken once each; the refused one was sent again in the try with its key after the 2 s the
    # receiver asked, refused again (its attempts ran out), and taken in try 2, 2 s or more after that.
    assert sorted(receiver.taken().values()) == [1] * 5
    refused_at, refused_key, _ = receiver.posts[2]
    again_at, again_key, _ = receiver.posts[3]
    (taken_at,) = [when for when, key, status in receiver.posts[4:] if key == refused_key and status == 200]
    assert again_key == refused_key and again_at - refused_at >= 2 and taken_at - again_at >= 2


def test_the_example_dag_retries_with_the_policy():
    from airflow_provider_resumable.example_dags import paced_retry

    policy = paced_retry.dag.task_dict["send"].retry_policy
    assert isinstance(policy, RetryAfterPolicy) and policy.max_delay == timedelta(minutes=10)
