"""One run of one job: reading the items in, and carrying out the decision table for each of their steps.

Items are read in chunks of :data:`CHUNK_SIZE` and each chunk is validated whole before any item of
it is touched (:func:`_prepare`). :class:`_Batch` walks an item's steps; it runs local steps itself and
hands each send to a driver (:mod:`airflow_resumable.runner.drivers`), which marks it IN_FLIGHT,
commits the mark and sends.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_resumable.exceptions import InvalidItemError, InvalidStepOutputError, NotSentError
from airflow_resumable.journal import HeldReason, HeldStep, JobRun, StepJournal, StepState
from airflow_resumable.journal.checks import text_problem
from airflow_resumable.journal.records import MAX_ID_LENGTH
from airflow_resumable.runner.decisions import HOLD_CHANGED, SKIP, VERIFY, decide
from airflow_resumable.runner.high_water import HighWater
from airflow_resumable.runner.results import BatchResult
from airflow_resumable.runner.settle import FINAL, REFUSED, UNKNOWN, Pace, Settlement, SharedPace, kind_of, retry_after_of
from airflow_resumable.runner.steps import _COMPACT, NotDelivered, Step, StepContext, canonical_digest
from airflow_resumable.runner.verify import _answer, _ask_receiver

# One logger for every part of the runner (airflow_resumable.runner): one name for a user to configure.
log = logging.getLogger(__package__)

MAX_OUTPUT_BYTES = 64 * 1024
# Items validated and looked up together: one journal query per chunk, not one per step.
CHUNK_SIZE = 500


@dataclass
class _Prepared:
    item_id: str
    item: Mapping[str, Any]
    digest: str


# What _Batch._verify_first answers for a send it held.
_HELD = object()


def _is_storable(value: str) -> bool:
    """True if both journal engines can store ``value`` as text: no NUL, no lone surrogate."""
    return text_problem(value) is None


def _item_id(item: object, id_field: str, position: int) -> str:
    # A dict is taken without asking the Mapping ABC: that question was the dearest part of an item
    # whose steps are all done (a resumed job reads every item again).
    if type(item) is not dict and not isinstance(item, Mapping):
        raise InvalidItemError(f"item at position {position} is a {type(item).__name__}, not a mapping")
    if id_field not in item:
        raise InvalidItemError(f"item at position {position} has no {id_field!r} field")
    raw = item[id_field]
    if type(raw) is int:  # digits: always text both engines store, never empty
        item_id = str(raw)
    else:
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


def _room_for_item_ids(journal: StepJournal, job_id: str, step_names: list[str]) -> int | None:
    """The most UTF-8 bytes an item id may take in ``journal`` beside this job id and these steps (None: no
    limit but the ids' own); ValueError if the job id and a step name already take the journal's key."""
    if journal.max_key_bytes is None:
        return None
    taken = len(job_id.encode("utf-8")) + max(len(name.encode("utf-8")) for name in step_names)
    if taken >= journal.max_key_bytes:
        raise ValueError(
            f"job_id and the longest step name take {taken} bytes; in journal {journal.location} a row's key "
            f"(job_id + item_id + step) holds at most {journal.max_key_bytes} bytes (UTF-8): shorten the job_id"
        )
    return journal.max_key_bytes - taken


def _prepare(chunk: list[object], id_field: str, first_position: int, run: JobRun, *,
             max_id_bytes: int | None = None) -> list[_Prepared]:
    """Validate a whole chunk before any item of it is touched."""
    prepared: list[_Prepared] = []
    ids_here: set[str] = set()
    for offset, item in enumerate(chunk):
        item_id = _item_id(item, id_field, first_position + offset)
        if max_id_bytes is not None and (size := len(item_id.encode("utf-8"))) > max_id_bytes:
            raise InvalidItemError(
                f"item at position {first_position + offset}: {id_field!r} is {size} bytes (UTF-8); beside this "
                f"job_id and its step names a row's key leaves it at most {max_id_bytes}: shorten the id"
            )
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
    if value is None:  # what most local steps return: no encoder needed
        return "null"
    if value is True or value is False:
        return "true" if value else "false"
    try:
        text = _COMPACT.encode(value)
        # ASCII text is its own UTF-8; other text is encoded (UnicodeEncodeError, a ValueError: a lone surrogate).
        size = len(text) if text.isascii() else len(text.encode("utf-8"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidStepOutputError(
            f"step {step!r} of item {item_id!r} returned a value that is not JSON ({type(exc).__name__}); "
            "return plain JSON data (a receipt string, a dict, ...)"
        ) from None
    if size > MAX_OUTPUT_BYTES:
        raise InvalidStepOutputError(
            f"step {step!r} of item {item_id!r} returned {size} bytes of output "
            f"(at most {MAX_OUTPUT_BYTES}); keep large data outside the journal and return a reference"
        )
    return text


def _receipt_of(value: Any, encoded: str) -> str | None:
    if value is None:
        return None
    # A receipt holding NUL is kept as its JSON text: no journal engine stores NUL in text.
    return value if isinstance(value, str) and "\x00" not in value else encoded


def _with_next(chunks: Iterator[list[object]], *, read_ahead: bool) -> Iterator[tuple[list[object], list[object]]]:
    """Each chunk with the one after it (empty at the end; always empty without ``read_ahead``). An
    error reading a chunk early is raised when the chunk would have been read."""
    if not read_ahead:
        for chunk in chunks:
            yield chunk, []
        return
    current = next(chunks, None)
    while current is not None:
        error: Exception | None = None
        try:
            following = next(chunks, None)
        except Exception as exc:  # noqa: BLE001 - raised in its turn, below
            following, error = None, exc
        yield current, following or []
        if error is not None:
            raise error
        current = following


def _planned_ids(chunk: list[object], id_field: str) -> list[str]:
    """The ids of a chunk's items as far as they can be read (an invalid item ends them: the chunk is
    refused when its turn comes)."""
    ids = []
    for position, item in enumerate(chunk):
        raw = item.get(id_field) if type(item) is dict else None
        if type(raw) is str and raw.strip():  # the usual id, taken as _item_id takes it
            ids.append(raw)
            continue
        try:
            ids.append(_item_id(item, id_field, position))
        except Exception:  # noqa: BLE001
            break
    return ids


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
    # Whether the step had no row before this send's IN_FLIGHT mark (the mark creates it).
    new_row: bool = False
    # Marked before, but it waited too long for a thread (or the receiver paused) and was queued again:
    # its next mark only renews the commit (no second attempt counted, no second audit row).
    marked_before: bool = False
    # Settlement in the task: this send's attempt in this run (sends and look-ups of the step), and
    # whether the chain of attempts began with a look-up (the run's first question about the step).
    attempt: int = 1
    from_verify: bool = False


@dataclass(frozen=True)
class _Verify:
    """A look-up the driver makes (settlement in the task): the step's outcome is unknown."""

    step: Step
    item: _Prepared
    ctx: StepContext
    status: str  # the row's status and held reason as the look-up found them (for the audit row)
    held_reason: str | None
    attempt: int = 1
    from_verify: bool = False  # the run's first question about the step (not after a send of this run)


Task = _Send | _Verify


@dataclass(frozen=True)
class _Done:
    """The step is settled: its recorded output, for the item's next steps."""

    encoded: str


@dataclass(frozen=True)
class _Wait:
    """Try again at ``due`` (``time.monotonic()``): a re-send or a look-up."""

    due: float
    task: Task


# The item goes no further in this run: held for a person, or out of attempts (left for the next try).
_ITEM_STOPS = object()


@dataclass(frozen=True)
class _Outcome:
    value: Any = None
    error: BaseException | None = None
    # Why a send that was marked and queued never started: the run was stopped ("stopped"), another
    # send raised ("halted"), it waited longer than the drivers' MAX_QUEUE_WAIT for a thread
    # ("waited too long"), or the receiver asked every send to wait ("paused").
    not_started: str | None = None
    started: float = 0.0  # time.monotonic() around the call: the pace learns from them
    ended: float = 0.0


class _ReceiverGaveUp(Exception):
    """The driver stops the run: the receiver kept failing, or asked to wait longer than a run waits.
    ``run_batch`` turns it into :class:`~airflow_resumable.exceptions.ReceiverUnavailableError`."""

    def __init__(self, reason: str, retry_after: float | None) -> None:
        super().__init__(reason)
        self.reason, self.retry_after = reason, retry_after


def _call(send: _Send) -> _Outcome:
    """Run a send's function (in a worker thread when concurrent). Never raises: the driver records."""
    started = time.monotonic()
    try:
        value = send.step.fn(send.item.item, send.ctx)
    except BaseException as exc:  # recorded FAILED (type name only), settled or re-raised by the driver
        return _Outcome(error=exc, started=started, ended=time.monotonic())
    return _Outcome(value, started=started, ended=time.monotonic())


def _look_up(task: _Verify) -> _Outcome:
    """Ask the receiver about a step (in a worker thread when concurrent). Never raises."""
    started = time.monotonic()
    try:
        value = task.step.verify(task.ctx) if task.step.verify is not None else None
    except BaseException as exc:  # no answer: asked again after a backoff
        return _Outcome(error=exc, started=started, ended=time.monotonic())
    return _Outcome(value, started=started, ended=time.monotonic())


ItemSteps = Generator[Task, str, None]


class _Batch:
    """One run of one job: applies :func:`decide` to every step of every item.

    :meth:`steps_of` walks one item's steps. Local steps run right there; at a side-effect step it
    yields a :class:`_Send` and waits to be handed the send's recorded output. Marking the send
    IN_FLIGHT, committing that mark and sending are the driver's job, so that a concurrent driver
    can commit the marks of a whole group with one fsync (:mod:`airflow_resumable.runner.drivers`).
    """

    def __init__(self, run: JobRun, steps: list[Step], result: BatchResult, settlement: Settlement | None = None,
                 shared_pace: Callable[[str], SharedPace] | None = None) -> None:
        self.run = run
        self.steps = steps
        self.result = result
        self.settlement = settlement
        self.last_retry_after: float | None = None
        self.high_water: HighWater | None = None  # set by run_batch when a mark is kept outside the journal
        # One pace per receiver: per limit key when steps name one (shared with other runs through the
        # journal), else per step. A step with neither a rate nor settlement is sent unpaced.
        self.paces: dict[str, Pace] = {}
        by_key: dict[str, Pace] = {}
        for step in steps:
            if not step.side_effect or (settlement is None and step.max_sends_per_second is None):
                continue
            key = step.limit_key or f"step {step.name}"
            pace = by_key.get(key)
            if pace is None:
                shared = shared_pace(step.limit_key) if step.limit_key is not None and shared_pace is not None else None
                pace = by_key[key] = Pace(step.max_sends_per_second, adaptive=settlement is not None, shared=shared)
            elif pace.rate != step.max_sends_per_second:
                raise ValueError(f"steps sharing limit_key {step.limit_key!r} name different max_sends_per_second")
            self.paces[step.name] = pace

    def steps_of(self, p: _Prepared, rows: Mapping[str, StepState]) -> ItemSteps:
        """An item's steps (a generator the driver advances). The high-water mark, if kept, is told when
        they end: done, held, or left for the next try (an item cut short by a failing run stays in its
        window: the run's last record is written without one)."""
        job_id, result = self.run.job_id, self.result
        outputs: dict[str, str | None] = {}  # step -> recorded JSON, decoded only if a later step asks
        for step in self.steps:
            row = rows.get(step.name)
            action = decide(row, p.digest, step.side_effect)
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
            if action == VERIFY and self.settlement is not None:
                assert row is not None
                # The driver asks (again after a backoff if the look-up fails) and settles; it counts.
                outputs[step.name] = yield _Verify(step, p, ctx, row.status.value,
                                                   row.held_reason.value if row.held_reason else None,
                                                   from_verify=True)
                continue
            if action == VERIFY:
                receipt = _ask_receiver(step.verify, ctx)
                if isinstance(receipt, NotDelivered):
                    assert row is not None
                    # The receiver affirms it never got this key: the send is made now, once. The
                    # audit row commits with the send's IN_FLIGHT mark, before the send (drivers._commit_marks).
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
                if self.high_water is not None and self.high_water.must_verify(p.item_id):
                    # The journal may have lost this send's record (SPEC §13): ask before sending.
                    answer = self._verify_first(step, p, ctx, row)
                    if answer is _HELD:
                        return
                    if isinstance(answer, str):
                        outputs[step.name] = answer
                        continue
                if row is not None:  # FAILED before anything was sent (NotSentError, not_delivered)
                    log.info("item %s: %s was not sent; sending it", p.item_id, step.name)
                outputs[step.name] = yield _Send(step, p, ctx, new_row=row is None)
            else:
                outputs[step.name] = self._run_local(step, p, ctx)
            result.executed_steps += 1
        result.items_completed += 1
        if self.high_water is not None:
            self.high_water.release(p.item_id, settled=True)

    def _verify_first(self, step: Step, p: _Prepared, ctx: StepContext, row: StepState | None) -> object:
        """A send the journal has no record of, where it may have lost one: its encoded receipt if the
        receiver has it, None (send it) if the receiver says it never got it, else _HELD (held for a
        person, as an IN_FLIGHT row: it may have been sent)."""
        answer = _ask_receiver(step.verify, ctx)
        if isinstance(answer, NotDelivered):
            log.info("item %s: %s not delivered per the receiver; sending it", p.item_id, step.name)
            return None
        if answer is None:
            self.run.mark_in_flight(p.item_id, step.name, p.digest, new_attempt=False)
            self.run.hold(p.item_id, step.name, HeldReason.UNKNOWN_OUTCOME)
            self._held(p.item_id, step.name, HeldReason.UNKNOWN_OUTCOME, ctx.generation)
            return _HELD
        encoded = json.dumps(answer)
        self.run.mark_succeeded(p.item_id, step.name, p.digest, side_effect=True, output=encoded,
                                receipt=answer, verified=True)
        self.result.skipped_steps += 1
        self.result.verified_steps += 1
        log.info("item %s: %s found at the receiver, not sent again", p.item_id, step.name)
        return encoded

    def _run_local(self, step: Step, p: _Prepared, ctx: StepContext) -> str:
        try:
            encoded = _encode_output(step.fn(p.item, ctx), p.item_id, step.name)
        except BaseException as exc:
            self._failed(step, p, exc)
            raise
        self.run.mark_succeeded(p.item_id, step.name, p.digest, side_effect=False, output=encoded, receipt=None)
        return encoded

    def after_send(self, send: _Send, outcome: _Outcome) -> _Done | _Wait | object:
        """Record a finished send and say what follows: the item goes on (:class:`_Done`), the send is
        made again or looked up after a wait (:class:`_Wait`), or the item stops here (``_ITEM_STOPS``:
        held, or out of attempts). An error that settlement does not cover is raised, recorded FAILED."""
        p, step = send.item, send.step
        error = outcome.error
        if error is None:
            try:
                encoded = _encode_output(outcome.value, p.item_id, step.name)
            except InvalidStepOutputError as exc:
                error = exc
        pace = self.paces.get(step.name)
        if error is None:
            # The receipt goes to the job's receipt log at once (committed with the next commit point):
            # a crash in the next step must not turn a delivered send back into an unknown outcome.
            self.run.mark_succeeded(p.item_id, step.name, p.digest, side_effect=True, output=encoded,
                                    receipt=_receipt_of(outcome.value, encoded), log_receipt=True)
            if pace is not None:
                pace.went_through(outcome.ended)
            if send.from_verify:  # the item's generator did not ask for a send: it is counted here
                self.result.executed_steps += 1
            return _Done(encoded)
        self._failed(step, p, error)
        kind = FINAL if self.settlement is None else kind_of(error)
        if kind == FINAL:
            raise error
        settlement = self.settlement
        assert settlement is not None and pace is not None
        retry_after = retry_after_of(error) if kind == REFUSED else None
        streak = pace.failed(outcome.started, outcome.ended, refused=kind == REFUSED, retry_after=retry_after,
                             settlement=settlement)
        if retry_after is not None:
            self.last_retry_after = retry_after
            if retry_after > settlement.max_wait:
                self._give_up(send, f"the receiver asked to wait {retry_after:g} s, longer than a run waits "
                                    f"(max_wait {settlement.max_wait:g} s)")
                raise _ReceiverGaveUp("long_retry_after", retry_after)
        following: Task
        if kind == UNKNOWN and not step.idempotent:
            if step.verify is None:
                log.warning("item %s: %s may have arrived (%s) and the step has no verify: holding it",
                            p.item_id, step.name, type(error).__name__)
                stops = self._hold_unknown(p, step, send.ctx, already_held=False)
                if streak > settlement.max_attempts:  # and hold no more: the receiver is failing
                    raise _ReceiverGaveUp("receiver_failing", pace.last_retry_after)
                return stops
            following = _Verify(step, p, send.ctx, "failed", None, attempt=send.attempt + 1,
                                from_verify=send.from_verify)
        else:
            following = dataclasses.replace(send, attempt=send.attempt + 1, new_row=False, marked_before=False,
                                            resent_from=None)
        if streak > settlement.max_attempts:
            self._give_up(send, f"the receiver failed {streak} rounds in a row")
            raise _ReceiverGaveUp("receiver_failing", pace.last_retry_after)
        if send.attempt >= settlement.max_attempts:
            return self._give_up(send, f"{send.attempt} attempts, the last {type(error).__name__}")
        wait = retry_after if retry_after is not None else settlement.backoff(send.attempt)
        self.result.waits += 1
        if isinstance(following, _Send):
            self.result.resent_in_task += 1
        log.info("item %s: %s %s (%s); %s in %.2f s (attempt %d of %d)", p.item_id, step.name,
                 "refused" if kind == REFUSED else "outcome unknown", type(error).__name__,
                 "sending it again" if isinstance(following, _Send) else "asking the receiver", wait,
                 following.attempt, settlement.max_attempts)
        return _Wait(time.monotonic() + wait, following)

    def after_verify(self, task: _Verify, outcome: _Outcome) -> _Done | _Wait | object:
        """Settle a step by the receiver's answer to a look-up (settlement in the task): its receipt (done),
        NOT_DELIVERED (sent once, audited), None (held). A look-up that raised is no answer: asked again
        after a backoff, and once its attempts run out the step stays FAILED for the next try - not held."""
        p, step, ctx = task.item, task.step, task.ctx
        settlement, pace = self.settlement, self.paces.get(step.name)
        assert settlement is not None and pace is not None
        if outcome.error is not None:
            if not isinstance(outcome.error, Exception):
                raise outcome.error  # KeyboardInterrupt, SystemExit: not a look-up's answer
            streak = pace.failed(outcome.started, outcome.ended, refused=False,
                                 retry_after=retry_after_of(outcome.error), settlement=settlement)
            if task.attempt >= settlement.max_attempts:
                return self._give_up(task, f"its look-up raised {type(outcome.error).__name__} every time")
            if streak > settlement.max_attempts:
                self._give_up(task, f"the receiver failed {streak} rounds in a row")
                raise _ReceiverGaveUp("receiver_failing", pace.last_retry_after)
            wait = settlement.backoff(task.attempt)
            self.result.waits += 1
            log.info("item %s: the look-up of %s raised %s (no answer); asking again in %.2f s", p.item_id,
                     step.name, type(outcome.error).__name__, wait)
            return _Wait(time.monotonic() + wait, dataclasses.replace(task, attempt=task.attempt + 1))
        pace.went_through(outcome.ended)
        answer = _answer(ctx, outcome.value)
        if isinstance(answer, NotDelivered):
            log.info("item %s: %s not delivered per the receiver; sending it once", p.item_id, step.name)
            self.result.resent_steps += 1
            if not task.from_verify:
                self.result.settled_in_task += 1
            return _Wait(time.monotonic(), _Send(step, p, ctx, (task.status, task.held_reason),
                                                 attempt=task.attempt + 1, from_verify=task.from_verify))
        if answer is None:
            return self._hold_unknown(p, step, ctx, already_held=task.held_reason == HeldReason.UNKNOWN_OUTCOME.value)
        encoded = json.dumps(answer)
        self.run.mark_succeeded(p.item_id, step.name, p.digest, side_effect=True, output=encoded,
                                receipt=answer, verified=True)
        self.result.verified_steps += 1
        if task.from_verify:
            self.result.skipped_steps += 1
        else:
            self.result.settled_in_task += 1
        log.info("item %s: %s verified by the receiver, not sent again", p.item_id, step.name)
        return _Done(encoded)

    def _hold_unknown(self, p: _Prepared, step: Step, ctx: StepContext, *, already_held: bool) -> object:
        if not already_held:
            self.run.hold(p.item_id, step.name, HeldReason.UNKNOWN_OUTCOME)
        self._held(p.item_id, step.name, HeldReason.UNKNOWN_OUTCOME, ctx.generation)
        return _ITEM_STOPS  # never send: the receiver may already have it

    def _give_up(self, task: Task, why: str) -> object:
        self.result.gave_up += 1
        if self.high_water is not None:  # no more sends of it in this run; its row says it was not sent
            self.high_water.release(task.item.item_id, settled=True)
        log.warning("item %s: %s left for the next try (%s); nothing was held", task.item.item_id, task.step.name,
                    why)
        return _ITEM_STOPS

    def record_not_started(self, send: _Send, cause: type[BaseException]) -> None:
        """A send was marked IN_FLIGHT but never started (the run failed or stopped while it was queued):
        its mark is taken back, so the next run sends it with no verify and no human."""
        p, step = send.item, send.step
        self.run.take_back_mark(p.item_id, step.name, p.digest, created_row=send.new_row, error_type=cause.__name__)
        log.info("item %s: %s was queued but never started (%s); the next run sends it", p.item_id, step.name,
                 cause.__name__)

    def _failed(self, step: Step, p: _Prepared, exc: BaseException) -> None:
        # Type name only: messages can carry tokens, addresses and payloads.
        not_sent = isinstance(exc, NotSentError)
        self.run.mark_failed(p.item_id, step.name, p.digest, side_effect=step.side_effect,
                             error_type=type(exc).__name__, not_sent=not_sent)
        log.warning("item %s: step %s failed with %s%s", p.item_id, step.name, type(exc).__name__,
                    " (nothing was sent: the next run sends it)" if not_sent and step.side_effect else "")

    def _held(self, item_id: str, step: str, reason: HeldReason, generation: int) -> None:
        self.result.held.append(HeldStep(self.run.job_id, item_id, step, reason, generation))
        if self.high_water is not None:
            self.high_water.release(item_id, settled=True)  # its row says it is held
        log.warning("item %s: %s held (%s)", item_id, step, reason.value)
