"""The seed article's experiment, re-run against our runner.

50 items x 3 steps (validate, transform, notify_external); item 41's send fails once, either before
the receiver accepted it or after (the reply is lost); 5 trials per fault mode; simulated waits
1.5 ms per local step and 4 ms per send (``time.sleep``).

* re-run everything: no journal; the failed run is started again from item 1.
* ours: run 1 fails at item 41; run 2 (no verify, as in the article) holds 41 and finishes 42-50;
  a human resolves the hold by asking the receiver for the idempotency key's receipt
  (``journal.resolve``); run 3 sends item 41 once (before accept) or nothing (after accept).

Counts are deterministic and must equal the article's table; times are compared with the floor:
the sum of the simulated waits of the steps actually executed.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from airflow_resumable.journal import StepJournal
from airflow_resumable.journal.backend import Durability
from airflow_resumable.runner import Step, StepContext, idempotency_key, run_batch

ITEMS = 50
FAIL_AT = "item-041"
LOCAL_WAIT = 0.0015
SEND_WAIT = 0.004
SEND_STEP = "notify_external"
MODES = ("before_accept", "after_accept")
JOB_ID = "article/job-1"

# The article's table: what every trial must reproduce exactly.
EXPECTED: dict[str, dict[str, int]] = {
    "before_accept": {"rerun_executed": 150, "rerun_skipped": 0, "rerun_duplicates": 40,
                      "run2_executed": 27, "run2_skipped": 122, "run3_executed": 1, "duplicates": 0},
    "after_accept": {"rerun_executed": 150, "rerun_skipped": 0, "rerun_duplicates": 41,
                     "run2_executed": 27, "run2_skipped": 122, "run3_executed": 0, "duplicates": 0},
}


class RefusedBeforeAccept(ConnectionError):
    """The receiver failed before it accepted the notification."""


class ReplyLost(TimeoutError):
    """The receiver accepted the notification, then the reply was lost."""


class MockReceiver:
    """In-process receiver: keeps receipts by idempotency key and counts every accepted delivery.

    It does not deduplicate: a duplicate send must show up as a duplicate here.
    """

    def __init__(self, mode: str, send_wait: float) -> None:
        self.mode = mode
        self.send_wait = send_wait
        self.fault_armed = True  # item 41 fails once
        self.accepted: Counter[str] = Counter()
        self.receipts: dict[str, str] = {}

    def deliver(self, item_id: str, key: str | None) -> str:
        time.sleep(self.send_wait)
        failing = item_id == FAIL_AT and self.fault_armed
        if failing and self.mode == "before_accept":
            self.fault_armed = False
            raise RefusedBeforeAccept(item_id)
        self.accepted[item_id] += 1
        receipt = f"rcpt-{item_id}-{self.accepted[item_id]}"
        if key is not None:
            self.receipts[key] = receipt
        if failing:
            self.fault_armed = False
            raise ReplyLost(item_id)
        return receipt

    def lookup(self, key: str) -> str | None:
        return self.receipts.get(key)

    @property
    def duplicates(self) -> int:
        return sum(n - 1 for n in self.accepted.values() if n > 1)


def article_items() -> list[dict[str, Any]]:
    return [{"id": f"item-{i:03d}", "body": f"payload {i}"} for i in range(1, ITEMS + 1)]


class _Executed:
    """Counts the steps that actually ran (started), by kind, to build the wait floor."""

    def __init__(self) -> None:
        self.local = 0
        self.send = 0

    @property
    def total(self) -> int:
        return self.local + self.send

    def floor(self, local_wait: float, send_wait: float) -> float:
        return self.local * local_wait + self.send * send_wait


def rerun_everything(mode: str, local_wait: float, send_wait: float) -> dict[str, Any]:
    """No journal: run, fail at 41, start again from item 1. Times the re-run."""
    receiver = MockReceiver(mode, send_wait)
    items = article_items()

    def one_pass(count: _Executed) -> None:
        for item in items:
            for _ in range(2):
                count.local += 1
                time.sleep(local_wait)
            count.send += 1
            receiver.deliver(item["id"], None)  # no journal, so no key to send either

    first = _Executed()
    try:
        one_pass(first)
    except (RefusedBeforeAccept, ReplyLost):
        pass
    again = _Executed()
    start = time.perf_counter()
    one_pass(again)
    seconds = time.perf_counter() - start
    return {"run1_executed": first.total, "rerun_executed": again.total, "rerun_skipped": 0,
            "rerun_duplicates": receiver.duplicates, "rerun_ms": seconds * 1e3}


def _article_steps(receiver: MockReceiver, count: list[_Executed], local_wait: float) -> list[Step]:
    # count[0] is swapped per run, so each run's executed steps are counted on their own.
    def local(item: Mapping[str, Any], ctx: StepContext) -> None:
        count[0].local += 1
        time.sleep(local_wait)

    def send(item: Mapping[str, Any], ctx: StepContext) -> str:
        count[0].send += 1
        return receiver.deliver(ctx.item_id, ctx.idempotency_key)

    return [Step("validate", local), Step("transform", local), Step(SEND_STEP, send, side_effect=True)]


def resume_with_journal(mode: str, local_wait: float, send_wait: float, durability: Durability) -> dict[str, Any]:
    receiver = MockReceiver(mode, send_wait)
    items = article_items()
    count = [_Executed()]
    steps = _article_steps(receiver, count, local_wait)
    with tempfile.TemporaryDirectory() as tmp, StepJournal(Path(tmp) / "journal.sqlite3",
                                                           durability=durability) as journal:
        try:
            run_batch(journal, JOB_ID, items, steps, settle_in_task=False)
            raise AssertionError("run 1 should have failed at item 41")
        except (RefusedBeforeAccept, ReplyLost):
            pass
        run1 = count[0]

        count[0] = run2_count = _Executed()
        start = time.perf_counter()
        run2 = run_batch(journal, JOB_ID, items, steps, settle_in_task=False)
        # The human's look-up: does the receiver have a receipt for this idempotency key?
        found = receiver.lookup(idempotency_key(JOB_ID, FAIL_AT, SEND_STEP))
        journal.resolve(JOB_ID, FAIL_AT, SEND_STEP, delivered=found is not None, receipt=found,
                        resolved_by="benchmark", note="looked up on the receiver by idempotency key")
        count[0] = run3_count = _Executed()
        run3 = run_batch(journal, JOB_ID, items, steps, settle_in_task=False)
        seconds = time.perf_counter() - start

    assert run2.executed_steps == run2_count.total and run3.executed_steps == run3_count.total
    floor = run2_count.floor(local_wait, send_wait) + run3_count.floor(local_wait, send_wait)
    return {
        "run1_executed": run1.total,
        "run2_executed": run2.executed_steps,
        "run2_skipped": run2.skipped_steps,
        "run2_held": [f"{h.item_id}:{h.step}:{h.reason.value}" for h in run2.held],
        "resolution": "delivered" if found is not None else "not_delivered",
        "run3_executed": run3.executed_steps,
        "run3_skipped": run3.skipped_steps,
        "run3_status": run3.status,
        "duplicates": receiver.duplicates,
        "items_received_once": sum(1 for n in receiver.accepted.values() if n == 1),
        "resumed_ms": seconds * 1e3,
        "floor_ms": floor * 1e3,
    }


def _summary(mode: str, reruns: list[dict[str, Any]], ours: list[dict[str, Any]]) -> dict[str, Any]:
    def counts(rerun: dict[str, Any], resumed: dict[str, Any]) -> dict[str, int]:
        return ({k: rerun[k] for k in ("rerun_executed", "rerun_skipped", "rerun_duplicates")}
                | {k: resumed[k] for k in ("run2_executed", "run2_skipped", "run3_executed", "duplicates")})

    resumed = [o["resumed_ms"] for o in ours]
    floors = [o["floor_ms"] for o in ours]
    last = ours[-1]
    return {
        "counts": counts(reruns[-1], last),
        "expected": EXPECTED[mode],
        # Every trial, not just the last, must give the article's counts and deliver each item once.
        "counts_identical": all(counts(r, o) == EXPECTED[mode] and o["items_received_once"] == ITEMS
                                for r, o in zip(reruns, ours, strict=True)),
        "run1_executed": last["run1_executed"],
        "run2_held": last["run2_held"],
        "resolution": last["resolution"],
        "run3_skipped": last["run3_skipped"],
        "items_received_once": last["items_received_once"],
        "resumed_ms": [round(x, 2) for x in resumed],
        "resumed_ms_mean": statistics.fmean(resumed),
        "resumed_ms_median": statistics.median(resumed),
        "floor_ms": statistics.median(floors),
        # The median trial against its floor: one trial hit by a noisy neighbour does not decide.
        "resumed_over_floor": statistics.median(x / f for x, f in zip(resumed, floors, strict=True)) if floors[0] else None,
    }


def run(trials: int = 5, durabilities: tuple[Durability, ...] = ("full", "normal")) -> dict[str, Any]:
    """Both fault modes, ``trials`` each. The first durability is the one the targets judge; the
    others (the article's ``normal``) are shown next to it."""
    modes: dict[str, Any] = {}
    for mode in MODES:
        reruns = [rerun_everything(mode, LOCAL_WAIT, SEND_WAIT) for _ in range(trials)]
        ours = {d: [resume_with_journal(mode, LOCAL_WAIT, SEND_WAIT, d) for _ in range(trials)] for d in durabilities}
        summary = _summary(mode, reruns, ours[durabilities[0]])
        for other in durabilities[1:]:
            extra = _summary(mode, reruns, ours[other])
            summary[other] = {k: extra[k] for k in ("counts_identical", "resumed_ms_median", "resumed_over_floor")}
        rerun_ms = [r["rerun_ms"] for r in reruns]
        rerun_floor_ms = ITEMS * (2 * LOCAL_WAIT + SEND_WAIT) * 1e3
        summary |= {
            "rerun_ms": [round(x, 2) for x in rerun_ms],
            "rerun_ms_mean": statistics.fmean(rerun_ms),
            # No journal at all, so this is what time.sleep alone overshoots by on this machine.
            "rerun_over_floor": statistics.median(rerun_ms) / rerun_floor_ms,
        }
        modes[mode] = summary
    return {"trials": trials, "durability": durabilities[0], "durabilities": list(durabilities),
            "waits_ms": {"local": LOCAL_WAIT * 1e3, "send": SEND_WAIT * 1e3}, "modes": modes}
