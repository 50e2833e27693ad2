"""The resumable runner: the per-item state machine over the step journal (SPEC §3).

It imports nothing from Airflow. The whole decision for one step found in the journal is
:func:`_decide`, a table you can read in one screen.
"""

from __future__ import annotations

import enum
import hashlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from airflow_resumable.errors import ResumableError
from airflow_resumable.journal import HeldReason, HeldStep, JobRun, Status, StepJournal, StepState
from airflow_resumable.journal.records import MAX_ID_LENGTH

__all__ = [
    "BatchProgress",
    "BatchStopped",
    "BatchResult",
    "HeldStep",
    "InvalidItemError",
    "InvalidStepOutputError",
    "NOT_DELIVERED",
    "NotSentError",
    "Step",
    "StepContext",
    "canonical_digest",
    "idempotency_key",
    "run_batch",
    "verify_held",
]

log = logging.getLogger(__name__)

MAX_OUTPUT_BYTES = 64 * 1024
# resolved_by of the audit rows the runner writes when verify settles a send by itself.
VERIFY_RESOLVER = "verify"
# Items validated and looked up together: one journal query per chunk, not one per step.
CHUNK_SIZE = 500


class InvalidItemError(ResumableError, ValueError):
    """An item (or a step's output for it) is not usable; the message names the item."""


class InvalidStepOutputError(InvalidItemError):
    """A step returned something that is not JSON or is over 64 KiB."""


class BatchStopped(ResumableError):
    """The run was asked to stop (``stop`` was set: Airflow's on_kill, "mark failed/success", Clear).
    No send was started after that; the sends already in flight were recorded as they finished. The
    job is left unfinished: run it again (a retry or a Clear) to resume."""


class NotSentError(ResumableError):
    """Raised by a step to declare that nothing of its send left the process: the connection was
    refused, the name did not resolve, the connect timed out, a check before the request failed.

    The step is recorded FAILED with that fact (and the type name, as for any error) and the next run
    sends it again without verify or hold. Raise it only when that is certain: an error after any
    byte of the request may have been written is an unknown outcome, never a NotSentError."""


class StepContext:
    """What a step function (and a verify function) is told about the step it is running.

    ``job_id``, ``item_id``, ``step``, ``digest``, ``generation`` (of the key: 0 unless a
    ``use_new_input`` resolution moved the item on), ``idempotency_key`` and ``outputs`` (the recorded
    outputs of the item's earlier steps, by step name). The key and the decoded outputs are worked
    out on first use: most local steps never look at them, and a batch can have millions of steps.
    """

    __slots__ = ("job_id", "item_id", "step", "digest", "generation", "_key", "_outputs", "_raw_outputs")

    def __init__(
        self, job_id: str, item_id: str, step: str, digest: str, idempotency_key: str | None = None,
        outputs: Mapping[str, Any] | None = None, generation: int = 0,
    ) -> None:
        self.job_id, self.item_id, self.step, self.digest = job_id, item_id, step, digest
        self.generation = generation
        self._key = idempotency_key
        self._outputs = outputs
        self._raw_outputs: dict[str, str | None] = {}

    @classmethod
    def _from_journal(cls, job_id: str, item_id: str, step: str, digest: str,
                      raw_outputs: dict[str, str | None], generation: int = 0) -> StepContext:
        ctx = cls(job_id, item_id, step, digest, generation=generation)
        ctx._raw_outputs = dict(raw_outputs)  # a snapshot: later steps' outputs are not this step's
        return ctx

    @property
    def idempotency_key(self) -> str:
        if self._key is None:
            self._key = idempotency_key(self.job_id, self.item_id, self.step, self.generation)
        return self._key

    @property
    def outputs(self) -> Mapping[str, Any]:
        if self._outputs is None:
            self._outputs = {name: None if raw is None else json.loads(raw) for name, raw in self._raw_outputs.items()}
        return self._outputs

    def __repr__(self) -> str:
        return f"StepContext(job_id={self.job_id!r}, item_id={self.item_id!r}, step={self.step!r})"


class _NotDelivered:
    """The type of :data:`NOT_DELIVERED` (one instance)."""

    _instance: _NotDelivered | None = None

    def __new__(cls) -> _NotDelivered:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_DELIVERED"

    def __reduce__(self) -> str:
        return "NOT_DELIVERED"


NOT_DELIVERED = _NotDelivered()
"""What ``verify`` returns when the receiver *affirms* it has no record of ``ctx.idempotency_key``
(not merely "cannot tell"): the send is made now, once, and the settlement is audited (resolved_by
``verify``). Return it only if the receiver's look-up is authoritative: one that records
asynchronously may not know yet of a send it already has."""

StepFn = Callable[[Mapping[str, Any], StepContext], Any]
VerifyFn = Callable[[StepContext], "str | _NotDelivered | None"]


@dataclass(frozen=True)
class Step:
    """One step of every item.

    :param name: the step's name in the journal (stable across runs).
    :param fn: ``fn(item, ctx)``; its JSON-serialisable return value is recorded (for a side effect:
        its receipt).
    :param side_effect: True when the step reaches outside (sends, pays, mails). Such a step found
        ``IN_FLIGHT`` or ``FAILED`` is never re-run blindly: it is verified or held.
    :param verify: ``verify(ctx)`` returns the receiver's receipt for ``ctx.idempotency_key`` if it
        has one (never sent again), :data:`NOT_DELIVERED` if the receiver affirms it has no record of
        it (sent now, once), else None: cannot tell (held for a human). Side-effect steps only.
    """

    name: str
    fn: StepFn
    side_effect: bool = False
    verify: VerifyFn | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("a Step needs a non-empty name")
        if "\x00" in self.name:
            raise ValueError(f"step name {self.name!r} contains a NUL character")
        if not callable(self.fn):
            raise ValueError(f"step {self.name!r}: fn must be callable")
        if self.verify is not None and not self.side_effect:
            raise ValueError(f"step {self.name!r}: verify only makes sense for a side_effect step")
        if self.verify is not None and not callable(self.verify):
            raise ValueError(f"step {self.name!r}: verify must be callable")


@dataclass(frozen=True)
class BatchProgress:
    """How far a run is, reported every ``progress_interval`` seconds, when a step fails, and at the end."""

    items_done: int  # items completed or held by this run so far (not those merely read in)
    items_total: int | None  # None when the items' count is not known up front (a generator)
    executed_steps: int
    skipped_steps: int
    held: int
    elapsed: float
    verified_steps: int = 0


@dataclass
class BatchResult:
    job_id: str
    status: str  # "completed" | "needs_review"
    executed_steps: int = 0
    skipped_steps: int = 0
    verified_steps: int = 0  # side-effect steps found by verify (counted in skipped_steps too)
    resent_steps: int = 0  # sends verify found NOT_DELIVERED, made again once (counted in executed_steps too)
    held: list[HeldStep] = field(default_factory=list)
    items_total: int = 0
    items_completed: int = 0
    elapsed: float = 0.0


# One encoder each instead of json.dumps(**options): with options, dumps builds a new encoder on
# every call, which costs as much as the encoding itself when a million items are resumed.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_digest(item: Mapping[str, Any]) -> str:
    """SHA-256 of the item's canonical JSON (sorted keys, no whitespace)."""
    return hashlib.sha256(_CANONICAL.encode(item).encode("utf-8")).hexdigest()


def idempotency_key(job_id: str, item_id: str, step: str, generation: int = 0) -> str:
    """A key deterministic in (job_id, item_id, step, generation), distinct across them, safe in an
    HTTP header. Generation 0 is the key of earlier releases (which had no generations)."""
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise ValueError(f"generation must be an integer >= 0, not {generation!r}")
    parts: list[object] = [job_id, item_id, step] if generation == 0 else [job_id, item_id, step, generation]
    material = json.dumps(parts, ensure_ascii=False, separators=(",", ":"))
    return "rsm1-" + hashlib.sha256(material.encode("utf-8")).hexdigest()


# --------------------------------------------------------------------------- the decision table


class Action(str, enum.Enum):
    """What the runner does with one step."""

    RUN = "run"
    SKIP = "skip"
    VERIFY = "verify"
    HOLD_CHANGED = "hold_input_changed"


RUN, SKIP, VERIFY, HOLD_CHANGED = Action.RUN, Action.SKIP, Action.VERIFY, Action.HOLD_CHANGED


def _decide(row: StepState | None, digest: str, side_effect: bool) -> Action:
    """What to do with one step, given its journal row (or None) and the item's digest now.

    | journal row                       | local step | side-effect step            |
    |-----------------------------------|------------|-----------------------------|
    | none                              | run        | run                         |
    | digest differs from the input's   | hold item (input_changed)                |
    | SUCCEEDED                         | skip       | skip                        |
    | FAILED, provably not sent         | run again  | run again (same key)        |
    | IN_FLIGHT or FAILED               | run again  | verify: receipt -> skip,    |
    |                                   |            | NOT_DELIVERED -> send once, |
    |                                   |            | else hold (unknown_outcome) |
    """
    if row is None:
        return RUN
    if row.digest != digest:
        return HOLD_CHANGED
    if row.status == Status.SUCCEEDED:
        return SKIP
    if row.not_sent and row.status == Status.FAILED:
        return RUN
    return VERIFY if side_effect else RUN


# ------------------------------------------------------------------------------------ the runner


@dataclass
class _Prepared:
    item_id: str
    item: Mapping[str, Any]
    digest: str


def _is_storable(value: str) -> bool:
    """True if both journal engines can store ``value`` as text: no NUL, no lone surrogate."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _item_id(item: object, id_field: str, position: int) -> str:
    if not isinstance(item, Mapping):
        raise InvalidItemError(f"item at position {position} is a {type(item).__name__}, not a mapping")
    if id_field not in item:
        raise InvalidItemError(f"item at position {position} has no {id_field!r} field")
    raw = item[id_field]
    # bool is an int subclass, but True as an id is a bug, not an id.
    if isinstance(raw, bool) or not isinstance(raw, (str, int)):
        raise InvalidItemError(
            f"item at position {position}: {id_field!r} must be a string or an integer, "
            f"not {type(raw).__name__}"
        )
    item_id = str(raw)
    if not item_id.strip():
        raise InvalidItemError(f"item at position {position} has an empty {id_field!r}")
    if not _is_storable(item_id):
        raise InvalidItemError(
            f"item at position {position}: {id_field!r} contains a NUL character or a lone surrogate; ids "
            "must be valid Unicode text"
        )
    if len(item_id) > MAX_ID_LENGTH:
        raise InvalidItemError(
            f"item at position {position}: {id_field!r} is {len(item_id)} characters (at most {MAX_ID_LENGTH})"
        )
    return item_id


def _prepare(chunk: list[object], id_field: str, first_position: int, run: JobRun) -> list[_Prepared]:
    """Validate a whole chunk before any item of it is touched."""
    prepared: list[_Prepared] = []
    ids_here: set[str] = set()
    for offset, item in enumerate(chunk):
        item_id = _item_id(item, id_field, first_position + offset)
        if item_id in ids_here:
            raise InvalidItemError(f"item {item_id!r} appears twice in this batch; ids must be unique")
        ids_here.add(item_id)
        assert isinstance(item, Mapping)
        try:
            digest = canonical_digest(item)
        except RecursionError:
            raise InvalidItemError(
                f"item {item_id!r} is nested too deeply to be encoded as JSON; flatten it or pass a reference"
            ) from None
        except (TypeError, ValueError) as exc:  # a lone surrogate in a value is a UnicodeEncodeError
            raise InvalidItemError(
                f"item {item_id!r} is not JSON-serialisable ({type(exc).__name__}); items must be plain "
                "JSON data: str, int, float, bool, None, lists and dicts with string keys"
            ) from None
        prepared.append(_Prepared(item_id, item, digest))
    repeated = run.admit([(p.item_id, p.digest) for p in prepared])
    if repeated:
        raise InvalidItemError(f"item {repeated[0]!r} appears twice in this batch; ids must be unique")
    return prepared


def _encode_output(value: Any, item_id: str, step: str) -> str:
    try:
        text = _COMPACT.encode(value)
    except (TypeError, ValueError) as exc:
        raise InvalidStepOutputError(
            f"step {step!r} of item {item_id!r} returned a value that is not JSON ({type(exc).__name__}); "
            "return plain JSON data (a receipt string, a dict, ...)"
        ) from None
    if len(text.encode("utf-8")) > MAX_OUTPUT_BYTES:
        raise InvalidStepOutputError(
            f"step {step!r} of item {item_id!r} returned {len(text.encode('utf-8'))} bytes of output "
            f"(at most {MAX_OUTPUT_BYTES}); keep large data outside the journal and return a reference"
        )
    return text


def _receipt_of(value: Any, encoded: str) -> str | None:
    if value is None:
        return None
    # A receipt holding NUL is kept as its JSON text: no journal engine stores NUL in text.
    return value if isinstance(value, str) and "\x00" not in value else encoded


def _chunks(items: Iterable[object]) -> Iterator[list[object]]:
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, CHUNK_SIZE)):
        yield chunk


@dataclass(frozen=True)
class _Send:
    """A side-effect step an item is waiting to have sent; the driver marks, commits and sends it."""

    step: Step
    item: _Prepared
    ctx: StepContext
    # A send verify found not delivered: the row as it was (status, held reason) for the audit row,
    # which is buffered with the send's IN_FLIGHT mark - a send that never starts leaves no audit row.
    resent_from: tuple[str, str | None] | None = None


@dataclass(frozen=True)
class _Outcome:
    value: Any = None
    error: BaseException | None = None


def _call(send: _Send) -> _Outcome:
    """Run a send's function (in a worker thread when concurrent). Never raises: the driver records."""
    try:
        return _Outcome(send.step.fn(send.item.item, send.ctx))
    except BaseException as exc:  # recorded FAILED (type name only) and re-raised by the driver
        return _Outcome(error=exc)


ItemSteps = Generator[_Send, str, None]


class _Batch:
    """One run of one job: applies :func:`_decide` to every step of every item.

    :meth:`steps_of` walks one item's steps. Local steps run right there; at a side-effect step it
    yields a :class:`_Send` and waits to be handed the send's recorded output. Marking the send
    IN_FLIGHT, committing that mark and sending are the driver's job, so that a concurrent driver
    can commit the marks of a whole group with one fsync (:class:`_Sequential`, :class:`_Concurrent`).
    """

    def __init__(self, run: JobRun, steps: list[Step], result: BatchResult) -> None:
        self.run = run
        self.steps = steps
        self.result = result

    def steps_of(self, p: _Prepared, rows: Mapping[str, StepState]) -> ItemSteps:
        job_id, result = self.run.job_id, self.result
        outputs: dict[str, str | None] = {}  # step -> recorded JSON, decoded only if a later step asks
        for step in self.steps:
            row = rows.get(step.name)
            action = _decide(row, p.digest, step.side_effect)
            if action == HOLD_CHANGED:
                assert row is not None
                if row.held_reason != HeldReason.INPUT_CHANGED:
                    self.run.hold(p.item_id, step.name, HeldReason.INPUT_CHANGED, new_digest=p.digest)
                self._held(p.item_id, step.name, HeldReason.INPUT_CHANGED, row.generation)
                return
            if action == SKIP:
                assert row is not None
                if row.held_reason == HeldReason.INPUT_CHANGED:
                    self.run.release_hold(p.item_id, step.name)  # the input went back to the journaled one
                outputs[step.name] = row.output
                result.skipped_steps += 1
                continue
            ctx = StepContext._from_journal(job_id, p.item_id, step.name, p.digest, outputs,
                                            0 if row is None else row.generation)
            if action == VERIFY:
                receipt = self._verify(step, ctx)
                if isinstance(receipt, _NotDelivered):
                    assert row is not None
                    # The receiver affirms it never got this key: the send is made now, once. The
                    # audit row commits with the send's IN_FLIGHT mark, before the send (_commit_marks).
                    log.info("item %s: %s not delivered per the receiver; sending it once", p.item_id, step.name)
                    resent_from = (row.status.value, row.held_reason.value if row.held_reason else None)
                    outputs[step.name] = yield _Send(step, p, ctx, resent_from)
                    result.executed_steps += 1
                    result.resent_steps += 1
                    continue
                if receipt is None:
                    assert row is not None
                    if row.held_reason != HeldReason.UNKNOWN_OUTCOME:
                        self.run.hold(p.item_id, step.name, HeldReason.UNKNOWN_OUTCOME)
                    self._held(p.item_id, step.name, HeldReason.UNKNOWN_OUTCOME, ctx.generation)
                    return  # never send: the receiver may already have it
                encoded = json.dumps(receipt)
                self.run.mark_succeeded(p.item_id, step.name, p.digest, side_effect=True, output=encoded,
                                        receipt=receipt, verified=True)
                outputs[step.name] = encoded
                result.skipped_steps += 1
                result.verified_steps += 1
                log.info("item %s: %s verified by the receiver, not sent again", p.item_id, step.name)
                continue
            if step.side_effect:
                if row is not None:  # FAILED before anything was sent (NotSentError, not_delivered)
                    log.info("item %s: %s was not sent; sending it", p.item_id, step.name)
                outputs[step.name] = yield _Send(step, p, ctx)
            else:
                outputs[step.name] = self._run_local(step, p, ctx)
            result.executed_steps += 1
        result.items_completed += 1

    def _run_local(self, step: Step, p: _Prepared, ctx: StepContext) -> str:
        try:
            encoded = _encode_output(step.fn(p.item, ctx), p.item_id, step.name)
        except BaseException as exc:
            self._failed(step, p, exc)
            raise
        self.run.mark_succeeded(p.item_id, step.name, p.digest, side_effect=False, output=encoded, receipt=None)
        return encoded

    def record_send(self, send: _Send, outcome: _Outcome) -> str:
        """Record a finished send; raise its error (after recording FAILED) if it had one."""
        p, step = send.item, send.step
        error = outcome.error
        if error is None:
            try:
                encoded = _encode_output(outcome.value, p.item_id, step.name)
            except InvalidStepOutputError as exc:
                error = exc
        if error is not None:
            self._failed(step, p, error)
            raise error
        # The receipt goes to the job's receipt log at once (committed with the next commit point):
        # a crash in the next step must not turn a delivered send back into an unknown outcome.
        self.run.mark_succeeded(p.item_id, step.name, p.digest, side_effect=True, output=encoded,
                                receipt=_receipt_of(outcome.value, encoded), log_receipt=True)
        return encoded

    def _failed(self, step: Step, p: _Prepared, exc: BaseException) -> None:
        # Type name only: messages can carry tokens, addresses and payloads.
        not_sent = isinstance(exc, NotSentError)
        self.run.mark_failed(p.item_id, step.name, p.digest, side_effect=step.side_effect,
                             error_type=type(exc).__name__, not_sent=not_sent)
        log.warning("item %s: step %s failed with %s%s", p.item_id, step.name, type(exc).__name__,
                    " (nothing was sent: the next run sends it)" if not_sent and step.side_effect else "")

    @staticmethod
    def _verify(step: Step, ctx: StepContext) -> str | _NotDelivered | None:
        return None if step.verify is None else _ask_receiver(step.verify, ctx)

    def _held(self, item_id: str, step: str, reason: HeldReason, generation: int) -> None:
        self.result.held.append(HeldStep(self.run.job_id, item_id, step, reason, generation))
        log.warning("item %s: %s held (%s)", item_id, step, reason.value)


def _ask_receiver(verify: VerifyFn, ctx: StepContext) -> str | _NotDelivered | None:
    """What ``verify`` says of a send: its receipt, NOT_DELIVERED, or None (cannot tell, also when it
    raised or answered an empty receipt)."""
    try:
        receipt = verify(ctx)
    except Exception as exc:
        log.warning("item %s: verify of %s raised %s; holding it", ctx.item_id, ctx.step, type(exc).__name__)
        return None
    if receipt is None or receipt is NOT_DELIVERED:
        return receipt
    receipt = receipt if isinstance(receipt, str) else json.dumps(receipt)
    return receipt if receipt.strip() else None


def _commit_marks(run: JobRun, sends: Iterable[_Send]) -> None:
    """Mark these sends IN_FLIGHT and commit the marks (with everything buffered) in one durable
    flush - one fsync under full durability. Call it before any of them starts."""
    for send in sends:
        if send.resent_from is not None:
            run.audit(send.item.item_id, send.step.name, "not_delivered", resolved_by=VERIFY_RESOLVER,
                      note="the receiver's look-up has no record of this key; sent again once",
                      previous_status=send.resent_from[0], previous_held_reason=send.resent_from[1])
        run.mark_in_flight(send.item.item_id, send.step.name, send.item.digest)
    run.flush(durable=True)


def _advance(gen: ItemSteps, value: str | None) -> _Send | None:
    """Run an item on to its next send (None: the item is done or held)."""
    try:
        return next(gen) if value is None else gen.send(value)
    except StopIteration:
        return None


def _check_stop(stop: threading.Event | None) -> None:
    """Raise :class:`BatchStopped` if the run was asked to stop: called before any send starts."""
    if stop is not None and stop.is_set():
        raise BatchStopped("stopped on request: no new send was started; the sends in flight were recorded "
                           "as they finished. The job is unfinished: a retry or a Clear resumes it.")


class _Sequential:
    """concurrency=1: one send at a time, each IN_FLIGHT mark committed (and fsync'd) just before it."""

    def __init__(self, batch: _Batch, stop: threading.Event | None = None) -> None:
        self.batch, self.stop = batch, stop

    def start(self, p: _Prepared, rows: Mapping[str, StepState]) -> None:
        gen = self.batch.steps_of(p, rows)
        send = _advance(gen, None)
        while send is not None:
            run = self.batch.run
            try:
                _check_stop(self.stop)
            except BatchStopped:
                gen.close()
                raise
            _commit_marks(run, [send])
            try:
                encoded = self.batch.record_send(send, _call(send))
            finally:
                run.write_receipts()  # before any further user code
            send = _advance(gen, encoded)

    def finish(self) -> None:
        pass

    def abort(self) -> None:
        pass


class _Concurrent:
    """Up to ``n`` sends in flight on worker threads; the journal is written by this thread only.

    Sends are started in groups: the IN_FLIGHT marks of a group are committed together, with one
    fsync (or one synchronous commit) under full durability, before any send of the group starts
    (group commit). A group is started once at least ``n // 4`` sends are ready and there is room
    for them (or nothing else is in flight), so a full pipeline costs at most one durable commit
    per four sends. While the pipeline is full, up to ``n // 2`` items are prepared ahead (their
    local steps run); once that many are ready, this thread waits for sends to finish and starts
    the next group as soon as it fits - with no user code in between, so the receipts of the sends
    that finished meanwhile ride with that group's commit instead of a commit of their own. Local
    steps run on this thread, between sends; receipts are always committed (or, with a receipt
    log, logged) before any of them runs.
    """

    def __init__(self, batch: _Batch, n: int, stop: threading.Event | None = None) -> None:
        self.batch, self.n, self.stop = batch, n, stop
        self.min_group = max(1, n // 4)
        self.max_ready = max(self.min_group, n // 2)
        # A send of the last step finishes its item: recording it runs no user code afterwards.
        self.last_step = batch.steps[-1].name
        self.pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="resumable-send")
        self.ready: list[tuple[ItemSteps, _Send]] = []
        self.in_flight: dict[Future[_Outcome], tuple[ItemSteps, _Send]] = {}

    def start(self, p: _Prepared, rows: Mapping[str, StepState]) -> None:
        self.batch.run.write_receipts()  # the item's own steps are user code
        gen = self.batch.steps_of(p, rows)
        send = _advance(gen, None)
        if send is not None:
            self.ready.append((gen, send))
        while True:
            room = self.n - len(self.in_flight)
            if self.ready and room >= min(len(self.ready), self.min_group) and (
                len(self.ready) >= self.min_group or not self.in_flight
            ):
                self._dispatch(room)
            elif len(self.ready) >= self.max_ready:
                self._collect(defer_receipts=True)  # the next thing this thread does is a dispatch
            else:
                return

    def finish(self) -> None:
        try:
            while self.ready or self.in_flight:
                room = self.n - len(self.in_flight)
                if self.ready and room > 0:
                    self._dispatch(room)
                else:
                    self._collect()
        finally:
            self.pool.shutdown(wait=True)

    def _dispatch(self, room: int) -> None:
        _check_stop(self.stop)  # abort() then closes what is ready and records what is in flight
        group, self.ready = self.ready[:room], self.ready[room:]
        _commit_marks(self.batch.run, [send for _, send in group])  # the group shares one commit
        for gen, send in group:
            self.in_flight[self.pool.submit(_call, send)] = (gen, send)

    def _collect(self, *, defer_receipts: bool = False) -> None:
        done, _ = wait(self.in_flight, return_when=FIRST_COMPLETED)
        finished: list[tuple[ItemSteps, str]] = []
        error: BaseException | None = None
        for future in done:
            gen, send = self.in_flight.pop(future)
            try:
                finished.append((gen, self.batch.record_send(send, future.result())))
            except BaseException as exc:  # recorded FAILED; the others of this round still count
                gen.close()
                error = error or exc
            if send.step.name != self.last_step:
                defer_receipts = False  # its item goes on with more steps: user code
        if error is not None or not defer_receipts:
            self.batch.run.write_receipts()  # one write (or commit) for the round, before any user code
        if error is not None:
            for gen, _ in finished:
                gen.close()
            raise error
        for gen, encoded in finished:
            following = _advance(gen, encoded)
            if following is not None:
                self.ready.append((gen, following))

    def abort(self) -> None:
        """Something raised: start nothing more, but record every send already started."""
        for gen, _ in self.ready:
            gen.close()  # never marked IN_FLIGHT, never sent
        self.ready = []
        try:
            while self.in_flight:
                done, _ = wait(self.in_flight, return_when=FIRST_COMPLETED)
                for future in done:
                    gen, send = self.in_flight.pop(future)
                    try:
                        encoded = self.batch.record_send(send, future.result())
                    except BaseException:  # noqa: S110 - recorded FAILED; the first error is the one raised
                        gen.close()
                        continue
                    if send.step.name == self.last_step:
                        _advance(gen, encoded)  # the item's last step: it completes, no user code runs
                    else:
                        gen.close()  # its later steps wait for the next run
            try:
                self.batch.run.write_receipts()
            except Exception as exc:  # noqa: BLE001 - the error that stopped the batch is the one to raise
                log.warning("could not record the receipts of the last sends (%s); the next run verifies "
                            "or holds them", type(exc).__name__)
        finally:
            self.pool.shutdown(wait=True)


def _check_steps(steps: Iterable[Step]) -> list[Step]:
    checked = list(steps)
    if not checked:
        raise ValueError("run_batch needs at least one Step")
    names: set[str] = set()
    for step in checked:
        if not isinstance(step, Step):
            raise ValueError(f"steps must be Step objects, got {type(step).__name__}")
        if step.name in names:
            raise ValueError(f"step name {step.name!r} is used twice; step names must be unique")
        names.add(step.name)
    return checked


MAX_CONCURRENCY = 256


def check_concurrency(concurrency: object) -> int:
    """``concurrency`` if it is a usable value, else ValueError (the operator checks it at parse time)."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise ValueError(f"concurrency must be an integer from 1 to {MAX_CONCURRENCY}, not {concurrency!r}")
    return concurrency


def run_batch(
    journal: StepJournal,
    job_id: str,
    items: Iterable[Mapping[str, Any]],
    steps: Iterable[Step],
    *,
    id_field: str = "id",
    concurrency: int = 1,
    on_progress: Callable[[BatchProgress], None] | None = None,
    progress_interval: float = 10.0,
    runner: str | None = None,
    stop: threading.Event | None = None,
    dag_id: str | None = None,
) -> BatchResult:
    """Run ``steps`` over ``items`` under ``job_id``, resuming whatever the journal already has.

    Items may be any iterable; they are streamed in chunks, never loaded whole. A step that raises
    is recorded FAILED (type name only) and the exception propagates: run the job again to resume.
    With ``concurrency=N`` up to N side-effect sends run at once on worker threads (local steps
    and all journal writes stay on the calling thread); items may finish in a different order, with
    the same results. Raises :class:`~airflow_resumable.journal.JobBusyError` at once if another
    runner holds the job. Setting ``stop`` (from another thread or a signal handler) stops the run:
    no send starts after that, the sends in flight are recorded, and :class:`BatchStopped` is raised;
    the job stays unfinished (``JobSummary.status``) until a run goes through the whole batch.
    ``dag_id``: the Airflow DAG running the job, recorded with it by its first run (who may settle its
    held items is decided by that DAG).
    """
    if not isinstance(job_id, str) or not job_id.strip() or not _is_storable(job_id):
        raise ValueError("job_id must be a non-empty string of valid Unicode text without NUL characters")
    if not isinstance(id_field, str) or not id_field:
        raise ValueError("id_field must be a non-empty string")
    check_concurrency(concurrency)
    checked_steps = _check_steps(steps)
    step_names = [s.name for s in checked_steps]
    items_total = len(items) if hasattr(items, "__len__") else None  # type: ignore[arg-type]
    started = last_report = time.monotonic()
    result = BatchResult(job_id=job_id, status="completed")

    def progress() -> BatchProgress:
        # Items done: completed or held (a held item stops at its held step) - not merely read in.
        return BatchProgress(result.items_completed + len(result.held), items_total, result.executed_steps,
                             result.skipped_steps, len(result.held), time.monotonic() - started,
                             result.verified_steps)

    def report_if_due() -> None:
        nonlocal last_report
        if on_progress is not None and time.monotonic() - last_report >= progress_interval:
            last_report = time.monotonic()
            on_progress(progress())

    with journal.open_job(job_id, runner=runner, dag_id=dag_id) as run:
        batch = _Batch(run, checked_steps, result)
        driver = _Sequential(batch, stop) if concurrency == 1 else _Concurrent(batch, concurrency, stop)
        try:
            for chunk in _chunks(items):
                prepared = _prepare(chunk, id_field, result.items_total, run)
                result.items_total += len(prepared)
                # Items whose every step is SUCCEEDED with this very input are settled in bulk by
                # the journal (row "SUCCEEDED -> skip" of the decision table, for all their steps).
                unfinished = run.unfinished(step_names)
                rows = run.lookup([p.item_id for p in prepared if p.item_id in unfinished]) if unfinished else {}
                for p in prepared:
                    if p.item_id in unfinished:
                        _check_stop(stop)
                        driver.start(p, rows.get(p.item_id, {}))
                        report_if_due()  # by time, between items: slow sends still report
                    else:
                        result.skipped_steps += len(checked_steps)
                        result.items_completed += 1
                report_if_due()
            driver.finish()
            run.finished()  # the whole batch was gone through: the job is no longer unfinished
        except BaseException:
            driver.abort()
            if on_progress is not None:
                # How far this run got, for the task log and metrics; the original error still wins.
                try:
                    on_progress(progress())
                except Exception as exc:  # noqa: BLE001
                    log.warning("on_progress raised %s while the batch was failing", type(exc).__name__)
            raise
    result.elapsed = time.monotonic() - started
    result.status = "needs_review" if result.held else "completed"
    if on_progress is not None:
        on_progress(progress())
    return result


def verify_held(
    journal: StepJournal, job_id: str, verify: VerifyFn, *, step: str | None = None,
    resolved_by: str = VERIFY_RESOLVER,
) -> list[HeldStep]:
    """Ask the receiver again about the job's unknown-outcome sends.

    Each one the receiver has a receipt for is marked SUCCEEDED (recorded in the audit log as a
    ``delivered`` resolution by ``resolved_by``); each one it affirms it never got
    (:data:`NOT_DELIVERED`) is resolved ``not_delivered``, so the next run sends it once. Returns
    the steps that were settled either way.

    Each question and the settlement it leads to happen under the job's claim, about the row as it was
    read under that claim: no run can send the step in between (its answer would be stale). A run of
    the job in progress raises :class:`~airflow_resumable.journal.JobBusyError` before anything is
    asked; the steps settled before it stay settled.
    """
    settled: list[HeldStep] = []
    for seen in journal.open_rows(job_id):
        if step is not None and seen.step != step:
            continue
        with journal.deciding(job_id):
            # Read again under the claim: what was open a moment ago may have been settled or re-sent.
            rows = {r.step: r for r in journal.rows(job_id, seen.item_id)}
            row = rows.get(seen.step)
            if (row is None or not row.side_effect or row.status == Status.SUCCEEDED or row.not_sent
                    or row.held_reason == HeldReason.INPUT_CHANGED):
                continue
            outputs = {r.step: r.output for r in rows.values() if r.status == Status.SUCCEEDED}
            ctx = StepContext(job_id, row.item_id, row.step, row.digest,
                              idempotency_key(job_id, row.item_id, row.step, row.generation), outputs, row.generation)
            receipt = _ask_receiver(verify, ctx)
            if receipt is None:
                continue
            if isinstance(receipt, _NotDelivered):
                journal.resolve(job_id, row.item_id, row.step, delivered=False, resolved_by=resolved_by,
                                note="the receiver's look-up has no record of this key; the next run sends it once",
                                expected_version=row.version)
            else:
                journal.resolve(job_id, row.item_id, row.step, delivered=True, receipt=receipt,
                                resolved_by=resolved_by, note="the receiver's look-up found a receipt",
                                expected_version=row.version)
        settled.append(HeldStep(job_id, row.item_id, row.step, HeldReason.UNKNOWN_OUTCOME, row.generation))
    return settled
