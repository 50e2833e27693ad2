"""What the high-water mark (SPEC §13) costs a normal run, per item, in one run.

The first-run batch of :mod:`benchmarks.first_run` (20,000 items; validate, transform, notify; NORMAL;
concurrency 1), three ways, each in processes of its own, alternating: the code of the main before the
mark (``REFERENCE``, taken out of git), this code without a mark store, and this code keeping its mark in
a store as slow as Airflow's task state store (a write is a round trip to the API server: 20 ms here,
slept on the store's own thread, as the Execution API's client waits). Target: the mark costs at most
2 % (this code with the mark ÷ the reference).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.first_run import REPO, _one_run, _reference_tree

REFERENCE = "04c8621"  # main before SPEC §13
STORE_SECONDS = 0.020

_CHILD = """
import json, sys, tempfile, time
from pathlib import Path
import airflow_resumable
from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import run_batch
from benchmarks import workload
n, mode, seconds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])


class SlowStore:
    def __init__(self):
        self.record, self.writes = None, 0

    def read(self):
        time.sleep(seconds)
        return self.record

    def write(self, record):
        time.sleep(seconds)
        self.record = json.loads(json.dumps(record))
        self.writes += 1


store = SlowStore() if mode == "mark" else None
kwargs = {"high_water": store} if store is not None else {}
bare = workload.median_of(3, lambda: workload.bare_seconds(n))
with tempfile.TemporaryDirectory() as tmp, StepJournal(Path(tmp) / "j.sqlite3", durability="normal") as journal:
    seconds = workload.timed(lambda: run_batch(journal, "bench", workload.items(n), workload.steps(), **kwargs))
print(json.dumps({"us_per_item": (seconds - bare) / n * 1e6, "code": airflow_resumable.__file__,
                  "writes": store.writes if store else 0}))
"""


def measure(n: int, reps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        tree = _reference_tree(Path(tmp), REFERENCE)
        if tree is None:
            return {"skipped": f"no git history with {REFERENCE} here (a git checkout is needed)"}
        figures: dict[str, list[float]] = {"reference": [], "off": [], "mark": []}
        writes: list[int] = []
        sides = [(tree, "reference", "off"), (REPO, "off", "off"), (REPO, "mark", "mark")]
        for rep in range(reps):
            for root, name, mode in sides if rep % 2 == 0 else sides[::-1]:
                run = _one_run(root, n, _CHILD, mode, str(STORE_SECONDS))
                if Path(run["code"]).resolve().parent.parent != root.resolve():
                    raise RuntimeError(f"the child ran the code at {run['code']}, not the one under {root}")
                figures[name].append(run["us_per_item"])
                if mode == "mark":
                    writes.append(run["writes"])
    median = {name: statistics.median(values) for name, values in figures.items()}
    return {"n": n, "reps": reps, "reference": REFERENCE, "store_seconds": STORE_SECONDS,
            "us_per_item": median["mark"], "without_mark_us_per_item": median["off"],
            "reference_us_per_item": median["reference"], "ratio": median["mark"] / median["reference"],
            "writes_per_run": statistics.median(writes), "runs_us": figures}
