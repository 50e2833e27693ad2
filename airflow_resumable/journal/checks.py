"""What the journal accepts in a decision: its text, names, version, outcome and, for a bulk call, its entries.

Every surface (the resolve DAG, the UI page, the CLI) ends in these checks, so a refusal reads the same
whichever way a decision came in. They run before any claim or transaction: a refused decision changes
nothing and waits for nobody.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from airflow_resumable.exceptions import NotHeldError, ResolutionError
from airflow_resumable.journal.records import (
    DECISIONS,
    ENTRY_FIELDS,
    MAX_ID_LENGTH,
    MAX_JOB_ID_LENGTH,
    MAX_NOTE_BYTES,
    MAX_PERSON_LENGTH,
    MAX_RECEIPT_BYTES,
)

__all__ = [
    "CheckedEntry",
    "check_entry",
    "check_names",
    "check_outcome",
    "check_person",
    "check_text",
    "check_version",
    "text_problem",
]


class CheckedEntry(NamedTuple):
    """One entry of :meth:`~.decisions.JournalDecisions.apply_decisions`, checked and normalised."""

    job_id: str
    item_id: str
    step: str | None  # None for an input change: it is about the item, not one step
    decision: str
    receipt: str | None
    note: str
    version: str | None


def text_problem(value: str) -> str | None:
    """What keeps ``value`` from being stored as text by both engines, or None.

    Neither engine stores a NUL character in text, and a lone surrogate (half of a UTF-16 pair, as a
    ``\\ud800`` escape in JSON or an argument's bytes that were not UTF-8 leave it) has no UTF-8 form.
    """
    if "\x00" in value:
        return "contains a NUL character; remove it"
    if value.isascii():  # no surrogate, and it costs no encoding (every resumed item's id comes here)
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return ("contains a lone surrogate (bytes that are not UTF-8, or a \\ud800-style escape with no pair); "
                "fix the text")
    return None


def check_text(value: object, what: str, *, max_chars: int | None = None, max_bytes: int | None = None) -> str:
    """``value`` if it is text the journal can store and show, else the refusal naming ``what``."""
    if not isinstance(value, str):
        raise ResolutionError(f"{what} must be text, not {type(value).__name__}")
    problem = text_problem(value)
    if problem is not None:
        raise ResolutionError(f"{what} {problem}")
    if max_chars is not None and len(value) > max_chars:
        raise ResolutionError(f"{what} is {len(value)} characters; at most {max_chars}")
    if max_bytes is not None and (size := len(value.encode("utf-8"))) > max_bytes:
        raise ResolutionError(f"{what} is {size} bytes; at most {max_bytes} (UTF-8)")
    return value


def check_person(resolved_by: object, note: object) -> None:
    """Who decided (required: every resolution is audited under a name) and their note."""
    if not isinstance(resolved_by, str) or not resolved_by.strip():
        raise ResolutionError("resolved_by is required: say who made this decision")
    check_text(resolved_by, "resolved_by", max_chars=MAX_PERSON_LENGTH)
    check_text(note, "note", max_bytes=MAX_NOTE_BYTES)


def check_names(*names: object) -> None:
    """job_id, item_id and (when given) step: names a held row could have, else :class:`NotHeldError`."""
    for what, name, limit in zip(("job_id", "item_id", "step"), names,
                                 (MAX_JOB_ID_LENGTH, MAX_ID_LENGTH, MAX_ID_LENGTH), strict=False):
        if not isinstance(name, str) or not name:
            raise NotHeldError(f"{what} {name!r} names nothing: expected non-empty text; check it")
        try:
            check_text(name, what, max_chars=limit)
        except ResolutionError as exc:
            raise NotHeldError(f"{exc}; no such {what.removesuffix('_id')} can be held") from None


def check_version(version: object) -> str | None:
    """The row version a decision expects, or None (none given: the decision applies to the row as it is)."""
    if version is None or version == "":
        return None
    checked = check_text(version, "version", max_chars=64).strip()
    if not checked:
        return None
    return checked


def check_outcome(delivered: object, receipt: object) -> None:
    """A send's outcome as a person settles it: delivered only with the receiver's receipt as evidence."""
    if not isinstance(delivered, bool):
        raise ResolutionError("delivered must be True or False")
    if delivered and (not isinstance(receipt, str) or not receipt.strip()):
        raise ResolutionError(
            "delivered=True needs the receiver's receipt as evidence; if you cannot find one, "
            "leave the step held"
        )
    if receipt is not None:
        check_text(receipt, "receipt", max_bytes=MAX_RECEIPT_BYTES)


def check_entry(n: int, entry: object, resolved_by: str) -> CheckedEntry:
    """One entry of a bulk call, checked, or the refusal naming it (``entry n: ...``; n == 0: a lone
    decision, whose refusals read as a single call's do)."""
    where = "" if n == 0 else f"entry {n}: "
    try:
        if not isinstance(entry, Mapping):
            raise ResolutionError("expected a mapping with job_id, item_id, step, decision")
        unknown = set(entry) - ENTRY_FIELDS
        if unknown:
            shown = ", ".join(sorted(repr(u)[:40] for u in unknown))
            raise ResolutionError(f"unknown field(s) {shown}; use {', '.join(sorted(ENTRY_FIELDS))}")
        decision = entry.get("decision")
        job_id, item_id, step = entry.get("job_id"), entry.get("item_id"), entry.get("step") or None
        receipt, note = entry.get("receipt") or None, entry.get("note") or ""
        if not isinstance(decision, str) or decision not in DECISIONS:
            raise ResolutionError(f"unknown decision {str(decision)[:40]!r}; use one of {', '.join(DECISIONS)}")
        check_person(resolved_by, note)
        version = check_version(entry.get("version"))
        if decision in ("delivered", "not_delivered"):
            if not step:
                raise ResolutionError("step is required for delivered / not_delivered")
            check_outcome(decision == "delivered", receipt)
            check_names(job_id, item_id, step)
        else:  # a changed input: about the item, whatever step or receipt came along
            check_names(job_id, item_id)
            step, receipt = None, None
    except (ResolutionError, NotHeldError) as exc:
        raise type(exc)(f"{where}{exc}") from None
    # check_names has refused job_id and item_id unless they are non-empty text.
    return CheckedEntry(job_id, item_id, step, decision, receipt, note, version)  # type: ignore[arg-type]
