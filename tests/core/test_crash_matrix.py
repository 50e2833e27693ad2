"""Crash matrix: real runner processes SIGKILLed at every boundary of a send, and at random.

A child process (tests/support/crash_child.py) runs 30 items through validate -> transform ->
notify_external (a side effect delivered to a DurableReceiver, a SQLite file of its own). The child
is killed with SIGKILL, then resumed by starting it again; holds are settled the way an operator
does by hand (ask the receiver for the idempotency key, resolve delivered / not delivered).
Every trial must end with each item delivered exactly once, the journal all SUCCEEDED, and no
lock file ever touched by the test.

Every test runs on a SQLite journal and on a PostgreSQL one (each trial a database of its own), and
with ``concurrency=1`` and with ``concurrency=16`` (sends on worker threads, IN_FLIGHT
marks group-committed). With 16 sends in flight, *which* items had been delivered when the kill
landed depends on thread timing, so the boundary test's checks of exact positions apply to
concurrency 1; at 16 it checks instead that the resumed run holds exactly the sends that were in
flight - never re-sending one - and everything else is the same.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from airflow_resumable.journal import HeldReason, Status, StepJournal
from airflow_resumable.runner import idempotency_key
from tests.support import backends
from tests.support.crash_child import (
    BOUNDARIES,
    EXIT_COMPLETED,
    EXIT_NEEDS_REVIEW,
    ChildRun,
)
from tests.support.receivers import DurableReceiver

pytestmark = pytest.mark.core

JOB = "crash/job-1"
N_ITEMS = 30
IDS = [f"item-{i:03d}" for i in range(1, N_ITEMS + 1)]
STEPS = ("validate", "transform", "notify_external")
SEND = "notify_external"
KILL_ITEM = "item-013"
RANDOM_TRIALS = 20


CONCURRENCY = [1, 16]


@pytest.fixture(params=["sqlite", "postgres"])
def new_journal(request):
    """Where each trial's journal lives: a SQLite file in the trial's folder, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return lambda root: root / "journal" / "journal.sqlite3"
    postgres = request.getfixturevalue("postgres")
    return lambda root: postgres.new_database()


class Setup:
    def __init__(self, root: Path, durability: str, concurrency: int, new_journal) -> None:
        root.mkdir(parents=True, exist_ok=True)
        self.root = root
        self.journal = new_journal(root)
        self.on_sqlite = isinstance(self.journal, Path)
        self.receiver_path = root / "receiver.sqlite3"
        self.receiver = DurableReceiver(self.receiver_path)
        self.durability = durability
        self.concurrency = concurrency

    def child(self, **kw) -> ChildRun:
        return ChildRun(self.root, self.journal, self.receiver_path, JOB, durability=self.durability,
                        concurrency=self.concurrency, **kw)

    def open_journal(self) -> StepJournal:
        return StepJournal(self.journal, durability=self.durability)


def key(item_id: str) -> str:
    return idempotency_key(JOB, item_id, SEND)


def check_marks_guard_every_delivery(receiver: DurableReceiver, job: str, rows: dict, context: str) -> dict[str, int]:
    """What must hold the moment a runner is dead (or its database crashed), whatever it was doing:
    nothing delivered twice, no delivery without its committed mark, no SUCCEEDED the receiver lacks.
    ``rows``: the job's journal rows by (item_id, step). Returns the receiver's counts."""
    counts = receiver.counts(job)
    assert all(n == 1 for n in counts.values()), f"{context}: delivered twice: {counts}"
    for item_id in counts:
        # The guard: a send the receiver has must have its IN_FLIGHT (or later) record committed.
        row = rows.get((item_id, SEND))
        assert row is not None, f"{context}: {item_id} was delivered but the journal has no record of it"
        assert row.status in (Status.IN_FLIGHT, Status.SUCCEEDED), f"{context}: {item_id}: {row.status}"
    for (item_id, step), row in rows.items():
        if step == SEND and row.status == Status.SUCCEEDED:
            # The journal never claims a send the receiver does not have.
            assert row.receipt == receiver.lookup(idempotency_key(job, item_id, SEND)), (
                f"{context}: {item_id} receipt mismatch"
            )
    return counts


def check_safe_after_kill(s: Setup, context: str) -> dict[str, int]:
    with s.open_journal() as journal:
        rows = {(r.item_id, r.step): r for r in journal.rows(JOB)}
    # The counts kept with each job were written in the killed transactions or not at all.
    backends.assert_counts_exact(s.journal)
    return check_marks_guard_every_delivery(s.receiver, JOB, rows, context)


def in_flight_sends(s: Setup) -> dict[str, bool]:
    """Sends the journal has IN_FLIGHT: item -> whether the receiver has it (the unknown window)."""
    counts = s.receiver.counts(JOB)
    with s.open_journal() as journal:
        return {r.item_id: r.item_id in counts for r in journal.rows(JOB)
                if r.step == SEND and r.status == Status.IN_FLIGHT}


def resume_until_complete(
    s: Setup, context: str, max_runs: int = 4
) -> tuple[list[dict], list[tuple[str, str]]]:
    """Run the child again (no kill) until it exits 0; settle holds between runs like an operator."""
    summaries: list[dict] = []
    decisions: list[tuple[str, str]] = []
    for _ in range(max_runs):
        code, summary, err = s.child().finish()
        assert code in (EXIT_COMPLETED, EXIT_NEEDS_REVIEW), (
            f"{context}: resumed run ended with exit code {code} (4 = JobBusyError: a dead runner's "
            f"lock blocked it):\n{summary}\n{err}"
        )
        summaries.append(summary)
        if code == EXIT_COMPLETED:
            assert summary["status"] == "completed" and summary["held"] == []
            return summaries, decisions
        assert summary["held"], f"{context}: exit 3 without a held item: {summary}"
        with s.open_journal() as journal:
            held = journal.held(JOB)
            assert sorted([h.item_id, h.step, h.reason.value] for h in held) == sorted(summary["held"])
            for h in held:
                assert h.step == SEND and h.reason == HeldReason.UNKNOWN_OUTCOME, f"{context}: {h}"
                receipt = s.receiver.lookup(key(h.item_id))
                journal.resolve(JOB, h.item_id, h.step, delivered=receipt is not None, receipt=receipt,
                                resolved_by="oncall", note="asked the receiver for the idempotency key")
                decisions.append((h.item_id, "delivered" if receipt else "not_delivered"))
    raise AssertionError(f"{context}: job not complete after {max_runs} resumed runs: {summaries}")


def check_complete(s: Setup, context: str, decisions: list[tuple[str, str]]) -> None:
    counts = s.receiver.counts(JOB)
    assert sorted(counts) == IDS, f"{context}: lost items: {sorted(set(IDS) - set(counts))}"
    twice = {k: v for k, v in counts.items() if v > 1}
    assert set(counts.values()) == {1}, f"{context}: duplicates: {twice}"
    backends.assert_counts_exact(s.journal)
    with s.open_journal() as journal:
        rows = journal.rows(JOB)
        assert sorted((r.item_id, r.step) for r in rows) == sorted((i, st) for i in IDS for st in STEPS)
        assert {r.status for r in rows} == {Status.SUCCEEDED}, context
        assert [r for r in rows if r.held_reason is not None] == [], context
        assert journal.held(JOB) == []
        summary = journal.job(JOB)
        assert summary is not None and summary.settled, context
        for r in rows:
            if r.step == SEND:
                assert r.receipt == s.receiver.lookup(key(r.item_id)), f"{context}: {r.item_id} receipt"
        audit = journal.resolutions(JOB)
        assert [(a.item_id, a.decision) for a in audit] == decisions, context
    if s.on_sqlite:
        # The lock files a SIGKILLed runner left are still there: nobody cleaned them up by hand.
        assert list(Path(str(s.journal) + ".locks").iterdir()), context


# ------------------------------------------------------------------------- deterministic kills


@pytest.mark.parametrize("concurrency", CONCURRENCY)
@pytest.mark.parametrize("durability", ["full", "normal"])
@pytest.mark.parametrize("boundary", BOUNDARIES)
def test_sigkill_at_boundary(tmp_path, boundary, durability, concurrency, new_journal):
    s = Setup(tmp_path, durability, concurrency, new_journal)
    context = f"kill at {boundary} of {KILL_ITEM} ({durability}, concurrency {concurrency})"
    child = s.child(pause_at=boundary, pause_item=KILL_ITEM)
    assert child.wait_ready().startswith(f"PAUSED {boundary} {KILL_ITEM}")
    assert child.kill(), "the child must have been killed, not have exited"

    counts = check_safe_after_kill(s, context)
    if concurrency > 1:
        check_concurrent_kill(s, context, boundary)
        return

    # Exactly where the kill landed.
    accepted = boundary in ("after_accept", "after_reply")
    assert counts == {i: 1 for i in IDS[:12] + ([KILL_ITEM] if accepted else [])}
    with s.open_journal() as journal:
        rows = {(r.item_id, r.step): r for r in journal.rows(JOB)}
        assert journal.held(JOB) == []
    for i in IDS[:12]:
        assert [rows[(i, st)].status for st in STEPS] == [Status.SUCCEEDED] * 3, i
    assert not [k for k in rows if k[0] > KILL_ITEM], "nothing after the killed item was started"
    send_row = rows.get((KILL_ITEM, SEND))
    if boundary == "local":
        assert send_row is None
    else:
        assert send_row is not None and send_row.status == Status.IN_FLIGHT and send_row.attempts == 1
        assert send_row.receipt is None
        # The IN_FLIGHT commit took the item's buffered local results with it (JobRun's contract).
        assert rows[(KILL_ITEM, "validate")].status == Status.SUCCEEDED
        assert rows[(KILL_ITEM, "transform")].status == Status.SUCCEEDED

    summaries, decisions = resume_until_complete(s, context)

    first = summaries[0]
    if boundary == "local":
        assert decisions == []
        assert len(summaries) == 1
        assert first["skipped"] >= 12 * 3 and first["executed"] + first["skipped"] == 90
    else:
        # Never re-sent blindly: the unknown-outcome send is held, everything else finishes.
        assert first["status"] == "needs_review"
        assert first["held"] == [[KILL_ITEM, SEND, "unknown_outcome"]]
        assert first["items_completed"] == N_ITEMS - 1
        assert first["executed"] == 17 * 3 and first["skipped"] == 12 * 3 + 2
        assert decisions == [(KILL_ITEM, "delivered" if accepted else "not_delivered")]
        assert len(summaries) == 2
        # After the resolution: sent once if it never arrived, nothing at all if it did.
        assert (summaries[1]["executed"], summaries[1]["skipped"]) == ((0, 90) if accepted else (1, 89))
    check_complete(s, context, decisions)


def check_concurrent_kill(s: Setup, context: str, boundary: str) -> None:
    in_flight = in_flight_sends(s)
    if boundary == "local":
        with s.open_journal() as journal:
            assert [r for r in journal.rows(JOB) if r.item_id == KILL_ITEM and r.step == SEND] == []
    else:
        assert KILL_ITEM in in_flight, f"{context}: the paused send must be IN_FLIGHT: {in_flight}"
    if boundary in ("after_accept", "after_reply"):
        assert in_flight[KILL_ITEM], f"{context}: the receiver has the paused send"

    summaries, decisions = resume_until_complete(s, context)
    first = summaries[0]
    # No verify here: every send that was in flight is held, and nothing else is; none is re-sent.
    assert sorted(item for item, _, _ in first["held"]) == sorted(in_flight), context
    assert sorted(decisions) == sorted((i, "delivered" if got else "not_delivered") for i, got in in_flight.items())
    assert first["items_completed"] == N_ITEMS - len(in_flight)
    check_complete(s, context, decisions)


# ------------------------------------------------------------------------------- random kills


def wait_for_deliveries(s: Setup, child: ChildRun, count: int, timeout: float = 20.0) -> None:
    """Until the receiver has ``count`` of the job's items (or the child ended, or ``timeout``)."""
    deadline = time.monotonic() + timeout
    while (count and child.proc.poll() is None and time.monotonic() < deadline
           and len(s.receiver.counts(JOB)) < count):
        time.sleep(0.001)


@pytest.mark.parametrize("concurrency", CONCURRENCY)
def test_sigkill_at_random_moments(tmp_path, concurrency, new_journal):
    seed = int(os.environ.get("CRASH_MATRIX_SEED", random.SystemRandom().randrange(2**32)))
    print(f"crash matrix seed: {seed} (rerun with CRASH_MATRIX_SEED={seed})")
    rng = random.Random(seed)
    landed_mid_batch = 0
    windows = {"before_accept": 0, "after_accept": 0}  # where kills caught a send IN_FLIGHT
    log: list[str] = []
    trial = 0
    # At least RANDOM_TRIALS trials; a few more (up to twice as many) if the kills so far have not
    # yet caught a send on both sides of the receiver's accept, or landed mid-batch often enough.
    while trial < RANDOM_TRIALS or (
        (min(windows.values()) == 0 or landed_mid_batch < RANDOM_TRIALS // 2) and trial < 2 * RANDOM_TRIALS
    ):
        durability = ("full", "normal")[trial % 2]
        s = Setup(tmp_path / f"trial-{trial:02d}", durability, concurrency, new_journal)
        seen_in_flight: set[str] = set()
        for kill_no in range(rng.randint(1, 2)):  # sometimes the resumed run is killed as well
            context = f"seed {seed} trial {trial} kill {kill_no} ({durability}, concurrency {concurrency})"
            # Aimed by the receiver's count, not by the clock (a loaded machine runs the child at any
            # speed): after a random number of deliveries, a random few milliseconds more.
            after, delay = rng.randint(0, N_ITEMS - 2), rng.uniform(0.0, 0.012)  # ~ one item's steps
            child = s.child(step_ms=(1.0, 3.0))
            child.wait_ready()
            wait_for_deliveries(s, child, after)
            time.sleep(delay)
            killed = child.kill()
            counts = check_safe_after_kill(s, context)
            caught = {i: a for i, a in in_flight_sends(s).items() if i not in seen_in_flight}
            seen_in_flight.update(caught)  # a held send stays IN_FLIGHT: count each one once
            for accepted in caught.values():
                windows["after_accept" if accepted else "before_accept"] += 1
            log.append(f"{context}: after {after} + {delay * 1000:.1f} ms, killed={killed}, delivered={len(counts)}, "
                       f"in flight {caught}")
            if kill_no == 0 and killed and 0 < len(counts) < N_ITEMS:
                landed_mid_batch += 1
        _, decisions = resume_until_complete(s, f"seed {seed} trial {trial} ({durability})")
        check_complete(s, f"seed {seed} trial {trial} ({durability})", decisions)
        trial += 1
    print("\n".join(log))
    print(f"kills caught a send in flight: {windows}")
    # The matrix only means something if the kills actually land in the middle of sends.
    assert landed_mid_batch >= RANDOM_TRIALS // 2, (
        f"only {landed_mid_batch} kills landed mid-batch:\n" + "\n".join(log)
    )
    # ... and some of them inside a send, on both sides of the receiver's accept.
    assert min(windows.values()) >= 1, f"no kill caught a send on one side of the accept: {windows}"


# ------------------------------------------------------------- a verify with three answers


def check_settled_by_verify(s: Setup, context: str, in_flight: dict[str, bool]) -> None:
    """Resume once: the run settles every send that was in flight by itself - no hold, nothing sent
    twice - and audits each NOT_DELIVERED re-send (resolved_by verify), in item order."""
    code, summary, err = s.child(verify="three_way").finish()
    assert code == EXIT_COMPLETED, f"{context}: exit {code}: {summary}\n{err}"
    assert summary["held"] == [], context
    not_delivered = sorted(i for i, got in in_flight.items() if not got)
    assert (summary["resent"], summary["verified"]) == (len(not_delivered), len(in_flight) - len(not_delivered))
    with s.open_journal() as journal:
        audit = journal.resolutions(JOB)
    assert all(a.resolved_by == "verify" and a.previous_status == "IN_FLIGHT" for a in audit), audit
    check_complete(s, context, [(i, "not_delivered") for i in not_delivered])


@pytest.mark.parametrize("boundary", ["before_send", "after_accept"])
def test_sigkill_at_16_in_flight_then_three_way_verify_settles_every_send(tmp_path, boundary, new_journal):
    """A SIGKILL with 16 sends in flight; the resumed run asks the receiver
    about each (receipt -> done, NOT_DELIVERED -> sent once now): zero holds, zero duplicates."""
    s = Setup(tmp_path, "full", 16, new_journal)
    child = s.child(pause_at=boundary, pause_item=KILL_ITEM, step_ms=(1.0, 3.0), verify="three_way")
    child.wait_ready()
    assert child.kill()
    context = f"three-way verify, kill at {boundary}"
    check_safe_after_kill(s, context)
    in_flight = in_flight_sends(s)
    assert KILL_ITEM in in_flight and in_flight[KILL_ITEM] == (boundary == "after_accept"), in_flight
    check_settled_by_verify(s, context, in_flight)


def test_sigkill_at_random_moments_then_three_way_verify_settles_every_send(tmp_path, new_journal):
    seed = int(os.environ.get("CRASH_MATRIX_SEED", random.SystemRandom().randrange(2**32)))
    print(f"crash matrix seed: {seed} (rerun with CRASH_MATRIX_SEED={seed})")
    rng = random.Random(seed)
    caught = 0
    for trial in range(6):
        s = Setup(tmp_path / f"trial-{trial}", "full", 16, new_journal)
        child = s.child(step_ms=(1.0, 3.0), verify="three_way")
        child.wait_ready()
        time.sleep(rng.uniform(0.04, 0.2))
        child.kill()
        context = f"seed {seed} trial {trial}"
        check_safe_after_kill(s, context)
        in_flight = in_flight_sends(s)
        caught += bool(in_flight)
        check_settled_by_verify(s, context, in_flight)
    assert caught >= 1, "no kill caught a send in flight"
