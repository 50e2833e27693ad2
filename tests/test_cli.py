"""The `airflow-resumable` console script against real journals (subprocesses, real files)."""

from __future__ import annotations

import csv
import io
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, run_batch

CLI = str(Path(sys.executable).with_name("airflow-resumable"))


def cli(journal: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "--journal", str(journal), *args], capture_output=True, text=True, timeout=60,
                          env=env)


def snapshot(path: Path) -> list:
    conn = sqlite3.connect(path)
    try:
        return [conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in ("steps", "resolutions", "jobs")]
    finally:
        conn.close()


@pytest.fixture
def journal_path(tmp_path) -> Path:
    """Job 'j': a done, b held (unknown outcome), c held (input changed)."""
    path = tmp_path / "journal.sqlite3"

    def notify(item, ctx):
        if item["id"] == "b":
            raise TimeoutError()
        return "rcpt-" + item["id"]

    steps = [Step("validate", lambda item, ctx: True), Step("notify", notify, side_effect=True)]
    with StepJournal(path) as journal:
        with pytest.raises(TimeoutError):
            run_batch(journal, "j", [{"id": "a"}, {"id": "c", "v": 1}, {"id": "b"}], steps)
        run_batch(journal, "j", [{"id": "a"}, {"id": "c", "v": 2}, {"id": "b"}], steps)
    return path


def test_jobs_held_show_audit_as_tables_and_json(journal_path):
    table = cli(journal_path, "jobs")
    assert table.returncode == 0 and "JOB_ID" in table.stdout and "j " in table.stdout
    (job,) = json.loads(cli(journal_path, "--json", "jobs").stdout)
    assert (job["job_id"], job["held"], job["SUCCEEDED"], job["FAILED"]) == ("j", 2, 5, 1)
    held = json.loads(cli(journal_path, "--json", "held", "j").stdout)
    assert sorted((h["item_id"], h["step"], h["reason"]) for h in held) == [
        ("b", "notify", "unknown_outcome"), ("c", "validate", "input_changed")]
    rows = json.loads(cli(journal_path, "--json", "show", "j", "--status", "FAILED").stdout)
    assert [(r["item_id"], r["step"], r["error_type"]) for r in rows] == [("b", "notify", "TimeoutError")]
    assert json.loads(cli(journal_path, "--json", "show", "j", "--item", "a").stdout)[1]["receipt"] == "rcpt-a"
    assert json.loads(cli(journal_path, "--json", "audit", "j").stdout) == []


def test_resolve_and_resolve_input_record_the_os_user(journal_path):
    done = cli(journal_path, "--json", "resolve", "j", "b", "notify", "--delivered", "--receipt", "r-9",
               "--note", "seen in dashboard")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["decision"] == "delivered"
    assert cli(journal_path, "resolve-input", "j", "c", "--keep-previous").returncode == 0
    audit = json.loads(cli(journal_path, "--json", "audit", "j").stdout)
    import getpass
    assert [(a["item_id"], a["decision"], a["resolved_by"]) for a in audit] == [
        ("b", "delivered", getpass.getuser()), ("c", "keep_previous_input", getpass.getuser())]
    assert json.loads(cli(journal_path, "--json", "held").stdout) == []


@pytest.mark.parametrize("args", [
    ["resolve", "j", "b", "notify", "--delivered"],                 # no receipt
    ["resolve", "j", "a", "notify", "--not-delivered"],             # not held
    ["resolve", "nope", "b", "notify", "--not-delivered"],          # unknown job
    ["resolve-input", "j", "b", "--use-new"],                       # not an input change
])
def test_refused_resolutions_exit_1_and_leave_the_journal_unchanged(journal_path, args):
    before = snapshot(journal_path)
    result = cli(journal_path, *args)
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "refused" in result.stderr
    assert snapshot(journal_path) == before


@pytest.mark.parametrize("args", [
    ["resolve", "j", "b", "notify"],                                # no decision
    ["resolve", "j", "b", "notify", "--delivered", "--not-delivered"],
    ["prune", "--older-than", "soon"],
    ["prune", "--older-than", "P1M"],  # a month has no fixed length
    ["prune", "--older-than", "2026-01-01"],  # a date, not a duration
    ["jobs", "--conn-id", "x"],  # --journal (given before the sub-command) and --conn-id exclude each other
    ["export", "j", "--format", "xml"],
    ["frobnicate"],
])
def test_bad_arguments_exit_2_with_one_line(journal_path, args):
    before = snapshot(journal_path)
    result = cli(journal_path, *args)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1
    assert snapshot(journal_path) == before


def test_export_json_and_csv_and_prune(journal_path, tmp_path):
    exported = json.loads(cli(journal_path, "export", "j").stdout)
    assert len(exported) == 6 and {r["item_id"] for r in exported} == {"a", "b", "c"}
    rows = list(csv.DictReader(io.StringIO(cli(journal_path, "export", "j", "--format", "csv").stdout)))
    assert len(rows) == 6 and rows[0]["job_id"] == "j"
    # Job 'j' has held rows: never pruned, even with a zero cut-off.
    assert json.loads(cli(journal_path, "--json", "prune", "--older-than", "0d").stdout) == {"pruned": []}
    other = tmp_path / "other.sqlite3"
    with StepJournal(other) as journal:
        run_batch(journal, "finished", [{"id": "x"}], [Step("s", lambda i, c: 1)])
    assert json.loads(cli(other, "--json", "prune", "--older-than", "0d").stdout) == {"pruned": ["finished"]}


def test_journal_path_from_the_environment(journal_path):
    import os
    env = {**os.environ, "AIRFLOW__RESUMABLE__JOURNAL_PATH": str(journal_path)}
    result = subprocess.run([CLI, "--json", "held", "j"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0 and len(json.loads(result.stdout)) == 2
    missing = cli(journal_path.with_name("missing.sqlite3"), "jobs")
    assert missing.returncode == 1 and "no journal at" in missing.stderr
    assert not journal_path.with_name("missing.sqlite3").exists()


def test_global_options_work_after_the_sub_command(journal_path):
    after = subprocess.run([CLI, "jobs", "--json", "--journal", str(journal_path)], capture_output=True, text=True,
                           timeout=60)
    assert after.returncode == 0, after.stderr
    assert json.loads(after.stdout) == json.loads(cli(journal_path, "--json", "jobs").stdout)
    held = subprocess.run([CLI, "held", "j", "--journal", str(journal_path), "--json"], capture_output=True,
                          text=True, timeout=60)
    assert len(json.loads(held.stdout)) == 2


@pytest.mark.parametrize("text", ["30d", "P30D", "p30d", "720h", "PT720H", "P29DT24H"])
def test_prune_reads_short_and_iso_8601_durations(journal_path, tmp_path, text):
    other = tmp_path / "other.sqlite3"
    with StepJournal(other) as journal:
        run_batch(journal, "finished", [{"id": "x"}], [Step("s", lambda i, c: 1)])
    result = cli(other, "--json", "prune", "--older-than", text)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == {"pruned": []}  # the job finished just now: not 30 days old
    assert json.loads(cli(other, "--json", "jobs").stdout)[0]["job_id"] == "finished"


def test_tables_show_times_in_airflows_default_timezone_and_how_long_ago(journal_path):
    import os

    env = {**os.environ, "AIRFLOW__CORE__DEFAULT_TIMEZONE": "Asia/Tokyo"}
    table = cli(journal_path, "jobs", env=env).stdout
    (job,) = json.loads(cli(journal_path, "--json", "jobs", env=env).stdout)
    from datetime import datetime, timedelta, timezone

    updated = datetime.fromisoformat(job["updated_at"])  # JSON stays ISO 8601 in UTC
    assert updated.utcoffset() == timedelta(0)
    tokyo = (updated + timedelta(hours=9)).strftime("%Y-%m-%d %H:%M")
    assert tokyo in table and "JST" in table, table
    assert " ago)" in table or "(just now)" in table, table
    assert datetime.now(timezone.utc) - updated < timedelta(minutes=10)


def test_durations_and_times_read_and_written_with_pendulum(monkeypatch):
    from datetime import datetime, timedelta, timezone

    from airflow_resumable import _time

    assert _time.parse_duration("30d") == _time.parse_duration("P30D") == timedelta(days=30)
    assert _time.parse_duration(" 12h ") == _time.parse_duration("PT12H") == timedelta(hours=12)
    for bad in ("", "30", "d", "-1d", "P1Y", "P1M", "PXD", "2026-01-01", "30 days"):
        with pytest.raises(_time.DurationError, match="invalid duration"):
            _time.parse_duration(bad)
    monkeypatch.setenv("AIRFLOW__CORE__DEFAULT_TIMEZONE", "Europe/Berlin")
    _time.display_timezone.cache_clear()
    try:
        at = datetime(2026, 12, 3, 9, 0, tzinfo=timezone.utc)
        assert _time.when(at, now=at + timedelta(hours=3, minutes=5)) == "2026-12-03 10:00:00 CET (3 hours ago)"
        assert _time.when(at.replace(month=7), now=at) == "2026-07-03 11:00:00 CEST (5 months ago)"
        assert _time.ago(at, now=at) == "just now"
        assert _time.ago(at + timedelta(minutes=2), now=at) == "2 minutes from now"  # another host's clock ahead
        assert _time.age(at, now=at + timedelta(days=2)) == "2 days"
        monkeypatch.setenv("AIRFLOW__CORE__DEFAULT_TIMEZONE", "Not/AZone")
        _time.display_timezone.cache_clear()
        assert _time.when(at, now=at).startswith("2026-12-03 09:00:00 UTC")  # an unknown zone shows UTC
    finally:
        _time.display_timezone.cache_clear()


def test_held_and_show_give_the_idempotency_key_and_jobs_a_status(journal_path, tmp_path):
    from airflow_resumable.runner import idempotency_key

    key = idempotency_key("j", "b", "notify")
    held = {h["item_id"]: h for h in json.loads(cli(journal_path, "held", "j", "--json").stdout)}
    assert held["b"]["idempotency_key"] == key  # what to ask the receiver about
    assert held["c"]["idempotency_key"] is None  # an input_changed hold is not about a send
    table = cli(journal_path, "held", "j").stdout
    assert "IDEMPOTENCY_KEY" in table and key in table
    rows = json.loads(cli(journal_path, "show", "j", "--item", "b", "--json").stdout)
    assert {(r["step"], r["idempotency_key"]) for r in rows} == {("validate", None), ("notify", key)}
    assert key in cli(journal_path, "show", "j", "--held").stdout
    (job,) = json.loads(cli(journal_path, "jobs", "--json").stdout)
    assert job["status"] == "needs_review"
    header, line = cli(journal_path, "jobs").stdout.splitlines()
    assert header.split()[:2] == ["JOB_ID", "STATUS"] and line.split()[:2] == ["j", "needs_review"]
    done = tmp_path / "done.sqlite3"
    with StepJournal(done) as journal:
        run_batch(journal, "finished", [{"id": "x"}], [Step("s", lambda i, c: 1)])
    assert json.loads(cli(done, "jobs", "--json").stdout)[0]["status"] == "completed"
