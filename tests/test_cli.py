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
