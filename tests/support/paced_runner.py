"""One runner process of a paced fleet: ``python -m tests.support.paced_runner JOURNAL JOB FIRST COUNT RATE [GO]``.

Sends items FIRST .. FIRST+COUNT-1 of job JOB through ``HttpReceiver("limited")`` (the Airflow connection
from the environment) at concurrency 16, under the limit key ``limited`` at RATE sends a second, shared
with every runner on JOURNAL. Prints the run's result as JSON. With GO (a file path): prints ``READY``
once imported and connected, and starts sending when that file exists (the fleet starts together).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

from airflow_resumable.journal import StepJournal
from airflow_resumable.receivers.http import HttpReceiver
from airflow_resumable.runner import Step, run_batch


def main(argv: list[str]) -> int:
    journal_url, job, first, count, rate = argv[0], argv[1], int(argv[2]), int(argv[3]), float(argv[4])
    http = HttpReceiver("limited", timeout=30)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify, max_sends_per_second=rate,
                  limit_key="limited")]
    items = [{"id": f"item-{n:05d}"} for n in range(first, first + count)]
    with StepJournal(journal_url, durability="normal") as journal:
        if len(argv) > 5:
            go = Path(argv[5])
            print("READY", flush=True)
            while not go.exists():
                time.sleep(0.01)
        result = run_batch(journal, job, items, steps, concurrency=16)
    summary = dataclasses.asdict(result)
    summary["held"] = len(result.held)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
