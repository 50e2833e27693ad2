"""Core figures: journal overhead per item, resume cost per item, memory for 1,000,000 streamed items.

Run: ``python -m benchmarks.core [--n 100000] [--memory-items 1000000]``. Each figure is measured
in its own child process so peak-RSS numbers are not polluted by earlier work.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, run_batch


def _steps() -> list[Step]:
    return [
        Step("validate", lambda item, ctx: None),
        Step("transform", lambda item, ctx: None),
        Step("notify", lambda item, ctx: "r", side_effect=True),
    ]


def _items(n: int):
    for i in range(n):
        yield {"id": i, "payload": "x" * 32}


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def measure_overhead(n: int, durability: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        with StepJournal(Path(tmp) / "j.sqlite3", durability=durability) as journal:  # type: ignore[arg-type]
            start = time.perf_counter()
            first = run_batch(journal, "bench", _items(n), _steps())
            first_s = time.perf_counter() - start
            start = time.perf_counter()
            again = run_batch(journal, "bench", _items(n), _steps())
            resume_s = time.perf_counter() - start
            assert first.executed_steps == 3 * n and again.skipped_steps == 3 * n
            fsyncs = journal.fsync_count
    # The same loop with no journal at all, to subtract the work that is not the journal's.
    steps = _steps()
    start = time.perf_counter()
    for item in _items(n):
        for step in steps:
            step.fn(item, None)  # type: ignore[arg-type]
    bare_s = time.perf_counter() - start
    return {
        "n": n,
        "durability": durability,
        "first_run_us_per_item": (first_s - bare_s) / n * 1e6,
        "resume_us_per_item": resume_s / n * 1e6,
        "fsyncs_per_item": fsyncs / n,
    }


def measure_memory(n: int) -> dict[str, float]:
    before = _rss_kib()
    with tempfile.TemporaryDirectory() as tmp:
        with StepJournal(Path(tmp) / "j.sqlite3", durability="normal") as journal:
            start = time.perf_counter()
            result = run_batch(journal, "mem", _items(n), _steps())
            elapsed = time.perf_counter() - start
            assert result.items_completed == n
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"items": n, "rss_before_mib": before / 1024, "peak_rss_mib": peak / 1024,
            "peak_growth_mib": (peak - before) / 1024, "seconds": elapsed}


_N = 100_000


def _child(kind: str, arg: str) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.core", "--n", str(_N), "--child", kind, arg],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--memory-items", type=int, default=1_000_000)
    parser.add_argument("--child", nargs=2)
    args = parser.parse_args()
    global _N
    _N = args.n
    if args.child:
        kind, arg = args.child
        if kind == "memory":
            print(json.dumps(measure_memory(int(arg))))
        else:
            print(json.dumps(measure_overhead(args.n, arg)))
        return
    for durability in ("normal", "full"):
        r = _child("overhead", durability)
        print(f"overhead  N={r['n']:,} durability={durability:6}  first run {r['first_run_us_per_item']:7.1f} us/item"
              f"  resume {r['resume_us_per_item']:6.1f} us/item  fsyncs/item {r['fsyncs_per_item']:.2f}")
    m = _child("memory", str(args.memory_items))
    print(f"memory    {m['items']:,} streamed items: peak RSS growth {m['peak_growth_mib']:.1f} MiB"
          f" (before {m['rss_before_mib']:.1f} MiB, peak {m['peak_rss_mib']:.1f} MiB, {m['seconds']:.1f} s)")


if __name__ == "__main__":
    main()
