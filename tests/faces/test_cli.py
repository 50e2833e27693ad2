"""The `airflow-resumable` console script against real journals (subprocesses, real files)."""

from __future__ import annotations

import csv
import io
import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from airflow_resumable.journal import SCHEMA_VERSION, StepJournal
from airflow_resumable.runner import Step, run_batch
from tests.support.backends import snapshot as snapshot_of

pytestmark = pytest.mark.core

CLI = str(Path(sys.executable).with_name("airflow-resumable"))


# The two Airflow settings a command reads for a SQLite journal, given as Airflow reads them first (the
# environment), so it need not import Airflow to find them: ~3 s of CPU a command, hundreds of commands.
# Tests that pass an environment of their own read Airflow's config as a user's command does.
SETTINGS_GIVEN = {"AIRFLOW__RESUMABLE__ALLOW_NETWORK_FILESYSTEM": "false", "AIRFLOW__CORE__DEFAULT_TIMEZONE": "utc"}


def cli(journal: Path | str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, "--journal", str(journal), *args], capture_output=True, text=True, timeout=60,
                          env=env if env is not None else {**SETTINGS_GIVEN, **os.environ})


def snapshot(path: Path) -> list:
    conn = sqlite3.connect(path)
    try:
        return [conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2").fetchall() for t in ("steps", "resolutions", "jobs")]
    finally:
        conn.close()


def _notify(item, ctx):
    if item["id"] == "b":
        raise TimeoutError()  # b's reply is always lost
    return "rcpt-" + item["id"]


STEPS = [Step("validate", lambda item, ctx: True), Step("notify", _notify, side_effect=True)]


def items_of_j(c_version: int) -> list:
    """Job 'j': a, c (its input at ``c_version``) and b, whose send's reply is always lost."""
    return [{"id": "a"}, {"id": "c", "v": c_version}, {"id": "b"}]


def two_holds(location) -> None:
    """Job 'j': a done, b held (unknown outcome), c held (input changed)."""
    with StepJournal(location) as journal:
        with pytest.raises(TimeoutError):
            run_batch(journal, "j", items_of_j(1), STEPS, settle_in_task=False)
        run_batch(journal, "j", items_of_j(2), STEPS, settle_in_task=False)


@pytest.fixture
def journal_path(tmp_path) -> Path:
    """Job 'j' (:func:`two_holds`) in a SQLite file."""
    path = tmp_path / "journal.sqlite3"
    two_holds(path)
    return path


@pytest.fixture
def journal_at(journal_location) -> str:
    """Job 'j' (:func:`two_holds`) in a SQLite file, then in a PostgreSQL database."""
    two_holds(journal_location)
    return journal_location


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
        run_batch(journal, "finished", [{"id": "x"}], [Step("s", lambda i, c: 1)], settle_in_task=False)
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
        run_batch(journal, "finished", [{"id": "x"}], [Step("s", lambda i, c: 1)], settle_in_task=False)
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
        run_batch(journal, "finished", [{"id": "x"}], [Step("s", lambda i, c: 1)], settle_in_task=False)
    assert json.loads(cli(done, "jobs", "--json").stdout)[0]["status"] == "completed"


# -- decisions are made against what was seen: versions, the held --json round trip, bad decision input ---


def held_json(location) -> dict[str, dict]:
    """What ``held j --json`` shows, by item."""
    shown = cli(location, "held", "j", "--json")
    assert shown.returncode == 0, shown.stderr
    return {h["item_id"]: h for h in json.loads(shown.stdout)}


def a_colleague_settles_then_runs_hold_again(location, *items: str) -> None:
    """Between a look and a decision: someone settles b (not delivered) and/or c (keep the previous
    input), and runs hold them again: b's reply is lost once more, c's input changed once more."""
    with StepJournal(location) as journal:
        if "b" in items:
            journal.resolve("j", "b", "notify", delivered=False, resolved_by="colleague")
            with pytest.raises(TimeoutError):
                run_batch(journal, "j", items_of_j(2), STEPS, settle_in_task=False)
        if "c" in items:
            journal.resolve_input_change("j", "c", use_new_input=False, resolved_by="colleague")
        run_batch(journal, "j", items_of_j(3 if "c" in items else 2), STEPS, settle_in_task=False)
        assert {h.item_id for h in journal.held("j")} == {"b", "c"}


def test_held_and_show_print_each_rows_version_short_in_tables_whole_in_json(journal_at):
    with StepJournal(journal_at) as journal:
        versions = {(h.item_id, h.step): h.version for h in journal.held("j")}
        rows = {(r.item_id, r.step): r.version for r in journal.rows("j")}
    assert len(versions) == 2 and all(len(v) == 16 for v in versions.values())
    assert {(i, h["step"]): h["version"] for i, h in held_json(journal_at).items()} == versions
    shown = json.loads(cli(journal_at, "show", "j", "--json").stdout)
    assert {(r["item_id"], r["step"]): r["version"] for r in shown} == rows
    for command, expected, key_cells in ((["held", "j"], versions, slice(1, 3)), (["show", "j"], rows, slice(0, 2))):
        table = cli(journal_at, *command).stdout
        header, *lines = table.splitlines()
        assert "VERSION" in header.split() and len(lines) == len(expected)
        for key, version in expected.items():  # the first 8 characters, in the row's own line
            (line,) = [line for line in lines if tuple(line.split()[key_cells]) == key]
            assert version[:8] in line.split() and version not in table


def test_a_stale_cli_decision_is_refused_and_changes_nothing(journal_at):
    seen = held_json(journal_at)
    a_colleague_settles_then_runs_hold_again(journal_at, "b", "c")
    before = snapshot_of(journal_at)
    for decision in (
        ["resolve", "j", "b", "notify", "--not-delivered", "--expected-version", seen["b"]["version"]],
        ["resolve", "j", "b", "notify", "--delivered", "--receipt", "r-1", "--expected-version",
         seen["b"]["version"][:8]],  # the short form the table showed
        ["resolve-input", "j", "c", "--use-new", "--expected-version", seen["c"]["version"][:8]],
    ):
        refused = cli(journal_at, *decision)
        assert refused.returncode == 1, (decision, refused.stderr)
        assert refused.stderr.count("\n") == 1 and "changed since it was looked at" in refused.stderr
        assert snapshot_of(journal_at) == before
    # Looked at again, the same decisions go through, with the short form the table shows now.
    now = held_json(journal_at)
    assert now["b"]["version"][:8] != seen["b"]["version"][:8]
    done = cli(journal_at, "resolve", "j", "b", "notify", "--not-delivered", "--expected-version",
               now["b"]["version"][:8])
    assert done.returncode == 0, done.stderr
    assert cli(journal_at, "resolve-input", "j", "c", "--keep-previous", "--expected-version",
               now["c"]["version"]).returncode == 0
    with StepJournal(journal_at) as journal:
        assert journal.held("j") == []


def _write_decisions(path: Path, entries: list[dict], form: str, bom: bool = False) -> Path:
    if form == "json":
        text = json.dumps(entries)
    else:
        out = io.StringIO()
        writer = csv.DictWriter(out, fieldnames=list(dict.fromkeys(k for e in entries for k in e)))
        writer.writeheader()
        writer.writerows(entries)
        text = out.getvalue()
    path.write_bytes((b"\xef\xbb\xbf" if bom else b"") + text.encode())
    return path


@pytest.mark.parametrize("form", ["json", "csv"])
def test_held_json_with_decisions_added_round_trips_through_resolve_file(journal_at, tmp_path, form):
    shown = held_json(journal_at)
    assert set(shown["b"]) == {"job_id", "item_id", "step", "reason", "generation", "version", "idempotency_key"}
    decisions = {"b": {"decision": "delivered", "receipt": "rcpt-b-from-the-dashboard"},
                 "c": {"decision": "keep_previous_input"}}
    file = _write_decisions(tmp_path / f"decisions.{form}", [{**h, **decisions[i]} for i, h in shown.items()], form)
    applied = cli(journal_at, "resolve", "--file", str(file), "--json")
    assert applied.returncode == 0, applied.stderr
    assert held_json(journal_at) == {}
    audit = json.loads(cli(journal_at, "audit", "j", "--json").stdout)
    assert [(a["item_id"], a["decision"], a["receipt"]) for a in audit] == [
        ("b", "delivered", "rcpt-b-from-the-dashboard"), ("c", "keep_previous_input", None)]


@pytest.mark.parametrize("form", ["json", "csv"])
def test_a_decision_file_made_before_a_row_changed_is_refused_as_a_whole(journal_at, tmp_path, form):
    shown = held_json(journal_at)
    decisions = {"b": {"decision": "not_delivered"}, "c": {"decision": "use_new_input"}}
    file = _write_decisions(tmp_path / f"decisions.{form}", [{**h, **decisions[i]} for i, h in shown.items()], form)
    a_colleague_settles_then_runs_hold_again(journal_at, "c")  # b is as it was seen; c is not
    assert held_json(journal_at)["b"] == shown["b"]
    before = snapshot_of(journal_at)
    refused = cli(journal_at, "resolve", "--file", str(file))
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1
    said = refused.stderr.lower()
    assert "entry 2: " in said and "changed since" in said and "nothing was changed" in said
    assert snapshot_of(journal_at) == before  # not even b's decision, which was still good


def test_a_decision_files_unknown_field_is_refused_while_helds_display_fields_are_not(journal_at, tmp_path):
    entry = {**held_json(journal_at)["b"], "decision": "not_delivered", "colour": "red"}
    before = snapshot_of(journal_at)
    refused = cli(journal_at, "resolve", "--file", str(_write_decisions(tmp_path / "d.json", [entry], "json")))
    assert refused.returncode == 1 and "unknown field(s) 'colour';" in refused.stderr  # only that one
    assert snapshot_of(journal_at) == before


@pytest.mark.parametrize("form", ["json", "csv"])
def test_a_decision_file_saved_with_a_byte_order_mark_is_read_normally(journal_at, tmp_path, form):
    version = held_json(journal_at)["b"]["version"]
    entry = {"job_id": "j", "item_id": "b", "step": "notify", "decision": "not_delivered", "version": version}
    file = _write_decisions(tmp_path / f"excel.{form}", [entry], form, bom=True)
    assert file.read_bytes().startswith(b"\xef\xbb\xbf")
    applied = cli(journal_at, "resolve", "--file", str(file))
    assert applied.returncode == 0, applied.stderr
    assert set(held_json(journal_at)) == {"c"}


def test_a_csv_written_from_the_tables_short_versions_applies_from_stdin(journal_at):
    table = cli(journal_at, "held", "j").stdout.splitlines()
    short = {line.split()[1]: line.split()[4] for line in table[1:]}  # JOB_ID ITEM_ID STEP REASON VERSION
    assert table[0].split()[4] == "VERSION" and all(len(v) == 8 for v in short.values())
    typed = (f"job_id,item_id,step,decision,receipt,version\n"
             f"j,b,notify,delivered,rcpt-b,{short['b']}\nj,c,,use_new_input,,{short['c']}\n")
    applied = subprocess.run([CLI, "--journal", str(journal_at), "resolve", "--file", "-"], input=typed,
                             capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0, applied.stderr
    assert held_json(journal_at) == {}


LONG_NOTE = "n" * (4 * 1024 + 1)
ENTRY = '{"job_id": "j", "item_id": "b", "step": "notify", "decision": "not_delivered"'


@pytest.mark.parametrize(("content", "args", "names"), [
    pytest.param(b"job_id,item_id,step,decision,decision\nj,b,notify,delivered,not_delivered\n", [],
                 ["'decision' appears twice"], id="csv-repeated-column"),
    pytest.param(("[" * 100_000 + "]" * 100_000).encode(), [], ["nested more than 32 levels"], id="json-deep"),
    pytest.param(f'[{ENTRY}, "decision": "delivered"}}]'.encode(), [], ["entry 1", "'decision' twice"],
                 id="json-repeated-field"),
    pytest.param(f'[{ENTRY}, "note": "\\ud800"}}]'.encode(), [], ["entry 1", "'note'", "lone surrogate"],
                 id="json-lone-surrogate"),
    pytest.param(f'[{ENTRY}, "note": "a\\u0000b"}}]'.encode(), [], ["entry 1", "'note'", "NUL"], id="json-nul"),
    pytest.param(f'[{ENTRY}, "note": "{LONG_NOTE}"}}]'.encode(), [], ["note is 4097 bytes"], id="json-long-note"),
    pytest.param("job_id,item_id,step,decision,note\nj,b,notify,not_delivered,café\n".encode("latin-1"), [],
                 ["not UTF-8"], id="csv-latin-1"),
    pytest.param("job_id,item_id,step,decision\n".encode("utf-16"), [], ["UTF-16"], id="csv-utf-16"),
    pytest.param(None, ["resolve", "j", "b\udc80", "notify", "--not-delivered"], ["item_id", "lone surrogate"],
                 id="argv-item"),
    pytest.param(None, ["resolve", "j", "b\udc80", "notify", "--not-delivered", "--expected-version", "0" * 8],
                 ["item_id", "lone surrogate"], id="argv-item-with-version"),
    pytest.param(None, ["resolve", "j", "b", "notify", "--not-delivered", "--note", "seen\udcff"],
                 ["note", "lone surrogate"], id="argv-note"),
    pytest.param(None, ["resolve", "j", "b", "notify", "--not-delivered", "--note", LONG_NOTE],
                 ["note is 4097 bytes"], id="argv-long-note"),
    pytest.param(None, ["resolve-input", "j\udc80", "c", "--use-new"], ["job_id", "lone surrogate"],
                 id="argv-resolve-input-job"),
    pytest.param(None, ["resolve", "j", "b", "notify", "--not-delivered", "--expected-version", "6c63"],
                 ["--expected-version '6c63' is too short", "at least its first 8 characters"],
                 id="argv-version-shorter-than-the-tables"),
    pytest.param(None, ["show", "j\udc80"], ["job_id", "lone surrogate"], id="argv-show"),
    pytest.param(None, ["show", "j", "--item", "c\udc80"], ["--item", "lone surrogate"], id="argv-show-item"),
    pytest.param(None, ["held", "j\udc80"], ["job_id", "lone surrogate"], id="argv-held"),
    pytest.param(None, ["audit", "j\udc80"], ["job_id", "lone surrogate"], id="argv-audit"),
    pytest.param(None, ["export", "j\udc80"], ["job_id", "lone surrogate"], id="argv-export"),
])
def test_bad_decision_input_exits_1_with_one_line_and_changes_nothing(journal_at, tmp_path, content, args, names):
    """Files as spreadsheets and hostile hands make them, arguments whose bytes are not UTF-8 (they arrive
    as lone surrogates): refused, never a traceback or an "internal error" (exit 3)."""
    if content is not None:
        (tmp_path / "decisions").write_bytes(content)
        args = ["resolve", "--file", str(tmp_path / "decisions")]
    before = snapshot_of(journal_at)
    refused = cli(journal_at, *args)
    assert refused.returncode == 1, refused.stderr
    assert refused.stderr.count("\n") == 1 and refused.stderr.startswith("airflow-resumable: refused: ")
    for name in names:
        assert name in refused.stderr, refused.stderr
    assert snapshot_of(journal_at) == before


# -- migrate: a journal moved to this release's schema on purpose, as `airflow db migrate` moves Airflow's --


def shared_journal_env(postgres_url: str) -> dict[str, str]:
    """The CLI's environment as the compose file's init service has it: the journal is the Airflow
    connection `resumable_journal`, schema `resumable`, named by [resumable] journal_conn_id."""
    import os

    from tests.airflow_layer.test_airflow_shared_journal import connection

    conn = {**json.loads(connection(postgres_url)), "extra": {"journal_schema": "resumable"}}
    return {**os.environ, "AIRFLOW__RESUMABLE__JOURNAL_CONN_ID": "resumable_journal",
            "AIRFLOW_CONN_RESUMABLE_JOURNAL": json.dumps(conn)}


def configured_cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=60, env=env)


def shared_journal_cli(postgres_url: str) -> tuple[Any, str]:
    """How an on-call points the CLI at the shared journal, and how the CLI names it: the compose file's
    Airflow connection where Airflow is installed, else ``--journal URL`` (the matrix's core cells have
    no Airflow, hence no connections)."""
    import importlib.util

    from airflow_resumable.journal.postgres import redacted

    if importlib.util.find_spec("airflow") is None:
        return (lambda *args: cli(postgres_url, *args)), f"{redacted(postgres_url)} (schema resumable)"
    env = shared_journal_env(postgres_url)
    return (lambda *args: configured_cli(env, *args)), "connection resumable_journal (schema resumable)"


def test_migrate_takes_an_older_shared_journal_to_this_release_and_runs_go_through_again(postgres_url):
    from airflow_resumable.exceptions import JournalVersionError
    from tests.support.backends import assert_counts_exact, postgres_downgrade_to_6

    two_holds(postgres_url)
    postgres_downgrade_to_6(postgres_url)  # as the previous release left it
    sent: list[str] = []
    steps = [Step("send", lambda item, ctx: sent.append(item["id"]) or "ok", side_effect=True)]
    with pytest.raises(JournalVersionError, match="airflow-resumable migrate"):
        with StepJournal(postgres_url) as journal:
            run_batch(journal, "next", [{"id": "x"}], steps, settle_in_task=False)
    assert sent == []  # refused before anything was sent
    run_cli, where = shared_journal_cli(postgres_url)
    looked = run_cli("held")  # an on-call is told the same
    assert looked.returncode == 1 and "airflow-resumable migrate" in looked.stderr, looked.stderr

    migrated = run_cli("migrate")
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout == f"journal {where}: schema version 6 -> {SCHEMA_VERSION}\n"
    assert_counts_exact(postgres_url)  # the kept counts were computed for the jobs already there
    with StepJournal(postgres_url) as journal:
        run_batch(journal, "next", [{"id": "x"}], steps, settle_in_task=False)
    assert sent == ["x"]
    assert {h["item_id"] for h in json.loads(run_cli("held", "j", "--json").stdout)} == {"b", "c"}
    again = run_cli("migrate", "--json")
    assert again.returncode == 0
    assert json.loads(again.stdout) == {"journal": where, "found": SCHEMA_VERSION, "version": SCHEMA_VERSION}


def test_migrate_creates_a_new_shared_journal(postgres_url):
    created = cli(postgres_url, "migrate")
    assert created.returncode == 0, created.stderr
    assert created.stdout.startswith("journal postgresql://") and created.stdout.endswith(
        f" (schema resumable): created at schema version {SCHEMA_VERSION}\n")
    assert cli(postgres_url, "jobs").stdout == "(none)\n"


def test_migrate_on_sqlite_moves_an_older_file_and_leaves_a_missing_one_to_the_first_task(journal_path):
    from tests.support.backends import sqlite_downgrade

    already = f"journal {journal_path}: already at schema version {SCHEMA_VERSION}\n"
    assert cli(journal_path, "migrate").stdout == already
    sqlite_downgrade(journal_path, 6)
    migrated = cli(journal_path, "migrate")
    assert migrated.returncode == 0
    assert migrated.stdout == f"journal {journal_path}: schema version 6 -> {SCHEMA_VERSION}\n"
    assert len(json.loads(cli(journal_path, "held", "j", "--json").stdout)) == 2
    missing = journal_path.with_name("not-yet.sqlite3")
    none_yet = cli(missing, "migrate")  # a single-host deployment runs the same init command
    assert none_yet.returncode == 0 and "none yet" in none_yet.stdout and not missing.exists()
    newer = sqlite3.connect(journal_path)
    newer.execute("PRAGMA user_version = 99")  # written by a release from the future
    newer.close()
    refused = cli(journal_path, "migrate")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and "newer release" in refused.stderr


# -- the console's edges: a reader that stops early, a terminal that is not UTF-8, a path the OS refuses --


def test_export_into_a_reader_that_stops_early_ends_quietly(tmp_path):
    """`export big | head -1`: the reader goes away mid-stream; the command ends with SIGPIPE's exit
    status and no traceback, not as an internal error."""
    from tests.faces.test_ui_paging import fill

    path = tmp_path / "journal.sqlite3"
    fill(path, ["big"], range(5000), dag_id="d")
    for form in ("json", "csv"):
        proc = subprocess.Popen([CLI, "--journal", str(path), "export", "big", "--format", form],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout.readline()
        proc.stdout.close()  # the reader is gone
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 141, err
        assert b"Traceback" not in err and b"internal error" not in err


def test_a_terminal_that_is_not_utf8_gets_ids_escaped(tmp_path):
    path = tmp_path / "journal.sqlite3"
    with StepJournal(path) as journal:
        run_batch(journal, "jé", [{"id": "é-ünï"}], [Step("notify", lambda item, ctx: "r", side_effect=True)],
                  settle_in_task=False)
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    for args in (("jobs",), ("show", "jé"), ("export", "jé", "--format", "csv")):
        done = cli(path, *args, env=env)
        assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)
        assert "\\xe9" in done.stdout, (args, done.stdout)  # é, escaped


def test_a_journal_path_the_os_refuses_to_look_at_is_a_short_message(tmp_path):
    done = cli(tmp_path / ("x" * 300) / "journal.sqlite3", "jobs")
    assert done.returncode == 1, done.stderr
    assert "cannot look at the journal path" in done.stderr and "Traceback" not in done.stderr
