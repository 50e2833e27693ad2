"""The journal's read API: jobs, their rows, held steps and resolutions, one page at a time.

A page ends with an opaque cursor that carries the last row's sort key: the next page starts after it,
so paging stays correct while runs add rows. A cursor of one kind of list is refused by another, and
one of a job's list by another job's.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Sequence
from typing import Any

from airflow_resumable.exceptions import PageError
from airflow_resumable.journal import statements as sql
from airflow_resumable.journal.backend import JournalBackend
from airflow_resumable.journal.checks import text_problem
from airflow_resumable.journal.compaction import expand_item
from airflow_resumable.journal.records import (
    MAX_CURSOR_LENGTH,
    MAX_PAGE,
    HeldReason,
    HeldStep,
    JobSummary,
    Page,
    Resolution,
    Status,
    StepRecord,
    step_record,
    ts,
    version_text,
)

__all__ = ["JournalReads"]


class _Found(list[tuple[Any, ...]]):
    """Rows a paged query found, and whether more follow the last of them."""

    def __init__(self, rows: list[tuple[Any, ...]], *, more: bool) -> None:
        super().__init__(rows)
        self.more = more


def _cursor(kind: str, *key: Any) -> str:
    text = json.dumps([kind, *key], ensure_ascii=False, separators=(",", ":"))
    return base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii").rstrip("=")


def _cursor_key(cursor: object, kind: str, types: tuple[type, ...]) -> list[Any]:
    """The key a cursor of ``kind`` carries, or :class:`PageError`."""
    refused = PageError(f"cursor {str(cursor)[:40]!r} is not a {kind} cursor this journal gave; "
                        "start again from the first page (no cursor)")
    if not isinstance(cursor, str) or len(cursor) > MAX_CURSOR_LENGTH:
        raise refused
    try:
        key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):  # RecursionError: "[[[[...", nested too deep
        raise refused from None
    if not isinstance(key, list) or len(key) != len(types) + 1 or key[0] != kind:
        raise refused
    values = key[1:]
    for value, wanted in zip(values, types, strict=True):
        if isinstance(value, bool):
            raise refused
        if wanted is str and isinstance(value, str) and text_problem(value) is None:
            continue  # text either engine can compare (no NUL, no lone surrogate)
        if wanted is int and isinstance(value, int) and 0 <= value < 2**63:
            continue  # an id: a 64-bit integer on both engines
        if wanted is float and isinstance(value, int | float) and _is_float(value):
            continue
        raise refused
    return [float(v) if t is float else v for v, t in zip(values, types, strict=True)]


def _is_float(value: float) -> bool:
    try:
        float(value)
    except OverflowError:  # an integer past any float
        return False
    return True


def _same_job(of_job: str, job_id: str, cursor: str) -> None:
    # A page of one job's list goes on only in that job's list: elsewhere its key would skip rows unseen.
    if of_job != job_id:
        raise PageError(f"cursor {cursor[:40]!r} pages another job's list, not {job_id[:80]!r}'s; "
                        "start again from the first page (no cursor)")


def _check_text_arg(value: object, what: str) -> str:
    # A NUL or a lone surrogate names nothing in either engine, which could not even be asked about it.
    if not isinstance(value, str) or not value or text_problem(value) is not None:
        raise PageError(f"{what} must be non-empty text without NUL or lone surrogates, not {str(value)[:40]!r}")
    return value


def _summary(r: Sequence[Any]) -> JobSummary:
    return JobSummary(
        job_id=r[0],
        created_at=ts(r[1]),
        updated_at=ts(r[2]),
        pruned_at=None if r[3] is None else ts(r[3]),
        items=int(r[4]),
        counts={"IN_FLIGHT": int(r[5]), "SUCCEEDED": int(r[6]), "FAILED": int(r[7])},
        held=int(r[8]),
        unresolved=int(r[9]),
        finished_at=None if r[10] is None else ts(r[10]),
        dag_id=r[11],
    )


class JournalReads:
    """What a journal shows: the UI page, the CLI's read commands and the sensor read through these."""

    engine: JournalBackend

    def has_job(self, job_id: str) -> bool:
        return bool(self.engine.read(sql.JOB_EXISTS, (_check_text_arg(job_id, "job_id"),)))

    def marks(self, job_id: str) -> int:
        """How many IN_FLIGHT marks the job's sends have committed (SPEC §13; it only grows)."""
        rows = self.engine.read(sql.JOB_MARKS, (_check_text_arg(job_id, "job_id"),))
        return int(rows[0][0]) if rows else 0

    def jobs(
        self, *, limit: int | None = None, cursor: str | None = None, status: str | None = None,
        dag_id: str | None = None,
    ) -> Page[JobSummary]:
        """Jobs with their counts, newest first (by when they were created), each read from its own row.

        ``status``: only jobs whose :attr:`JobSummary.status` is this; ``dag_id``: only the jobs of this
        DAG (as recorded by their first run). ``limit``: at most this many, with ``next_cursor`` to go on
        (``cursor=``); without it, every job that matches.
        """
        query, params = sql.JOBS, []
        if status is not None:
            if status not in sql.JOB_STATUS_WHERE:
                raise PageError(f"unknown job status {str(status)[:40]!r}; use one of {', '.join(sql.JOB_STATUS_WHERE)}")
            query += f" AND {sql.JOB_STATUS_WHERE[status]}"
        if dag_id is not None:
            query, params = query + " AND dag_id = ?", [_check_text_arg(dag_id, "dag_id")]
        if cursor is not None:
            created_at, job_id = _cursor_key(cursor, "jobs", (float, str))
            query, params = query + sql.JOBS_AFTER, [*params, created_at, created_at, job_id]
        found = self._page(query + sql.JOBS_ORDER, params, limit)
        summaries = [_summary(r) for r in found]
        last = found[-1] if found.more else None
        return Page(summaries, None if last is None else _cursor("jobs", last[1], last[0]))

    def job(self, job_id: str) -> JobSummary | None:
        found = self.engine.read(sql.JOB_SUMMARY, (_check_text_arg(job_id, "job_id"),))
        return _summary(found[0]) if found else None

    def rows(
        self, job_id: str, item_id: str | None = None, *, status: Status | str | None = None,
        limit: int | None = None, cursor: str | None = None,
    ) -> Page[StepRecord]:
        """The job's step rows (one item's when ``item_id`` is given; only those in ``status``), by item and
        then in the order the item's steps were first written. ``limit``/``cursor`` as for :meth:`jobs`."""
        query, params = sql.JOB_ROWS, [_check_text_arg(job_id, "job_id")]
        if item_id is not None:
            query, params = query + sql.ROWS_ITEM, [*params, _check_text_arg(item_id, "item_id")]
        if status is not None:
            if str(status) not in Status.__members__:
                raise PageError(f"unknown row status {str(status)[:40]!r}; use one of {', '.join(Status.__members__)}")
            query, params = query + sql.ROWS_STATUS, [*params, str(status)]
        after: tuple[str, float, str] | None = None
        if cursor is not None:
            of_job, after_item, after_created, after_step = _cursor_key(cursor, "rows", (str, str, float, str))
            _same_job(of_job, job_id, cursor)
            query += sql.ROWS_AFTER
            params += [after_item, after_item, after_created, after_created, after_step]
            after = (after_item, after_created, after_step)
        # One snapshot: an item compacted or put back meanwhile is seen once, where it was when the page was read.
        with self.engine.snapshot() as tx:
            found = self._page(query + sql.ROWS_ORDER, params, limit, tx.all)
            if status is None or str(status) == Status.SUCCEEDED.value:  # compacted items are SUCCEEDED throughout
                window = (query + sql.ROWS_ORDER + ("" if limit is None else " LIMIT ?"),
                          params if limit is None else [*params, limit + 1])  # the live rows _page read
                found = self._with_compacted(tx.all, job_id, item_id, after, limit, found, window)
        records = [step_record(r) for r in found]
        last = found[-1] if found.more else None
        return Page(records, None if last is None else _cursor("rows", job_id, last[1], last[12], last[2]))

    def _with_compacted(
        self, read: Callable[..., list[tuple[Any, ...]]], job_id: str, item_id: str | None,
        after: tuple[str, float, str] | None, limit: int | None, live: _Found, window: tuple[str, list[Any]],
    ) -> _Found:
        """A page of the job's live rows merged with its compacted items' rows, in the one order of its rows:
        by item (in the database's order of its keys: the database merges the two windows' item ids), then
        as each item's rows go. ``window``: the query and parameters the live rows were read with."""
        found = read(sql.JOB_NUMBER, (job_id,))
        job_no = found[0][0] if found else None
        if job_no is None:
            return live  # never compacted
        where, params = sql.COMPACTED_PAGE_WHERE, [job_no]
        if item_id is not None:
            where, params = where + sql.COMPACTED_PAGE_ITEM, [*params, item_id]
        if after is not None:
            where, params = where + sql.COMPACTED_PAGE_FROM, [*params, after[0]]
        where += sql.COMPACTED_PAGE_ORDER
        if limit is not None:  # the cursor's own item may have nothing left: one more than the page needs
            where, params = where + " LIMIT ?", [*params, limit + 2]
        compacted: dict[str, list[tuple[Any, ...]]] = {}
        for of_item, digest, names, data in read(sql.COMPACTED_PAGE + where, params):
            rows = sorted(expand_item(job_id, of_item, digest, json.loads(names), data), key=lambda r: (r[12], r[2]))
            if after is not None and of_item == after[0]:
                rows = [r for r in rows if (r[12], r[2]) > after[1:]]
            if rows:
                compacted[of_item] = rows
        if not compacted:
            return live
        by_item: dict[str, list[tuple[Any, ...]]] = {}
        for row in live:
            by_item.setdefault(row[1], []).append(row)
        order = [r[0] for r in read(sql.merged_item_order(window[0], where), [*window[1], *params])]
        merged = [row for of_item in order for row in by_item.get(of_item) or compacted.get(of_item) or ()]
        if limit is None:
            return _Found(merged, more=False)
        return _Found(merged[:limit], more=len(merged) > limit or live.more)

    def held(self, job_id: str | None = None, *, limit: int | None = None, cursor: str | None = None) -> Page[HeldStep]:
        """Steps the runner held for a human, in one job or in all, by job, item and step.
        ``limit``/``cursor`` as for :meth:`jobs`."""
        found = self._held_page(sql.HELD, job_id, limit, cursor)
        return Page([HeldStep(r[0], r[1], r[2], HeldReason(r[3]), int(r[4]), version_text(r[5], r[6])) for r in found],
                    found.next_cursor)

    def held_rows(
        self, job_id: str | None = None, *, limit: int | None = None, cursor: str | None = None,
    ) -> Page[StepRecord]:
        """The held steps of :meth:`held` as their whole rows (status, attempts, error type, receipt), in
        the same order and pages: a cursor of one goes on in the other."""
        found = self._held_page(sql.HELD_ROWS, job_id, limit, cursor)
        return Page([step_record(r) for r in found], found.next_cursor)

    def _held_page(self, select: str, job_id: str | None, limit: int | None, cursor: str | None) -> Page[Any]:
        """Held rows as ``select`` reads them (job_id, item_id and step first), one page of them."""
        query, params = select.format(held_steps=self.engine.held_steps), []
        if job_id is not None:
            query, params = query + sql.HELD_JOB, [_check_text_arg(job_id, "job_id")]
        if cursor is not None:
            after_job, after_item, after_step = _cursor_key(cursor, "held", (str, str, str))
            if job_id is not None:
                _same_job(after_job, job_id, cursor)
            query += sql.HELD_AFTER
            params += [after_job, after_job, after_item, after_item, after_step]
        found = self._page(query + sql.HELD_ORDER, params, limit)
        last = found[-1] if found.more else None
        return Page(found, None if last is None else _cursor("held", last[0], last[1], last[2]))

    def _page(
        self, query: str, params: list[Any], limit: int | None, read: Callable[..., list[tuple[Any, ...]]] | None = None,
    ) -> _Found:
        """The rows of ``query`` (through ``read``, default the engine's); with a limit, at most that many, and
        whether more follow."""
        read = read or self.engine.read
        if limit is None:
            return _Found(read(query, params), more=False)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
            raise PageError(f"limit must be a whole number from 1 to {MAX_PAGE}, not {str(limit)[:40]!r}")
        found = read(query + " LIMIT ?", [*params, limit + 1])
        return _Found(found[:limit], more=len(found) > limit)

    def open_rows(self, job_id: str) -> list[StepRecord]:
        """Held rows plus side-effect rows not yet SUCCEEDED: what keeps a job from being settled."""
        return [step_record(r) for r in self.engine.read(sql.OPEN_ROWS, (_check_text_arg(job_id, "job_id"),))]

    def resolutions(
        self, job_id: str, *, limit: int | None = None, cursor: str | None = None, newest_first: bool = False,
    ) -> Page[Resolution]:
        """The append-only audit log of resolutions for a job, oldest first (``newest_first``: the latest
        first). ``limit``/``cursor`` as for :meth:`jobs`."""
        query, params = sql.RESOLUTIONS, [_check_text_arg(job_id, "job_id")]
        kind = "resolutions-desc" if newest_first else "resolutions"
        if cursor is not None:
            of_job, after = _cursor_key(cursor, kind, (str, int))
            _same_job(of_job, job_id, cursor)
            query += sql.RESOLUTIONS_BEFORE if newest_first else sql.RESOLUTIONS_AFTER
            params.append(after)
        query += sql.RESOLUTIONS_NEWEST_FIRST if newest_first else sql.RESOLUTIONS_ORDER
        found = self._page(query, params, limit)
        records = [Resolution(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[7], ts(r[8]), r[9], r[10])
                   for r in found]
        return Page(records, _cursor(kind, job_id, records[-1].id) if found.more else None)
