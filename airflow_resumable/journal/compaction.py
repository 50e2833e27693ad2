"""Compacted items: a finished item's step rows kept as one row, losslessly (schema version 8).

A fleet's journal is almost all finished items: every step SUCCEEDED, nothing held. Each such item can
live as one row of ``compacted`` - the job as a number, the item id, the input's digest as 32 bytes, the
set of its steps as a number, and the rest of its rows packed in ``data`` - instead of one row per step,
each repeating the job's and the item's ids in the row and in the primary key. Nothing is lost: unpacked,
an item's rows are the very rows it had (versions, attempts, generations, timestamps to the bit), and a
run that needs an item again (its input changed, a step was added) puts them back before it looks.

``data`` (format 1): a format byte, then per step, in the order of the step set's names:

* a flags byte: bit 0 side effect, bit 1 a receipt follows, bits 2-3 the output: 0 none, 1 ``null``,
  2 the receipt as a JSON string, 3 its own text follows;
* attempts, generation and version as unsigned LEB128 varints;
* created_at: the first step's as 8 bytes (an IEEE double, little-endian), every later one as the XOR of
  its bits with the previous step's, a varint (times written close together share their high bits);
  updated_at as the XOR of its bits with the same step's created_at, a varint;
* the receipt, then the output, when present: a varint length and UTF-8 bytes.

This module imports nothing from Airflow.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["CompactedItem", "compact_item", "expand_item", "step_set_key"]

FORMAT = 1
_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")
_DOUBLE = struct.Struct("<d")
_OUTPUT_NONE, _OUTPUT_NULL, _OUTPUT_RECEIPT, _OUTPUT_TEXT = range(4)


@dataclass(frozen=True)
class CompactedItem:
    """One item's rows as one ``compacted`` row (the job's number is the caller's)."""

    item_id: str
    digest: bytes
    names: tuple[str, ...]  # the step set: the item's step names, sorted
    data: bytes


def step_set_key(names: Sequence[str]) -> tuple[str, str]:
    """The step set of these names as stored (their sorted JSON) and its key in ``step_sets``."""
    text = json.dumps(sorted(names), ensure_ascii=False, separators=(",", ":"))
    return text, hashlib.sha256(text.encode("utf-8")).hexdigest()


def _receipt_json(receipt: str) -> str:
    return json.dumps(receipt, ensure_ascii=False, separators=(",", ":"))


def _varint(value: int, out: bytearray) -> None:
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return


def _bits(value: float) -> int:
    return int.from_bytes(_DOUBLE.pack(value), "little")


def _text(value: str, out: bytearray) -> None:
    encoded = value.encode("utf-8")
    _varint(len(encoded), out)
    out += encoded


def compact_item(job_id: str, item_id: str, rows: Sequence[Sequence[Any]]) -> CompactedItem | None:
    """The item's rows (``RECORD_COLUMNS``) as one compacted row, or None if it is not finished: every
    row SUCCEEDED, nothing held or pending, one input digest (SHA-256 in hex) for all of them (and no two
    rows created at the same instant: a reader orders an item's rows by creation time, then by name)."""
    if not rows:
        return None
    digest = rows[0][5]
    for r in rows:
        (of_job, of_item, _step, side_effect, status, row_digest, _receipt, _output, error_type, held_reason,
         new_digest, attempts, created_at, updated_at, generation, not_sent, version) = r
        if (of_job != job_id or of_item != item_id or status != "SUCCEEDED" or row_digest != digest
                or error_type is not None or held_reason is not None or new_digest is not None or not_sent
                or side_effect not in (0, 1) or min(attempts, generation, version) < 0
                or not isinstance(created_at, float) or not isinstance(updated_at, float)):
            return None
    if not isinstance(digest, str) or not _HEX_DIGEST.fullmatch(digest):
        return None
    if len({r[12] for r in rows}) != len(rows):
        return None  # two steps written at one instant: their order is the database's collation's, kept live
    by_name = sorted(rows, key=lambda r: r[2])
    out = bytearray([FORMAT])
    previous: int | None = None
    for r in by_name:
        side_effect, receipt, output = r[3], r[6], r[7]
        if output is None:
            kind = _OUTPUT_NONE
        elif output == "null":
            kind = _OUTPUT_NULL
        elif receipt is not None and output == _receipt_json(receipt):
            kind = _OUTPUT_RECEIPT
        else:
            kind = _OUTPUT_TEXT
        out.append(int(side_effect) | (receipt is not None) << 1 | kind << 2)
        for number in (r[11], r[14], r[16]):  # attempts, generation, version
            _varint(int(number), out)
        created, updated = _bits(r[12]), _bits(r[13])
        if previous is None:
            out += _DOUBLE.pack(r[12])
        else:
            _varint(created ^ previous, out)
        _varint(updated ^ created, out)
        previous = created
        if receipt is not None:
            _text(receipt, out)
        if kind == _OUTPUT_TEXT:
            _text(output, out)
    return CompactedItem(item_id, bytes.fromhex(digest), tuple(r[2] for r in by_name), bytes(out))


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 0

    def byte(self) -> int:
        value = self.data[self.at]
        self.at += 1
        return value

    def varint(self) -> int:
        value, shift = 0, 0
        while True:
            byte = self.byte()
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
            shift += 7

    def double(self) -> int:
        bits = int.from_bytes(self.data[self.at:self.at + 8], "little")
        self.at += 8
        return bits

    def text(self) -> str:
        size = self.varint()
        value = self.data[self.at:self.at + size].decode("utf-8")
        self.at += size
        return value


def _float(bits: int) -> float:
    value: float = _DOUBLE.unpack(bits.to_bytes(8, "little"))[0]
    return value


def expand_item(job_id: str, item_id: str, digest: bytes, names: Sequence[str], data: bytes) -> list[tuple[Any, ...]]:
    """The item's rows (``RECORD_COLUMNS``, in step-name order) as they were before it was compacted."""
    reader = _Reader(bytes(data))
    if reader.byte() != FORMAT:
        raise ValueError(f"compacted item {item_id!r} of job {job_id!r} is in an unknown format")
    hex_digest = bytes(digest).hex()
    rows: list[tuple[Any, ...]] = []
    previous: int | None = None
    for name in names:
        flags = reader.byte()
        attempts, generation, version = reader.varint(), reader.varint(), reader.varint()
        created = reader.double() if previous is None else reader.varint() ^ previous
        updated = reader.varint() ^ created
        previous = created
        receipt = reader.text() if flags & 2 else None
        kind = flags >> 2
        output = {_OUTPUT_NONE: None, _OUTPUT_NULL: "null"}.get(kind)
        if kind == _OUTPUT_RECEIPT:
            output = _receipt_json(receipt or "")
        elif kind == _OUTPUT_TEXT:
            output = reader.text()
        rows.append((job_id, item_id, name, flags & 1, "SUCCEEDED", hex_digest, receipt, output, None, None, None,
                     attempts, _float(created), _float(updated), generation, 0, version))
    if reader.at != len(reader.data):
        raise ValueError(f"compacted item {item_id!r} of job {job_id!r} has {len(reader.data) - reader.at} bytes too many")
    return rows
