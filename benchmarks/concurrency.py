"""Throughput against a slow receiver: ``run_batch(..., concurrency=16)`` vs ``concurrency=1``, full durability.

The receiver is real HTTP on 127.0.0.1 in its own process (an asyncio server that answers each
request 4 ms after it arrived, any number at once), so the runner's threads compete with nothing of
the receiver's for the GIL. Each runner thread keeps one keep-alive ``http.client`` connection.
The receiver counts requests per idempotency key, so a concurrent run that sent anything twice
would show it.

Two sections: ``concurrency`` (:func:`measure`) on a SQLite journal, ``concurrency_postgres``
(:func:`measure_postgres`) on a PostgreSQL journal in a throwaway cluster of its own
(:mod:`benchmarks.pg`), both at full durability. On PostgreSQL the commits that count are the
synchronous ones (``synchronous_commit=on``, each a WAL flush the runner waits for: the commits of
``IN_FLIGHT`` marks); every write transaction is reported beside them.

``concurrency=`` is being added to ``run_batch`` separately; a build without it reports the section
as not available instead of failing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import inspect
import json
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping
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


class _Receiver:
    """A minimal HTTP/1.1 keep-alive server on asyncio: POST answers a receipt 4 ms later, GET the counts.

    Not ``http.server``: on a 2-core machine the receiver shares the CPU with the runner under
    test, and a thread plus header parsing per request cost it a good part of one core at 2,000
    requests/s. An event loop keeps the receiver's share small, so the figure is the runner's.
    """

    def __init__(self, reply_seconds: float = REPLY_SECONDS) -> None:
        self.reply_seconds = reply_seconds
        self.requests_by_key: Counter[str] = Counter()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
                headers = dict((name.strip().lower(), value.strip())
                               for name, _, value in (line.partition(":") for line in head[1:] if line))
                await reader.readexactly(int(headers.get("content-length") or 0))
                if head[0].startswith("POST "):
                    key = headers.get("idempotency-key", "")
                    await asyncio.sleep(self.reply_seconds)  # the receiver's work; other requests go on meanwhile
                    self.requests_by_key[key] += 1
                    payload: dict[str, Any] = {"receipt": f"rcpt-{key[-12:]}-{self.requests_by_key[key]}"}
                else:
                    counts = list(self.requests_by_key.values())
                    payload = {"requests": sum(counts), "keys": len(counts), "duplicates": sum(n - 1 for n in counts)}
                body = json.dumps(payload).encode()
                # One write for head and body: no Nagle / delayed-ACK stall between them.
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed its keep-alive connection
        finally:
            writer.close()


async def _serve(reply_seconds: float) -> None:
    receiver = _Receiver(reply_seconds)
    server = await asyncio.start_server(receiver.connection, "127.0.0.1", 0, backlog=128)
    print(server.sockets[0].getsockname()[1], flush=True)
    await server.serve_forever()


def serve(reply_seconds: float = REPLY_SECONDS) -> None:
    """Run the receiver until terminated; the first line on stdout is its port."""
    asyncio.run(_serve(reply_seconds))


class _ReceiverProcess:
    def __init__(self, reply_seconds: float = REPLY_SECONDS) -> None:
        self.reply_seconds = reply_seconds

    def __enter__(self) -> _ReceiverProcess:
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.concurrency", "--serve",
                                      "--reply-ms", repr(self.reply_seconds * 1e3)],
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

    def post(self, ctx: StepContext) -> tuple[http.client.HTTPResponse, bytes]:
        """POST the step's key on this thread's connection; the answer and its body."""
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            with self._lock:
                self._all.append(conn)
        conn.request("POST", "/notify", body=json.dumps({"id": ctx.item_id}),
                     headers={"Idempotency-Key": ctx.idempotency_key, "Content-Type": "application/json"})
        response = conn.getresponse()
        return response, response.read()

    def send(self, item: Mapping[str, Any], ctx: StepContext) -> str:
        response, body = self.post(ctx)
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


@contextlib.contextmanager
def fresh_journal(journal_url: str | None, schema: str) -> Iterator[StepJournal]:
    """A new full-durability journal for one run: a SQLite file, or ``schema`` of its own in ``journal_url``."""
    if journal_url is not None:
        with StepJournal(journal_url, durability="full", schema=schema) as journal:
            yield journal
        return
    with tempfile.TemporaryDirectory() as tmp, StepJournal(Path(tmp) / "j.sqlite3", durability="full") as journal:
        yield journal


def measure(n: int, levels: tuple[int, ...] = (1, 16), serial_n: int = 2_000,
            journal_url: str | None = None) -> dict[str, Any]:
    """Items per second at each level, on a SQLite journal or, given ``journal_url``, a PostgreSQL one.

    The ``concurrency=1`` run streams only ``serial_n`` items: throughput is a rate, and 10,000
    serial sends at ~6 ms would add a minute to ``make bench``."""
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
            with fresh_journal(journal_url, f"concurrency_{level}") as journal:
                start = time.perf_counter()
                result = _run(journal, f"concurrency-{level}", level_n, steps, level)
                seconds = time.perf_counter() - start
            client.close()
            after = receiver.stats()
            if result.executed_steps != 3 * level_n:
                raise AssertionError(f"concurrency={level}: {result.executed_steps} of {3 * level_n} steps executed")
            runs[str(level)] = {
                "items": level_n,
                "seconds": seconds,
                "items_per_second": level_n / seconds,
                "commits_per_item": journal.commit_count / level_n,
                "durable_commits_per_item": journal.durable_commit_count / level_n,
                "sends": after["requests"] - before["requests"],
                "duplicate_sends": after["duplicates"] - before["duplicates"],
            }
            if journal_url is None:
                runs[str(level)]["fsyncs_per_item"] = journal.engine.fsync_count / level_n  # type: ignore[attr-defined]
    figures: dict[str, Any] = {"n": n, "reply_ms": REPLY_SECONDS * 1e3, "durability": "full", "runs": runs}
    if len(levels) == 2:
        low, high = (runs[str(level)] for level in levels)
        figures |= {"levels": list(levels), "throughput_ratio": high["items_per_second"] / low["items_per_second"]}
        if journal_url is None:
            figures["fsyncs_per_item"] = high["fsyncs_per_item"]
        else:
            figures |= {"durable_commits_per_item": high["durable_commits_per_item"],
                        "commits_per_item": high["commits_per_item"]}
    return figures


def measure_postgres(n: int, levels: tuple[int, ...] = (1, 16), serial_n: int = 2_000) -> dict[str, Any]:
    """:func:`measure` on a PostgreSQL journal in a throwaway cluster started (and destroyed) here."""
    from benchmarks import pg

    if not supports_concurrency() and levels != (1,):
        return {"skipped": NOT_AVAILABLE}
    if (why := pg.unavailable()) is not None:
        return {"skipped": why}
    with pg.throwaway_server() as server:
        figures = measure(n, levels, serial_n, journal_url=server.new_database())
        version = server.version()
    return {"engine": "postgresql", "postgres_version": version} | figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the HTTP receiver of the concurrency benchmark")
    parser.add_argument("--serve", action="store_true", required=True)
    parser.add_argument("--reply-ms", type=float, default=REPLY_SECONDS * 1e3, help="answer each POST this late")
    serve(parser.parse_args().reply_ms / 1e3)
