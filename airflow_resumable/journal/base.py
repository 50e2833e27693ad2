"""The journal's API, written once over the engine primitives of :mod:`.backend`."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

from airflow_resumable.journal import statements as sql
from airflow_resumable.journal.backend import RESOLUTION_RUNNER, Durability, JournalBackend, Tx
from airflow_resumable.journal.engines import is_postgres_url, open_engine
from airflow_resumable.journal.errors import (
    JobBusyError,
    NotHeldError,
    PageError,
    ResolutionError,
    StaleDecisionError,
)
from airflow_resumable.journal.jobrun import JobRun
from airflow_resumable.journal.records import (
    DECISIONS,
    ENTRY_FIELDS,
    MAX_DECISIONS,
    MAX_ID_LENGTH,
    MAX_JOB_ID_LENGTH,
    MAX_NOTE_BYTES,
    MAX_PAGE,
    MAX_PERSON_LENGTH,
    MAX_RECEIPT_BYTES,
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

__all__ = ["StepJournal", "is_postgres_url", "migrate"]


class _Found(list[tuple[Any, ...]]):
    """Rows a paged query found, and whether more follow the last of them."""

    def __init__(self, rows: list[tuple[Any, ...]], *, more: bool) -> None:
        super().__init__(rows)
        self.more = more


def migrate(location: str | os.PathLike[str], **options: Any) -> tuple[int | None, int]:
    """Move the journal at ``location`` to this release's schema; returns (the version it had, or None
    for a new journal; the version it has now). What ``airflow-resumable migrate`` runs.

    A shared (PostgreSQL) journal is never migrated as a side effect: a worker of this release refuses an
    older one until this has run, and sends nothing. A SQLite journal is migrated by whoever opens it.
    """
    from airflow_resumable.journal.schema import SCHEMA_VERSION

    with StepJournal(location, migrate=True, **options) as journal:
        return journal.migrated_from, SCHEMA_VERSION


class StepJournal:
    """The step journal: per job, item and step, what was done.

    ``StepJournal(location, ...)`` opens a SQLite file when ``location`` is a path, and a
    PostgreSQL schema when it is a ``postgresql://`` or ``postgres://`` URL (a shared journal that
    every worker reaches). Both have the same methods, records, errors and guarantees: this class is
    written once over :attr:`engine` (a :class:`~airflow_resumable.journal.backend.JournalBackend`).

    :param location: a filesystem path, or a libpq URL.
    :param durability: ``"full"`` (default): the ``IN_FLIGHT`` mark of every send is on stable
        storage before the send starts. ``"normal"``: it survives the runner being killed, but not
        power loss or a crash of the OS (SQLite) or of the database server (PostgreSQL).

    ``readonly=True``: open for reading only (the UI page, the CLI's read commands): the open writes
    nothing, so it works on a full disk; a SQLite journal then shows what is committed, and receipts a
    dead runner left in its receipt log are folded by the next writer (a run, a resolution, prune).
    ``migrate=True``: move a shared journal of an older schema to this release's (see :func:`migrate`).
    SQLite only: ``allow_network_filesystem``, ``busy_timeout``. PostgreSQL only: ``schema``
    (default ``resumable``), ``claim_timeout`` (seconds within which a runner that vanished or was
    cut off from the server loses its claim on a job, default 30), ``connect_timeout``.
    """

    def __init__(self, location: str | os.PathLike[str], *, durability: Durability = "full", **options: Any) -> None:
        self.engine: JournalBackend = open_engine(location, durability=durability, **options)
        self._deciding: set[str] = set()  # jobs whose claim this journal holds for a decision (deciding())

    @classmethod
    def on(cls, engine: JournalBackend) -> StepJournal:
        """A journal over an engine opened by hand (a test's, an engine of one's own)."""
        journal = cls.__new__(cls)
        journal.engine, journal._deciding = engine, set()
        return journal

    # What the engine says about itself.

    @property
    def location(self) -> str:
        return self.engine.location

    @property
    def journal_id(self) -> str:
        return self.engine.journal_id

    @property
    def kind(self) -> str:
        return self.engine.kind

    @property
    def shared(self) -> bool:
        """Whether any worker may open this journal (a database server), or only the worker whose disk holds it."""
        return self.engine.shared

    @property
    def durability(self) -> Durability:
        return self.engine.durability

    @property
    def migrated_from(self) -> int | None:
        """The schema version this open found (None: a new journal)."""
        return self.engine.migrated_from

    @property
    def commit_count(self) -> int:
        """Write transactions committed; benchmarks and tests read them."""
        return self.engine.commit_count

    @property
    def durable_commit_count(self) -> int:
        """Of which made durable before returning (full durability)."""
        return self.engine.durable_commit_count

    @property
    def closed(self) -> bool:
        return self.engine.closed

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> StepJournal:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"StepJournal({self.location!r}, durability={self.durability!r})"

    # -- running a job ------------------------------------------------------------------------

    def open_job(self, job_id: str, *, runner: str | None = None, dag_id: str | None = None) -> JobRun:
        """Claim ``job_id`` for one runner (at once, or :class:`JobBusyError`). ``dag_id``: the Airflow
        DAG running it, recorded with the job by its first run (it decides who may settle its items)."""
        return JobRun(self.engine, job_id, runner=runner, dag_id=dag_id)

    def has_job(self, job_id: str) -> bool:
        return bool(self.engine.read(sql.JOB_EXISTS, (job_id,)))

    # -- read API -----------------------------------------------------------------------------

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
            query, params = query + " AND dag_id = ?", [self._check_text_arg(dag_id, "dag_id")]
        if cursor is not None:
            created_at, job_id = self._cursor_key(cursor, "jobs", (float, str))
            query, params = query + sql.JOBS_AFTER, [*params, created_at, created_at, job_id]
        found = self._page(query + sql.JOBS_ORDER, params, limit)
        summaries = [self._summary(r) for r in found]
        last = found[-1] if found.more else None
        return Page(summaries, None if last is None else self._cursor("jobs", last[1], last[0]))

    def job(self, job_id: str) -> JobSummary | None:
        found = self.engine.read(sql.JOB_SUMMARY, (job_id,))
        return self._summary(found[0]) if found else None

    @staticmethod
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

    def rows(
        self, job_id: str, item_id: str | None = None, *, status: Status | str | None = None,
        limit: int | None = None, cursor: str | None = None,
    ) -> Page[StepRecord]:
        """The job's step rows (one item's when ``item_id`` is given; only those in ``status``), by item and
        then in the order the item's steps were first written. ``limit``/``cursor`` as for :meth:`jobs`."""
        query, params = sql.JOB_ROWS, [job_id]
        if item_id is not None:
            query, params = query + sql.ROWS_ITEM, [*params, item_id]
        if status is not None:
            if str(status) not in Status.__members__:
                raise PageError(f"unknown row status {str(status)[:40]!r}; use one of {', '.join(Status.__members__)}")
            query, params = query + sql.ROWS_STATUS, [*params, str(status)]
        if cursor is not None:
            after_item, after_created, after_step = self._cursor_key(cursor, "rows", (str, float, str))
            query += sql.ROWS_AFTER
            params += [after_item, after_item, after_created, after_created, after_step]
        found = self._page(query + sql.ROWS_ORDER, params, limit)
        records = [step_record(r) for r in found]
        last = found[-1] if found.more else None
        return Page(records, None if last is None else self._cursor("rows", last[1], last[12], last[2]))

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
            query, params = query + sql.HELD_JOB, [job_id]
        if cursor is not None:
            after_job, after_item, after_step = self._cursor_key(cursor, "held", (str, str, str))
            query += sql.HELD_AFTER
            params += [after_job, after_job, after_item, after_item, after_step]
        found = self._page(query + sql.HELD_ORDER, params, limit)
        last = found[-1] if found.more else None
        return Page(found, None if last is None else self._cursor("held", last[0], last[1], last[2]))

    def _page(self, query: str, params: list[Any], limit: int | None) -> _Found:
        """The rows of ``query``; with a limit, at most that many, and whether more follow."""
        if limit is None:
            return _Found(self.engine.read(query, params), more=False)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_PAGE:
            raise PageError(f"limit must be a whole number from 1 to {MAX_PAGE}, not {str(limit)[:40]!r}")
        found = self.engine.read(query + " LIMIT ?", [*params, limit + 1])
        return _Found(found[:limit], more=len(found) > limit)

    @staticmethod
    def _cursor(kind: str, *key: Any) -> str:
        text = json.dumps([kind, *key], ensure_ascii=False, separators=(",", ":"))
        return base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii").rstrip("=")

    @staticmethod
    def _cursor_key(cursor: object, kind: str, types: tuple[type, ...]) -> list[Any]:
        """The key a cursor of ``kind`` carries, or :class:`PageError`."""
        refused = PageError(f"cursor {str(cursor)[:40]!r} is not a {kind} cursor this journal gave; "
                            "start again from the first page (no cursor)")
        if not isinstance(cursor, str) or len(cursor) > 4 * MAX_JOB_ID_LENGTH:
            raise refused
        try:
            key = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("utf-8"))
        except (ValueError, UnicodeDecodeError):
            raise refused from None
        if not isinstance(key, list) or len(key) != len(types) + 1 or key[0] != kind:
            raise refused
        values = key[1:]
        for value, wanted in zip(values, types, strict=True):
            if wanted is float and isinstance(value, int) and not isinstance(value, bool):
                continue
            if not isinstance(value, wanted) or isinstance(value, bool):
                raise refused
        return [float(v) if t is float else v for v, t in zip(values, types, strict=True)]

    @staticmethod
    def _check_text_arg(value: object, what: str) -> str:
        if not isinstance(value, str) or not value or "\x00" in value:
            raise PageError(f"{what} must be non-empty text without NUL, not {str(value)[:40]!r}")
        return value

    def open_rows(self, job_id: str) -> list[StepRecord]:
        """Held rows plus side-effect rows not yet SUCCEEDED: what keeps a job from being settled."""
        return [step_record(r) for r in self.engine.read(sql.OPEN_ROWS, (job_id,))]

    def resolutions(
        self, job_id: str, *, limit: int | None = None, cursor: str | None = None, newest_first: bool = False,
    ) -> Page[Resolution]:
        """The append-only audit log of resolutions for a job, oldest first (``newest_first``: the latest
        first). ``limit``/``cursor`` as for :meth:`jobs`."""
        query, params = sql.RESOLUTIONS, [job_id]
        kind = "resolutions-desc" if newest_first else "resolutions"
        if cursor is not None:
            (after,) = self._cursor_key(cursor, kind, (int,))
            query += sql.RESOLUTIONS_BEFORE if newest_first else sql.RESOLUTIONS_AFTER
            params.append(after)
        query += sql.RESOLUTIONS_NEWEST_FIRST if newest_first else sql.RESOLUTIONS_ORDER
        found = self._page(query, params, limit)
        records = [Resolution(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[7], ts(r[8]), r[9], r[10])
                   for r in found]
        return Page(records, self._cursor(kind, records[-1].id) if found.more else None)

    # -- resolution API -----------------------------------------------------------------------

    @staticmethod
    def _check_text(value: object, what: str, *, max_chars: int | None = None, max_bytes: int | None = None) -> str:
        """``value`` if it is text the journal can store and show, else the refusal naming ``what``."""
        if not isinstance(value, str):
            raise ResolutionError(f"{what} must be text, not {type(value).__name__}")
        if "\x00" in value:
            raise ResolutionError(f"{what} contains a NUL character; remove it")
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise ResolutionError(f"{what} contains a lone surrogate (not valid Unicode text); fix the text") from None
        if max_chars is not None and len(value) > max_chars:
            raise ResolutionError(f"{what} is {len(value)} characters; at most {max_chars}")
        if max_bytes is not None and size > max_bytes:
            raise ResolutionError(f"{what} is {size} bytes; at most {max_bytes} (UTF-8)")
        return value

    @classmethod
    def _check_person(cls, resolved_by: object, note: object) -> None:
        if not isinstance(resolved_by, str) or not resolved_by.strip():
            raise ResolutionError("resolved_by is required: say who made this decision")
        cls._check_text(resolved_by, "resolved_by", max_chars=MAX_PERSON_LENGTH)
        cls._check_text(note, "note", max_bytes=MAX_NOTE_BYTES)

    @classmethod
    def _check_names(cls, *names: object) -> None:
        for what, name, limit in zip(("job_id", "item_id", "step"), names,
                                     (MAX_JOB_ID_LENGTH, MAX_ID_LENGTH, MAX_ID_LENGTH), strict=False):
            if not isinstance(name, str) or not name:
                raise NotHeldError(f"{what} {name!r} names nothing: expected non-empty text; check it")
            try:
                cls._check_text(name, what, max_chars=limit)
            except ResolutionError as exc:
                raise NotHeldError(f"{exc}; no such {what.removesuffix('_id')} can be held") from None

    @classmethod
    def _check_version(cls, version: object) -> str | None:
        if version is None or version == "":
            return None
        checked = cls._check_text(version, "version", max_chars=64).strip()
        if not checked:
            return None
        return checked

    def resolve(
        self,
        job_id: str,
        item_id: str,
        step: str,
        *,
        delivered: bool,
        receipt: str | None = None,
        resolved_by: str,
        note: str = "",
        expected_version: str | None = None,
    ) -> Resolution:
        """Settle a side-effect step whose outcome was unknown.

        ``delivered=True`` (with the receiver's ``receipt`` as evidence) marks it SUCCEEDED: it is
        never sent again. ``delivered=False`` means the receiver confirmed it never arrived: the row
        stays, FAILED and owed under the same key, and the next run sends it once without verify. If
        you cannot confirm either, do not call this.

        ``expected_version``: the row's version as you saw it (``HeldStep.version``,
        ``StepRecord.version``). If the row changed since, :class:`StaleDecisionError` is raised and
        nothing changes: look again. Without it the decision applies to the row as it is now.
        """
        self._check_person(resolved_by, note)
        self._check_outcome(delivered, receipt)
        self._check_names(job_id, item_id, step)
        version = self._check_version(expected_version)
        with self.deciding(job_id), self.engine.write(durable=True) as tx:
            return self._settle_outcome(tx, job_id, item_id, step, delivered, receipt, resolved_by, note, version)

    @classmethod
    def _check_outcome(cls, delivered: object, receipt: object) -> None:
        if not isinstance(delivered, bool):
            raise ResolutionError("delivered must be True or False")
        if delivered and (not isinstance(receipt, str) or not receipt.strip()):
            raise ResolutionError(
                "delivered=True needs the receiver's receipt as evidence; if you cannot find one, "
                "leave the step held"
            )
        if receipt is not None:
            cls._check_text(receipt, "receipt", max_bytes=MAX_RECEIPT_BYTES)

    @staticmethod
    def _stale(job_id: str, item_id: str, step: str, seen: str, now_is: str) -> StaleDecisionError:
        # The row's new version is left out on purpose: it is to be read by looking again, not pasted
        # from a refusal about something else.
        return StaleDecisionError(
            f"{job_id} / {item_id} / {step} changed since it was looked at (version {seen}): it is now "
            f"{now_is}. Nothing was changed; look at it again and decide on what it is now"
        )

    def _settle_outcome(
        self, tx: Tx, job_id: str, item_id: str, step: str, delivered: bool, receipt: str | None,
        resolved_by: str, note: str, expected_version: str | None = None,
    ) -> Resolution:
        found = tx.one(sql.RESOLVABLE_STEP, (job_id, item_id, step))
        if found is None:
            raise self._no_such_row(tx, job_id, item_id, step)
        side_effect, status, held_reason, not_sent, counter, created_at, attempts, generation = found
        version = version_text(counter, created_at)
        if expected_version is not None and expected_version != version:
            now_is = (f"{status}" + (f", held ({held_reason})" if held_reason else ", not held")
                      + (", provably not sent (the next run sends it)" if not_sent else "")
                      + f", after {attempts} attempt(s), key generation {generation}")
            raise self._stale(job_id, item_id, step, expected_version, now_is)
        if not side_effect or status == Status.SUCCEEDED or not_sent:
            raise NotHeldError(
                f"{job_id} / {item_id} / {step} is {status}"
                f"{'' if side_effect else ' (a local step)'}"
                f"{' and provably not sent (the next run sends it)' if side_effect and not_sent else ''}, "
                "not an unknown-outcome send; there is nothing to resolve"
                + (" (for a changed input use resolve_input_change)" if held_reason else "")
            )
        now = time.time()
        keep_reason = held_reason if held_reason == HeldReason.INPUT_CHANGED else None
        if delivered:
            tx.run(sql.RESOLVE_DELIVERED, (receipt, json.dumps(receipt), keep_reason, now, job_id, item_id, step))
        else:
            tx.run(sql.RESOLVE_NOT_DELIVERED, (keep_reason, now, job_id, item_id, step))
        return self._audit(
            tx, job_id, item_id, step, "delivered" if delivered else "not_delivered",
            receipt, note, resolved_by, now, status, held_reason,
        )

    def resolve_input_change(
        self, job_id: str, item_id: str, *, use_new_input: bool, resolved_by: str, note: str = "",
        expected_version: str | None = None,
    ) -> Resolution:
        """Settle an item held because its input changed since it was journaled.

        ``use_new_input=False`` (keep previous): the new input is taken as already handled; the next
        run skips the item. ``use_new_input=True``: the next run processes the new input from scratch;
        its sends are new operations, under the next generation of their idempotency keys (SPEC §9), so
        a receiver that dedupes by key does not drop them and one that refuses a reused key with
        different content is never sent one.

        ``expected_version``: the held row's version as you saw it; see :meth:`resolve`.
        """
        self._check_person(resolved_by, note)
        if not isinstance(use_new_input, bool):
            raise ResolutionError("use_new_input must be True or False")
        self._check_names(job_id, item_id)
        version = self._check_version(expected_version)
        with self.deciding(job_id), self.engine.write(durable=True) as tx:
            return self._settle_input_change(tx, job_id, item_id, use_new_input, resolved_by, note, version)

    def _settle_input_change(
        self, tx: Tx, job_id: str, item_id: str, use_new_input: bool, resolved_by: str, note: str,
        expected_version: str | None = None,
    ) -> Resolution:
        found = tx.one(sql.INPUT_CHANGE_HOLD, (job_id, item_id))
        if found is None:
            missing = self._no_such_row(tx, job_id, item_id, None)
            if expected_version is not None and tx.one(sql.ITEM_HAS_ROWS, (job_id, item_id)) is not None:
                # It was held when it was looked at: a run or another person settled it since.
                raise self._stale(job_id, item_id, "(its input change)", expected_version,
                                  "no longer held for an input change") from None
            raise missing
        step, status, new_digest, counter, created_at = found
        version = version_text(counter, created_at)
        if expected_version is not None and expected_version != version:
            raise self._stale(job_id, item_id, step, expected_version,
                              f"{status}, held for another input change than the one looked at")
        now = time.time()
        if use_new_input:
            tx.run(sql.USE_NEW_INPUT, (new_digest, now, job_id, item_id))
        else:
            tx.run(sql.KEEP_PREVIOUS_INPUT, (new_digest, now, job_id, item_id))
        return self._audit(
            tx, job_id, item_id, step, "use_new_input" if use_new_input else "keep_previous_input",
            None, note, resolved_by, now, status, HeldReason.INPUT_CHANGED.value,
        )

    def apply_decision(
        self, job_id: str, item_id: str, step: str | None, decision: str, *, resolved_by: str,
        receipt: str | None = None, note: str = "", expected_version: str | None = None,
    ) -> Resolution:
        """One of :data:`DECISIONS` by name, as the resolve DAG, the UI page and the CLI take it:
        ``delivered`` (with ``receipt``) / ``not_delivered`` settle a send of unknown outcome (``step``
        required); ``keep_previous_input`` / ``use_new_input`` settle an item whose input changed.
        ``expected_version`` as for :meth:`resolve`."""
        return self.apply_decisions(
            [{"job_id": job_id, "item_id": item_id, "step": step, "decision": decision, "receipt": receipt,
              "note": note, "version": expected_version}], resolved_by=resolved_by)[0]

    def apply_decisions(self, entries: Sequence[Mapping[str, Any]], *, resolved_by: str) -> list[Resolution]:
        """Several decisions at once, all or nothing: each entry is a mapping with ``job_id``,
        ``item_id``, ``step`` (for ``delivered`` / ``not_delivered``), ``decision``, and optional
        ``receipt``, ``note`` and ``version`` (the row's version as its maker saw it: if the row has
        changed since, the entry is refused as stale), as :meth:`apply_decision` takes them. Every
        entry is checked, then all are applied in one transaction, each with its own audit row. If any
        entry is refused (a bad field, a step that is not held or changed since it was seen, the same
        step twice, a job running right now), nothing changes and the error names the entry
        (``entry 3: ...``)."""
        if isinstance(entries, (str, bytes, Mapping)) or not isinstance(entries, Sequence):
            raise ResolutionError("decisions must be a list of entries (mappings)")
        if not entries:
            raise ResolutionError("no decisions given: the list is empty")
        if len(entries) > MAX_DECISIONS:
            raise ResolutionError(f"{len(entries)} decisions in one call; at most {MAX_DECISIONS}, split the list")
        single = len(entries) == 1  # one decision: its errors read as before, with no "entry 1:"
        checked = [self._check_entry(0 if single else n, entry, resolved_by) for n, entry in enumerate(entries, 1)]
        seen: dict[tuple[str, str, str | None], int] = {}
        for n, (job_id, item_id, step, *_rest) in enumerate(checked, 1):
            target = (job_id, item_id, step)
            if target in seen:
                raise ResolutionError(f"entry {n}: the same step as entry {seen[target]}; give one decision per step")
            seen[target] = n
        jobs = sorted({c[0] for c in checked})
        with contextlib.ExitStack() as quiet:
            for job_id in jobs:  # in one order, so two bulk calls never wait on each other crosswise
                quiet.enter_context(self.deciding(job_id))
            with self.engine.write(durable=True) as tx:
                done: dict[int, Resolution] = {}
                # Sends' outcomes first, then input changes: an item may have both held, and a
                # use_new_input moves its sends on (they are then no longer held), so the list's order
                # must not decide whether the other decision is refused.
                order = sorted(range(len(checked)), key=lambda i: checked[i][3] not in ("delivered", "not_delivered"))
                for i in order:
                    job_id, item_id, step, decision, receipt, note, version = checked[i]
                    try:
                        if decision in ("delivered", "not_delivered"):
                            assert step is not None
                            done[i] = self._settle_outcome(tx, job_id, item_id, step, decision == "delivered",
                                                           receipt, resolved_by, note, version)
                        else:
                            done[i] = self._settle_input_change(tx, job_id, item_id, decision == "use_new_input",
                                                                resolved_by, note, version)
                    except (ResolutionError, NotHeldError) as exc:
                        if len(checked) == 1:
                            raise
                        said = "" if "nothing was changed" in str(exc).lower() else "; nothing was changed"
                        raise type(exc)(f"entry {i + 1}: {exc}{said}") from None
                return [done[i] for i in range(len(checked))]

    def _check_entry(
        self, n: int, entry: object, resolved_by: str,
    ) -> tuple[str, str, str | None, str, str | None, str, str | None]:
        """(job_id, item_id, step, decision, receipt, note, version) of one entry, or the refusal naming it."""
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
            self._check_person(resolved_by, note)
            version = self._check_version(entry.get("version"))
            if decision in ("delivered", "not_delivered"):
                if not step:
                    raise ResolutionError("step is required for delivered / not_delivered")
                self._check_outcome(decision == "delivered", receipt)
                self._check_names(job_id, item_id, step)
            else:  # a changed input: about the item, whatever step or receipt came along
                self._check_names(job_id, item_id)
                step, receipt = None, None
        except (ResolutionError, NotHeldError) as exc:
            raise type(exc)(f"{where}{exc}") from None
        return job_id, item_id, step, decision, receipt, note, version  # type: ignore[return-value]

    @contextlib.contextmanager
    def deciding(self, job_id: str) -> Iterator[None]:
        """Hold the job's claim while deciding about its rows: no run acts on them meanwhile.

        Never settle a row its running job is still writing (a send resolved "not delivered" while it is
        in flight would lose its receipt to the resolution and be sent again). A look-up and the
        settlement it leads to (the sensor's verify) go in one such block, so no run can send between
        them; resolutions inside the block use its claim. A run of the job in progress:
        :class:`JobBusyError`, nothing changed.
        """
        if job_id in self._deciding:
            yield
            return
        try:
            claim = self.engine.claim(job_id, runner=RESOLUTION_RUNNER, brief=True)
        except JobBusyError as exc:
            raise JobBusyError(
                f"job {job_id!r} is running right now ({exc.holder}); nothing was changed. Resolve "
                "its held items after the run ends.", holder=exc.holder, runner=exc.runner,
            ) from None
        self._deciding.add(job_id)
        try:
            self.engine.recover(job_id)
            yield
        finally:
            self._deciding.discard(job_id)
            claim.release()

    def _no_such_row(self, tx: Tx, job_id: str, item_id: str, step: str | None) -> NotHeldError:
        if tx.one(sql.JOB_EXISTS, (job_id,)) is None:
            return NotHeldError(f"unknown job {job_id!r} in journal {self.location}; check the job_id")
        if tx.one(sql.ITEM_HAS_ROWS, (job_id, item_id)) is None:
            return NotHeldError(f"job {job_id!r} has no item {item_id!r}; check the item_id")
        if step is None:
            return NotHeldError(f"{job_id} / {item_id} is not held for an input change")
        return NotHeldError(f"item {item_id!r} of job {job_id!r} has no step {step!r}; check the step name")

    @staticmethod
    def _audit(
        tx: Tx, job_id: str, item_id: str, step: str, decision: str, receipt: str | None, note: str,
        resolved_by: str, now: float, previous_status: str | None, previous_held_reason: str | None,
    ) -> Resolution:
        new_id = tx.insert_id(sql.AUDIT, (job_id, item_id, step, decision, receipt, note, resolved_by, now,
                                          previous_status, previous_held_reason))
        tx.run(sql.JOB_UPDATED, (now, job_id))
        return Resolution(new_id, job_id, item_id, step, decision, receipt, note, resolved_by, ts(now),
                          previous_status, previous_held_reason)

    # -- housekeeping -------------------------------------------------------------------------

    # Items deleted per transaction by prune: short enough that a run on the same journal waits
    # milliseconds, not seconds, for its next mark's commit.
    PRUNE_BATCH_ITEMS = 500

    def prune(self, older_than: timedelta) -> list[str]:
        """Forget finished jobs not updated for ``older_than``; returns the pruned job ids.

        A job is finished when a run went through its whole batch, every row is SUCCEEDED and nothing
        is held. A job with held or unresolved rows, or one running right now, is never pruned. A
        pruned job leaves a tombstone: running it again under the same job_id is refused (it would
        re-send everything). The tombstone is written first, then the rows are deleted in short
        transactions of :attr:`PRUNE_BATCH_ITEMS` items, pausing between them so runs on the same
        journal commit their marks meanwhile; a prune that was interrupted is finished by the next one.
        """
        if not isinstance(older_than, timedelta) or older_than < timedelta(0):
            raise ValueError("older_than must be a non-negative datetime.timedelta, e.g. timedelta(days=30)")
        cutoff = time.time() - older_than.total_seconds()
        pruned = [job_id for (job_id,) in self.engine.read(sql.PRUNES_UNDER_WAY) if self._prune_job(job_id, resume=True)]
        pruned += [job_id for (job_id,) in self.engine.read(sql.PRUNE_CANDIDATES, (cutoff,))
                   if self._prune_job(job_id, resume=False)]
        return pruned

    def _prune_job(self, job_id: str, *, resume: bool) -> bool:
        try:
            claim = self.engine.claim(job_id, runner="prune")
        except JobBusyError:
            return False  # running right now: not finished after all
        try:
            if not resume:
                with self.engine.write(durable=True) as tx:
                    # Re-check under the claim: a run may have started and stopped in between.
                    if tx.one(sql.JOB_STILL_FINISHED, (job_id,)) is None:
                        return False
                    tx.run(sql.MARK_PRUNED, (time.time(), job_id))
            after = ""  # item ids are never empty: "" comes before every one
            while True:
                started = time.monotonic()
                with self.engine.write(durable=False) as tx:
                    (last,) = tx.one(sql.PRUNE_BATCH_END, (job_id, after, self.PRUNE_BATCH_ITEMS)) or (None,)
                    if last is not None:
                        tx.run(sql.PRUNE_BATCH, (job_id, after, last))
                if last is None:
                    return True
                after = last
                # As long again as the batch took (at most 50 ms): writers waiting for the journal get in.
                time.sleep(min(0.05, time.monotonic() - started))
        finally:
            claim.release(remove=True)
