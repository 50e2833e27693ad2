"""Journals grow to millions of rows, so no command reads an unbounded list.

``jobs``, ``held``, ``show`` and ``audit`` read one page (``--limit``, default :data:`PAGE_SIZE`) and,
when there is more, say on stderr which ``--cursor`` goes on from there; ``--all`` and ``export`` read
every page, :data:`FETCH_SIZE` at a time, and write each record as it comes, so memory stays that of
one page however many there are.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from airflow_resumable.cli.output import emit, stream
from airflow_resumable.journal import Page
from airflow_resumable.journal.records import MAX_PAGE

PAGE_SIZE = 100  # what jobs, held and show print without --limit: a screenful, never an unbounded read
FETCH_SIZE = 1000  # what --all and export read at a time: memory stays that of one page


def page_limit(text: str) -> int:
    """``--limit``: a whole number from 1 to the journal's largest page."""
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise argparse.ArgumentTypeError(f"invalid limit {text[:20]!r}: give a whole number from 1 to {MAX_PAGE}")
    return limit


def add_paging_options(parser: argparse.ArgumentParser) -> None:
    """``--limit`` or ``--all``, and ``--cursor``, on a listing sub-command."""
    amount = parser.add_mutually_exclusive_group()
    # No default here: --limit 100 --all must be refused like any other --limit with --all.
    amount.add_argument("--limit", type=page_limit, help=f"at most this many (1 to {MAX_PAGE}, default {PAGE_SIZE})")
    amount.add_argument("--all", action="store_true", help=f"everything (read {FETCH_SIZE} at a time)")
    parser.add_argument("--cursor", help="go on where a page stopped: the cursor its 'more:' line gave (with the "
                                         "same filters)")


def print_listing(
    out: Any, args: argparse.Namespace, read: Callable[..., Page[Any]], columns: Sequence[str],
    shape: Callable[[Any], Any] = lambda record: record, keep: Callable[[Any], bool] = lambda record: True,
) -> None:
    """What the paging options ask for, as JSON (``--json``) or a table of ``columns``: one page
    (``--limit``, default :data:`PAGE_SIZE`) from ``--cursor`` and where the next one starts, or with
    ``--all`` every page from there on, each record written as it comes.

    :param read: a journal listing (``jobs``, ``rows``, ``held``, ...) with its filters bound.
    :param shape: what is printed of a record.
    :param keep: which records are printed.
    """
    if args.all:
        stream(out, args.json, (shape(r) for r in each(read, args.cursor) if keep(r)), columns)
        return
    page = read(limit=args.limit or PAGE_SIZE, cursor=args.cursor)
    emit(out, args.json, [shape(r) for r in page if keep(r)], columns)
    say_more(out, page)


def each(read: Callable[..., Page[Any]], cursor: str | None = None) -> Iterator[Any]:
    """Every record ``read`` pages through from ``cursor`` on, :data:`FETCH_SIZE` at a time."""
    while True:
        page = read(limit=FETCH_SIZE, cursor=cursor)
        cursor = page.next_cursor
        yield from page
        del page  # not kept while the next one is read: one page in memory, not two
        if cursor is None:
            return


def say_more(out: Any, page: Page[Any]) -> None:
    """Where the next page starts, on stderr: stdout stays a table, or JSON another tool reads."""
    if page.next_cursor is not None:
        out.flush()  # after the page on a terminal
        sys.stderr.write(f"more: --cursor {page.next_cursor}  (or --all)\n")
