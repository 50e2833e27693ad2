"""Asking the receiver about a send whose outcome the journal does not know.

A run asks when the decision table says verify (:class:`~airflow_resumable.runner.batch._Batch`);
:func:`verify_held` asks again, between runs, about the sends already held. Both ask through
:func:`_ask_receiver`, so a verify function's answer means the same thing to either.
"""

from __future__ import annotations

import logging

from airflow_resumable.exceptions import ResolutionError
from airflow_resumable.journal import HeldReason, HeldStep, Status, StepJournal
from airflow_resumable.journal.checks import check_text
from airflow_resumable.journal.records import MAX_RECEIPT_BYTES
from airflow_resumable.runner.steps import NOT_DELIVERED, NotDelivered, StepContext, VerifyFn, idempotency_key

# One logger for every part of the runner (airflow_resumable.runner): one name for a user to configure.
log = logging.getLogger(__package__)

# resolved_by of the audit rows the runner writes when verify settles a send by itself.
VERIFY_RESOLVER = "verify"


def _ask_receiver(verify: VerifyFn | None, ctx: StepContext) -> str | NotDelivered | None:
    """What ``verify`` says of a send: its receipt, NOT_DELIVERED, or None (cannot tell: there is no
    verify function, it raised, or it answered no receipt the journal could keep as one).

    A receipt is text: ``False``, ``0``, ``{}`` or a record object are no evidence that the receiver has
    the send (a look-up answering "not found" as False must never settle it as delivered), and text the
    journal cannot keep (NUL, a lone surrogate, over 64 KiB) would be refused when recorded.
    """
    if verify is None:
        return None
    try:
        receipt = verify(ctx)
    except Exception as exc:
        log.warning("item %s: verify of %s raised %s; holding it", ctx.item_id, ctx.step, type(exc).__name__)
        return None
    return _answer(ctx, receipt)


def _answer(ctx: StepContext, receipt: object) -> str | NotDelivered | None:
    """What a look-up's return value says (see :func:`_ask_receiver`)."""
    if receipt is None or receipt is NOT_DELIVERED:
        return receipt
    if not isinstance(receipt, str):
        log.warning("item %s: verify of %s answered a %s, not a receipt (text), NOT_DELIVERED or None; holding it",
                    ctx.item_id, ctx.step, type(receipt).__name__)
        return None
    if not receipt.strip():
        return None
    try:
        check_text(receipt, "receipt", max_bytes=MAX_RECEIPT_BYTES)
    except ResolutionError as exc:
        log.warning("item %s: verify of %s answered a receipt the journal cannot keep (%s); holding it",
                    ctx.item_id, ctx.step, exc)
        return None
    return receipt


def verify_held(
    journal: StepJournal, job_id: str, verify: VerifyFn, *, step: str | None = None,
    resolved_by: str = VERIFY_RESOLVER,
) -> list[HeldStep]:
    """Ask the receiver again about the job's unknown-outcome sends.

    Each one the receiver has a receipt for is marked SUCCEEDED (recorded in the audit log as a
    ``delivered`` resolution by ``resolved_by``); each one it affirms it never got
    (:data:`NOT_DELIVERED`) is resolved ``not_delivered``, so the next run sends it once. Returns
    the steps that were settled either way.

    Each question and the settlement it leads to happen under the job's claim, about the row as it was
    read under that claim: no run can send the step in between (its answer would be stale). A run of
    the job in progress raises :class:`~airflow_resumable.journal.JobBusyError` before anything is
    asked; the steps settled before it stay settled.
    """
    settled: list[HeldStep] = []
    for seen in journal.open_rows(job_id):
        if step is not None and seen.step != step:
            continue
        with journal.deciding(job_id):
            # Read again under the claim: what was open a moment ago may have been settled or re-sent.
            rows = {r.step: r for r in journal.rows(job_id, seen.item_id)}
            row = rows.get(seen.step)
            if (row is None or not row.side_effect or row.status == Status.SUCCEEDED or row.not_sent
                    or row.held_reason == HeldReason.INPUT_CHANGED):
                continue
            outputs = {r.step: r.output for r in rows.values() if r.status == Status.SUCCEEDED}
            ctx = StepContext(job_id, row.item_id, row.step, row.digest,
                              idempotency_key(job_id, row.item_id, row.step, row.generation), outputs, row.generation)
            receipt = _ask_receiver(verify, ctx)
            if receipt is None:
                continue
            if isinstance(receipt, NotDelivered):
                journal.resolve(job_id, row.item_id, row.step, delivered=False, resolved_by=resolved_by,
                                note="the receiver's look-up has no record of this key; the next run sends it once",
                                expected_version=row.version)
            else:
                journal.resolve(job_id, row.item_id, row.step, delivered=True, receipt=receipt,
                                resolved_by=resolved_by, note="the receiver's look-up found a receipt",
                                expected_version=row.version)
        settled.append(HeldStep(job_id, row.item_id, row.step, HeldReason.UNKNOWN_OUTCOME, row.generation))
    return settled
