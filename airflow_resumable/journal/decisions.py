"""The journal's resolution API: a person's decisions about held steps, each applied under the job's claim
and written with its own audit row."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from airflow_resumable.exceptions import JobBusyError, JournalError, NotHeldError, ResolutionError, StaleDecisionError
from airflow_resumable.journal import statements as sql
from airflow_resumable.journal.backend import (
    BRIEF_HOLDER_DOING,
    RESOLUTION_RUNNER,
    JournalBackend,
    Tx,
    claim_after_brief_holders,
)
from airflow_resumable.journal.checks import (
    check_entry,
    check_names,
    check_outcome,
    check_person,
    check_version,
)
from airflow_resumable.journal.compaction import expand_item
from airflow_resumable.journal.records import (
    MAX_DECISION_JOBS,
    MAX_DECISIONS,
    HeldReason,
    Resolution,
    Status,
    ts,
    version_matches,
    version_text,
)

__all__ = ["JournalDecisions"]


def _stale(job_id: str, item_id: str, step: str, seen: str, now_is: str) -> StaleDecisionError:
    # The row's new version is left out on purpose: it is to be read by looking again, not pasted
    # from a refusal about something else.
    return StaleDecisionError(
        f"{job_id} / {item_id} / {step} changed since it was looked at (version {seen}): it is now "
        f"{now_is}. Nothing was changed; look at it again and decide on what it is now"
    )


def _audit(
    tx: Tx, job_id: str, item_id: str, step: str, decision: str, receipt: str | None, note: str,
    resolved_by: str, now: float, previous_status: str | None, previous_held_reason: str | None,
) -> Resolution:
    new_id = tx.insert_id(sql.AUDIT, (job_id, item_id, step, decision, receipt, note, resolved_by, now,
                                      previous_status, previous_held_reason))
    tx.run(sql.JOB_UPDATED, (now, job_id))
    return Resolution(new_id, job_id, item_id, step, decision, receipt, note, resolved_by, ts(now),
                      previous_status, previous_held_reason)


class JournalDecisions:
    """How held steps are settled: the resolve DAG, the UI page, the CLI and the sensor's verify decide
    through these."""

    engine: JournalBackend
    _deciding: set[str]  # jobs whose claim this journal holds for a decision (deciding())

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
        check_person(resolved_by, note)
        check_outcome(delivered, receipt)
        check_names(job_id, item_id, step)
        version = check_version(expected_version)
        with self.deciding(job_id), self.engine.write(durable=True) as tx:
            return self._settle_outcome(tx, job_id, item_id, step, delivered, receipt, resolved_by, note, version)

    def _settle_outcome(
        self, tx: Tx, job_id: str, item_id: str, step: str, delivered: bool, receipt: str | None,
        resolved_by: str, note: str, expected_version: str | None = None,
    ) -> Resolution:
        found = tx.one(sql.RESOLVABLE_STEP, (job_id, item_id, step))
        if found is None:
            compacted = _compacted_rows(tx, job_id, item_id).get(step)
            if compacted is None:
                raise self._no_such_row(tx, job_id, item_id, step)
            # A compacted step (SUCCEEDED): answered as the same row live would be - refused either way.
            found = tuple(compacted[i] for i in (3, 4, 9, 15, 16, 12, 11, 14))
        side_effect, status, held_reason, not_sent, counter, created_at, attempts, generation = found
        version = version_text(counter, created_at)
        if expected_version is not None and not version_matches(expected_version, version):
            now_is = (f"{status}" + (f", held ({held_reason})" if held_reason else ", not held")
                      + (", provably not sent (the next run sends it)" if not_sent else "")
                      + f", after {attempts} attempt(s), key generation {generation}")
            raise _stale(job_id, item_id, step, expected_version, now_is)
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
        return _audit(
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
        its sends are new operations, under the next generation of their idempotency keys, so a
        receiver that dedupes by key does not drop them and one that refuses a reused key with
        different content is never sent one.

        ``expected_version``: the held row's version as you saw it; see :meth:`resolve`.
        """
        check_person(resolved_by, note)
        if not isinstance(use_new_input, bool):
            raise ResolutionError("use_new_input must be True or False")
        check_names(job_id, item_id)
        version = check_version(expected_version)
        with self.deciding(job_id), self.engine.write(durable=True) as tx:
            return self._settle_input_change(tx, job_id, item_id, use_new_input, resolved_by, note, version)

    def _settle_input_change(
        self, tx: Tx, job_id: str, item_id: str, use_new_input: bool, resolved_by: str, note: str,
        expected_version: str | None = None,
    ) -> Resolution:
        found = tx.one(sql.INPUT_CHANGE_HOLD, (job_id, item_id))
        if found is None:
            missing = self._no_such_row(tx, job_id, item_id, None)
            if expected_version is not None and _item_has_rows(tx, job_id, item_id):
                # It was held when it was looked at: a run or another person settled it since.
                raise _stale(job_id, item_id, "(its input change)", expected_version,
                             "no longer held for an input change") from None
            raise missing
        step, status, new_digest, counter, created_at = found
        version = version_text(counter, created_at)
        if expected_version is not None and not version_matches(expected_version, version):
            raise _stale(job_id, item_id, step, expected_version,
                         f"{status}, held for another input change than the one looked at")
        now = time.time()
        if use_new_input:
            tx.run(sql.USE_NEW_INPUT, (new_digest, now, job_id, item_id))
        else:
            tx.run(sql.KEEP_PREVIOUS_INPUT, (new_digest, now, job_id, item_id))
        return _audit(
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
        single = len(entries) == 1  # one decision: its errors name no "entry 1:"
        checked = [check_entry(0 if single else n, entry, resolved_by) for n, entry in enumerate(entries, 1)]
        seen: dict[tuple[str, str, str | None], int] = {}
        for n, entry in enumerate(checked, 1):
            target = (entry.job_id, entry.item_id, entry.step)
            if target in seen:
                raise ResolutionError(f"entry {n}: the same step as entry {seen[target]}; give one decision per step")
            seen[target] = n
        jobs = sorted({entry.job_id for entry in checked})
        if len(jobs) > MAX_DECISION_JOBS:
            raise ResolutionError(f"decisions about {len(jobs)} jobs in one list; at most {MAX_DECISION_JOBS} (each "
                                  "job is claimed until all are applied): split the list by job")
        with contextlib.ExitStack() as quiet:
            for job_id in jobs:  # in one order, so two bulk calls never wait on each other crosswise
                quiet.enter_context(self.deciding(job_id))
            with self.engine.write(durable=True) as tx:
                done: dict[int, Resolution] = {}
                # Sends' outcomes first, then input changes: an item may have both held, and a
                # use_new_input moves its sends on (they are then no longer held), so the list's order
                # must not decide whether the other decision is refused.
                order = sorted(range(len(checked)),
                               key=lambda i: checked[i].decision not in ("delivered", "not_delivered"))
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
            # A compaction batch, a receipt-log fold or another decision holds the job for a moment:
            # waited out, as a run waits. A run holds it until it ends.
            claim = claim_after_brief_holders(self.engine, job_id, runner=RESOLUTION_RUNNER, brief=True)
        except JobBusyError as exc:
            doing = BRIEF_HOLDER_DOING.get(exc.runner or "")
            if doing is None:
                said = f"is running right now ({exc.holder}); nothing was changed. Resolve its held items after " \
                       "the run ends."
            else:
                said = f"is {doing} right now ({exc.holder}), still after a wait; nothing was changed. Try again " \
                       "in a minute."
            raise JobBusyError(f"job {job_id!r} {said}", holder=exc.holder, runner=exc.runner) from None
        self._deciding.add(job_id)
        try:
            self.engine.recover(job_id)
            yield
        finally:
            self._deciding.discard(job_id)
            # A decision about a job the journal does not have (a mistyped id) leaves no claim of it behind:
            # on SQLite, a lock file per mistyped id.
            claim.release(remove=not self._job_known(job_id))

    def _job_known(self, job_id: str) -> bool:
        try:
            return bool(self.engine.read(sql.JOB_EXISTS, (job_id,)))
        except JournalError:  # failing right now: keep the claim's file; the error that matters is the first
            return True

    def _no_such_row(self, tx: Tx, job_id: str, item_id: str, step: str | None) -> NotHeldError:
        if tx.one(sql.JOB_EXISTS, (job_id,)) is None:
            return NotHeldError(f"unknown job {job_id!r} in journal {self.engine.location}; check the job_id")
        if not _item_has_rows(tx, job_id, item_id):
            return NotHeldError(f"job {job_id!r} has no item {item_id!r}; check the item_id")
        if step is None:
            return NotHeldError(f"{job_id} / {item_id} is not held for an input change")
        return NotHeldError(f"item {item_id!r} of job {job_id!r} has no step {step!r}; check the step name")


def _job_no(tx: Tx, job_id: str) -> int | None:
    (job_no,) = tx.one(sql.JOB_NUMBER, (job_id,)) or (None,)
    return job_no  # type: ignore[no-any-return]


def _item_has_rows(tx: Tx, job_id: str, item_id: str) -> bool:
    return tx.one(sql.ITEM_HAS_ROWS, (job_id, item_id, _job_no(tx, job_id), item_id)) is not None


def _compacted_rows(tx: Tx, job_id: str, item_id: str) -> dict[str, tuple[Any, ...]]:
    """The item's rows by step (``RECORD_COLUMNS``) when it is compacted, else none."""
    job_no = _job_no(tx, job_id)
    found = None if job_no is None else tx.one(sql.COMPACTED_ITEM, (job_no, item_id))
    if found is None:
        return {}
    digest, names, data = found
    return {row[2]: row for row in expand_item(job_id, item_id, digest, json.loads(names), data)}
