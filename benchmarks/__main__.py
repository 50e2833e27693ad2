"""``python -m benchmarks [--quick]``: every figure, every ratio, its target and PASS/FAIL.

Each section runs in a child process of its own (fresh interpreter: peak RSS, SQLite's caches and
DBOS's global state do not leak from one figure into the next); ours and the compared side are
measured inside the same child, interleaved where repetitions are cheap. The ``*_postgres``
sections start a throwaway PostgreSQL cluster in their child and destroy it (skipped, with the
reason, where PostgreSQL's server binaries or psycopg are missing). A full run writes
``benchmarks/results.json`` and the table between the ``bench`` markers in README.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sqlite3
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from benchmarks import report

REPO = Path(__file__).resolve().parents[1]

SECTIONS = ("article", "first_run", "overhead_normal", "overhead_full", "memory", "peer", "concurrency", "journal_cost",
            "peer_postgres", "concurrency_postgres", "journal_cost_postgres", "scaleout_postgres", "journal_size",
            "journal_size_postgres", "pace", "high_water")

# The journal-size sections' sizes (benchmarks.journal_size). jobs_small is above the pages' 100, so
# both journals fill every page and the ratios are about the journal, not about what a page shows.
JOURNAL_SIZE = {"n_big": 10_000_000, "jobs_big": 300, "n_small": 10_000, "jobs_small": 120,
                "new_items": 10_000, "reps": 5, "new_reps": 3}
JOURNAL_SIZE_QUICK = {"n_big": 100_000, "jobs_big": 30, "n_small": 10_000, "jobs_small": 12,
                      "new_items": 1_000, "reps": 3, "new_reps": 1}

# Sizes of a full run and of --quick. --n caps every item count (the smoke test uses it).
SIZES: dict[str, dict[str, dict[str, int]]] = {
    "full": {
        "article": {"trials": 5},
        # This code's first run against main of 2026-12-04's, each side 5 times in processes of its own.
        "first_run": {"n": 20_000, "reps": 5},
        # Baseline FULL makes 6 fsync'd commits per item: 5,000 items x 2 repetitions is plenty.
        "overhead_normal": {"n": 100_000, "reps": 1, "resumes": 2},
        "overhead_full": {"n": 5_000, "reps": 2, "resumes": 0},
        "memory": {"n": 1_000_000},
        "peer": {"n": 200, "reps": 3},  # DBOS takes milliseconds per step
        "concurrency": {"n": 10_000, "serial_n": 2_000},
        # The same sends with and without the journal, at concurrency 16 and 64 (4 ms) and 64 (50 ms).
        "journal_cost": {"n": 10_000, "reps": 2},
        "peer_postgres": {"n": 200, "reps": 3},
        "concurrency_postgres": {"n": 10_000, "serial_n": 2_000},
        "journal_cost_postgres": {"n": 10_000, "reps": 2},
        # n items per runner process; 1 runner, then 8 at once, 3 times (the median repetition is reported).
        "scaleout_postgres": {"n": 1_000, "processes": 8, "reps": 3},
        # A journal of n_big items (3 steps each) vs one of n_small, filled in SQL; the prune
        # takes the big journal's finished half. --journal-items sets n_big.
        "journal_size": JOURNAL_SIZE,
        "journal_size_postgres": JOURNAL_SIZE,
        # Behind nginx: 1,500 sends at 100/s (15 s), 6,000 at 1,000/s; settlement on / off, twice each.
        "pace": {"n100": 1_500, "n1000": 6_000, "n_cost": 3_000, "reps": 2},
        # SPEC §13's mark in a store as slow as the task state store, against main before it (3 sides, 5 times).
        "high_water": {"n": 20_000, "reps": 5},
    },
    "quick": {
        "article": {"trials": 2},
        "first_run": {"n": 2_000, "reps": 1},
        "overhead_normal": {"n": 5_000, "reps": 1, "resumes": 2},
        "overhead_full": {"n": 500, "reps": 2, "resumes": 0},
        "memory": {"n": 20_000},
        "peer": {"n": 30, "reps": 1},
        "concurrency": {"n": 500, "serial_n": 200},
        "journal_cost": {"n": 500, "reps": 1},
        "peer_postgres": {"n": 30, "reps": 1},
        "concurrency_postgres": {"n": 500, "serial_n": 200},
        "journal_cost_postgres": {"n": 500, "reps": 1},
        "scaleout_postgres": {"n": 100, "processes": 8, "reps": 1},
        "journal_size": JOURNAL_SIZE_QUICK,
        "journal_size_postgres": JOURNAL_SIZE_QUICK,
        "pace": {"n100": 200, "n1000": 500, "n_cost": 300, "reps": 1},
        "high_water": {"n": 2_000, "reps": 1},
    },
}


def run_section(name: str, params: dict[str, int]) -> dict[str, Any]:
    """Runs in the child process."""
    # Held items and the injected faults are logged as warnings; here they are expected noise.
    logging.getLogger("airflow_resumable").setLevel(logging.ERROR)
    if name == "article":
        from benchmarks import article_experiment

        return article_experiment.run(trials=params["trials"])
    if name == "first_run":
        from benchmarks import first_run

        return first_run.measure(params["n"], params["reps"])
    if name.startswith("overhead_"):
        from benchmarks import core

        return core.measure_overhead(params["n"], name.removeprefix("overhead_"),  # type: ignore[arg-type]
                                     params["reps"], params["resumes"])
    if name == "memory":
        from benchmarks import core

        return core.measure_memory(params["n"])
    if name == "peer":
        from benchmarks import peer_dbos

        return peer_dbos.measure(params["n"], params["reps"])
    if name == "concurrency":
        from benchmarks import concurrency

        return concurrency.measure(params["n"], serial_n=params["serial_n"])
    if name in ("journal_cost", "journal_cost_postgres"):
        from benchmarks import journal_cost

        if name.endswith("_postgres"):
            return journal_cost.measure_postgres(params["n"], params["reps"])
        return journal_cost.measure(params["n"], reps=params["reps"])
    if name == "peer_postgres":
        from benchmarks import peer_dbos

        return peer_dbos.measure_postgres(params["n"], params["reps"])
    if name == "concurrency_postgres":
        from benchmarks import concurrency

        return concurrency.measure_postgres(params["n"], serial_n=params["serial_n"])
    if name == "scaleout_postgres":
        from benchmarks import scaleout

        return scaleout.measure(params["n"], processes=params["processes"], reps=params["reps"])
    if name == "high_water":
        from benchmarks import high_water

        return high_water.measure(params["n"], params["reps"])
    if name == "pace":
        from benchmarks import pace

        return pace.measure(params)
    if name in ("journal_size", "journal_size_postgres"):
        from benchmarks import journal_size

        return journal_size.measure_postgres(params) if name.endswith("_postgres") else journal_size.measure(params)
    raise SystemExit(f"unknown section {name!r}")


def _journal_sizes(params: dict[str, int], cap: int | None, big: int | None) -> dict[str, int]:
    """The journal-size sections' sizes under --journal-items and --n (a smoke run: the big journal 100 x n
    items in jobs of more than one prune batch, so the interrupted prune is still part way through a job)."""
    params = dict(params)
    if big is not None:
        params["n_big"] = big
    if cap is not None:
        params |= {"n_big": min(params["n_big"], 100 * cap), "n_small": min(params["n_small"], 10 * cap),
                   "new_items": min(params["new_items"], cap), "reps": 1, "new_reps": 1}
    return params


def _in_child(name: str, params: dict[str, int]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        started = time.monotonic()
        # The child's stderr passes through, so a failure shows its traceback right here.
        proc = subprocess.run(
            [sys.executable, "-m", "benchmarks", "--child", name, json.dumps(params), str(out)], cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
        if proc.returncode != 0 or not out.exists():
            return {"error": f"the {name} benchmark failed (exit {proc.returncode}); see its output above",
                    "params": params}
        result: dict[str, Any] = json.loads(out.read_text())
        result["wall_seconds"] = time.monotonic() - started
        return result


def _meta(quick: bool, argv: list[str]) -> dict[str, Any]:
    return {
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": platform.machine(),
        "nproc": os.cpu_count(),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "quick": quick,
        "command": "make bench" if not quick and not argv else "python -m benchmarks " + " ".join(argv),
    }


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def _print_section(name: str, result: dict[str, Any]) -> None:
    if "skipped" in result:
        # The concurrency sections' "not available in this build" message names itself.
        skipped = result["skipped"]
        print(skipped if skipped.startswith("concurrency:") else f"{name}: skipped: {skipped}")
    elif "error" in result:
        print(f"{name}: ERROR: {result['error']}")
    elif name == "article":
        print(report.article_table(result))
    elif name.startswith(("journal_size", "journal_cost", "pace")):
        print(f"{name}: {json.dumps(_rounded(result))}")
    else:
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
        print(f"{name}: {json.dumps(shown)}")
    sys.stdout.flush()


def merged(path: Path, meta: dict[str, Any], sections: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The results at ``path`` with these sections put in (replacing their earlier figures), and when
    and by which command each section was measured (``meta["measured"]``)."""
    if not path.exists():
        return meta | {"measured": dict.fromkeys(sections, _provenance(meta))}, sections
    previous = json.loads(path.read_text())
    before = previous["meta"]
    measured = before.get("measured") or dict.fromkeys(previous["sections"], _provenance(before))
    measured = measured | dict.fromkeys(sections, _provenance(meta))
    return meta | {"measured": measured}, previous["sections"] | sections


def _provenance(meta: dict[str, Any]) -> dict[str, str]:
    return {"date": meta["date"], "command": meta["command"]}


def main(argv: list[str] | None = None) -> int:
    args_in = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (under a minute); writes no files by default")
    parser.add_argument("--only", help="comma-separated sections: " + ",".join(SECTIONS))
    parser.add_argument("--n", type=int, help="cap every section's item count (smoke tests)")
    parser.add_argument("--trials", type=int, help="trials per fault mode of the article experiment")
    parser.add_argument("--journal-items", type=int,
                        help="items of the journal-size sections' big journal (default 10,000,000; --quick 100,000)")
    parser.add_argument("--json", type=Path, help="write results here (default: benchmarks/results.json on a full run)")
    parser.add_argument("--no-readme", action="store_true", help="do not update README.md's table")
    parser.add_argument("--merge", action="store_true",
                        help="with --only (full size): put these sections into benchmarks/results.json beside the "
                             "ones measured before - each keeps when and by which command it was measured - and "
                             "rewrite README.md's table from them all")
    parser.add_argument("--child", nargs=3, metavar=("SECTION", "PARAMS", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args(args_in)

    if args.child:
        name, params, out = args.child
        Path(out).write_text(json.dumps(run_section(name, json.loads(params))))
        return 0

    if args.merge and (args.quick or args.n is not None or not args.only):
        parser.error("--merge takes a full-size run of some sections (--only, without --quick or --n)")
    mode = "quick" if args.quick else "full"
    chosen = SECTIONS if not args.only else tuple(s.strip() for s in args.only.split(","))
    unknown = set(chosen) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    meta = _meta(args.quick, args_in)
    print(f"benchmarks ({mode}) {meta['date']}: {meta['machine']}, {meta['nproc']} cores, "
          f"Python {meta['python']}, SQLite {meta['sqlite']}\n")
    sections: dict[str, Any] = {}
    for name in chosen:
        params = dict(SIZES[mode][name])
        for key in ("n", "serial_n", "n100", "n1000", "n_cost"):
            if args.n is not None and key in params:
                params[key] = min(params[key], args.n)
        if args.trials is not None and "trials" in params:
            params["trials"] = args.trials
        if "n_big" in params:
            params = _journal_sizes(params, args.n, args.journal_items)
        sections[name] = _in_child(name, params)
        _print_section(name, sections[name])
        print()

    results_path = REPO / "benchmarks" / "results.json"
    if args.merge:
        meta, sections = merged(results_path, meta, sections)
    rows = report.rows(sections)
    print(report.text_table(rows))
    results = {"meta": meta, "sections": sections, "targets": [row.as_json() for row in rows]}
    json_path = args.json or (None if args.quick or (args.only and not args.merge) else results_path)
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nresults: {json_path}")
    if not (args.quick or (args.only and not args.merge) or args.no_readme):
        report.update_readme(REPO / "README.md", report.markdown(rows, meta, sections.get("article")))
        print("README.md: Performance table updated")
    # A FAIL is a finding, not a crash; a section that could not run at all is. So is a first run that got
    # dearer than its target allows, measured at full size: the regression guard.
    guarded = [row for row in rows if row.figure.startswith(report.GUARDED) and row.result == "FAIL"]
    if guarded and mode == "full" and args.n is None:
        print(f"\nregression: {guarded[0].figure} is {guarded[0].shown}, past its target {guarded[0].target}")
        return 1
    return 1 if any("error" in result for result in sections.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
