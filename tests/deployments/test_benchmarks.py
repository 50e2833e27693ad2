"""The benchmarks' code paths at tiny sizes, so `make bench` does not rot.

Only deterministic facts are asserted (the article experiment's counts, who received what); no
timing or ratio is: performance targets live in `make bench`, not in unit tests.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_resumable.journal.schema import recount_statement
from airflow_resumable.runner import Step
from benchmarks import (
    article_experiment,
    concurrency,
    journal_cost,
    journal_size,
    peer_dbos,
    pg,
    report,
    row_layouts,
    scaleout,
)
from benchmarks.article_baseline import ArticleStyleJournal, run_article_style

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--n", "200", "--trials", "1", "--json", str(out), "--no-readme"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    results["stdout"] = proc.stdout
    return results


def test_the_article_experiment_reproduces_the_articles_counts(quick_results):
    modes = quick_results["sections"]["article"]["modes"]
    assert modes["before_accept"]["counts"] == {
        "rerun_executed": 150, "rerun_skipped": 0, "rerun_duplicates": 40,
        "run2_executed": 27, "run2_skipped": 122, "run3_executed": 1, "duplicates": 0,
    }
    assert modes["after_accept"]["counts"] == {
        "rerun_executed": 150, "rerun_skipped": 0, "rerun_duplicates": 41,
        "run2_executed": 27, "run2_skipped": 122, "run3_executed": 0, "duplicates": 0,
    }
    for mode, resolution in (("before_accept", "not_delivered"), ("after_accept", "delivered")):
        m = modes[mode]
        assert m["counts_identical"] and m["normal"]["counts_identical"]
        assert m["run1_executed"] == 123  # items 1-40 and item 41's three steps
        assert m["run2_held"] == ["item-041:notify_external:unknown_outcome"]
        assert m["resolution"] == resolution
        assert m["items_received_once"] == 50


def test_every_section_reports_a_figure_or_says_why_not(quick_results):
    sections = quick_results["sections"]
    assert not [name for name, s in sections.items() if "error" in s]
    assert sections["overhead_normal"]["n"] == 200 and "resume_ratio" in sections["overhead_normal"]
    assert sections["overhead_normal"]["baseline_commits_per_item"] == 6  # the article's way: 2 per step
    assert sections["overhead_full"]["ours_fsyncs_per_item"] <= 1
    assert sections["memory"]["items"] == 200
    assert "ratio" in sections["peer"] or "dbos is not installed" in sections["peer"]["skipped"]
    if concurrency.supports_concurrency():
        assert sections["concurrency"]["runs"]["16"]["duplicate_sends"] == 0
    else:
        assert "concurrency: not available in this build" in quick_results["stdout"]
    first = sections["first_run"]  # both sides ran, each from its own code (the section checks where from)
    assert ("ratio" in first and first["n"] == 200 and len(first["reference_runs_us"]) == 1) or (
        "no git history" in first["skipped"])
    mark = sections["high_water"]  # three sides: main before the mark, this code without and with it
    assert ("ratio" in mark and mark["n"] == 200 and mark["writes_per_run"] >= 2
            and all(len(runs) == 1 for runs in mark["runs_us"].values())) or "no git history" in mark["skipped"]
    results = {t["figure"].split(" (")[0]: t["result"] for t in quick_results["targets"]}
    assert set(results.values()) <= {"PASS", "FAIL", "SKIP", "INFO"}
    assert all(line.startswith("[") for line in report.text_table(report.rows(sections)).splitlines())


POSTGRES_SECTIONS = ("peer_postgres", "concurrency_postgres", "journal_cost_postgres", "scaleout_postgres")


def test_the_postgres_sections_run_where_postgres_is_installed(quick_results):
    """With PostgreSQL's server binaries (and psycopg) here, none of the PostgreSQL sections is skipped."""
    sections = quick_results["sections"]
    why = pg.unavailable()
    if why is not None:
        assert all(sections[name]["skipped"] == why for name in POSTGRES_SECTIONS)
        pytest.skip(why)
    assert not [name for name in POSTGRES_SECTIONS if "skipped" in sections[name] or "error" in sections[name]]
    figures = [t for t in quick_results["targets"]  # the pace section's fleet is tested on its own
               if "PostgreSQL" in t["figure"] and not t["figure"].startswith(("journal size", "pace:"))]
    assert len(figures) == 14  # the journal cost's three settings with the CPU each side used among them
    # Every PostgreSQL figure is measured; only the DBOS comparison may lack its peer (the bench extra).
    assert all(t["result"] in ("PASS", "FAIL", "INFO") or "dbos is not installed" in t["note"] for t in figures)


def test_peer_postgres_runs_both_sides_with_one_synchronous_commit_per_item(quick_results):
    peer = quick_results["sections"]["peer_postgres"]
    if "skipped" in peer:
        pytest.skip(peer["skipped"])
    assert peer["n"] == 30 and peer["postgres_version"] and "ours_full_us_per_step" in peer
    if "dbos_skipped" in peer:  # our side measured on PostgreSQL all the same
        assert "dbos is not installed" in peer["dbos_skipped"] and "ratio" not in peer
    else:
        assert set(peer["dbos_us_per_step_by_shape"]) == {"per_item", "per_batch"} and "ratio" in peer
    assert peer["ours_full_durable_commits_per_item"] == 1.0  # each send's IN_FLIGHT mark, nothing else
    assert peer["ours_full_commits_per_item"] >= 1.0


@pytest.mark.parametrize("section", ["journal_cost", "journal_cost_postgres"])
def test_the_journal_cost_runs_both_sides_of_each_setting_and_profiles_the_journal_thread(quick_results, section):
    c = quick_results["sections"][section]
    if "skipped" in c:
        pytest.skip(c["skipped"])
    assert set(c["settings"]) == {"16@4ms", "64@4ms", "64@50ms"}
    for name, s in c["settings"].items():
        assert s["items"] == 200 and s["duplicate_sends"] == 0, name
        assert len(s["all_seconds"]["without"]) == len(s["all_seconds"]["with"]) == 1, name
        assert s["ratio"] == pytest.approx(s["with_items_per_second"] / s["without_items_per_second"]), name
        for side in ("without", "with"):
            cpu = s["cpu_ms_per_item"][side]
            assert cpu["client"] > 0 and cpu["receiver"] >= 0 and 0 < cpu["busy_share"] <= 1, (name, side, cpu)
            if section == "journal_cost":
                assert cpu["database"] == 0, (name, cpu)
    # The database server's CPU is counted on PostgreSQL, where the journal's statements run (clock ticks:
    # summed over the settings, so that a few milliseconds are not rounded down to none).
    if section == "journal_cost_postgres":
        assert sum(s["cpu_ms_per_item"]["with"]["database"] for s in c["settings"].values()) > 0
    profile = c["profile"]
    assert profile["setting"] == "16@4ms" and 0 <= profile["waiting_for_sends_share"] <= 1
    assert len(profile["busiest"]) == 8 and all(f["calls"] > 0 for f in profile["busiest"])


def test_concurrency_postgres_sends_every_item_once(quick_results):
    c = quick_results["sections"]["concurrency_postgres"]
    if "skipped" in c:
        pytest.skip(c["skipped"])
    assert c["engine"] == "postgresql" and c["levels"] == [1, 16]
    for level, run in c["runs"].items():
        assert run["items"] == 200 and run["sends"] == 200 and run["duplicate_sends"] == 0, level
        assert 0 < run["durable_commits_per_item"] <= run["commits_per_item"]
    assert c["runs"]["1"]["durable_commits_per_item"] == 1.0
    assert c["durable_commits_per_item"] == c["runs"]["16"]["durable_commits_per_item"]
    assert c["commits_per_item"] == c["runs"]["16"]["commits_per_item"]


def test_scaleout_postgres_runs_every_runners_job_to_the_end(quick_results):
    s = quick_results["sections"]["scaleout_postgres"]
    if "skipped" in s:
        pytest.skip(s["skipped"])
    assert (s["processes"], s["n_per_process"], s["jobs_in_journal"]) == (8, 100, 9)
    assert s["runs"]["1"]["items"] == 100 and s["runs"]["8"]["items"] == 800
    assert len(s["runs"]["8"]["runner_seconds"]) == 8
    for run in s["runs"].values():
        assert run["durable_commits_per_item"] == 1.0 and run["commits_per_item"] >= 1.0
    assert "throughput_ratio" in s


def test_the_postgres_sections_say_why_they_are_skipped_without_postgres(monkeypatch):
    monkeypatch.setattr(pg, "unavailable", lambda: pg.SKIPPED_NO_SERVER)
    sections = {"peer_postgres": peer_dbos.measure_postgres(10), "concurrency_postgres": concurrency.measure_postgres(10),
                "journal_cost_postgres": journal_cost.measure_postgres(10), "scaleout_postgres": scaleout.measure(10)}
    assert sections["peer_postgres"] == sections["scaleout_postgres"] == {"skipped": pg.SKIPPED_NO_SERVER}
    assert sections["journal_cost_postgres"] == {"skipped": pg.SKIPPED_NO_SERVER}
    if concurrency.supports_concurrency():
        assert sections["concurrency_postgres"] == {"skipped": pg.SKIPPED_NO_SERVER}
    rows = [r for r in report.rows(sections)
            if "PostgreSQL" in r.figure and not r.figure.startswith(("journal size", "pace:"))]
    assert len(rows) == 7  # the journal cost's three settings among them
    assert all(r.result == "SKIP" and r.note in (pg.SKIPPED_NO_SERVER, concurrency.NOT_AVAILABLE) for r in rows)


def test_the_baseline_resumes_the_articles_way(tmp_path):
    """Run 1 fails at item 41's send; run 2 skips 1-40, holds 41, finishes 42-50."""
    receiver = article_experiment.MockReceiver("before_accept", 0.0)
    steps = [Step("validate", lambda item, ctx: None), Step("transform", lambda item, ctx: None),
             Step("notify_external", lambda item, ctx: receiver.deliver(item["id"], None), side_effect=True)]
    items = article_experiment.article_items()
    with ArticleStyleJournal(tmp_path / "article.sqlite3", durability="full") as journal:
        with pytest.raises(article_experiment.RefusedBeforeAccept):
            run_article_style(journal, "job", items, steps)
        assert journal.commits == 40 * 6 + 2 * 2 + 2  # two per step; 41's send: IN_FLIGHT, FAILED
        again = run_article_style(journal, "job", items, steps)
        assert (again.executed_steps, again.skipped_steps) == (27, 122)
        assert again.held == [("item-041", "notify_external", "unknown_outcome")]
        journal.resolve("job", "item-041", "notify_external", delivered=False)
        third = run_article_style(journal, "job", items, steps)
    assert (third.executed_steps, third.status) == (1, "completed")
    assert receiver.duplicates == 0 and len(receiver.accepted) == 50


def test_the_concurrency_section_runs_at_concurrency_1_against_real_http():
    figures = concurrency.measure(20, levels=(1,))
    assert figures["runs"]["1"]["sends"] == 20
    assert figures["runs"]["1"]["duplicate_sends"] == 0


def test_readme_has_the_markers_the_benchmark_fills():
    text = (REPO / "README.md").read_text()
    assert text.index(report.START) < text.index(report.END)


def test_the_peer_is_skipped_with_a_clear_message_without_dbos(monkeypatch):
    from benchmarks import peer_dbos

    monkeypatch.setattr(peer_dbos, "dbos_version", lambda: None)
    skipped = peer_dbos.measure(10)
    assert "dbos is not installed" in skipped["skipped"]
    row = next(r for r in report.rows({"peer": skipped}) if "DBOS" in r.figure)
    assert row.result == "SKIP" and "dbos is not installed" in row.note


JOURNAL_SIZE_SECTIONS = ("journal_size", "journal_size_postgres")


@pytest.mark.parametrize("name", JOURNAL_SIZE_SECTIONS)
def test_the_journal_size_sections_read_page_run_and_prune_in_a_big_and_a_small_journal(quick_results, name):
    j = quick_results["sections"][name]
    if name.endswith("_postgres") and pg.unavailable() is not None:
        assert j == {"skipped": pg.unavailable()}
        pytest.skip(j["skipped"])
    assert (j["n_big"], j["jobs_big"], j["n_small"], j["jobs_small"]) == (19_980, 30, 1_992, 12)  # --n 200
    for size in ("big", "small"):
        assert set(j["reads_ms"][size]) == set(journal_size.READS)
        assert all(ms > 0 for ms in j["reads_ms"][size].values())
        assert j["bytes_per_item"][size]["bytes_per_item"] > 0
    assert set(j["read_ratios"]) == set(journal_size.READS)
    assert j["new_job"]["items"] == 200 and j["new_job"]["ratio"] > 0
    prune = j["prune"]
    # The first prune was killed part way through a job; the second finished it, and every job's kept
    # counts equal a recount of its rows.
    assert prune["interrupted_mid_job"] and prune["resumed_jobs"] == 1 and prune["counts_exact"], prune
    assert (prune["jobs"], prune["items"]) == (15, 15 * 666)
    rows = [t for t in quick_results["targets"] if t["figure"].startswith("journal size")
            and ("PostgreSQL" in t["figure"]) == name.endswith("_postgres")]
    assert len(rows) == 12 and all(t["result"] in ("PASS", "FAIL") for t in rows)
    assert next(t for t in rows if "resumes" in t["figure"])["result"] == "PASS"


def test_the_journal_size_rows_say_why_they_were_not_measured():
    rows = [r for r in report.rows({"journal_size_postgres": {"skipped": pg.SKIPPED_NO_SERVER}})
            if r.figure.startswith("journal size, PostgreSQL")]
    assert len(rows) == 12 and all(r.result == "SKIP" and r.note == pg.SKIPPED_NO_SERVER for r in rows)


def test_a_journal_filled_in_sql_keeps_the_counts_its_rows_give(tmp_path):
    """The fill goes through the counters' triggers: every job's counts are its rows' own, half the jobs
    are finished and settled (what a prune takes) and half hold a few sends (what the held page shows)."""
    engine = journal_size.SqliteEngine(str(tmp_path / "filled.sqlite3"))
    shape = journal_size.Shape(items=1_000, jobs=10)
    with engine.open():
        pass
    journal_size.fill(engine, shape)
    with engine.open(readonly=True) as journal:
        jobs = {j.job_id: j for j in journal.jobs()}
        held = journal.held()
        rows = journal.rows(shape.job_id(9), limit=3)
    recount = {row[0]: tuple(row[1:]) for row in engine.count(recount_statement())}
    assert len(jobs) == 10 and all(j.items == 100 for j in jobs.values())
    for job in jobs.values():
        assert recount[job.job_id] == (job.items, job.counts["IN_FLIGHT"], job.counts["SUCCEEDED"],
                                       job.counts["FAILED"], job.held, job.unresolved)
    assert sorted(j.status for j in jobs.values()) == ["completed"] * 5 + ["needs_review"] * 5
    assert len(held) == 5 * journal_size.HELD_PER_JOB
    assert [r.step for r in rows] == ["validate", "transform", "notify"]  # the order a run writes them
    assert rows[0].item_id == "order-00000900" and rows[0].digest == rows[2].digest


def test_the_row_layouts_baseline_is_the_journals_own_table_and_size(tmp_path):
    """The layout study's "today" is the journal's steps table (same columns, same key) and weighs what a
    journal filled by the journal-size section weighs per item, so the candidates are compared with the truth."""
    engine = journal_size.SqliteEngine(str(tmp_path / "filled.sqlite3"))
    with engine.open():
        pass
    journal_size.fill(engine, journal_size.Shape(items=4_000, jobs=1), compacted=False)
    journal_columns = [row[1] for row in engine.count("PRAGMA table_info(steps)")]
    conn = sqlite3.connect(tmp_path / "today.sqlite3")
    conn.execute(row_layouts.LAYOUTS[0].table.format(real="REAL", blob="BLOB", without_rowid="WITHOUT ROWID"))
    assert [row[1] for row in conn.execute("PRAGMA table_info(t)")] == journal_columns
    conn.close()

    results = row_layouts.measure(4_000)
    layouts = results["layouts"]
    filled, _ = engine.bytes()
    assert layouts["today"]["sqlite"] == pytest.approx(filled / 4_000, rel=0.15)
    engines = ["sqlite"] if results["postgresql_skipped"] else ["sqlite", "postgresql"]
    for name in engines:
        sizes = [layouts[layout.name][name] for layout in row_layouts.LAYOUTS]
        assert sizes == sorted(sizes, reverse=True), (name, sizes)  # each candidate below the one before


def test_a_merged_run_keeps_the_other_sections_and_says_which_run_measured_each(tmp_path):
    """``--merge``: the sections of an --only run go into results.json beside the earlier ones, and the
    README's table names the run (date and command) that measured each."""
    from benchmarks.__main__ import merged

    full = {"date": "2026-12-03 13:58 UTC", "machine": "x86_64", "nproc": 2, "python": "3.11.7", "sqlite": "3.40.1",
            "quick": False, "command": "make bench"}
    earlier = {"concurrency": {"n": 1}, "journal_cost": {"old": True}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"meta": full, "sections": earlier, "targets": []}))
    later = full | {"date": "2026-12-05 17:40 UTC", "command": "python -m benchmarks --only journal_cost --merge"}
    meta, sections = merged(path, later, {"journal_cost": {"new": True}})
    assert sections == {"concurrency": {"n": 1}, "journal_cost": {"new": True}}
    assert meta["measured"] == {"concurrency": {"date": full["date"], "command": "make bench"},
                                "journal_cost": {"date": later["date"], "command": later["command"]}}
    table = report.markdown([], meta)
    assert "* 2026-12-03 13:58 UTC by `make bench`: concurrency" in table
    assert f"* 2026-12-05 17:40 UTC by `{later['command']}`: journal_cost" in table
    # Merged again later: the provenance kept in results.json is carried on, not the first run's.
    path.write_text(json.dumps({"meta": meta, "sections": sections, "targets": []}))
    again, _ = merged(path, later | {"date": "2026-12-06 09:00 UTC"}, {"concurrency": {"n": 2}})
    assert again["measured"]["journal_cost"]["date"] == later["date"]
    assert again["measured"]["concurrency"]["date"] == "2026-12-06 09:00 UTC"


def test_the_pace_section_sends_each_item_once_behind_nginx(quick_results):
    """Its code path at a tiny size: every run behind nginx completes, nothing is sent twice (no ratio)."""
    pace = quick_results["sections"]["pace"]
    assert "error" not in pace and "skipped" not in pace, pace
    assert pace["duplicates"] == 0
    assert pace["configured_100"]["through"] == pace["defaults_100"]["through"] == pace["n100"]
    assert pace["fleet_100"]["through"] == pace["n100"] // 4 * 4
    assert any(row["figure"].startswith("pace: ") for row in quick_results["targets"])


@pytest.mark.parametrize("ratio, code", [(1.6, 1), (0.9, 0)])
def test_make_bench_fails_when_the_first_run_got_dearer_than_its_target(monkeypatch, tmp_path, capsys, ratio, code):
    """The regression guard: a full-size run whose first-run figure is past its target exits 1, naming it."""
    from benchmarks import __main__ as bench

    measured = {"n": 20_000, "reps": 5, "reference": "6d45386", "reference_date": "2026-12-04",
                "us_per_item": 300.0 * ratio, "reference_us_per_item": 300.0, "ratio": ratio,
                "runs_us": [300.0 * ratio], "reference_runs_us": [300.0]}
    monkeypatch.setattr(bench, "_in_child", lambda name, params: measured)
    assert bench.main(["--only", "first_run", "--json", str(tmp_path / "r.json"), "--no-readme"]) == code
    out = capsys.readouterr().out
    assert ("regression: first run per item, NORMAL" in out) == (code == 1)
