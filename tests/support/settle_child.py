"""A runner process killed while it waits to settle a send (SPEC §12), for the crash tests:
``python -m tests.support.settle_child JOURNAL RECEIVER MARKER MODE CONCURRENCY``.

Sends items 00..19 to a DurableReceiver (a SQLite file of its own). item-05's first send fails once
(MODE ``refuse``: a 429 with ``Retry-After: 60``, nothing taken; ``lost``: taken, then the reply times
out and the look-up waits a 60 s backoff). MARKER is created when the fault fires: the parent then kills
this process during the wait.
"""

from __future__ import annotations

import sys
from pathlib import Path

from airflow_resumable.exceptions import ReceiverRefused
from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Settlement, Step, run_batch
from tests.support.receivers import DurableReceiver

ITEMS = [{"id": f"item-{n:02d}"} for n in range(20)]


def steps(receiver: DurableReceiver, marker: Path | None, mode: str) -> list[Step]:
    def send(item, ctx):
        if marker is not None and item["id"] == "item-05" and not marker.exists():
            if mode == "lost":
                receiver.deliver(ctx.job_id, item["id"], ctx.step, ctx.idempotency_key)
            marker.touch()
            if mode == "refuse":
                raise ReceiverRefused(429, retry_after=60)
            raise TimeoutError("the reply never came")
        return receiver.deliver(ctx.job_id, item["id"], ctx.step, ctx.idempotency_key)

    return [Step("notify", send, side_effect=True, verify=lambda ctx: receiver.lookup(ctx.idempotency_key))]


def main(argv: list[str]) -> int:
    journal, receiver, marker, mode, concurrency = argv[0], argv[1], Path(argv[2]), argv[3], int(argv[4])
    with StepJournal(journal) as opened:
        run_batch(opened, "settle/job", ITEMS, steps(DurableReceiver(Path(receiver)), marker, mode),
                  concurrency=concurrency, settle_in_task=Settlement(first_backoff=60, max_backoff=60))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
