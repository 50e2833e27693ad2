"""The article's batch (50 items x 3 steps, item 41's send fails once) as reusable pieces."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, StepContext, run_batch
from tests.support.receivers import AcceptedThenLost, DurableReceiver, RefusedBeforeAccept

STEP_NAMES = ("validate", "transform", "notify_external")


def article_items(n: int = 50) -> list[dict[str, Any]]:
    return [{"id": f"item-{i:03d}", "amount": i * 100, "to": f"user{i}@example.test"} for i in range(1, n + 1)]


class FaultOnce:
    """Makes one item's send fail once, before or after the receiver accepted it."""

    def __init__(self, item_id: str | None, mode: str) -> None:
        assert mode in ("before_accept", "after_accept")
        self.item_id, self.mode, self.fired = item_id, mode, False

    def before(self, item_id: str) -> None:
        if item_id == self.item_id and not self.fired and self.mode == "before_accept":
            self.fired = True
            raise RefusedBeforeAccept()

    def after(self, item_id: str) -> None:
        if item_id == self.item_id and not self.fired and self.mode == "after_accept":
            self.fired = True
            raise AcceptedThenLost()


def article_steps(receiver: DurableReceiver, fault: FaultOnce | None = None, *, with_verify: bool = False) -> list[Step]:
    def validate(item: Mapping[str, Any], ctx: StepContext) -> dict[str, Any]:
        assert item["amount"] >= 0
        return {"ok": True}

    def transform(item: Mapping[str, Any], ctx: StepContext) -> dict[str, Any]:
        assert ctx.outputs["validate"] == {"ok": True}
        return {"cents": item["amount"] * 100}

    def notify(item: Mapping[str, Any], ctx: StepContext) -> str:
        if fault:
            fault.before(ctx.item_id)
        receipt = receiver.deliver(ctx.job_id, ctx.item_id, ctx.step, ctx.idempotency_key,
                                   str(ctx.outputs["transform"]["cents"]))
        if fault:
            fault.after(ctx.item_id)
        return receipt

    def verify(ctx: StepContext) -> str | None:
        return receiver.lookup(ctx.idempotency_key)

    return [
        Step("validate", validate),
        Step("transform", transform),
        Step("notify_external", notify, side_effect=True, verify=verify if with_verify else None),
    ]


def rerun_everything(receiver: DurableReceiver, job_id: str, items: list[dict[str, Any]], fault: FaultOnce) -> int:
    """The baseline: no journal; a failed run is simply started again from item 1. Returns steps run."""
    executed = 0
    steps = article_steps(receiver, fault)

    def one_pass() -> None:
        nonlocal executed
        for item in items:
            outputs: dict[str, Any] = {}
            for step in steps:
                ctx = StepContext(job_id, item["id"], step.name, "", f"{job_id}:{item['id']}:{step.name}", outputs)
                outputs[step.name] = step.fn(item, ctx)
                executed += 1

    try:
        one_pass()
    except (RefusedBeforeAccept, AcceptedThenLost):
        pass
    executed = 0
    one_pass()
    return executed


def held_job(location: Any, job_id: str, item_id: str = "a") -> str:
    """A job at ``location`` (a file or a PostgreSQL URL) with one send held: its reply was lost (an
    unknown outcome), then the next run held it. Returns the journal's id."""
    def lost(item: Mapping[str, Any], ctx: StepContext) -> str:
        raise ConnectionError("reply lost")

    steps = [Step("send", lost, side_effect=True)]
    with StepJournal(location) as journal:
        with pytest.raises(ConnectionError):
            run_batch(journal, job_id, [{"id": item_id}], steps, settle_in_task=False)
        assert [h.item_id for h in run_batch(journal, job_id, [{"id": item_id}], steps,
                                             settle_in_task=False).held] == [item_id]
        return journal.journal_id
