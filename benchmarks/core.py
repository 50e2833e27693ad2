"""Journal cost per item (ours vs the article-style baseline), resume cost, memory for streamed items.

Each function here runs inside its own child process (see ``benchmarks.__main__``), so peak RSS and
SQLite's page cache of one figure do not pollute the next.
"""

from __future__ import annotations

import resource
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from airflow_resumable.journal import StepJournal
from airflow_resumable.journal.backend import Durability
from airflow_resumable.runner import run_batch
from benchmarks import workload
from benchmarks.article_baseline import ArticleStyleJournal, run_article_style


def _ours(journal: StepJournal, n: int, executed_items: int) -> float:
    return workload.timed(
        lambda: _check(run_batch(journal, "bench", workload.items(n), workload.steps()), executed_items, n - executed_items))


def _baseline(journal: ArticleStyleJournal, n: int, executed_items: int) -> float:
    return workload.timed(
        lambda: _check(run_article_style(journal, "bench", workload.items(n), workload.steps()),
                       executed_items, n - executed_items))


def _check(result: Any, executed_items: int, skipped_items: int) -> None:
    # A benchmark that silently did less work would report a flattering figure.
    steps = len(workload.STEP_NAMES)
    if result.executed_steps != steps * executed_items or result.skipped_steps != steps * skipped_items:
        raise AssertionError(f"unexpected work: {result.executed_steps} executed, {result.skipped_steps} skipped")


def measure_overhead(n: int, durability: Durability, reps: int, resumes: int) -> dict[str, Any]:
    """Journal cost per item of a first run, ours and baseline, at one durability.

    Cost = (run time - bare loop time) / n on both sides; the bare loop (same items, same step
    functions, no journal) is the median of a few runs. Each of ``reps`` repetitions uses fresh
    journal files, ours and the baseline's alternating, and the medians are compared. ``resumes``
    re-runs of the finished job (the first repetition's), again alternating, give the resume cost.
    """
    bare = workload.median_of(3, lambda: workload.bare_seconds(n))
    ours_first: list[float] = []
    base_first: list[float] = []
    ours_resume: list[float] = []
    base_resume: list[float] = []
    for rep in range(reps):
        with tempfile.TemporaryDirectory() as tmp, \
                StepJournal(Path(tmp) / "ours.sqlite3", durability=durability) as ours, \
                ArticleStyleJournal(Path(tmp) / "article.sqlite3", durability=durability) as baseline:
            ours_first.append(_ours(ours, n, n))
            base_first.append(_baseline(baseline, n, n))
            fsyncs, commits = ours.engine.fsync_count, baseline.commits
            for _ in range(resumes if rep == 0 else 0):  # alternating, so a noisy moment hits both sides
                ours_resume.append(_ours(ours, n, 0))
                base_resume.append(_baseline(baseline, n, 0))

    def per_item_us(seconds: list[float], subtract: float) -> float:
        return (statistics.median(seconds) - subtract) / n * 1e6

    ours_us = per_item_us(ours_first, bare)
    base_us = per_item_us(base_first, bare)
    figures: dict[str, Any] = {
        "n": n,
        "durability": durability,
        "reps": reps,
        "bare_us_per_item": bare / n * 1e6,
        "ours_us_per_item": ours_us,
        "baseline_us_per_item": base_us,
        "baseline_us_per_step": base_us / len(workload.STEP_NAMES),
        "ratio": ours_us / base_us,
        "ours_fsyncs_per_item": fsyncs / n,
        "baseline_commits_per_item": commits / n,
    }
    if resumes:
        # A resume executes no step, so nothing is subtracted: both sides walk the same generator.
        figures |= {
            "resumes": resumes,
            "ours_resume_us_per_item": per_item_us(ours_resume, 0.0),
            "baseline_resume_us_per_item": per_item_us(base_resume, 0.0),
        }
        figures["resume_ratio"] = figures["ours_resume_us_per_item"] / figures["baseline_resume_us_per_item"]
    return figures


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def measure_memory(n: int) -> dict[str, Any]:
    """Peak RSS growth while ``n`` generated items stream through a first run."""
    before = _rss_kib()
    with tempfile.TemporaryDirectory() as tmp:
        with StepJournal(Path(tmp) / "j.sqlite3", durability="normal") as journal:
            start = time.perf_counter()
            result = run_batch(journal, "mem", workload.items(n), workload.steps())
            elapsed = time.perf_counter() - start
            if result.items_completed != n:
                raise AssertionError(f"{result.items_completed} of {n} items completed")
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        "items": n,
        "rss_before_mb": before * 1024 / 1e6,
        "peak_rss_mb": peak * 1024 / 1e6,
        "peak_growth_mb": (peak - before) * 1024 / 1e6,
        "seconds": elapsed,
    }
