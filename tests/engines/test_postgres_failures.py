"""PostgreSQL journal under real failures: the server crashing mid-batch, and a runner cut off from it.

Both tests start a throwaway cluster of their own (never the session's shared one) and tear down
everything they start - processes, network namespace, veth pair, cluster - even when they fail.

* Server crash: ``pg_ctl restart -m immediate`` while a runner process (tests/support/crash_child.py) is
  sending. The runner must stop with a clear ``JournalConnectionError`` (the journal never
  reconnects); every delivery the receiver has must have a committed ``IN_FLIGHT`` or ``SUCCEEDED``
  row (the ``IN_FLIGHT`` marks are synchronous commits under ``durability="full"``); resuming, with
  holds settled the way an operator does, delivers every item exactly once.
* Cut-off runner: runner A runs in a network namespace of its own and reaches the server over a
  veth pair; the host side of the link is brought down (its traffic is dropped, no reset reaches
  either end). Runner B, on the host, takes the job over within the claim bound; once B has
  finished and the link is back, A sends nothing more and stops with a connection error.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_resumable.journal import HeldReason, Status, StepJournal
from airflow_resumable.runner import idempotency_key
from tests.core.test_crash_matrix import check_marks_guard_every_delivery
from tests.support.crash_child import EXIT_COMPLETED, EXIT_NEEDS_REVIEW, ChildRun
from tests.support.postgres_server import HOW_TO_ENABLE, PostgresCluster, server_bindir, wait_until
from tests.support.receivers import DurableReceiver

pytestmark = pytest.mark.core

REPO = Path(__file__).resolve().parents[2]
SEND = "notify_external"
STEPS = ("validate", "transform", SEND)


def _bindir_or_skip() -> Path:
    bindir = server_bindir()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the PostgreSQL failure tests, but no PostgreSQL server was found. " + HOW_TO_ENABLE)
        pytest.skip(HOW_TO_ENABLE)
    return bindir


def _ids(n: int) -> list[str]:
    return [f"item-{i:03d}" for i in range(1, n + 1)]


def _stop(proc: subprocess.Popen) -> None:
    """SIGKILL a process this test started (by its pid) if it is still running, and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.communicate(timeout=30)


def _settle_held(url: str, receiver: DurableReceiver, job: str, expected: list[list[str]], context: str) -> list:
    """What an operator does with held sends: ask the receiver for the idempotency key, resolve."""
    decisions = []
    with StepJournal(url) as journal:
        held = journal.held(job)
        assert sorted([h.item_id, h.step, h.reason.value] for h in held) == sorted(expected), context
        for h in held:
            assert h.step == SEND and h.reason == HeldReason.UNKNOWN_OUTCOME, f"{context}: {h}"
            receipt = receiver.lookup(idempotency_key(job, h.item_id, h.step))
            journal.resolve(job, h.item_id, h.step, delivered=receipt is not None, receipt=receipt,
                            resolved_by="oncall", note="asked the receiver for the idempotency key")
            decisions.append((h.item_id, "delivered" if receipt else "not_delivered"))
    return decisions


def _check_complete(url: str, receiver: DurableReceiver, job: str, ids: list[str], decisions: list,
                    context: str) -> None:
    counts = receiver.counts(job)
    assert sorted(counts) == ids, f"{context}: lost items: {sorted(set(ids) - set(counts))}"
    assert set(counts.values()) == {1}, f"{context}: duplicates: {({k: v for k, v in counts.items() if v > 1})}"
    with StepJournal(url) as journal:
        rows = journal.rows(job)
        assert sorted((r.item_id, r.step) for r in rows) == sorted((i, s) for i in ids for s in STEPS), context
        assert {r.status for r in rows} == {Status.SUCCEEDED}, context
        assert journal.held(job) == [], context
        summary = journal.job(job)
        assert summary is not None and summary.settled, context
        for r in rows:
            if r.step == SEND:
                assert r.receipt == receiver.lookup(idempotency_key(job, r.item_id, SEND)), f"{context}: {r.item_id}"
        assert sorted((a.item_id, a.decision) for a in journal.resolutions(job)) == sorted(decisions), context


# ------------------------------------------------------------------------------ server crash


CRASH_JOB = "pg-crash/job-1"
CRASH_ITEMS = 200


@pytest.mark.postgres_server  # a cluster of its own
@pytest.mark.slow
@pytest.mark.parametrize("concurrency", [1, 16])
def test_server_crash_mid_batch_then_resume_delivers_each_item_once(tmp_path, concurrency):
    bindir = _bindir_or_skip()
    ids = _ids(CRASH_ITEMS)
    context = f"server crash, concurrency {concurrency}"
    with contextlib.ExitStack() as cleanup:
        cluster = PostgresCluster(bindir)  # of its own: this test crashes it
        cleanup.callback(cluster.destroy)
        url = cluster.new_database()
        receiver_path = tmp_path / "receiver.sqlite3"
        receiver = DurableReceiver(receiver_path)

        def child(step_ms: tuple[float, float]) -> ChildRun:
            run = ChildRun(tmp_path, url, receiver_path, CRASH_JOB, durability="full", step_ms=step_ms,
                           n_items=CRASH_ITEMS, concurrency=concurrency)
            cleanup.callback(_stop, run.proc)
            return run

        first = child((1.0, 3.0))
        first.wait_ready()

        def some_delivered() -> bool:
            assert first.proc.poll() is None, f"{context}: the runner ended before the crash: {first.finish()}"
            return len(receiver.counts(CRASH_JOB)) >= 10

        assert wait_until(some_delivered, timeout=120, interval=0.005), f"{context}: nothing was delivered"
        delivered_before = len(receiver.counts(CRASH_JOB))
        cluster.crash_restart()

        code, summary, err = first.finish(timeout=120)
        if code == EXIT_COMPLETED:
            # It finished before the server went down (it never needed the journal afterwards).
            assert summary["status"] == "completed", f"{context}: {summary}"
            print(f"{context}: the runner finished before the crash landed")
        else:
            last = err.strip().splitlines()[-1] if err.strip() else ""
            assert code == 1 and "JournalConnectionError" in last and "lost the connection" in last, (
                f"{context}: the runner must stop with a clear JournalConnectionError, got exit code {code}:\n"
                f"{summary}\n{err}"
            )
            assert "Retry the task once the database is reachable" in last, last
        # Safety, right after: no send without its committed mark, nothing delivered twice.
        with StepJournal(url) as journal:
            rows = {(r.item_id, r.step): r for r in journal.rows(CRASH_JOB)}
            assert journal.held(CRASH_JOB) == []
        counts = check_marks_guard_every_delivery(receiver, CRASH_JOB, rows, context)
        print(f"{context}: crash after {delivered_before} deliveries; the runner had delivered {len(counts)} "
              f"when it stopped (exit code {code})")
        in_flight = sorted(i for (i, s), r in rows.items() if s == SEND and r.status == Status.IN_FLIGHT)
        if code != EXIT_COMPLETED:
            assert len(counts) < CRASH_ITEMS, f"{context}: the crash did not land mid-batch"

        # Resume like an operator: run again, settle holds by asking the receiver, until complete.
        decisions: list = []
        for attempt in range(4):
            code, summary, err = child((0.0, 0.0)).finish(timeout=180)
            assert code in (EXIT_COMPLETED, EXIT_NEEDS_REVIEW), (
                f"{context}: resumed run {attempt} ended with exit code {code}:\n{summary}\n{err}"
            )
            if attempt == 0:
                # Every send that was in flight is held (never re-sent blindly), and nothing else.
                assert sorted(i for i, _, _ in summary["held"]) == in_flight, f"{context}: {summary}"
            if code == EXIT_COMPLETED:
                assert summary["status"] == "completed" and summary["held"] == []
                break
            assert summary["held"], f"{context}: exit 3 without a held item: {summary}"
            decisions += _settle_held(url, receiver, CRASH_JOB, summary["held"], context)
        else:
            raise AssertionError(f"{context}: not complete after 4 resumed runs")
        _check_complete(url, receiver, CRASH_JOB, ids, decisions, context)


# -------------------------------------------------------------------------- cut-off runner


CUT_JOB = "pg-cutoff/job-1"
CUT_ITEMS = 20
CUT_ITEM = "item-006"  # runner A has delivered items 1-5 when the link goes down
CLAIM_TIMEOUT = 9.0

# A runner for this test: like tests/support/crash_child.py, but it opens the journal with a claim_timeout,
# reports events (with time.monotonic(), one clock for every process of the host) to a file, and in
# --retry-busy mode tries again every so many seconds while the job is held by someone else.
RUNNER = r'''
import argparse, json, os, sys, time
sys.path.insert(0, REPO)
from airflow_resumable.journal import JobBusyError, StepJournal
from airflow_resumable.runner import Step, run_batch
from tests.support.receivers import DurableReceiver

p = argparse.ArgumentParser()
p.add_argument("--url", required=True)
p.add_argument("--receiver", required=True)
p.add_argument("--job", required=True)
p.add_argument("--items", type=int, required=True)
p.add_argument("--claim-timeout", type=float, required=True)
p.add_argument("--send-ms", type=float, nargs=2, default=(0.0, 0.0))
p.add_argument("--pause-at", choices=("local", "before_send"))
p.add_argument("--pause-item")
p.add_argument("--release")
p.add_argument("--events", required=True)
p.add_argument("--retry-busy", type=float, default=0.0)
p.add_argument("--give-up", type=float, default=0.0)
args = p.parse_args()

def emit(event, **kw):
    line = json.dumps(dict(event=event, t=time.monotonic(), pid=os.getpid(), **kw)) + "\n"
    fd = os.open(args.events, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)

def pause(boundary, item_id):
    if args.pause_at == boundary and item_id == args.pause_item:
        emit("paused", boundary=boundary, item=item_id)
        while not os.path.exists(args.release):
            time.sleep(0.01)
        emit("released", item=item_id)

receiver = DurableReceiver(args.receiver)
before, after = args.send_ms

def validate(item, ctx):
    return {"ok": True}

def transform(item, ctx):
    pause("local", ctx.item_id)
    return {"cents": item["amount"] * 100}

def notify_external(item, ctx):
    pause("before_send", ctx.item_id)
    time.sleep(before / 1000)
    receipt = receiver.deliver(ctx.job_id, ctx.item_id, ctx.step, ctx.idempotency_key,
                               str(ctx.outputs["transform"]["cents"]))
    emit("delivered", item=ctx.item_id)
    time.sleep(after / 1000)
    return receipt

steps = [Step("validate", validate), Step("transform", transform),
         Step("notify_external", notify_external, side_effect=True)]
items = [{"id": f"item-{i:03d}", "amount": i * 100} for i in range(1, args.items + 1)]
with StepJournal(args.url, claim_timeout=args.claim_timeout) as journal:
    open_job = journal.open_job
    def claimed(*a, **kw):
        run = open_job(*a, **kw)
        emit("claimed")
        return run
    journal.open_job = claimed
    emit("opened")
    deadline = time.monotonic() + args.give_up
    while True:
        try:
            result = run_batch(journal, args.job, items, steps, runner=f"cutoff:{os.getpid()}")
            break
        except JobBusyError as exc:
            emit("busy", message=str(exc))
            if args.retry_busy <= 0 or time.monotonic() >= deadline:
                sys.exit(4)
            time.sleep(args.retry_busy)
emit("done", status=result.status, executed=result.executed_steps, skipped=result.skipped_steps,
     held=[[h.item_id, h.step, h.reason.value] for h in result.held])
sys.exit(0 if result.status == "completed" else 3)
'''


def _events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    found = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):  # the line being written right now
            found.append(json.loads(line))
    return found


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def _free_subnet() -> int:
    """X of a 10.200.X.0/30 that no interface of this host uses (X picked from the pid)."""
    used = _ip("-4", "-o", "addr", "show").stdout
    start = os.getpid() % 240
    for n in range(240):
        x = 10 + (start + n) % 240
        if f" 10.200.{x}." not in used:
            return x
    pytest.fail("no free 10.200.X.0/30 subnet for the test's veth pair")


class Proc:
    """A runner process with its output and events in files (no pipe to fill up)."""

    def __init__(self, cmd: list[str], folder: Path, name: str) -> None:
        self.name, self.events = name, folder / f"{name}.events"
        self.out, self.err = folder / f"{name}.stdout", folder / f"{name}.stderr"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)

    def of(self, event: str) -> list[dict]:
        return [e for e in _events(self.events) if e["event"] == event]

    def stderr(self) -> str:
        return self.err.read_text()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.name} still running after {timeout:.0f} s:\n{self.stderr()}") from None

    def describe(self) -> str:
        return f"{self.name}: exit {self.proc.poll()}\nevents: {_events(self.events)}\nstderr:\n{self.stderr()}"


@pytest.mark.postgres_server  # a cluster of its own
@pytest.mark.slow
@pytest.mark.parametrize("cut_at", ["before_send", "local"])
def test_runner_cut_off_from_the_server_loses_the_job_and_sends_nothing_more(tmp_path, cut_at):
    """cut_at=before_send: A's send of CUT_ITEM is marked IN_FLIGHT when the link goes down, and is
    delivered right after (while A is cut off); its outcome is held and settled by an operator.
    cut_at=local: A is inside a local step of CUT_ITEM and only carries on once the link is back -
    its next move would be the IN_FLIGHT mark of a send B has already made."""
    bindir = _bindir_or_skip()
    ids = _ids(CUT_ITEMS)
    context = f"cut off at {cut_at} of {CUT_ITEM}"
    token = f"{os.getpid() % 10**6:06d}{random.randrange(256):02x}"
    ns, host_if, ns_if = f"rsm-{token}", f"rsh{token}", f"rsn{token}"

    with contextlib.ExitStack() as cleanup:
        added = _ip("netns", "add", ns, check=False)
        if added.returncode != 0:
            message = f"cannot create a network namespace (ip netns add: {added.stderr.strip()})"
            if os.environ.get("CI"):
                pytest.fail("CI must run the cut-off runner test: " + message)
            pytest.skip(message)
        cleanup.callback(_ip, "netns", "del", ns, check=False)
        x = _free_subnet()
        host_ip, ns_ip = f"10.200.{x}.1", f"10.200.{x}.2"
        _ip("link", "add", host_if, "type", "veth", "peer", "name", ns_if, "netns", ns)
        cleanup.callback(_ip, "link", "del", host_if, check=False)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _ip("-n", ns, "link", "set", ns_if, "up")

        # A cluster of its own, listening on loopback and on the host's end of the veth pair only.
        cluster = PostgresCluster(bindir, listen=f"127.0.0.1,{host_ip}")
        cleanup.callback(cluster.destroy)
        url = cluster.new_database()  # via 127.0.0.1: runner B and the operator
        url_a = url.replace(f"@{cluster.host}:", f"@{host_ip}:")  # runner A, through the veth pair
        assert url_a != url
        receiver_path = tmp_path / "receiver.sqlite3"
        receiver = DurableReceiver(receiver_path)
        script = tmp_path / "runner.py"
        script.write_text(f"REPO = {str(REPO)!r}\n" + RUNNER)
        release = tmp_path / "release"

        def runner(name: str, journal_url: str, *extra: str, prefix: tuple[str, ...] = ()) -> Proc:
            cmd = [*prefix, sys.executable, str(script), "--url", journal_url, "--receiver", str(receiver_path),
                   "--job", CUT_JOB, "--items", str(CUT_ITEMS), "--claim-timeout", str(CLAIM_TIMEOUT),
                   "--events", str(tmp_path / f"{name}.events"), *extra]
            proc = Proc(cmd, tmp_path, name)
            cleanup.callback(_stop, proc.proc)
            return proc

        a = runner("A", url_a, "--send-ms", "20", "20", "--pause-at", cut_at, "--pause-item", CUT_ITEM,
                   "--release", str(release), prefix=("ip", "netns", "exec", ns))
        assert wait_until(lambda: a.of("paused") or a.proc.poll() is not None, timeout=60), a.describe()
        assert a.of("paused"), a.describe()
        assert sorted(receiver.counts(CUT_JOB)) == ids[:5], context

        # B, on the host, is refused while A holds the job - and A holds it from the namespace's address.
        b = runner("B1", url, "--send-ms", "5", "5", "--retry-busy", "0.5", "--give-up", str(3 * CLAIM_TIMEOUT + 30))
        assert wait_until(lambda: b.of("busy") or b.proc.poll() is not None, timeout=60), b.describe()
        busy = b.of("busy")
        assert busy and f"pid {a.proc.pid}@" in busy[0]["message"], b.describe()
        assert re.search(rf"from {re.escape(ns_ip)}\b", busy[0]["message"]), b.describe()

        # Cut A off: the host's end of the link goes down, everything A and the server send is dropped.
        _ip("link", "set", host_if, "down")
        cut = time.monotonic()
        if cut_at == "before_send":
            release.touch()  # A goes on with the send it had marked IN_FLIGHT: delivered while cut off
            assert wait_until(lambda: CUT_ITEM in receiver.counts(CUT_JOB), timeout=30), a.describe()

        b.wait(timeout=3 * CLAIM_TIMEOUT + 60)
        claimed = b.of("claimed")
        assert claimed, f"{context}: B never got the job:\n{b.describe()}"
        takeover = claimed[0]["t"] - cut
        print(f"{context}: B took the job over {takeover:.1f} s after the link went down "
              f"(claim_timeout {CLAIM_TIMEOUT:.0f} s)")
        assert 0 < takeover <= 2 * CLAIM_TIMEOUT + 10, f"{context}: takeover took {takeover:.1f} s"
        assert all(e["t"] < claimed[0]["t"] for e in b.of("busy")), b.describe()

        # B finishes the job; A's send that was in flight is held, and settled like an operator would.
        decisions: list = []
        for attempt in range(4):
            done = b.of("done")
            assert b.proc.returncode in (EXIT_COMPLETED, EXIT_NEEDS_REVIEW) and done, b.describe()
            held = done[-1]["held"]
            if attempt == 0:
                expected = [[CUT_ITEM, SEND, "unknown_outcome"]] if cut_at == "before_send" else []
                assert held == expected, f"{context}: {b.describe()}"
            if b.proc.returncode == EXIT_COMPLETED:
                assert held == []
                break
            decisions += _settle_held(url, receiver, CUT_JOB, held, context)
            b = runner(f"B{attempt + 2}", url, "--send-ms", "5", "5")
            b.wait(timeout=120)
        else:
            raise AssertionError(f"{context}: B did not complete the job")
        if cut_at == "before_send":
            assert decisions == [(CUT_ITEM, "delivered")], decisions
        _check_complete(url, receiver, CUT_JOB, ids, decisions, context)
        finished = receiver.counts(CUT_JOB)

        # The link comes back (and works: the namespace reaches the server again). A sends nothing more.
        _ip("link", "set", host_if, "up")
        probe = subprocess.run(
            ["ip", "netns", "exec", ns, sys.executable, "-c",
             "import psycopg, sys; psycopg.connect(sys.argv[1], connect_timeout=5).close()", url_a],
            capture_output=True, text=True, timeout=60, check=False,
        )
        assert probe.returncode == 0, f"the link did not come back: {probe.stderr}"
        release.touch()  # (cut_at=local: A carries on only now, with the link back)
        code = a.wait(timeout=3 * CLAIM_TIMEOUT)
        time.sleep(2)
        assert receiver.counts(CUT_JOB) == finished, f"{context}: A sent after losing the job:\n{a.describe()}"
        delivered_by_a = sorted(e["item"] for e in a.of("delivered"))
        expected_a = ids[:5] + ([CUT_ITEM] if cut_at == "before_send" else [])
        assert delivered_by_a == expected_a, f"{context}: A delivered {delivered_by_a}"
        err = a.stderr()
        last = err.strip().splitlines()[-1] if err.strip() else ""
        assert code == 1 and "JournalConnectionError" in last and "lost the connection" in last, (
            f"{context}: A must stop with a clear connection error, not complete the job it lost:\n{a.describe()}"
        )
        print(f"{context}: A stopped with: {last[:110]}...")
        _check_complete(url, receiver, CUT_JOB, ids, decisions, context)
