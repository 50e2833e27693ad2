"""What the command prints: tables a person reads, JSON and CSV another tool reads.

Ids are data from DAG authors and upstream systems, so nothing here trusts them: a table escapes
control and format characters (no terminal escape sequence reaches the screen, one row stays one
line), and a CSV cell a spreadsheet would run as a formula starts with an apostrophe.
"""

from __future__ import annotations

import csv
import itertools
import json
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import fields, is_dataclass
from datetime import datetime, timezone
from enum import Enum
from typing import Any

from airflow_resumable._time import when
from airflow_resumable.decision_input import short_version

# What a spreadsheet reads as the start of a formula (a tab or carriage return before one, too).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
# Unicode categories a terminal may act on rather than show: control, format (bidi overrides,
# zero-width), lone surrogate, private use, unassigned, line and paragraph separators.
_UNSAFE_CATEGORIES = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


# Values JSON writes as they are: most of a record's fields, checked first.
_SCALARS = frozenset({str, int, float, bool, type(None)})


def plain(value: Any) -> Any:
    """JSON-ready data: records and enums as their fields and values, datetimes in ISO 8601 (UTC).

    :param value: a journal record (a dataclass), or dicts, lists and tuples of them.
    """
    if type(value) in _SCALARS:
        return value
    if is_dataclass(value) and not isinstance(value, type):
        # Field by field, not asdict(): its deep copy is most of what a million-row export costs.
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    return value


def printable(text: str) -> str:
    """``text`` with control, format (bidi overrides, zero-width), separator and surrogate characters
    escaped as ``\\x1b`` / ``\\u202e``: safe to print to a terminal, one row per line."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() or unicodedata.category(ch) not in _UNSAFE_CATEGORIES
        else (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}" if ord(ch) < 0x10000
              else f"\\U{ord(ch):08x}")
        for ch in text
    )


def csv_cell(value: Any) -> Any:
    """A cell a spreadsheet shows as text: a string that would start a formula gets a leading '."""
    if isinstance(value, (dict, list)):
        value = json.dumps(value)
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


# A table is sized and written this many rows at a time: a listing of millions stays one chunk in memory.
TABLE_CHUNK = 1000


def fields_of(record: Any) -> dict[str, Any]:
    """A record's fields as a dict, its values as they are (``asdict`` deep-copies every value: most of
    what a listing of a million rows would cost)."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


class _Times:
    """The times one table shows: "3 hours ago" from one moment for every row, and each second
    formatted once (rows written in the same second are many; formatting is most of a row's cost)."""

    def __init__(self) -> None:
        self.now = datetime.now(timezone.utc)
        self.shown: dict[datetime, str] = {}

    def __call__(self, value: datetime) -> str:
        second = value.replace(microsecond=0)  # what the table shows of it
        text = self.shown.get(second)
        if text is None:
            if len(self.shown) >= TABLE_CHUNK:
                self.shown.clear()
            text = self.shown[second] = printable(when(second, self.now))
        return text


def _cell(column: str, value: Any, times: _Times) -> str:
    """What a table shows of a value: times in Airflow's [core] default_timezone with "3 hours ago"
    (only the shown columns' are formatted), versions short."""
    if value is None:
        return ""
    if isinstance(value, datetime):
        return times(value)
    if column == "version":
        return printable(short_version(value))
    return printable(str(plain(value)))


def write_table(out: Any, records: Iterable[Any], columns: Sequence[str]) -> None:
    """``records`` as aligned text under upper-case ``columns`` headers (``(none)`` when there are none),
    read and written :data:`TABLE_CHUNK` at a time. Each column is as wide as the widest cell seen so
    far: the first chunk sizes the header, a wider cell later widens the column from there on."""
    records, times = iter(records), _Times()
    widths: list[int] | None = None
    while chunk := list(itertools.islice(records, TABLE_CHUNK)):
        cells = [[_cell(c, row.get(c), times) for c in columns]
                 for row in (r if isinstance(r, dict) else fields_of(r) for r in chunk)]
        del chunk
        first = widths is None
        widths = [max(w, *(len(r[i]) for r in cells)) for i, w in enumerate(widths or map(len, columns))]
        if first:
            out.write("  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)) + "\n")
        out.write("".join("  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) + "\n"
                          for r in cells))
    if widths is None:
        out.write("(none)\n")


def emit(out: Any, as_json: bool, data: Any, columns: Sequence[str]) -> None:
    """``data`` (a record or a list of them) as indented JSON, or as a table of ``columns``.

    :param out: where to write (stdout).
    :param as_json: ``--json`` was given.
    :param data: journal records.
    :param columns: the fields a table shows, in order (JSON has them all).
    """
    if as_json:
        out.write(json.dumps(plain(data), indent=2) + "\n")
    else:
        write_table(out, data if isinstance(data, list) else [data], columns)


def stream(out: Any, as_json: bool, records: Iterable[Any], columns: Sequence[str]) -> None:
    """:func:`emit` for a listing of any length: the same text, written as the records come."""
    if as_json:
        write_json_list(out, map(plain, records))
    else:
        write_table(out, records, columns)


def write_json_list(out: Any, records: Iterable[Any]) -> None:
    """``json.dumps(list(records), indent=2)`` and a newline, written one record at a time."""
    first = True
    for record in records:
        # A list's entries are its elements' own indented text, one level in (JSON text has no raw newlines).
        out.write(("[\n  " if first else ",\n  ") + json.dumps(record, indent=2).replace("\n", "\n  "))
        first = False
    out.write("[]\n" if first else "\n]\n")



def write_csv(out: Any, records: Iterable[dict[str, Any]]) -> None:
    """One row per record, the columns those of the first (an empty export is a lone ``item_id`` header)."""
    records = iter(records)
    first = next(records, None)
    writer = csv.DictWriter(out, fieldnames=list(first) if first else ["item_id"], lineterminator="\n")
    writer.writeheader()
    for row in itertools.chain([first], records) if first else ():
        writer.writerow({k: csv_cell(v) for k, v in row.items()})
