"""A first run's cost per item: this checkout's code against main of 2026-12-04, measured in one run.

On 2026-12-04 (``6d45386``) a first run of 20,000 items (validate, transform, notify; NORMAL;
concurrency 1) cost about 440-480 µs an item on a loaded machine; the per-job counts that came after it
made it 1.25-1.5 times dearer. This section keeps that from happening again unseen: the reference's
``airflow_resumable`` is taken out of git (``git archive``) into a temporary folder, and each side runs
the same batch in processes of its own, the two alternating, so a burst of other load hits both. The
cost of an item is (run time - the bare loop's) / n, as in :mod:`benchmarks.core`; the median of each
side is compared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
REFERENCE = "6d45386"
REFERENCE_DATE = "2026-12-04"

# One side's run, in a process of its own: airflow_resumable comes from the first folder on the path.
_CHILD = """
import json, sys, tempfile
from pathlib import Path
import airflow_resumable
from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import run_batch
from benchmarks import workload
n = int(sys.argv[1])
bare = workload.median_of(3, lambda: workload.bare_seconds(n))
with tempfile.TemporaryDirectory() as tmp, StepJournal(Path(tmp) / "j.sqlite3", durability="normal") as journal:
    seconds = workload.timed(lambda: run_batch(journal, "bench", workload.items(n), workload.steps()))
print(json.dumps({"us_per_item": (seconds - bare) / n * 1e6, "code": airflow_resumable.__file__}))
"""


def _reference_tree(into: Path, reference: str = REFERENCE) -> Path | None:
    """The reference's package, taken out of this checkout's git history; None without git or history."""
    try:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", reference, "airflow_resumable"],
                                 capture_output=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


def _one_run(code_root: Path, n: int, child: str = _CHILD, *args: str) -> dict[str, Any]:
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(code_root), str(REPO)])}
    done = subprocess.run([sys.executable, "-c", child, str(n), *args], capture_output=True, text=True, env=env,
                          check=False, timeout=600, cwd=code_root)
    if done.returncode != 0:
        raise RuntimeError(f"the first-run child failed ({code_root}): {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(n: int, reps: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        tree = _reference_tree(Path(tmp))
        if tree is None:
            return {"skipped": f"no git history with {REFERENCE} here (a git checkout is needed)"}
        today: list[float] = []
        reference: list[float] = []
        for rep in range(reps):
            sides = [(REPO, today), (tree, reference)]
            for root, figures in sides if rep % 2 == 0 else sides[::-1]:
                run = _one_run(root, n)
                if Path(run["code"]).resolve().parent.parent != root.resolve():
                    raise RuntimeError(f"the child ran the code at {run['code']}, not the one under {root}")
                figures.append(run["us_per_item"])
    ours, theirs = statistics.median(today), statistics.median(reference)
    return {"n": n, "reps": reps, "reference": REFERENCE, "reference_date": REFERENCE_DATE,
            "us_per_item": ours, "reference_us_per_item": theirs, "ratio": ours / theirs,
            "runs_us": today, "reference_runs_us": reference}
