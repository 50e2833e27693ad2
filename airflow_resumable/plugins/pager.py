"""Paging the page's lists: which page a URL asks for, and the links to the first, previous and next.

Every list the page and its JSON show is one page of the journal's keyset pages: what a view costs
stays the same however big the journal grows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, HTTPException, Query

from airflow_resumable.journal.records import MAX_CURSOR_LENGTH, MAX_PAGE
from airflow_resumable.plugins.paths import with_query

# ``?limit=`` asks for up to MAX_PAGE.
DEFAULT_PAGE = 100
# "Previous" links carry the cursors of the pages before (the journal's pages only go forward). The
# trail is bounded so that the URL stays short; past it, "Previous" goes back to the first page.
MAX_TRAIL_CHARS = 4000


@dataclass(frozen=True)
class Paging:
    """Which page of a list is asked for: at most ``limit`` records after ``cursor`` (None: the first
    page), and ``back``, the cursors of the pages between the first and this one, for "Previous"."""

    limit: int
    cursor: str | None
    back: tuple[str, ...]

    @property
    def previous(self) -> tuple[str | None, tuple[str, ...]] | None:
        """(cursor, back) of the page before this one (cursor None: the first page); None on the first."""
        if self.cursor is None:
            return None
        if not self.back:
            return None, ()
        return self.back[-1], self.back[:-1]

    def following(self, next_cursor: str) -> tuple[str, tuple[str, ...]]:
        """(cursor, back) of the page after this one."""
        back = [*self.back, self.cursor] if self.cursor is not None else []
        while len(".".join(back)) > MAX_TRAIL_CHARS:
            del back[0]  # the oldest: "Previous" from the oldest page kept goes to the first page
        return next_cursor, tuple(back)


def _cursor_text(value: str, what: str) -> str:
    # The journal's cursors are URL-safe base64 ('.' separates those of the trail); anything else is
    # refused here, before the journal is asked, with a message that does not repeat it.
    if len(value) > MAX_CURSOR_LENGTH or value.strip("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"):
        raise HTTPException(status_code=400, detail=f"{what} is not one this page gave; start again from the first page")
    return value


def paging(
    limit: Annotated[int, Query()] = DEFAULT_PAGE, cursor: Annotated[str, Query()] = "",
    back: Annotated[str, Query()] = "",
) -> Paging:
    """The ``limit``, ``cursor`` and ``back`` of a listing's URL, checked."""
    if not 1 <= limit <= MAX_PAGE:
        raise HTTPException(status_code=400, detail=f"limit must be from 1 to {MAX_PAGE}")
    trail = tuple(_cursor_text(c, "back") for c in back.split(".") if c)
    return Paging(limit, _cursor_text(cursor, "cursor") or None, trail)


PagingDep = Annotated[Paging, Depends(paging)]


@dataclass(frozen=True)
class PageLinks:
    """The links of a listing page: first, previous and next (None where there is none), all keeping the
    listing's filters and page size."""

    first: str | None
    previous: str | None
    next: str | None


def page_links(path: str, paging: Paging, next_cursor: str | None, **filters: Any) -> PageLinks:
    size = {"limit": paging.limit if paging.limit != DEFAULT_PAGE else None}

    def link(cursor: str | None, back: tuple[str, ...]) -> str:
        return with_query(path, **filters, **size, cursor=cursor, back=".".join(back) if cursor else None)

    previous = paging.previous
    following = paging.following(next_cursor) if next_cursor is not None else None
    return PageLinks(
        first=link(None, ()) if paging.cursor is not None else None,
        previous=link(*previous) if previous is not None else None,
        next=link(*following) if following is not None else None,
    )
