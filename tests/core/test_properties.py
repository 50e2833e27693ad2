"""Property test of the runner + journal against a model written from the product's rules.

Random batches (ids, payloads, order, subsets), random step failures (a local step raising; the send
failing before the receiver accepted it, or after, or provably never leaving: ``NotSentError``),
random input edits between runs, and a human who resolves held steps by asking the receiver (its
receipt if it has the idempotency key, else "not delivered") and input changes at random (keep
previous / use new). Besides that human, two people decide on what they *last saw*: each "looks" (the
held steps with their versions, and what the receiver said of each send then) and "decides" later -
after runs, the other people and the sensor may have changed those rows - passing the version they
saw; a decision about a row that changed since must be refused (``StaleDecisionError``) and changes
nothing, one about an unchanged row is applied as the model says. The sensor's verify
(``verify_held``) asks the receiver in between and settles what it can. After every run:

* the receiver never got a (job, item, step) twice, except after an explicit ``use_new_input``
  resolution of that item (which by definition sends the new input again), and then under a key it
  never saw (the item's next key generation);
* every item of the batch ended SUCCEEDED on every step (for its current input) or is in ``held``;
* executed + skipped counts are exactly what the spec says: per completed item, every step is either
  executed or skipped; per held item, exactly the steps before the held one are; executed equals the
  number of step calls that returned; skipped includes sends settled by ``verify``;
* the journal's rows (status, digest, held reason, new digest, attempts, key generation, not-sent
  flag) equal the model's; a row's version moves on exactly when the model's row changes.

At the end, after a phase that settles everything, every item's send of its current key generation is
at the receiver (none lost) and no key reached it twice.

The property runs with ``concurrency`` 1, 2 and 16. With sends on worker threads, a run
that stops on an exception may have started items after the failing one (their sends are recorded
before it returns), so for such a run each item's rows must instead be what the model gives for that
item stopped at *some* step boundary (or untouched), and the model adopts the journal's rows. A run
that does not raise must match the model exactly, as with concurrency 1.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from airflow_resumable.exceptions import StaleDecisionError
from airflow_resumable.journal import HeldReason, HeldStep, Status, StepJournal
from airflow_resumable.runner import (
    NOT_DELIVERED,
    NotSentError,
    Step,
    StepContext,
    canonical_digest,
    run_batch,
    verify_held,
)
from tests.support import backends
from tests.support.receivers import AcceptedThenLost, RefusedBeforeAccept

pytestmark = pytest.mark.core

# validate, transform: local; notify: the side effect; ack: a local step after the send.
STEPS = (("validate", False), ("transform", False), ("notify", True), ("ack", False))
STEP_NAMES = tuple(name for name, _ in STEPS)
SIDE_EFFECT = {name: side for name, side in STEPS}
FAULT_STEPS = ("validate", "transform", "notify", "notify", "notify", "ack")
LOCAL_FAULT, BEFORE_ACCEPT, AFTER_ACCEPT, UNREACHABLE = "raise", "before_accept", "after_accept", "unreachable"
IC, UO = HeldReason.INPUT_CHANGED.value, HeldReason.UNKNOWN_OUTCOME.value


class LocalBoom(Exception):
    pass


class Unreachable(NotSentError):
    pass


FAULT_ERRORS = {LOCAL_FAULT: LocalBoom, BEFORE_ACCEPT: RefusedBeforeAccept, AFTER_ACCEPT: AcceptedThenLost,
                UNREACHABLE: Unreachable}


# ------------------------------------------------------------------------------- the outside world


class Receiver:
    """In memory: deliveries by idempotency key, and the duplicate check of the property."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.by_key: dict[str, str] = {}
        self.counts: dict[tuple[str, str], int] = {}
        self.key_of: dict[tuple[str, str, int], str] = {}  # (item, step, generation) -> key
        self.reset_allowed: set[str] = set()  # items whose next delivery may repeat (use_new_input)
        self.violations: list[str] = []
        self.lock = threading.Lock()  # sends arrive on worker threads when concurrent

    def check_key(self, ctx: StepContext) -> None:
        assert ctx.job_id == self.job_id
        key = ctx.idempotency_key
        assert isinstance(key, str) and 0 < len(key) <= 255 and key.isascii() and key.isprintable()
        known = self.key_of.setdefault((ctx.item_id, ctx.step, ctx.generation), key)
        assert known == key, "the idempotency key must be the same on every retry"
        owners = [k for k, v in self.key_of.items() if v == key]
        assert owners == [(ctx.item_id, ctx.step, ctx.generation)], "keys must be distinct per (item, step, generation)"

    def deliver(self, ctx: StepContext) -> str:
        with self.lock:
            return self._deliver(ctx)

    def _deliver(self, ctx: StepContext) -> str:
        self.check_key(ctx)
        target = (ctx.item_id, ctx.step)
        if self.counts.get(target, 0) and ctx.item_id not in self.reset_allowed:
            self.violations.append(f"{target} delivered again without a use_new_input resolution")
        if ctx.idempotency_key in self.by_key:
            self.violations.append(f"{target} sent under a key already delivered: a deduping receiver drops it")
        self.reset_allowed.discard(ctx.item_id)
        self.counts[target] = self.counts.get(target, 0) + 1
        receipt = f"rcpt-{ctx.item_id}-{self.counts[target]}"
        self.by_key.setdefault(ctx.idempotency_key, receipt)
        return receipt

    def lookup(self, key: str) -> str | None:
        return self.by_key.get(key)


class World:
    def __init__(self, job_id: str, with_verify: bool) -> None:
        self.receiver = Receiver(job_id)
        self.with_verify = with_verify
        self.faults: dict[tuple[str, str], str] = {}
        self.returned = 0  # step calls that returned normally (this run)
        self.verified = 0  # verify calls that found a receipt (this run)

    def steps(self) -> list[Step]:
        def make(name: str, index: int):
            def fn(item: Mapping[str, Any], ctx: StepContext) -> Any:
                assert ctx.step == name and ctx.digest == canonical_digest(item)
                # Earlier steps' outputs are handed on, whether they ran now or earlier.
                assert tuple(ctx.outputs) == STEP_NAMES[:index]
                if name == "ack":
                    assert isinstance(ctx.outputs["notify"], str) and ctx.outputs["notify"].startswith("rcpt-")
                fault = self.faults.get((ctx.item_id, name))
                if SIDE_EFFECT[name]:
                    if fault in (BEFORE_ACCEPT, UNREACHABLE):
                        with self.receiver.lock:
                            self.receiver.check_key(ctx)
                        raise FAULT_ERRORS[fault]()
                    receipt = self.receiver.deliver(ctx)
                    if fault == AFTER_ACCEPT:
                        raise AcceptedThenLost()
                    with self.receiver.lock:
                        self.returned += 1
                    return receipt
                if fault == LOCAL_FAULT:
                    raise LocalBoom()
                self.returned += 1
                return {"step": name, "v": item["v"]}
            return fn

        def verify(ctx: StepContext) -> str | None:
            self.receiver.check_key(ctx)
            receipt = self.receiver.lookup(ctx.idempotency_key)
            self.verified += receipt is not None
            return receipt

        return [
            Step(name, make(name, i), side_effect=side, verify=verify if (side and self.with_verify) else None)
            for i, (name, side) in enumerate(STEPS)
        ]


# ----------------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Row:
    status: str
    digest: str
    held: str | None = None
    new_digest: str | None = None
    attempts: int = 0
    generation: int = 0
    not_sent: bool = False


@dataclass
class Outcome:
    raised: type[BaseException] | None = None
    executed: int = 0
    skipped: int = 0
    verified: int = 0
    completed: int = 0
    held: list[tuple[str, str, str]] | None = None
    counted: int = 0  # steps of held items before their held step


class Model:
    """The per-step rules and the resolutions, over plain dicts."""

    def __init__(self, world: World) -> None:
        self.world = world
        self.rows: dict[tuple[str, str], Row] = {}
        # How many times each row changed: its journal version must move on exactly then. What the
        # journal showed for each count (a person's look), to check that.
        self.writes: dict[tuple[str, str], int] = {}
        self.versions_seen: dict[tuple[str, str], dict[int, str]] = {}

    def _set(self, key: tuple[str, str], row: Row) -> None:
        if self.rows.get(key) != row:
            self.writes[key] = self.writes.get(key, 0) + 1
        self.rows[key] = row

    def adopt(self, before: dict[tuple[str, str], Row], writes: dict[tuple[str, str], int],
              rows: dict[tuple[str, str], Row]) -> None:
        """Take the journal's rows after a concurrent run that stopped part way (which items it reached is
        timing), instead of what the model ran: ``before`` and ``writes`` as they were before that run."""
        self.rows, self.writes = dict(before), dict(writes)
        for key, row in rows.items():
            self._set(key, row)

    def check_version(self, key: tuple[str, str], version: str) -> None:
        """The version the journal shows is one per state of the row the model counts: the same until the
        row changes, another one after."""
        shown = self.versions_seen.setdefault(key, {})
        assert shown.setdefault(self.writes.get(key, 0), version) == version, f"{key}: version moved, row did not"
        assert list(shown.values()).count(version) == 1, f"{key}: the row changed, its version {version} did not"

    def run(self, items: list[dict[str, Any]], faults: dict[tuple[str, str], str],
            max_steps: int | None = None) -> Outcome:
        """``max_steps``: stop after deciding that many steps (an item cut off at a step boundary)."""
        out = Outcome(held=[])
        decided = 0
        for item in items:
            item_id, digest = str(item["id"]), canonical_digest(item)
            for index, name in enumerate(STEP_NAMES):
                if max_steps is not None and decided == max_steps:
                    return out
                decided += 1
                key = (item_id, name)
                row = self.rows.get(key)
                if row is not None and row.digest != digest:  # rule 2: hold the item, next item
                    if row.held == IC and row.new_digest != digest:
                        event("input changed again while held")
                    if row.held != IC:
                        self._set(key, replace(row, held=IC, new_digest=digest))
                    out.held.append((item_id, name, IC))
                    out.counted += index
                    break
                if row is not None and row.status == "SUCCEEDED":  # rule 1: skip
                    if row.held == IC:  # the input went back to the journaled one
                        event("input went back: hold released")
                        self._set(key, replace(row, held=None, new_digest=None))
                    out.skipped += 1
                    continue
                not_sent = row is not None and row.not_sent and row.status == "FAILED"  # provably not sent: send it
                if row is not None and SIDE_EFFECT[name] and not not_sent:  # rule 4: never send again; verify or hold
                    if self.world.with_verify and self.world.receiver.lookup(self._key(item_id, name)):
                        self._set(key, replace(row, status="SUCCEEDED", held=None, new_digest=None))
                        out.skipped += 1
                        out.verified += 1
                        continue
                    if row.held != UO:
                        self._set(key, replace(row, held=UO, new_digest=None))
                    out.held.append((item_id, name, UO))
                    out.counted += index
                    break
                # no row, a local step IN_FLIGHT / FAILED (rule 3), or a send that never left: run it
                attempts, generation = (row.attempts, row.generation) if row else (0, 0)
                fault = faults.get(key)
                if fault is not None:  # rule 5: FAILED, and the run stops with the exception
                    self._set(key, Row("FAILED", digest, attempts=attempts + 1, generation=generation,
                                       not_sent=fault == UNREACHABLE))
                    out.raised = FAULT_ERRORS[fault]
                    return out
                self._set(key, Row("SUCCEEDED", digest, attempts=attempts + 1, generation=generation))
                out.executed += 1
            else:
                out.completed += 1
        return out

    def _key(self, item_id: str, step: str) -> str:
        row = self.rows[(item_id, step)]
        return self.world.receiver.key_of.get((item_id, step, row.generation), "")

    def unknown_outcome(self, key: tuple[str, str]) -> bool:
        """A send whose outcome nobody knows: what resolve settles (held, or not held yet)."""
        row = self.rows[key]
        return SIDE_EFFECT[key[1]] and row.status != "SUCCEEDED" and not row.not_sent

    def resolve(self, item_id: str, step: str, delivered: bool) -> None:
        row = self.rows[(item_id, step)]
        assert self.unknown_outcome((item_id, step))
        held = row.held if row.held == IC else None
        if delivered:
            self._set((item_id, step), replace(row, status="SUCCEEDED", held=held))
        else:  # owed under the same key: the next run sends it once, without verify
            self._set((item_id, step), replace(row, status="FAILED", held=held, not_sent=True))

    def resolve_input_change(self, item_id: str, use_new: bool) -> None:
        mine = {k: r for k, r in self.rows.items() if k[0] == item_id}
        changed = [r for r in mine.values() if r.held == IC]
        assert len(changed) == 1
        for key, row in mine.items():
            if use_new:  # a new operation: every step runs again; sends under the next key generation
                side = SIDE_EFFECT[key[1]]
                self._set(key, replace(row, status="FAILED", digest=changed[0].new_digest, held=None,
                                       new_digest=None, generation=row.generation + side, not_sent=side))
            else:
                self._set(key, replace(row, digest=changed[0].new_digest, new_digest=None,
                                       held=None if row.held == IC else row.held))


# ----------------------------------------------------------------------------------- the test


def journal_rows(journal: StepJournal, job_id: str) -> dict[tuple[str, str], Row]:
    return {
        (r.item_id, r.step): Row(r.status.value, r.digest, None if r.held_reason is None else r.held_reason.value,
                                 r.new_digest, r.attempts, r.generation, r.not_sent)
        for r in journal.rows(job_id)
    }


VALUES = st.sampled_from([0, 1, 1, 2])
NAMES_ALPHABET = st.characters(exclude_characters="\x00", exclude_categories=("Cs",))
NAMES = st.text(NAMES_ALPHABET, min_size=1, max_size=6)

ids_strategy = st.lists(
    # Any text but NUL, which no id may hold (PostgreSQL's text cannot; refused on both engines).
    st.one_of(st.integers(-(10**6), 10**6), NAMES.filter(lambda s: s.strip() != "")),
    min_size=1, max_size=7, unique_by=str,
)


def check_concurrent_stop(journal: StepJournal, world: World, model: Model, before: dict[tuple[str, str], Row],
                          writes: dict[tuple[str, str], int], job_id: str, batch: list[dict[str, Any]],
                          faults: dict[tuple[str, str], str]) -> None:
    """A concurrent run raised: every item is untouched, or as the model has it cut off at a step boundary."""
    rows = journal_rows(journal, job_id)
    in_batch = {str(item["id"]) for item in batch}
    assert {k: r for k, r in rows.items() if k[0] not in in_batch} == {
        k: r for k, r in before.items() if k[0] not in in_batch}, "a run touched an item not in its batch"
    assert [k for k, r in rows.items() if r.status == "IN_FLIGHT"] == [], "every started send was recorded"
    for item in batch:
        item_id = str(item["id"])
        mine = {k: r for k, r in rows.items() if k[0] == item_id}
        candidates = []
        for cut in range(len(STEPS) + 1):
            alone = Model(world)
            alone.rows = {k: r for k, r in before.items() if k[0] == item_id}
            alone.run([item], faults, max_steps=cut)
            candidates.append(alone.rows)
        assert mine in candidates, f"item {item_id!r}: {mine} is no step boundary of {candidates}"
    event("concurrent run stopped on an exception")
    model.adopt(before, writes, rows)


def check_run(journal: StepJournal, world: World, model: Model, job_id: str, batch: list[dict[str, Any]],
              faults: dict[tuple[str, str], str], concurrency: int = 1) -> Outcome:
    world.faults, world.returned, world.verified = faults, 0, 0
    before, writes = dict(model.rows), dict(model.writes)
    expected = model.run(batch, faults)
    event(f"run raised {expected.raised.__name__}" if expected.raised else "run returned")
    for _, _, reason in expected.held or []:
        event(f"held {reason}")
    if expected.verified:
        event("verify found a receipt")
    try:
        result = run_batch(journal, job_id, [dict(item) for item in batch], world.steps(), concurrency=concurrency,
                           settle_in_task=False)
    except (LocalBoom, RefusedBeforeAccept, AcceptedThenLost, Unreachable) as exc:
        assert expected.raised is not None, f"raised {type(exc).__name__}, the model expected no exception"
        if concurrency == 1:
            assert expected.raised is type(exc), f"raised {type(exc).__name__}, model expected {expected.raised}"
        else:
            # Another fault of this batch may be reached first when later items run alongside.
            assert type(exc) in {FAULT_ERRORS[mode] for mode in faults.values()}
            check_concurrent_stop(journal, world, model, before, writes, job_id, batch, faults)
    else:
        assert expected.raised is None, f"model expected {expected.raised} to propagate"
        assert result.executed_steps == expected.executed == world.returned
        assert result.skipped_steps == expected.skipped
        assert result.verified_steps == expected.verified == world.verified
        assert result.items_total == len(batch)
        assert result.items_completed == expected.completed == len(batch) - len(result.held)
        # Each step of each completed item is executed or skipped; of a held item, the steps before it.
        assert result.executed_steps + result.skipped_steps == len(STEPS) * result.items_completed + expected.counted
        assert sorted((h.item_id, h.step, h.reason.value) for h in result.held) == sorted(expected.held)
        assert all(h.job_id == job_id for h in result.held)
        assert len({h.item_id for h in result.held}) == len(result.held), "an item is held once per run"
        assert result.status == ("needs_review" if result.held else "completed")

        rows = journal_rows(journal, job_id)
        held_items = {h.item_id for h in result.held}
        for item in batch:
            item_id = str(item["id"])
            if item_id in held_items:
                continue
            mine = [rows.get((item_id, name)) for name in STEP_NAMES]
            assert all(r is not None and r.status == "SUCCEEDED" and r.digest == canonical_digest(item)
                       and r.held is None for r in mine), f"item {item_id!r} is neither done nor held"
        in_batch = {str(item["id"]) for item in batch}
        assert {h.item_id for h in journal.held(job_id)} & in_batch == held_items

    assert journal_rows(journal, job_id) == model.rows
    assert sorted((h.item_id, h.step, h.reason.value) for h in journal.held(job_id)) == sorted(
        (k[0], k[1], r.held) for k, r in model.rows.items() if r.held is not None)
    assert world.receiver.violations == []
    return expected


HUMAN_CHOICES = 8  # choices drawn per round, whatever the number of holds (see resolve_holds)


def resolve_holds(journal: StepJournal, world: World, model: Model, job_id: str,
                  choices: list[tuple[bool, bool]] | None, resets: dict[str, int]) -> None:
    """A human works through the held steps: asks the receiver, or picks an input. With ``choices``
    (resolve it?, use the new input?) each one may also be left held ("cannot confirm").

    The choices are drawn before the run, a fixed number of them: which sends are held at
    ``concurrency > 1`` depends on timing, and Hypothesis needs the same draws when it replays an
    example on a machine under another load."""
    left_alone: set[tuple[str, str]] = set()
    pending = iter(choices or ())
    while True:
        todo = [h for h in journal.held(job_id) if (h.item_id, h.step) not in left_alone]
        if not todo:
            return
        held = todo[0]
        resolve, use_new = next(pending, (True, bool(len(held.item_id) % 2)))
        if choices is not None and not resolve:
            left_alone.add((held.item_id, held.step))
            continue
        if held.reason == HeldReason.INPUT_CHANGED:
            journal.resolve_input_change(job_id, held.item_id, use_new_input=use_new, resolved_by="prop")
            event("resolved use_new_input" if use_new else "resolved keep_previous_input")
            model.resolve_input_change(held.item_id, use_new)
            if use_new:
                world.receiver.reset_allowed.add(held.item_id)
                resets[held.item_id] = resets.get(held.item_id, 0) + 1
        else:
            key = world.receiver.key_of[(held.item_id, held.step, held.generation)]
            receipt = world.receiver.lookup(key)
            journal.resolve(job_id, held.item_id, held.step, delivered=receipt is not None, receipt=receipt,
                            resolved_by="prop", note="asked the receiver")
            model.resolve(held.item_id, held.step, receipt is not None)
            event("resolved delivered" if receipt is not None else "resolved not_delivered")
        assert journal_rows(journal, job_id) == model.rows


# --------------------------------------------------------------- people deciding on what they saw

PEOPLE = ("ana", "ben")


@dataclass(frozen=True)
class Seen:
    """A held step as a person saw it: the version the journal showed, the model's count of the row's
    changes then, and for a send its key generation and what the receiver said of that key then (its
    receipt, or None: no record)."""

    item_id: str
    step: str
    reason: str
    version: str
    writes: int
    generation: int
    receipt: str | None

    @property
    def key(self) -> tuple[str, str]:
        return self.item_id, self.step


@dataclass(frozen=True)
class Look:
    person: str


@dataclass(frozen=True)
class Decide:
    person: str
    how_many: int  # of what they saw, oldest first
    use_new: bool  # their answer to a changed input
    as_a_list: bool  # all in one apply_decisions call (all or nothing), else one call each


@dataclass(frozen=True)
class SensorVerify:
    three_way: bool  # the receiver's look-up is authoritative: no record means NOT_DELIVERED


# People look and decide more often than the sensor polls: each of its polls settles every send it can,
# closing the window in which a decision goes stale.
ACTIONS = st.sampled_from(["look", "look", "look", "decide", "decide", "sensor"]).flatmap(lambda kind: {
    "look": st.builds(Look, st.sampled_from(PEOPLE)),
    "decide": st.builds(Decide, st.sampled_from(PEOPLE), st.integers(1, 3), st.booleans(), st.booleans()),
    "sensor": st.builds(SensorVerify, st.booleans()),
}[kind])


class People:
    """What each person last saw, and what they do about it later."""

    def __init__(self, journal: StepJournal, world: World, model: Model, job_id: str, resets: dict[str, int]) -> None:
        self.journal, self.world, self.model, self.job_id, self.resets = journal, world, model, job_id, resets
        self.seen: dict[str, dict[tuple[str, str], Seen]] = {person: {} for person in PEOPLE}

    def act(self, actions: list[Look | Decide | SensorVerify]) -> None:
        for action in actions:
            if isinstance(action, Look):
                self.look(action.person)
            elif isinstance(action, Decide):
                self.decide(action)
            else:
                self.sensor_verify(action.three_way)
            assert journal_rows(self.journal, self.job_id) == self.model.rows

    def look(self, person: str) -> None:
        """What is held now, with its version. What the person saw earlier of steps no longer held they
        still have in mind (a page left open): they may decide on it later."""
        seen = self.seen[person]
        for held in self.journal.held(self.job_id):
            key = (held.item_id, held.step)
            assert held.version is not None
            self.model.check_version(key, held.version)
            receipt = None
            if held.reason == HeldReason.UNKNOWN_OUTCOME:
                receipt = self.world.receiver.lookup(self.world.receiver.key_of[(*key, held.generation)])
            seen[key] = Seen(*key, held.reason.value, held.version, self.model.writes.get(key, 0), held.generation,
                             receipt)

    def decide(self, decision: Decide) -> None:
        """The person's answers, on what they saw: a send they found at the receiver was delivered (its
        receipt), one it had no record of was not; a changed input, their ``use_new``. A refused decision
        they keep, and send again later as it was (a form sent twice): it is refused every time, until
        they look at the step again."""
        mine = self.seen[decision.person]
        chosen = [mine.pop(key) for key in list(mine)[:decision.how_many]]
        # One list settles sends before input changes (a use_new_input moves the item's sends on).
        chosen.sort(key=lambda seen: seen.reason == IC)
        if not chosen:
            return
        if decision.as_a_list:
            refused = [] if self._decide_together(decision, chosen) else chosen
        else:
            refused = [seen for seen in chosen if not self._decide_one(decision, seen)]
        for seen in refused:
            mine.setdefault(seen.key, seen)  # behind the others: the next decision starts with those

    def _changed_since(self, seen: Seen) -> bool:
        return self.model.writes.get(seen.key, 0) != seen.writes

    def _decide_one(self, decision: Decide, seen: Seen) -> bool:
        try:
            if seen.reason == IC:
                self.journal.resolve_input_change(self.job_id, seen.item_id, use_new_input=decision.use_new,
                                                  resolved_by=decision.person, expected_version=seen.version)
            else:
                self.journal.resolve(self.job_id, seen.item_id, seen.step, delivered=seen.receipt is not None,
                                     receipt=seen.receipt, resolved_by=decision.person, expected_version=seen.version)
        except StaleDecisionError:
            assert self._changed_since(seen), f"{seen}: refused as stale, but the row is as it was seen"
            event(f"a stale decision was refused ({seen.reason})")
            self._note_harm_avoided(seen)
            return False
        assert not self._changed_since(seen), f"{seen}: the row changed since it was seen, the decision was applied"
        self._apply(decision, seen)
        return True

    def _note_harm_avoided(self, seen: Seen) -> None:
        """What the refused decision would have done to the row as it is now (Hypothesis's statistics)."""
        if seen.reason == UO and self.model.unknown_outcome(seen.key):
            if seen.receipt is None:
                event("refused: not_delivered about a send made since (it would have been sent twice)")
            elif self.model.rows[seen.key].generation != seen.generation:
                event("refused: delivered about an earlier key (the new input would have been lost)")

    def _decide_together(self, decision: Decide, chosen: list[Seen]) -> bool:
        entries = [{"job_id": self.job_id, "item_id": seen.item_id, "step": seen.step, "version": seen.version,
                    "decision": ("use_new_input" if decision.use_new else "keep_previous_input") if seen.reason == IC
                    else "delivered" if seen.receipt is not None else "not_delivered",
                    "receipt": seen.receipt} for seen in chosen]
        try:
            self.journal.apply_decisions(entries, resolved_by=decision.person)
        except StaleDecisionError:
            assert any(self._changed_since(seen) for seen in chosen), "a list was refused, nothing in it changed"
            event("a list with a stale decision was refused")
            for seen in chosen:
                if self._changed_since(seen):
                    self._note_harm_avoided(seen)
            return False
        assert not any(self._changed_since(seen) for seen in chosen), "a list with a stale decision was applied"
        for seen in chosen:
            self._apply(decision, seen)
        return True

    def _apply(self, decision: Decide, seen: Seen) -> None:
        if seen.reason == IC:
            self.model.resolve_input_change(seen.item_id, decision.use_new)
            if decision.use_new:
                self.world.receiver.reset_allowed.add(seen.item_id)
                self.resets[seen.item_id] = self.resets.get(seen.item_id, 0) + 1
        else:
            self.model.resolve(seen.item_id, seen.step, seen.receipt is not None)
        event("a decision on what was seen was applied")

    def sensor_verify(self, three_way: bool) -> None:
        """The HeldItemSensor's verify: asks the receiver about every send of unknown outcome and settles
        those it can answer."""
        receiver = self.world.receiver

        def ask(ctx: StepContext) -> Any:
            receiver.check_key(ctx)
            return receiver.lookup(ctx.idempotency_key) or (NOT_DELIVERED if three_way else None)

        expected = []
        for key, row in sorted(self.model.rows.items()):
            if self.model.unknown_outcome(key) and row.held != IC:
                receipt = receiver.lookup(receiver.key_of[(*key, row.generation)])
                if receipt is not None or three_way:
                    self.model.resolve(*key, receipt is not None)
                    expected.append(key)
        settled = verify_held(self.journal, self.job_id, ask, resolved_by="sensor")
        assert sorted((h.item_id, h.step) for h in settled) == expected
        if expected:
            event("the sensor's verify settled a send")


# The unlucky item's send fails in four rounds of five it is in: refused before the receiver stored it
# (a person then finds no record), or stored with the reply lost (a re-send that leaves it unknown again).
UNLUCKY_FAULTS = [BEFORE_ACCEPT, AFTER_ACCEPT, BEFORE_ACCEPT, AFTER_ACCEPT, None]


@pytest.fixture(params=["sqlite", "postgres"])
def fresh_journal(request):
    """Makes a new, empty journal for each example: a SQLite file, or a PostgreSQL schema of its own."""
    if request.param == "sqlite":
        return lambda directory: StepJournal(directory / "journal.sqlite3", durability="normal")
    url = request.getfixturevalue("postgres_url")
    return lambda directory: StepJournal(url, durability="normal", schema=f"prop_{uuid.uuid4().hex[:16]}")


@pytest.mark.parametrize("concurrency", [1, 2, 16])  # 2: sends in flight while small batches go on
# 300 examples in the main suite; the compatibility matrix's Python cells run fewer (make test-matrix).
@settings(max_examples=int(os.environ.get("RESUMABLE_PROPERTY_EXAMPLES", "300")), deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(
    raw_ids=ids_strategy,
    job_id=st.text(NAMES_ALPHABET, min_size=1, max_size=12).filter(lambda s: s.strip() != ""),
    with_verify=st.booleans(),
    rounds=st.integers(1, 6),
    data=st.data(),
)
def test_runs_with_faults_edits_and_resolutions(fresh_journal, concurrency, raw_ids, job_id, with_verify, rounds, data):
    directory = Path(tempfile.mkdtemp(prefix="resumable-prop-"))
    world = World(job_id, with_verify)
    model = Model(world)
    values = {str(i): data.draw(VALUES, label="initial value") for i in raw_ids}
    raw_of = {str(i): i for i in raw_ids}
    resets: dict[str, int] = {}

    def item(item_id: str) -> dict[str, Any]:
        return {"id": raw_of[item_id], "v": values[item_id]}

    # One item's send fails more often than the others: a stale decision does harm when a send it was
    # about was sent again since and failed again (with a fault on each of two rounds' sends).
    unlucky = data.draw(st.sampled_from(sorted(values)), label="the item whose sends fail most")
    try:
        with fresh_journal(directory) as journal:
            people = People(journal, world, model, job_id, resets)
            for _ in range(rounds):
                order = data.draw(st.permutations(sorted(values)), label="order")
                size = data.draw(st.integers(1, len(order)), label="batch size")
                batch = [item(i) for i in order[:size]]
                drawn = data.draw(
                    st.dictionaries(
                        # Sends fail more often than local steps: they are what the journal is for.
                        st.tuples(st.sampled_from(order[:size]), st.sampled_from(FAULT_STEPS)),
                        st.sampled_from([BEFORE_ACCEPT, AFTER_ACCEPT, UNREACHABLE]), max_size=3,
                    ),
                    label="faults",
                )
                # A local step just raises; a send fails before or after the receiver accepted it.
                faults = {k: mode if SIDE_EFFECT[k[1]] else LOCAL_FAULT for k, mode in drawn.items()}
                unlucky_fault = data.draw(st.sampled_from(UNLUCKY_FAULTS), label="its fault")
                if unlucky_fault is not None and unlucky in order[:size]:
                    faults.setdefault((unlucky, "notify"), unlucky_fault)
                choices = data.draw(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=HUMAN_CHOICES,
                                             max_size=HUMAN_CHOICES), label="the human's choices")
                # What the people and the sensor do after the run, and after the human: drawn before the
                # run, as the choices are. What they look at and decide on is what is held by then.
                after_run = data.draw(st.lists(ACTIONS, min_size=1, max_size=3), label="after the run")
                after_human = data.draw(st.lists(ACTIONS, max_size=2), label="after the human")
                check_run(journal, world, model, job_id, batch, faults, concurrency)
                backends.assert_summary_is_a_recount(journal, job_id)
                people.act(after_run)
                resolve_holds(journal, world, model, job_id, choices, resets)
                people.act(after_human)
                # The counts kept with the job follow every run, resolution and verify exactly.
                backends.assert_summary_is_a_recount(journal, job_id)
                if data.draw(st.booleans(), label="compact the finished items"):
                    seen = list(journal.rows(job_id))
                    journal.compact(timedelta(0))
                    assert list(journal.rows(job_id)) == seen  # nobody can tell, versions included
                    backends.assert_summary_is_a_recount(journal, job_id)
                # Few values per item, so an edit is often an edit back to what was journaled.
                for item_id in data.draw(st.lists(st.sampled_from(sorted(values)), max_size=3), label="edits"):
                    values[item_id] = data.draw(VALUES, label=f"new value of {item_id}")

            # Whatever the people still meant to decide, they decide now, on what they last saw.
            people.act([Decide(person, 99, use_new=True, as_a_list=False) for person in PEOPLE])
            # Settle: no more faults or edits; resolve everything, run again, until done.
            everything = [item(i) for i in sorted(values)]
            for _ in range(8):
                outcome = check_run(journal, world, model, job_id, everything, {}, concurrency)
                if not outcome.held:
                    break
                resolve_holds(journal, world, model, job_id, None, resets)
            else:
                raise AssertionError("the job did not settle")

            rows = journal_rows(journal, job_id)
            assert set(rows) == {(i, s) for i in values for s in STEP_NAMES}
            assert all(r.status == "SUCCEEDED" and r.held is None for r in rows.values())
            assert journal.held(job_id) == [] and journal.job(job_id).settled
            backends.assert_summary_is_a_recount(journal, job_id)
            # Everything reached the receiver; more than once only after a use_new_input resolution.
            for item_id in values:
                count = world.receiver.counts.get((item_id, "notify"), 0)
                assert 1 <= count <= 1 + resets.get(item_id, 0), (item_id, count, resets)
                # None lost: the receiver has the send of the item's current input (its key generation).
                current = world.receiver.key_of[(item_id, "notify", rows[(item_id, "notify")].generation)]
                assert world.receiver.lookup(current) is not None, f"{item_id!r}: its current send never arrived"
            assert world.receiver.violations == []
            # Settled means settled: one more run does nothing at all, compacted or not.
            journal.compact(timedelta(0))
            again = check_run(journal, world, model, job_id, everything, {}, concurrency)
            assert (again.executed, again.skipped, again.held) == (0, len(STEPS) * len(values), [])
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_the_model_would_catch_a_blind_resend(tmp_path):
    """Control: the duplicate check fires when a send is repeated without use_new_input, or after it
    under the old key (which a deduping receiver would drop)."""
    world = World("j", with_verify=False)

    class Ctx:
        job_id, item_id, step, idempotency_key, generation = "j", "a", "notify", "k-1", 0

    class NextGeneration(Ctx):
        idempotency_key, generation = "k-2", 1

    world.receiver.deliver(Ctx)  # type: ignore[arg-type]
    world.receiver.deliver(Ctx)  # type: ignore[arg-type]
    assert len(world.receiver.violations) == 2
    world.receiver.violations.clear()
    world.receiver.reset_allowed.add("a")
    world.receiver.deliver(Ctx)  # type: ignore[arg-type]
    assert [v for v in world.receiver.violations if "already delivered" in v]
    world.receiver.violations.clear()
    world.receiver.reset_allowed.add("a")
    world.receiver.deliver(NextGeneration)  # type: ignore[arg-type]
    assert world.receiver.violations == []


def test_model_agrees_with_the_article_scenario(tmp_path):
    """Control: the model itself reproduces the article's numbers (27 executed, 122 skipped)."""
    world = World("article", with_verify=False)
    model = Model(world)
    items = [{"id": f"item-{i:03d}", "v": i} for i in range(1, 51)]
    first = model.run(items, {("item-041", "notify"): BEFORE_ACCEPT})
    assert first.raised is RefusedBeforeAccept
    second = model.run(items, {})
    # 4 steps here (an ack after the send): 9 items x 4 executed; 40 x 4 + item 41's 2 skipped.
    assert (second.executed, second.skipped, second.held) == (36, 162, [("item-041", "notify", UO)])
    with StepJournal(tmp_path / "j.sqlite3") as journal:
        real_world = World("article", with_verify=False)
        real_world.faults = {("item-041", "notify"): BEFORE_ACCEPT}
        try:
            run_batch(journal, "article", items, real_world.steps(), settle_in_task=False)
        except RefusedBeforeAccept:
            pass
        real_world.faults = {}
        result = run_batch(journal, "article", items, real_world.steps(), settle_in_task=False)
        assert (result.executed_steps, result.skipped_steps) == (second.executed, second.skipped)
        assert result.held == [HeldStep("article", "item-041", "notify", HeldReason.UNKNOWN_OUTCOME)]
        assert {r.status for r in journal.rows("article", "item-041")} == {Status.SUCCEEDED, Status.FAILED}
