"""A high-water mark of a job's IN_FLIGHT marks, kept outside the journal (SPEC §13).

The journal counts every IN_FLIGHT mark of a job in the transaction that commits it (``jobs.n_marks``,
never taken back). A run records that count in a :class:`MarkStore` - a place in another failure
domain: on Airflow >= 3.3 the task instance's ``task_state_store`` - and, before its next send, compares
it with the journal's. A journal whose count is below the recorded one lost marks (a backup restored,
a copy, an asynchronous standby promoted): the items it forgot may have been sent, so the run is
refused (:class:`~airflow_resumable.exceptions.JournalBehindError`), or, with
``on_journal_behind="verify"``, every send the journal has no record of asks ``verify`` first.

A record is written once per *window*, not once per send (a write is a round trip to Airflow's API
server). A window is the set of items whose marks may be committed after the count it records: the
items in the middle of their steps when it was written and the next few the run will start. No item
is started before a record covering it is in the store; the next record is written while this
window's items are being sent, so the run waits for the store only when the window runs out first.
Should the journal lose the marks of an open window (its host crashed, or it was copied while the run
ran), the count does not show it: the next run verifies the window's items before it sends them - unless
the journal is the very one the window was recorded against (``StepJournal.incarnation()``: the same file
on the same boot of its host, the same run of its server), which has kept every commit: then the window
was left open by a try that was killed, and its marks say all that was sent. A run
that ends in Python (done, failed, stopped) writes a last record with the final count and no window; a
run that finishes the batch re-bases a mark the journal was behind.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime, timezone
from typing import Any, Protocol

from airflow_resumable.exceptions import JournalBehindError
from airflow_resumable.journal import JobRun

log = logging.getLogger(__package__)

ON_JOURNAL_BEHIND = ("refuse", "verify")
RECORD_FORMAT = 1
# Item hashes one record carries at most: 8 bytes each, ~43 KB as base64, within the 64 KiB a task
# state store value may take.
WINDOW_MAX = 4000
HASH_BYTES = 8
# A window spans about this long at the run's pace, or four of the store's round trips if that is longer:
# the next record is written when half of it is left, so the stored count trails the journal's by a
# tenth of a second of the run (a restore older than that is refused) at about ten writes a second at
# most. Never fewer than MIN_AHEAD items beyond those in progress; FIRST_AHEAD before the pace is known.
# A window's items are asked about only after the journal may have lost commits (a host crash, a
# failover): the journal's incarnation changed.
WINDOW_SECONDS = 0.2
MIN_AHEAD = 16
FIRST_AHEAD = 64


class MarkStore(Protocol):
    """Where a run keeps its high-water mark: one JSON object, read at the start, overwritten per window."""

    def read(self) -> Mapping[str, Any] | None:
        """The last record written, or None."""

    def write(self, record: dict[str, Any]) -> None:
        """Replace the record; it must be kept (outside the journal) once this returns."""


def item_hash(item_id: str) -> bytes:
    return hashlib.blake2b(item_id.encode("utf-8", "surrogatepass"), digest_size=HASH_BYTES).digest()


def _decode_window(text: object) -> frozenset[bytes]:
    if not isinstance(text, str) or not text:
        return frozenset()
    raw = base64.b64decode(text)
    return frozenset(raw[i:i + HASH_BYTES] for i in range(0, len(raw) - HASH_BYTES + 1, HASH_BYTES))


def check_on_journal_behind(value: object) -> str:
    if value not in ON_JOURNAL_BEHIND:
        raise ValueError(f"on_journal_behind must be one of {', '.join(map(repr, ON_JOURNAL_BEHIND))}, got {value!r}")
    return str(value)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _encode(hashes: Iterable[bytes]) -> str:
    return base64.b64encode(b"".join(hashes)).decode("ascii")


def mark_record(*, journal_id: str, job: str, marks: int, by: str | None, window: Iterable[bytes] = (),
                open_: bool = False, behind: Mapping[str, Any] | None = None, incarnation: str | None = None,
                suspects: Iterable[bytes] = ()) -> dict[str, Any]:
    """A record of the mark as a store keeps it (JSON): the journal's count, the window's item hashes, the
    journal's incarnation (``StepJournal.incarnation()``) when it was written, and the items of an earlier
    window that still must be asked about whatever the incarnation (``suspects``)."""
    return {
        "format": RECORD_FORMAT, "journal_id": journal_id, "job": job, "marks": marks, "open": open_,
        "window": _encode(window), "suspects": _encode(suspects), "behind": behind, "at": _now(), "by": by,
        "incarnation": incarnation,
    }


class HighWater:
    """One run's side of the high-water mark (see the module's docstring).

    The runner calls :meth:`start` before anything else, :meth:`plan` with the ids of the items it has
    read, :meth:`admit` before it starts an item's steps, :meth:`release` when they ended, and
    :meth:`close` when the run ends. :meth:`must_verify` says whether a send the journal has no record
    of must ask ``verify`` first.
    """

    def __init__(self, store: MarkStore, run: JobRun, *, journal: str, journal_id: str, label: str | None,
                 on_behind: str = "refuse", concurrency: int = 1, incarnation: str | None = None) -> None:
        self.store = store
        self.run = run
        self.journal = journal
        self.journal_id = journal_id
        self.label = label
        self.on_behind = check_on_journal_behind(on_behind)
        self.incarnation = incarnation
        self.verify_all = False  # the journal was found behind: every unrecorded send asks first
        self.behind: dict[str, Any] | None = None
        self.suspects: set[bytes] = set()  # an open window's items, not yet settled by this run
        self.writes = 0
        self.waited = 0.0
        self._plan: deque[str] = deque()  # item ids, in the order the run reaches them
        self._pos = 0  # plan entries passed so far (the next planned item's number)
        self._live: set[str] = set()
        self._landed_end = 0  # plan entries before this number are covered by the record in the store
        self._pending: Future[None] | None = None
        self._pending_end = 0  # ... and before this one by the record being written
        self._half = 0  # issue the next record when this few covered items are left
        self._pool: ThreadPoolExecutor | None = None
        self._latency = 0.05
        self._floor = max(MIN_AHEAD, 2 * concurrency)
        self._admitted = 0
        self._started: float | None = None  # the first admission (the pace is the run's, not its start's)
        self._waited_before = 0.0

    # -- the check -----------------------------------------------------------------------------

    def start(self) -> None:
        """Compare the stored mark with the journal's count; raise JournalBehindError if it is behind
        (unless on_journal_behind="verify"). A job with no stored mark is never refused."""
        record = self.store.read()
        count = self.run.marks()
        if (not isinstance(record, Mapping) or record.get("format") != RECORD_FORMAT
                or record.get("job") != self.run.job_id or record.get("journal_id") != self.journal_id):
            log.info("high-water mark: none recorded for job %s yet; the journal counts %d mark(s)",
                     self.run.job_id, count)
            return
        stored = int(record.get("marks", 0))
        behind = record.get("behind")
        if not isinstance(behind, Mapping) and count < stored:
            behind = {"journal_marks": count, "stored_marks": stored, "at": record.get("at"), "by": record.get("by")}
        if isinstance(behind, Mapping):
            self.behind = dict(behind)
            if self.on_behind != "verify":
                raise self._behind_error(count)
            self.verify_all = True
            log.warning("high-water mark: the journal %s is behind (job %s: %d mark(s) in the journal, %s recorded "
                        "%s by %s); on_journal_behind='verify': every send the journal has no record of asks "
                        "the receiver first, and a step without verify is held", self.journal, self.run.job_id,
                        behind["journal_marks"], behind["stored_marks"], behind.get("at"), behind.get("by"))
            return
        # Items a run after a lost window did not get to settle: asked about whatever happened since.
        self.suspects = set(_decode_window(record.get("suspects")))
        if record.get("open") and self.incarnation is not None and record.get("incarnation") == self.incarnation:
            # The same journal, on the same boot of its host (or the same server run): whatever it committed
            # is still there - the try that left the window open was killed, and its marks say what it sent.
            log.info("high-water mark: the last run of job %s ended with a window open (it was killed); the journal "
                     "is the one it wrote to, with every commit: nothing to verify", self.run.job_id)
        elif record.get("open"):
            self.suspects |= _decode_window(record.get("window"))
            if self.suspects:
                log.warning("high-water mark: the last run of job %s ended with a window of %d item(s) open (it "
                            "was killed, or the journal's host crashed): those items are verified before they are "
                            "sent (a step without verify holds them)", self.run.job_id, len(self.suspects))
        log.info("high-water mark: job %s has %d mark(s) in the journal, %d recorded %s by %s", self.run.job_id,
                 count, stored, record.get("at"), record.get("by"))

    def _behind_error(self, count: int) -> JournalBehindError:
        b = self.behind or {}
        at, by = b.get("at"), b.get("by") or "a run that gave no name"
        return JournalBehindError(
            f"the journal {self.journal} is behind for job {self.run.job_id}: it has {b.get('journal_marks', count)} "
            f"IN_FLIGHT mark(s), but {b.get('stored_marks')} were recorded outside it at {at or '?'} by "
            f"{by}. It lost sends it had recorded - restored from a backup, copied, or failed over to a "
            "standby that had not received everything - so some items may have been sent already. Nothing was "
            "sent. If the receiver can look sends up (verify), set on_journal_behind='verify' (the operator's "
            "argument, or [resumable] on_journal_behind) and clear the task: every send the journal has no record "
            "of asks the receiver first. Otherwise find the newest journal (the primary, the file before the "
            "restore) and point the task at it.",
            journal=self.journal, journal_marks=int(b.get("journal_marks", count)),
            stored_marks=int(b.get("stored_marks", 0)), recorded_at=at, recorded_by=by,
        )

    def must_verify(self, item_id: str) -> bool:
        """Whether a send of this item that the journal has no record of must ask the receiver first."""
        return self.verify_all or (bool(self.suspects) and item_hash(item_id) in self.suspects)

    # -- windows -------------------------------------------------------------------------------

    def plan(self, item_ids: Iterable[str]) -> None:
        """The ids of items read in, in the order the run will reach them."""
        self._plan.extend(item_ids)
        if self._pending is None and self._landed_end == 0 and self._plan:
            self._issue()  # the first record is written while the first items are read in

    def admit(self, item_id: str) -> None:
        """Before ``item_id``'s steps start: wait until a record in the store covers it."""
        plan = self._plan
        while plan and plan[0] != item_id:  # items passed over (finished ones)
            plan.popleft()
            self._pos += 1
        if not plan:
            plan.append(item_id)  # not planned (it should have been): covered all the same
        number = self._pos
        if self._pending is not None and self._pending.done():
            self._wait()
        while number >= self._landed_end or (self._pending is not None and number >= self._pending_end):
            if self._pending is None:
                self._issue()
            self._wait()
        self._live.add(plan.popleft())
        self._pos += 1
        self._admitted += 1
        if self._started is None:
            self._started, self._waited_before = time.monotonic(), self.waited
        left = self._landed_end - self._pos  # covered items not started yet
        if self._pending is None and left <= self._half and len(plan) > left:  # and the plan goes beyond them
            self._issue()

    def release(self, item_id: str, *, settled: bool) -> None:
        """``item_id``'s steps ended (``settled``: with a row for every send it reached)."""
        self._live.discard(item_id)
        if settled and self.suspects:
            self.suspects.discard(item_hash(item_id))

    def _ahead(self) -> int:
        """Items a new record covers beyond those in progress: what the run starts in WINDOW_SECONDS, or in
        four writes' time if the store is slower (the next record is issued when half are left) - the
        run's pace measured without its waits for the store, which would keep the windows small."""
        working = 0.0 if self._started is None else (
            time.monotonic() - self._started - (self.waited - self._waited_before))
        if working <= 0 or self._admitted < 4:
            wanted = max(self._floor, FIRST_AHEAD)
        else:
            wanted = max(self._floor, int(self._admitted / working * max(4 * self._latency, WINDOW_SECONDS)) + 1)
        return max(1, min(wanted, WINDOW_MAX - len(self._live) - len(self.suspects)))

    def _record(self, marks: int, window: Iterable[bytes], *, open_: bool) -> dict[str, Any]:
        return mark_record(journal_id=self.journal_id, job=self.run.job_id, marks=marks, by=self.label,
                           window=window, open_=open_, behind=self.behind, incarnation=self.incarnation,
                           suspects=self.suspects)

    def _issue(self) -> None:
        upcoming = list(itertools.islice(self._plan, self._ahead()))
        self._half = len(upcoming) // 2
        window = {*map(item_hash, self._live), *map(item_hash, upcoming)}
        # Every mark committed after this count is of an item in progress now or one of the upcoming ones.
        record = self._record(self.run.marks(), window, open_=True)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="resumable-high-water")
        self._pending_end = self._pos + len(upcoming)
        self._pending = self._pool.submit(self._write, record)

    def _write(self, record: dict[str, Any]) -> None:
        started = time.monotonic()
        self.store.write(record)
        self._latency = 0.7 * self._latency + 0.3 * (time.monotonic() - started)

    def _wait(self) -> None:
        pending = self._pending
        assert pending is not None
        started = time.monotonic()
        try:
            pending.result()
        finally:
            self._pending = None
            self.waited += time.monotonic() - started
        self.writes += 1
        self._landed_end = self._pending_end

    # -- the end -------------------------------------------------------------------------------

    def close(self, *, finished: bool) -> None:
        """The run ended; every mark it made is committed. Record the final count with no window but the
        suspects of an earlier one it did not settle. ``finished``: the run went through the whole batch:
        no suspect is left, and a mark the journal was behind is re-based to its count."""
        try:
            if self._pending is not None:
                try:
                    self._wait()
                except Exception as exc:  # noqa: BLE001 - the last record below replaces it
                    log.warning("high-water mark: a write failed (%s)", type(exc).__name__)
            if finished:
                # Every item of the batch was gone through: each suspect is now recorded (done, held or
                # sent once more after the receiver said it never got it), or not in this batch at all.
                self.suspects.clear()
                if self.behind is not None:
                    log.warning("high-water mark: job %s went through the whole batch with every unrecorded send "
                                "verified; the mark is re-based to the journal's count", self.run.job_id)
                self.behind = None
            self.store.write(self._record(self.run.marks(), (), open_=False))
            self.writes += 1
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
        log.info("high-water mark: %d write(s); the run waited %.3f s for the store", self.writes, self.waited)
