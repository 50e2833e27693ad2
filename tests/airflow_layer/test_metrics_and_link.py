"""Batch counters reach a real StatsD socket, and the batch task's "Resumable job" extra link
points at its job page - both from a real `airflow dags test` run with retries."""

from __future__ import annotations

import socket
import threading
from collections import defaultdict
from urllib.parse import quote

import pytest

from tests.airflow_layer.test_airflow_layer import arm, output

pytestmark = [pytest.mark.airflow, pytest.mark.compat]


class StatsdSink:
    """A UDP socket on 127.0.0.1 that keeps every StatsD line it receives."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.lines: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(65535)
            except TimeoutError:
                continue
            self.lines += data.decode(errors="replace").splitlines()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()

    def counters(self, prefix: str) -> dict[str, list[int]]:
        found: dict[str, list[int]] = defaultdict(list)
        for line in self.lines:
            name, _, rest = line.partition(":")
            value, _, kind = rest.partition("|")
            if name.startswith(prefix) and kind.startswith("c"):
                found[name[len(prefix):]].append(int(value))
        return dict(found)


@pytest.fixture
def statsd():
    sink = StatsdSink()
    yield sink
    sink.close()


# The article's DAGs run with settle_in_task=False: nothing is settled in the task, and every try says so.
SETTLED_NOTHING = {"resent_in_task": [0, 0], "settled_in_task": [0, 0], "waits": [0, 0], "gave_up": [0, 0]}


def metrics_env(airflow, port: int) -> None:
    airflow.env.update(
        AIRFLOW__METRICS__STATSD_ON="True", AIRFLOW__METRICS__STATSD_HOST="127.0.0.1",
        AIRFLOW__METRICS__STATSD_PORT=str(port), AIRFLOW__METRICS__STATSD_PREFIX="airflow",
        AIRFLOW__API__BASE_URL="http://airflow.example.test:8080",
    )


def test_held_batch_reports_its_counters_to_statsd(airflow, statsd):
    metrics_env(airflow, statsd.port)
    arm(airflow, "item-041", "before_accept")
    assert airflow.dags_test("article_hold").returncode != 0  # try 2 ends failed: item 41 is held
    counters = statsd.counters("airflow.resumable.steps.")
    # Try 1 dies at item 41's send: it executed items 1-40 and item 41's two local steps.
    # Try 2 resumes: items 42-50 run (27 steps), 122 are skipped, item 41 is held.
    assert counters == {"executed": [122, 27], "skipped": [0, 122], "verified": [0, 0], "held": [0, 1],
                        **SETTLED_NOTHING}, output(airflow)


def test_verified_send_is_counted_and_the_extra_link_names_the_job(airflow, statsd):
    metrics_env(airflow, statsd.port)
    arm(airflow, "item-041", "after_accept")
    assert airflow.dags_test("article_verify").returncode == 0, output(airflow)
    counters = statsd.counters("airflow.resumable.steps.")
    assert counters == {"executed": [122, 27], "skipped": [0, 123], "verified": [0, 1], "held": [0, 0],
                        **SETTLED_NOTHING}, \
        output(airflow)

    run_id = airflow.last_run_id("article_verify")
    job_id = airflow.xcom("article_verify", "send", key="resumable_summary")["job_id"]
    assert job_id == f"article_verify/send/{run_id}"
    link = airflow.xcom("article_verify", "send", key="_link_ResumableJobLink")
    assert link == f"http://airflow.example.test:8080/resumable/jobs/{quote(job_id, safe='')}"
