"""Decisions people write by hand or in a spreadsheet, read safely: ``resolve --file`` and the CLI's
arguments.

A decision file is a JSON list of entries or a CSV whose header names the fields, as
:meth:`~airflow_resumable.journal.StepJournal.apply_decisions` takes them. What ``held --json`` prints
round-trips: add ``decision`` (and ``receipt``) to each of its entries and pass the list back; the fields
it prints only for people to read (``reason``, ``generation``, ``idempotency_key``) are dropped here, and
its ``version`` makes each decision refused if its row changed since. Any other unknown field is refused
by the journal.

Everything that cannot be read as decisions is refused with :class:`DecisionInputError`, one line that
says what is wrong and what to do, before the journal is opened: text that is not UTF-8, a CSV naming a
column twice, a JSON object naming a field twice, JSON nested deeper than any decision list is, NUL
characters and lone surrogates. A UTF-8 byte-order mark (Excel writes one) is read as the start of the
file. Pure Python: imports nothing from Airflow.
"""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import re
from typing import Any

from airflow_resumable.exceptions import DecisionInputError
from airflow_resumable.journal.checks import text_problem
from airflow_resumable.journal.records import ENTRY_FIELDS, SHORT_VERSION_LENGTH, HeldStep

# A decision list is two levels deep (a list of objects). Past this, the file is not a decision list,
# and Python's JSON parser would run out of stack on it long before the journal could say so.
MAX_JSON_DEPTH = 32
# What ``held --json`` prints beside the decision's own fields: there for people to read, dropped when
# the list comes back as decisions.
HELD_JSON_FIELDS = frozenset(f.name for f in dataclasses.fields(HeldStep)) | {"idempotency_key"}
DISPLAY_ONLY_FIELDS = HELD_JSON_FIELDS - ENTRY_FIELDS

# Brackets outside strings (a string, escapes and all, is matched whole and skipped).
_JSON_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
_UTF16_BOMS = (b"\xff\xfe", b"\xfe\xff")


def check_text(value: str, what: str) -> str:
    """``value``, or the refusal naming ``what`` (an id or a note given as an argument)."""
    problem = text_problem(value)
    if problem is not None:
        raise DecisionInputError(f"{what} {problem}")
    return value


def check_version(value: str, what: str = "version") -> str:
    """A version as a person gives it back: the whole of it, or at least the short form tables show."""
    version = check_text(value, what).strip()
    if len(version) < SHORT_VERSION_LENGTH:
        raise DecisionInputError(
            f"{what} {version[:20]!r} is too short: give the whole version (held --json) or at least its "
            f"first {SHORT_VERSION_LENGTH} characters, as the table shows"
        )
    return version


def short_version(version: str) -> str:
    """The form tables print: the first :data:`SHORT_VERSION_LENGTH` characters."""
    return version[:SHORT_VERSION_LENGTH]


def read_decisions(data: bytes, source: str) -> list[Any]:
    """The entries of a decision file (JSON list or CSV), display-only fields dropped; or the refusal,
    naming ``source`` (e.g. ``--file decisions.csv``)."""
    text = _utf8(data, source)
    if text.lstrip().startswith(("[", "{")):
        entries = _json_entries(text, source)
    else:
        entries = _csv_entries(text, source)
    for n, entry in enumerate(entries, 1):
        if isinstance(entry, dict):
            _check_entry_text(entry, f"{source}: entry {n}")
            if isinstance(entry.get("version"), str) and entry["version"].strip():
                entry["version"] = check_version(entry["version"], f"{source}: entry {n}: version")
    return [
        {k: v for k, v in entry.items() if k not in DISPLAY_ONLY_FIELDS} if isinstance(entry, dict) else entry
        for entry in entries
    ]


def _utf8(data: bytes, source: str) -> str:
    if data.startswith(_UTF16_BOMS):
        raise DecisionInputError(f"{source}: saved as UTF-16; save it as UTF-8 (in Excel: 'CSV UTF-8')")
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark is dropped, not read as text
    except UnicodeDecodeError as exc:
        raise DecisionInputError(
            f"{source}: not UTF-8 text (byte {exc.start}); save it as UTF-8 (in Excel: 'CSV UTF-8')"
        ) from None
    if "\x00" in text:  # no decision holds one; UTF-16 without a byte-order mark is full of them
        line = text.count("\n", 0, text.index("\x00")) + 1
        raise DecisionInputError(f"{source}: line {line} contains a NUL character; save the file as UTF-8 text")
    return text


def _json_entries(text: str, source: str) -> list[Any]:
    if _nested_deeper_than(text, MAX_JSON_DEPTH):
        raise DecisionInputError(
            f"{source}: JSON nested more than {MAX_JSON_DEPTH} levels deep; a decision file is a list of "
            "flat objects ({\"job_id\": ..., \"decision\": ...})"
        )
    try:
        entries = json.loads(text, object_pairs_hook=_JsonObject)
    except json.JSONDecodeError as exc:
        raise DecisionInputError(
            f"{source}: not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); expected a list of "
            "decisions"
        ) from None
    except ValueError:  # Python's own limit on a number's digits (4,300): no decision holds such a number
        raise DecisionInputError(f"{source}: a number in it has too many digits; expected a list of decisions") from None
    except RecursionError:  # the depth check above should make this unreachable; never a traceback
        raise DecisionInputError(f"{source}: JSON nested too deeply; expected a list of flat objects") from None
    if not isinstance(entries, list):
        raise DecisionInputError(f"{source}: expected a JSON list of decisions ([{{...}}, ...])")
    for n, entry in enumerate(entries, 1):
        if isinstance(entry, _JsonObject) and entry.repeated is not None:
            raise DecisionInputError(
                f"{source}: entry {n} names the field {entry.repeated[:40]!r} twice; keep one of them"
            )
    return [dict(e) if isinstance(e, dict) else e for e in entries]


class _JsonObject(dict):  # type: ignore[type-arg]
    """A JSON object that remembers the first field it named twice (``json`` would keep the last)."""

    def __init__(self, pairs: list[tuple[str, Any]]) -> None:
        super().__init__(pairs)
        self.repeated: str | None = None
        seen: set[str] = set()
        for key, _ in pairs if len(self) < len(pairs) else ():
            if key in seen:
                self.repeated = key
                break
            seen.add(key)


def _nested_deeper_than(text: str, limit: int) -> bool:
    """Whether the JSON ``text`` opens more than ``limit`` brackets at once; counted without recursion."""
    depth = 0
    for match in _JSON_STRUCTURE.finditer(text):
        char = text[match.start()]
        if char in "[{":
            depth += 1
            if depth > limit:
                return True
        elif char in "]}":
            depth -= 1
    return False


def _csv_entries(text: str, source: str) -> list[dict[str, str]]:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = next(reader, None)
        if header is None:
            return []
        seen: set[str] = set()
        for name in header:
            if name in seen:
                raise DecisionInputError(
                    f"{source}: the column {name[:40]!r} appears twice in the header; keep one of them"
                )
            seen.add(name)
        entries = []
        for cells in reader:
            if not any(cell.strip() for cell in cells):  # blank lines, and the ",,,," rows spreadsheets leave
                continue
            if len(cells) > len(header):
                raise DecisionInputError(
                    f"{source}: line {reader.line_num} has more cells than the header names; quote cells that "
                    "contain a comma"
                )
            # An empty cell is an absent field, and so is a cell a short row leaves out.
            entries.append({name: cell for name, cell in zip(header, cells, strict=False) if cell != ""})
        return entries
    except csv.Error as exc:  # e.g. a cell past the csv module's size limit; the message names no data
        raise DecisionInputError(f"{source}: not a readable CSV (line {reader.line_num}: {exc})") from None


def _check_entry_text(entry: dict[Any, Any], where: str) -> None:
    for key, value in entry.items():
        if isinstance(key, str) and (problem := text_problem(key)) is not None:
            raise DecisionInputError(f"{where}: a field name {problem}")
        if isinstance(value, str) and (problem := text_problem(value)) is not None:
            raise DecisionInputError(f"{where}: {str(key)[:40]!r} {problem}")
