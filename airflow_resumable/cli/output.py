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
from collections.abc import Callable, Iterable, Sequence
from dataclasses import fields, is_dataclass
from datetime import datetime
from enum import Enum
from typing import Any

from airflow_resumable._time import when
from airflow_resumable.decision_input import short_version

# What a spreadsheet reads as the start of a formula (a tab or carriage return before one, too).
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
# Unicode categories a terminal may act on rather than show: control, format (bidi overrides,
# zero-width), lone surrogate, private use, unassigned, line and paragraph separators.
_UNSAFE_CATEGORIES = ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")


def plain(value: Any, time: Callable[[datetime], str] = datetime.isoformat) -> Any:
    """JSON-ready data; ``time`` writes datetimes (ISO 8601 UTC for JSON, local and relative for tables).

    :param value: a journal record (a dataclass), or dicts, lists and tuples of them.
    :param time: how a datetime is written.
    """
    if is_dataclass(value) and not isinstance(value, type):
        # Field by field, not asdict(): its deep copy is most of what a million-row export costs.
        return {f.name: plain(getattr(value, f.name), time) for f in fields(value)}
    if isinstance(value, dict):
        return {k: plain(v, time) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v, time) for v in value]
    if isinstance(value, datetime):
        return time(value)
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


def table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    """``rows`` as aligned text under upper-case ``columns`` headers; ``(none)`` when there are none."""
    if not rows:
        return "(none)"
    cells = [[printable(str("" if row.get(c) is None else row.get(c))) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def emit(out: Any, as_json: bool, data: Any, columns: Sequence[str]) -> None:
    """``data`` (a record or a list of them) as indented JSON, or as a table of ``columns``.

    :param out: where to write (stdout).
    :param as_json: ``--json`` was given.
    :param data: journal records.
    :param columns: the fields a table shows, in order (JSON has them all).
    """
    if as_json:
        out.write(json.dumps(plain(data), indent=2) + "\n")
    else:  # times in Airflow's [core] default_timezone, with "3 hours ago"; versions short
        shown = plain(data, time=when)
        rows = [{**r, "version": short_version(r["version"])} if r.get("version") else r
                for r in (shown if isinstance(shown, list) else [shown])]
        out.write(table(rows, columns) + "\n")


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
