"""A shared journal on PostgreSQL inside real Airflow: nothing of the job is on the worker's disk.

The article's 50 items run with ``journal_conn_id`` (an Airflow Postgres connection from the
environment, as a secrets backend would give it) while ``[resumable] journal_path`` points at a
folder that does not exist. Try 1 fails at item 41 (the receiver refused it); try 2 resumes from
PostgreSQL and holds item 41 (its outcome is unknown, no verify); the CLI on "another host" (no
journal file anywhere) and the Resumable jobs page's JSON see the job and the held item; the resolve
DAG settles it; the sensor sees the job settled; the second pass sends item 41 once.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from urllib.parse import quote

import pytest

from airflow_resumable.journal import StepJournal
from tests.airflow_layer.test_airflow_layer import ALL_ITEMS, arm, output, resolve, wait_for_held
from tests.support import airflow_server
from tests.support.airflow_harness import Airflow
from tests.support.receivers import DurableReceiver

pytestmark = pytest.mark.airflow
CONN_ID = "resumable_journal"


def connection(postgres_url: str) -> str:
    """An Airflow Postgres connection (JSON, as AIRFLOW_CONN_<ID> takes it) for the database of ``postgres_url``."""
    from psycopg.conninfo import conninfo_to_dict

    parts = conninfo_to_dict(postgres_url)
    return json.dumps({
        "conn_type": "postgres", "host": parts["host"], "port": int(parts["port"]), "login": parts["user"],
        "schema": parts["dbname"], "extra": {"connect_timeout": "10"},
    })


def use_shared_journal(airflow: Airflow, postgres_url: str) -> None:
    airflow.env[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = connection(postgres_url)
    airflow.env["AIRFLOW__RESUMABLE__JOURNAL_CONN_ID"] = CONN_ID  # the resolve DAG, the CLI and the page
    # No journal on this worker's disk: a path under a folder that does not exist (and must not appear).
    airflow.journal = airflow.home.parent / "no-such-folder" / "journal.sqlite3"
    airflow.env["AIRFLOW__RESUMABLE__JOURNAL_PATH"] = str(airflow.journal)


def cli(airflow: Airflow, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "airflow_resumable.cli", *args], env=airflow.env,
                          capture_output=True, text=True, timeout=120)


def test_retry_resumes_from_postgres_and_every_tool_sees_the_job(airflow, airflow_template, postgres_url, tmp_path):
    use_shared_journal(airflow, postgres_url)
    arm(airflow, "item-041", "before_accept")
    proc = airflow.popen("dags", "test", "article_shared")
    try:
        job_id = wait_for_held(postgres_url, proc, timeout=180)
        time.sleep(2)  # the sensor pokes and reschedules while item 41 is held
        assert proc.poll() is None, "the sensor must wait while item 41 is held"

        # The CLI reads the shared journal through the Airflow connection; no file is involved.
        listed = cli(airflow, "--json", "held")
        assert listed.returncode == 0, listed.stderr
        assert [(h["job_id"], h["item_id"], h["reason"]) for h in json.loads(listed.stdout)] == [
            (job_id, "item-041", "unknown_outcome")]
        by_url = cli(airflow, "--journal", postgres_url, "--json", "jobs")
        assert by_url.returncode == 0 and json.loads(by_url.stdout)[0]["job_id"] == job_id, by_url.stderr

        # The Resumable jobs page on an API server of its own (no journal file on its host either).
        # Another host: its own AIRFLOW_HOME (a SQLite metadata DB shared with the running `dags test`
        # would lock it out: real deployments share a PostgreSQL metadata DB instead), the same
        # [resumable] config and Airflow connection, and no journal file.
        shared = {k: v for k, v in airflow.env.items() if k.startswith(("AIRFLOW__RESUMABLE__", "AIRFLOW_CONN_"))}
        server = airflow_server.api_server(airflow_template, tmp_path / "api-host", shared)
        try:
            token = airflow_server.token(server.url)
            request = urllib.request.Request(f"{server.url}/resumable/api/jobs/{quote(job_id, safe='')}",
                                             headers={"Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=60) as response:
                page = json.loads(response.read())
        finally:
            server.stop()
        assert page["job"]["job_id"] == job_id, page
        assert [(r["item_id"], r["step"]) for r in page["open_rows"]] == [("item-041", "notify_external")], page

        # The resolve DAG settles item 41 on the shared journal; the sensor lets the second pass run.
        assert resolve(airflow, job_id=job_id, item_id="item-041", step="notify_external",
                       decision="not_delivered", note="receiver has no record").returncode == 0, output(airflow)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-5000:]
    states = airflow.task_states("article_shared")
    # Try 1 failed at item 41 (the receiver refused it); try 2 resumed and held it.
    assert states[("send", -1)] == ("success", 2)
    assert {k[0]: v[0] for k, v in states.items()} == {
        "send": "success", "wait_for_resolution": "success", "second_pass": "success"}
    summary = airflow.xcom("article_shared", "send")
    assert summary["journal_kind"] == "postgresql" and summary["journal_path"] is None
    assert (summary["executed_steps"], summary["skipped_steps"], summary["status"]) == (27, 122, "needs_review")
    second = airflow.xcom("article_shared", "second_pass")
    assert (second["job_id"], second["executed_steps"], second["status"]) == (job_id, 1, "completed")
    counts = DurableReceiver(airflow.receiver).counts()
    assert sorted(counts) == ALL_ITEMS and set(counts.values()) == {1}
    with StepJournal(postgres_url) as journal:
        (audit,) = journal.resolutions(job_id)
        assert (audit.decision, audit.resolved_by) == ("not_delivered", "dag_test")
        assert journal.job(job_id).settled
    assert not airflow.journal.parent.exists(), "nothing may be written to the worker's local journal path"


def test_a_retry_configured_with_another_shared_journal_is_refused_and_sends_nothing(airflow, postgres, postgres_url):
    """Any worker may resume from the shared journal, but not from a *different* one: the journal's
    identity recorded in task_state_store refuses a retry whose connection names another database."""
    use_shared_journal(airflow, postgres_url)
    other = postgres.new_database()
    airflow.env["RESUMABLE_TEST_OTHER_JOURNAL_CONN"] = connection(other)
    arm(airflow, "item-011", "switch_journal")
    assert airflow.dags_test("article_shared_plain").returncode != 0
    log = output(airflow)
    assert airflow.task_states("article_shared_plain") == {("send", -1): ("failed", 2)}
    assert "this job's journal is the shared journal" in log and "Nothing was sent" in log, log[-3000:]
    counts = DurableReceiver(airflow.receiver).counts()
    assert sorted(counts) == ALL_ITEMS[:10] and set(counts.values()) == {1}
    with StepJournal(other) as journal:
        assert journal.jobs() == []  # the retry wrote nothing to the other journal
