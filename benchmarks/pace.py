"""The ``pace`` section (SPEC §12): sends behind a real rate limiter, Debian's nginx (``limit_req``, 429
with ``Retry-After: 1``), in front of the concurrency benchmark's receiver (asyncio, 4 ms a reply, counts
each key). The runner sends at concurrency 16 with one keep-alive connection per thread, to a SQLite
journal (``durability="normal"``); four runner processes share one PostgreSQL journal and one limit key.

Figures, each measured at nginx (its access log: the POSTs it let through, and when):

* ``configured_100`` / ``configured_1000``: ``max_sends_per_second`` equal to nginx's limit; throughput
  over the limit, and the share of POSTs refused (429). At 1,000/s only where the same sends with no
  limit reach 1.5 x 1,000/s (``unlimited``), else reported as not measurable.
* ``fleet_100``: four processes, one limit key at 100/s on a PostgreSQL journal.
* ``defaults_100``: no rate configured (the run learns it); throughput over the limit.
* ``settlement_cost``: the same sends, no limit and nothing failing, with settlement on and off,
  interleaved; the cost is 1 - on / off.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from airflow_resumable.exceptions import ReceiverError, ReceiverRefused
from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, StepContext, run_batch
from benchmarks import pg
from benchmarks.concurrency import _Client, _ReceiverProcess
from tests.support.nginx import HOW_TO_INSTALL, RateLimiter, nginx_binary

REPO = Path(__file__).resolve().parents[1]
CONCURRENCY = 16


class _LimitedClient(_Client):
    """A send through nginx: a 429 is the receiver's refusal (with its Retry-After), as HttpReceiver has it."""

    def send(self, item: Mapping[str, Any], ctx: StepContext) -> str:
        response, body = self.post(ctx)
        if response.status == 429:
            after = response.getheader("Retry-After")
            raise ReceiverRefused(429, retry_after=float(after) if after and after.isdigit() else None)
        if response.status != 200:
            raise ReceiverError(response.status)
        return json.loads(body)["receipt"]  # type: ignore[no-any-return]


def _at_nginx(limiter: RateLimiter, since: float) -> dict[str, Any]:
    """What nginx saw of the POSTs since ``since`` (epoch seconds): let through, refused, and the rate."""
    seen = [(status, at) for method, _, status, at in limiter.timed_requests() if method == "POST" and at >= since]
    through = sorted(at for status, at in seen if status == 200)
    refused = sum(1 for status, _ in seen if status == 429)
    rate = (len(through) - 1) / (through[-1] - through[0]) if len(through) > 1 and through[-1] > through[0] else 0.0
    return {"through": len(through), "refused": refused, "refused_share": refused / max(1, len(seen)),
            "per_second": rate}


def _run(port: int, tmp: Path, job: str, n: int, *, rate: float | None = None, settle: bool = True) -> float:
    """``n`` sends to ``port``; returns the run's wall seconds."""
    client = _LimitedClient(port)
    steps = [Step("notify", client.send, side_effect=True, max_sends_per_second=rate)]
    items = [{"id": f"i{k:06d}"} for k in range(n)]
    try:
        with StepJournal(tmp / f"{job}.sqlite3", durability="normal") as journal:
            started = time.perf_counter()
            result = run_batch(journal, job, items, steps, concurrency=CONCURRENCY, settle_in_task=settle)
            elapsed = time.perf_counter() - started
    finally:
        client.close()
    if result.items_completed != n or result.held:
        raise SystemExit(f"pace: {job} completed {result.items_completed} of {n}, held {len(result.held)}")
    return elapsed


def _limited(tmp: Path, name: str, port: int, rate: int) -> RateLimiter:
    return RateLimiter(tmp / name, port, rate=rate, burst=max(10, rate // 10), retry_after=1)


def _fleet(limiter_url: str, n: int, tmp: Path) -> dict[str, Any]:
    """Four runner processes (tests/support/paced_runner.py), one PostgreSQL journal, one limit key at 100/s."""
    if (why := pg.unavailable()) is not None:
        return {"skipped": why}
    with pg.throwaway_server() as server:
        url = server.new_database()
        env = {**os.environ, "PYTHONPATH": str(REPO),
               "AIRFLOW_CONN_LIMITED": json.dumps({"conn_type": "http", "host": limiter_url})}
        go = tmp / "go"
        runners = [subprocess.Popen([sys.executable, "-m", "tests.support.paced_runner", url, f"fleet/{k}",
                                     str(k * n), str(n), "100", str(go)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                                    text=True)
                   for k in range(4)]
        for runner in runners:  # each imported and connected: they start together
            assert runner.stdout is not None
            if runner.stdout.readline().strip() != "READY":
                raise SystemExit("pace: a fleet runner did not start")
        go.touch()
        for runner in runners:
            out, _ = runner.communicate(timeout=1800)
            if runner.returncode != 0:
                raise SystemExit(f"pace: a fleet runner failed: {out[-2000:]}")
            if json.loads(out.strip().splitlines()[-1])["items_completed"] != n:
                raise SystemExit("pace: a fleet runner did not complete its items")
    return {}


def measure(params: dict[str, int]) -> dict[str, Any]:
    if nginx_binary() is None:
        return {"skipped": f"no nginx: {HOW_TO_INSTALL}"}
    n100, n1000, n_cost = params["n100"], params["n1000"], params["n_cost"]
    out: dict[str, Any] = {"concurrency": CONCURRENCY, "n100": n100, "n1000": n1000, "n_cost": n_cost}
    with tempfile.TemporaryDirectory() as tmpdir, _ReceiverProcess() as receiver:
        tmp = Path(tmpdir)
        # No limit: what these sends reach at all, and what settlement costs when nothing fails.
        open_door = _limited(tmp, "open", receiver.port, 1_000_000)
        try:
            unlimited = _run(open_door.port, tmp, "unlimited", n1000)
            out["unlimited"] = {"per_second": n1000 / unlimited}
            on: list[float] = []
            off: list[float] = []
            for rep in range(params["reps"]):
                off.append(_run(open_door.port, tmp, f"off-{rep}", n_cost, settle=False))
                on.append(_run(open_door.port, tmp, f"on-{rep}", n_cost, settle=True))
            out["settlement_cost"] = {"on_seconds": min(on), "off_seconds": min(off),
                                      "cost": 1 - min(off) / min(on)}
        finally:
            open_door.stop()
        for name, rate, n, configured in (("configured_100", 100, n100, True), ("defaults_100", 100, n100, False),
                                          ("configured_1000", 1000, n1000, True)):
            if rate == 1000 and out["unlimited"]["per_second"] < 1.5 * rate:
                out[name] = {"not_measurable": f"the same sends with no limit reach {out['unlimited']['per_second']:.0f}"
                                               f"/s, under 1.5 x {rate}/s"}
                continue
            limiter = _limited(tmp, name, receiver.port, rate)
            try:
                since = time.time()
                _run(limiter.port, tmp, name, n, rate=rate if configured else None)
                seen = _at_nginx(limiter, since)
            finally:
                limiter.stop()
            out[name] = seen | {"limit": rate, "ratio": seen["per_second"] / rate}
        limiter = _limited(tmp, "fleet", receiver.port, 100)
        try:
            since = time.time()
            fleet = _fleet(limiter.url, n100 // 4, tmp)
            out["fleet_100"] = fleet or (_at_nginx(limiter, since) | {"limit": 100, "processes": 4})
            if not fleet:
                out["fleet_100"]["ratio"] = out["fleet_100"]["per_second"] / 100
        finally:
            limiter.stop()
        stats = receiver.stats()
        out["duplicates"] = stats["duplicates"]
    return out
