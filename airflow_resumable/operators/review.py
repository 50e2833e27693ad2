"""ReviewHeldItemsOperator: a job's held items as one of Airflow's own "Required actions".

Built on the standard provider's Human-in-the-loop ``HITLOperator`` (Airflow >= 3.1). Put it in the
batch's own DAG, between a ``ResumableBatchOperator(on_held="succeed")`` and a second pass of the same
job::

    send = ResumableBatchOperator(task_id="send", items=..., steps=..., on_held="succeed")
    review = ReviewHeldItemsOperator(task_id="review", batch_task_id="send", assigned_users=[...])
    second = ResumableBatchOperator(task_id="second_pass", batch_task_id="send", items=..., steps=...)
    send >> review >> second

The review task lists the job's held items (reason, attempts, last error type, idempotency key) and
asks one decision per item (``delivered`` with the receiver's receipt, ``not_delivered``, or for a
changed input ``keep_previous_input`` / ``use_new_input``; ``leave_held`` leaves it). "Apply
decisions" settles them through the journal in one transaction (all or nothing), each with an audit
row naming the responding Airflow user; then the task succeeds and the second pass resumes. The
task keeps the version of each held step it showed: if a step the response decides on changed after
it was shown (another person settled it, a run sent it again and held it again, the sensor's verify
settled it), the whole response is refused, nothing changes, and this try of the task fails - its
retry, or a Clear, shows the holds as they are now and asks again. Who may answer is the DAG's
business: its permissions and ``assigned_users``. Nothing held: the task succeeds at once without
asking.
"""

from __future__ import annotations

import os
import re
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.providers.standard.operators.hitl import HITLOperator
from airflow.sdk import Param
from airflow.sdk.definitions.param import ParamsDict

from airflow_resumable._location import RESOLVE_DAG_ID, batch_job
from airflow_resumable.exceptions import ResolutionRefused, StaleDecisionError
from airflow_resumable.hooks.journal import ResumableJournalHook
from airflow_resumable.journal import DECISIONS_BY_REASON, HeldReason, HeldStep, JournalError, StepRecord
from airflow_resumable.journal.records import MAX_NOTE_BYTES, MAX_RECEIPT_BYTES

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["APPLY", "LEAVE", "LEAVE_HELD", "ReviewHeldItemsOperator"]

APPLY, LEAVE = "Apply decisions", "Leave all held"
LEAVE_HELD = "leave_held"  # the per-item choice that changes nothing
REVIEW_XCOM_KEY = "resumable_review"  # what was put before the human: the job, its journal, the items


class ReviewHeldItemsOperator(HITLOperator):
    """Ask a human, in Airflow's "Required actions", to settle the held items of a resumable job.

    :param job_id: the job (templated). Or:
    :param batch_task_id: the ResumableBatchOperator task whose XCom summary names the job; the
        journal is never taken from XCom (the operator opens its own, below, and checks it is the one
        the summary names).
    :param journal_conn_id: an Airflow Postgres connection holding a shared journal; default
        ``[resumable] journal_conn_id``. Wins over ``journal_path``.
    :param journal_path: the journal file; default ``[resumable] journal_path`` (then run this task on
        the batch task's worker queue).
    :param max_items: at most this many held items in one review (the rest stay held for the next
        one, the resolve DAG or the CLI). Default 25.
    :param subject: the headline of the required action (templated).

    Other keyword arguments go to ``HITLOperator`` (``assigned_users``, ``response_timeout``,
    ``notifiers``...); ``options``, ``defaults``, ``multiple``, ``body`` and the form's ``params`` are
    this operator's own.
    On a response timeout the default is "Leave all held".
    """

    template_fields = (*HITLOperator.template_fields, "job_id", "batch_task_id")

    def __init__(
        self,
        *,
        job_id: str | None = None,
        batch_task_id: str | None = None,
        journal_conn_id: str | None = None,
        journal_path: str | os.PathLike[str] | None = None,
        max_items: int = 25,
        subject: str = "Held items of a resumable batch",
        **kwargs: Any,
    ) -> None:
        task_id = kwargs.get("task_id", "review")
        # (params: the DAG's reach every task's __init__; the form is built at run time, replacing them.)
        taken = sorted({"options", "defaults", "multiple", "body"} & set(kwargs))
        if taken:
            raise ValueError(f"{task_id}: {', '.join(taken)} are set by ReviewHeldItemsOperator itself")
        if (job_id is None) == (batch_task_id is None):
            raise ValueError(f"{task_id}: give exactly one of job_id= or batch_task_id=")
        if isinstance(max_items, bool) or not isinstance(max_items, int) or not 1 <= max_items <= 200:
            raise ValueError(f"{task_id}: max_items must be an integer from 1 to 200, not {max_items!r}")
        super().__init__(subject=subject, options=[APPLY, LEAVE], defaults=[LEAVE], multiple=False, **kwargs)
        self.job_id = job_id
        self.batch_task_id = batch_task_id
        self.journal_conn_id = journal_conn_id
        self.journal_path = journal_path
        self.max_items = max_items

    @cached_property
    def hook(self) -> ResumableJournalHook:
        """The batch task's journal: this task's own settings, then the Airflow config."""
        return ResumableJournalHook(self.journal_conn_id, self.journal_path)

    def execute(self, context: Context) -> Any:
        job_id, recorded_id = batch_job(context, owner=self.task_id, job_id=self.job_id,
                                        batch_task_id=self.batch_task_id)
        with self.hook.batch_journal(owner=self.task_id, recorded_id=recorded_id) as journal:
            # One page of holds, however many a receiver outage left; the job's own count says how many.
            summary = journal.job(job_id)
            if summary is None:  # a mistyped job_id: "nothing held" would let the DAG go on as if reviewed
                raise ValueError(f"{self.task_id}: journal {journal.location} has no job {job_id!r}; check the "
                                 "job_id (or give batch_task_id= to take it from the batch task)")
            shown = list(journal.held(job_id, limit=self.max_items))
            rows = {(r.item_id, r.step): r for item_id in dict.fromkeys(h.item_id for h in shown)
                    for r in journal.rows(job_id, item_id)}
            journal_id = journal.journal_id
        if not shown:
            self.log.info("Job %s has nothing held: nothing to review", job_id)
            return {"job_id": job_id, "held": 0, "applied": 0}
        held = max(len(shown), summary.held)
        self.log.info("Job %s: %d held item(s); asking for a decision on %d in Required actions",
                      job_id, held, len(shown))
        self.params = ParamsDict(review_params(shown))
        self.body = review_body(job_id, shown, rows, more=held - len(shown))
        # What the human is shown, each held step's version included: a response is applied only to
        # steps that have not changed since (see execute_complete).
        context["ti"].xcom_push(key=REVIEW_XCOM_KEY, value={
            "job_id": job_id, "journal_id": journal_id,
            "items": [{"item_id": h.item_id, "step": h.step, "reason": h.reason.value, "version": h.version}
                      for h in shown]})
        return super().execute(context)

    def validate_params_input(self, params_input: Any) -> None:
        """Checked against the items that were put before the human, in :meth:`execute_complete`."""

    def execute_complete(self, context: Context, event: dict[str, Any]) -> Any:
        answer = super().execute_complete(context, event)
        ti = context["ti"]
        review = ti.xcom_pull(task_ids=self.task_id, key=REVIEW_XCOM_KEY, map_indexes=ti.map_index)
        if not isinstance(review, dict):
            raise ResolutionRefused(f"{self.task_id}: the review's list of items is gone from XCom; Clear this task")
        user = answer.get("responded_by_user") or {}
        responder = str(user.get("name") or user.get("id") or "").strip()
        job_id, items = review["job_id"], review["items"]
        if answer["chosen_options"] != [APPLY]:
            self.log.info("%s chose %r: the %d item(s) stay held", responder or "the default", LEAVE, len(items))
            return {"job_id": job_id, "held": len(items), "applied": 0, "responded_by": responder}
        if not responder:
            raise ResolutionRefused(f"{self.task_id}: Airflow did not say who responded; nothing was changed")
        if not all(isinstance(item, dict) for item in items):
            raise ResolutionRefused(f"{self.task_id}: this review was asked by an earlier release of the provider, "
                                    "which kept no versions; nothing was changed. Clear this task to review the "
                                    "current holds")
        entries = decisions_from(items, answer["params_input"] or {}, job_id)
        with self.hook.batch_journal(owner=self.task_id, recorded_id=review["journal_id"]) as journal:
            try:
                done = journal.apply_decisions(entries, resolved_by=responder) if entries else []
            except StaleDecisionError as exc:
                # The answer was about the hold as shown; applied to what it is now it could send an item
                # twice. The next try (a retry, or a Clear) shows the holds as they are now.
                raise ResolutionRefused(
                    f"{self.task_id}: the response by {responder} is refused as a whole: {exc}. This try fails: "
                    "a retry, or a Clear of this task, asks again about the holds as they are now") from None
            except (JournalError, ValueError) as exc:
                raise ResolutionRefused(f"{exc}; nothing was changed. Clear this task to answer again") from None
        for r in done:
            self.log.info("Resolved %s / %s as %s by %s", r.item_id, r.step, r.decision, r.resolved_by)
        self.log.info("%d item(s) settled by %s, %d left held", len(entries), responder, len(items) - len(entries))
        return {"job_id": job_id, "held": len(items) - len(entries), "applied": len(entries), "responded_by": responder}


def review_params(held: list[HeldStep]) -> dict[str, Param]:
    """The form: one decision per held item (``item_N``), a receipt per held send (``receipt_N``),
    and one note for the audit rows."""
    params: dict[str, Param] = {}
    for n, h in enumerate(held, 1):
        params[f"item_{n}"] = Param(
            LEAVE_HELD, type="string", enum=[LEAVE_HELD, *DECISIONS_BY_REASON[h.reason]],
            title=f"{n}. {h.item_id} / {h.step}",
            description=("delivered: the receiver has it (give its receipt below); not_delivered: the receiver "
                         "confirmed it never arrived (sent once by the next pass)"
                         if h.reason == HeldReason.UNKNOWN_OUTCOME else
                         "keep_previous_input: the new input counts as handled; use_new_input: process the new "
                         "input (sent again, under a new key)") + "; leave_held: decide later",
        )
        if h.reason == HeldReason.UNKNOWN_OUTCOME:
            # Optional (null allowed): Airflow's form requires a field whose type is a plain "string".
            params[f"receipt_{n}"] = Param(None, type=["null", "string"], maxLength=MAX_RECEIPT_BYTES,
                                           title=f"{n}. receipt",
                                           description="The receiver's receipt or reference (for delivered).")
    params["note"] = Param(None, type=["null", "string"], maxLength=MAX_NOTE_BYTES, title="Note",
                           description="What you checked; recorded with every decision.")
    return params


def _code(text: object) -> str:
    """Text for inside a Markdown code span (where backslash escapes do not apply)."""
    return str(text).replace("`", "'").replace("\n", " ").replace("\r", " ")


def _cell(text: object) -> str:
    """An id as inert Markdown text: no markup, links or HTML of its own, on one line."""
    return re.sub(r"([\\`*_\[\]<>|~])", r"\\\1", str(text)).replace("\n", " ").replace("\r", " ")


def review_body(job_id: str, held: list[HeldStep], rows: dict[tuple[str, str], StepRecord], *, more: int) -> str:
    """Markdown: the job, then per held item what it is and the key to ask the receiver about."""
    lines = [
        f"Job `{_code(job_id)}` has held items: the batch could not tell whether these sends arrived, or their "
        "input changed since. Ask the receiver about each idempotency key, then choose per item and "
        f"**{APPLY}** (all or nothing; every decision is audited under your name).",
        "",
    ]
    for n, h in enumerate(held, 1):
        row = rows.get((h.item_id, h.step))
        facts = [h.reason.value]
        if row is not None:
            facts.append(f"{row.attempts} attempt{'s' if row.attempts != 1 else ''}")
            if row.error_type:
                facts.append(f"last error {_cell(row.error_type)}")
        line = f"{n}. **{_cell(h.item_id)}** / {_cell(h.step)}: {', '.join(facts)}"
        if h.key_to_ask:  # a hard line break (two spaces), then the key
            line += f"  \n   idempotency key `{h.key_to_ask}`"
        lines.append(line)
    if more:
        lines += ["", f"{more} more held item(s) are not listed: answer these, then Clear this task for the next ones "
                      f"(or use the {RESOLVE_DAG_ID} DAG or `airflow-resumable resolve --file`)."]
    return "\n".join(lines)


def decisions_from(items: list[dict[str, Any]], params_input: dict[str, Any], job_id: str) -> list[dict[str, Any]]:
    """The journal entries of a response: one per item not left held, each with the version of the
    held step as it was shown (the journal refuses them all if one changed since). ``items``: what was
    presented, ``{"item_id", "step", "reason", "version"}`` each. Refuses, before anything is applied,
    a choice the form did not offer for that item (the REST API takes any value)."""
    note = params_input.get("note") or ""
    if not isinstance(note, str):
        raise ResolutionRefused("note must be text; nothing was changed")
    entries = []
    for n, shown in enumerate(items, 1):
        item_id, step, reason = shown["item_id"], shown["step"], shown["reason"]
        decision = params_input.get(f"item_{n}", LEAVE_HELD) or LEAVE_HELD
        allowed = (LEAVE_HELD, *DECISIONS_BY_REASON[HeldReason(reason)])
        if decision not in allowed:
            raise ResolutionRefused(f"item_{n} ({item_id} / {step}, {reason}): decision {decision!r} is not one of "
                                    f"{', '.join(allowed)}; nothing was changed")
        if decision == LEAVE_HELD:
            continue
        receipt = params_input.get(f"receipt_{n}") or None
        entries.append({"job_id": job_id, "item_id": item_id, "decision": decision, "note": note,
                        "step": step if decision in DECISIONS_BY_REASON[HeldReason.UNKNOWN_OUTCOME] else None,
                        "receipt": receipt if decision == "delivered" else None, "version": shown["version"]})
    return entries
