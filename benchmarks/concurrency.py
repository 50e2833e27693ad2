"""Throughput against a slow receiver: ``run_batch(..., concurrency=16)`` vs ``concurrency=1``, full durability.

The receiver is real HTTP on 127.0.0.1 in its own process (a threaded server whose handler sleeps
4 ms before it answers), so the runner's threads compete with nothing of the receiver's for the GIL.
Each runner thread keeps one keep-alive connection. The receiver counts requests per idempotency
key, so a concurrent run that sent anything twice would show it.

``concurrency=`` is being added to ``run_batch`` separately; a build without it reports the section
as not available instead of failing.
"""

from __future__ import annotations

import argparse
import http.client
import inspect
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import BatchResult, Step, StepContext, run_batch
from benchmarks import workload

REPLY_SECONDS = 0.004
REPO = Path(__file__).resolve().parents[1]
NOT_AVAILABLE = "concurrency: not available in this build (run_batch has no concurrency= parameter)"


def supports_concurrency() -> bool:
    return "concurrency" in inspect.signature(run_batch).parameters


# ------------------------------------------------------------------------------ the receiver


class _Receiver(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so a send costs a request, not a TCP handshake
    # Headers and body go out in two writes; with Nagle on, the body would wait for the client's
    # delayed ACK (~40 ms), ten times the reply time being measured.
    disable_nagle_algorithm = True
    requests_by_key: Counter[str] = Counter()
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - the name http.server dispatches to
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        key = self.headers.get("Idempotency-Key") or ""
        time.sleep(REPLY_SECONDS)
        with self.lock:
            self.requests_by_key[key] += 1
            seen = self.requests_by_key[key]
        self._answer({"receipt": f"rcpt-{key[-12:]}-{seen}"})

    def do_GET(self) -> None:  # noqa: N802
        with self.lock:
            counts = list(self.requests_by_key.values())
        self._answer({"requests": sum(counts), "keys": len(counts), "duplicates": sum(n - 1 for n in counts)})

    def _answer(self, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        return None  # 10,000 access-log lines would only slow the receiver down


def serve() -> None:
    """Run the receiver until killed; the first line on stdout is its port."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.daemon_threads = True
    server.request_queue_size = 128  # 16 connections opening at once must not wait in a short backlog
    print(server.server_address[1], flush=True)
    server.serve_forever()


class _ReceiverProcess:
    def __enter__(self) -> _ReceiverProcess:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.concurrency", "--serve"],
                                     stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())
        return self

    def stats(self) -> dict[str, int]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/stats")
            return json.loads(conn.getresponse().read())  # type: ignore[no-any-return]
        finally:
            conn.close()

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()  # our own child, by its handle
        self.proc.wait(timeout=10)


class _Client:
    """One keep-alive connection per runner thread."""

    def __init__(self, port: int) -> None:
        self.port = port
        self._local = threading.local()
        self._all: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def send(self, item: Mapping[str, Any], ctx: StepContext) -> str:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            with self._lock:
                self._all.append(conn)
        conn.request("POST", "/notify", body=json.dumps({"id": ctx.item_id}),
                     headers={"Idempotency-Key": ctx.idempotency_key, "Content-Type": "application/json"})
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"receiver answered {response.status}")
        return json.loads(body)["receipt"]  # type: ignore[no-any-return]

    def close(self) -> None:
        for conn in self._all:
            conn.close()


# ------------------------------------------------------------------------------ the measurement


def _run(journal: StepJournal, job_id: str, n: int, steps: list[Step], concurrency: int) -> BatchResult:
    if supports_concurrency():
        return run_batch(journal, job_id, workload.items(n), steps, concurrency=concurrency)  # type: ignore[call-arg]
    if concurrency == 1:  # lets this section's own logic be exercised on a build without the parameter
        return run_batch(journal, job_id, workload.items(n), steps)
    raise RuntimeError(NOT_AVAILABLE)


def measure(n: int, levels: tuple[int, ...] = (1, 16), serial_n: int = 2_000) -> dict[str, Any]:
    """Items per second at each level. The ``concurrency=1`` run streams only ``serial_n`` items:
    throughput is a rate, and 10,000 serial sends at ~6 ms would add a minute to ``make bench``."""
    if not supports_concurrency() and levels != (1,):
        return {"skipped": NOT_AVAILABLE}
    runs: dict[str, Any] = {}
    with _ReceiverProcess() as receiver:
        for level in levels:
            level_n = min(n, serial_n) if level == 1 else n
            client = _Client(receiver.port)
            steps = [Step("validate", lambda item, ctx: None), Step("transform", lambda item, ctx: None),
                     Step("notify", client.send, side_effect=True)]
            before = receiver.stats()
            with tempfile.TemporaryDirectory() as tmp, StepJournal(Path(tmp) / "j.sqlite3", durability="full") as journal:
                start = time.perf_counter()
                result = _run(journal, f"concurrency-{level}", level_n, steps, level)
                seconds = time.perf_counter() - start
                fsyncs = journal.fsync_count
            client.close()
            after = receiver.stats()
            if result.executed_steps != 3 * level_n:
                raise AssertionError(f"concurrency={level}: {result.executed_steps} of {3 * level_n} steps executed")
            runs[str(level)] = {
                "items": level_n,
                "seconds": seconds,
                "items_per_second": level_n / seconds,
                "fsyncs_per_item": fsyncs / level_n,
                "sends": after["requests"] - before["requests"],
                "duplicate_sends": after["duplicates"] - before["duplicates"],
            }
    figures: dict[str, Any] = {"n": n, "reply_ms": REPLY_SECONDS * 1e3, "durability": "full", "runs": runs}
    if len(levels) == 2:
        low, high = (runs[str(level)] for level in levels)
        figures |= {"levels": list(levels), "throughput_ratio": high["items_per_second"] / low["items_per_second"],
                    "fsyncs_per_item": high["fsyncs_per_item"]}
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the 4 ms HTTP receiver of the concurrency benchmark")
    parser.add_argument("--serve", action="store_true", required=True)
    parser.parse_args()
    serve()
