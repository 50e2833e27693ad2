"""What a batch is made of: the :class:`Step`, the :class:`StepContext` its function is handed,
:data:`NOT_DELIVERED`, and the item digest and idempotency key the journal knows a step by."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from airflow_resumable.journal.checks import text_problem
from airflow_resumable.journal.records import MAX_ID_LENGTH
from airflow_resumable.journal.records import idempotency_key as idempotency_key
from airflow_resumable.runner.settle import check_limit_key, check_rate


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


class NotDelivered:
    """The type of :data:`NOT_DELIVERED` (one instance): what a ``verify`` function's return type names."""

    # Pickled by name, as airflow_resumable.runner.NOT_DELIVERED (its one public path), so a pickle one
    # release makes loads in another.
    __module__ = "airflow_resumable.runner"

    _instance: NotDelivered | None = None

    def __new__(cls) -> NotDelivered:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_DELIVERED"

    def __reduce__(self) -> str:
        return "NOT_DELIVERED"


NOT_DELIVERED = NotDelivered()
"""What ``verify`` returns when the receiver *affirms* it has no record of ``ctx.idempotency_key``
(not merely "cannot tell"): the send is made now, once, and the settlement is audited (resolved_by
``verify``). Return it only if the receiver's look-up is authoritative: one that records
asynchronously may not know yet of a send it already has."""

StepFn = Callable[[Mapping[str, Any], StepContext], Any]
"""A step's function: ``fn(item, ctx)``, returning what is recorded (JSON, at most 64 KiB)."""
VerifyFn = Callable[[StepContext], "str | NotDelivered | None"]
"""A side-effect step's look-up: ``verify(ctx)`` -> the receipt, :data:`NOT_DELIVERED`, or None."""


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
    :param idempotent: the receiver dedupes by ``ctx.idempotency_key`` for at least the job's lifetime:
        a send whose outcome is unknown is sent again with the same key, in the task, instead of being
        looked up or held. Side-effect steps only.
    :param max_sends_per_second: the most sends of this step per second, kept by every thread of the run
        (and, with ``limit_key``, by every run naming that key on the same journal). None: the run
        learns the rate the receiver accepts from its refusals. Side-effect steps only.
    :param limit_key: the name a rate limit is shared under: the runs of a fleet (mapped tasks, other
        DAGs) that name the same key on the same journal keep ``max_sends_per_second`` together, and
        pause together when the receiver asks to wait. Needs ``max_sends_per_second``.
    """

    name: str
    fn: StepFn
    side_effect: bool = False
    verify: VerifyFn | None = None
    idempotent: bool = False
    max_sends_per_second: float | None = None
    limit_key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise ValueError("a Step needs a non-empty name")
        problem = text_problem(self.name)
        if problem:
            raise ValueError(f"step name {self.name[:80]!r} {problem}")
        if len(self.name) > MAX_ID_LENGTH:  # no decision could name it: its holds could never be settled
            raise ValueError(f"step name {self.name[:80]!r}... is {len(self.name)} characters; at most {MAX_ID_LENGTH}")
        if not callable(self.fn):
            raise ValueError(f"step {self.name!r}: fn must be callable")
        if self.verify is not None and not self.side_effect:
            raise ValueError(f"step {self.name!r}: verify only makes sense for a side_effect step")
        if self.verify is not None and not callable(self.verify):
            raise ValueError(f"step {self.name!r}: verify must be callable")
        if not isinstance(self.idempotent, bool):
            raise ValueError(f"step {self.name!r}: idempotent must be True or False")
        where = f"step {self.name!r}"
        check_rate(self.max_sends_per_second, where)
        check_limit_key(self.limit_key, where)
        if not self.side_effect and (self.idempotent or self.max_sends_per_second is not None or self.limit_key):
            raise ValueError(f"step {self.name!r}: idempotent, max_sends_per_second and limit_key are for "
                             "side_effect steps (the ones that send)")
        if self.limit_key is not None and self.max_sends_per_second is None:
            raise ValueError(f"step {self.name!r}: limit_key shares a rate: give max_sends_per_second too")


def _check_steps(steps: Iterable[Step]) -> list[Step]:
    """The batch's steps as a list, or ValueError: none at all, a non-Step, a name used twice."""
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


# One encoder each instead of json.dumps(**options): with options, dumps builds a new encoder on
# every call, which costs as much as the encoding itself when a million items are resumed.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
_COMPACT = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def canonical_digest(item: Mapping[str, Any]) -> str:
    """SHA-256 of the item's canonical JSON (sorted keys, no whitespace)."""
    return hashlib.sha256(_CANONICAL.encode(item).encode("utf-8")).hexdigest()
