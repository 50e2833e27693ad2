"""A journal that went back in time, under real Airflow (SPEC §13): ``airflow dags test``, a SIGKILLed
try, the journal restored from a file-level backup, then a Clear.

200 items to a receiver that counts every delivery per idempotency key (no dedupe); the backup is taken
while item 82's mark is committed and its send not yet made; the runner is SIGKILLed before item 151
(150 delivered). On Airflow >= 3.3 the high-water mark in the task state store refuses the Clear, and
``[resumable] on_journal_behind = verify`` completes it with nothing sent twice and nothing lost. Before
3.3 there is no task state store: the check is off, and the task log says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from airflow_resumable._compat import airflow_version
from airflow_resumable.journal import StepJournal
from tests.airflow_layer.test_airflow_layer import arm, output, receiver
from tests.airflow_layer.test_metrics_and_link import StatsdSink, metrics_env
from tests.support import airflow_server

pytestmark = [pytest.mark.airflow, pytest.mark.compat]

DAG_ID = "journal_behind"
ITEMS = [f"item-{i:03d}" for i in range(1, 201)]


def restore_backup(journal: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{journal}{suffix}").unlink(missing_ok=True)
        backup = Path(f"{journal}.backup{suffix}")
        if backup.exists():
            shutil.copyfile(backup, f"{journal}{suffix}")
    journal.chmod(0o600)


def cli(airflow, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "airflow_resumable.cli", *args], env=airflow.env,
                          capture_output=True, text=True, timeout=120)


def page_says_behind(airflow, job_id: str, stored: int) -> None:
    """The Resumable jobs page, served by a real API server on this Airflow home, says the job is refused."""
    port = airflow_server.free_port()
    env = airflow_server.server_env(airflow.env, airflow.home, port)
    server = airflow_server.start(["api-server", "--port", str(port), "--host", "127.0.0.1", "--workers", "1"], env,
                                  f"http://127.0.0.1:{port}", airflow.home / "api-server.log")
    try:
        token = airflow_server.token(server.url)
        detail = airflow_server.api(f"{server.url}/resumable/api/jobs/{quote(job_id, safe='')}", token)
        assert detail["high_water"]["journal_marks"] == 82, detail["high_water"]
        (behind,) = detail["high_water"]["behind"]
        assert (behind["marks"], behind["task_id"]) == (stored, "send")
        status, _, page = airflow_server.get(f"{server.url}/resumable/jobs/{quote(job_id, safe='')}", bearer=token,
                                             accept="text/html")
        assert status == 200 and "The journal is behind." in page and f"recorded {stored}" in page, page[-3000:]
    finally:
        server.stop()


def clear_and_rerun(airflow, run_id: str, *, after_a_kill: bool = False):
    # A task instance whose runner was SIGKILLed still reads "running" (no supervisor watched it under
    # `dags test`): a Clear makes it "restarting", a second one clears it for the next try.
    for _ in range(2 if after_a_kill else 1):
        assert airflow.run("tasks", "clear", DAG_ID, "-t", "send", "-y").returncode == 0, output(airflow)
    return airflow.rerun(DAG_ID, run_id)


@pytest.fixture
def statsd_sink():
    sink = StatsdSink()
    yield sink
    sink.close()


@pytest.mark.parametrize("how", ["files", "api", "live"])
def test_a_restored_journal_is_refused_then_verify_completes_with_nothing_sent_twice(airflow, statsd_sink, how):
    """``how`` the backup was taken: the file, -wal and -shm copied; SQLite's online backup API; the files
    copied while the runner went on. The page and the CLI are looked at once (``files``)."""
    metrics_env(airflow, statsd_sink.port)
    arm(airflow, "item-082", f"back_up_journal_{how}")
    arm(airflow, "item-151", "sigkill")
    first = airflow.dags_test(DAG_ID)
    assert first.returncode != 0, "the try was to be SIGKILLed"
    run_id = airflow.last_run_id(DAG_ID)
    delivered = receiver(airflow).counts()
    assert sorted(delivered) == ITEMS[:150] and set(delivered.values()) == {1}
    restore_backup(airflow.journal)
    with StepJournal(airflow.journal) as journal:
        (job,) = journal.jobs()
        kept = journal.marks(job.job_id)
    # Items 1-82 marked, 1-81 done: the backup's moment (a copy made beside the run may end a little later).
    assert (kept == 82) if how != "live" else (82 <= kept < 150), kept

    behind = clear_and_rerun(airflow, run_id, after_a_kill=True)
    log = output(airflow)
    if airflow_version() < (3, 3):
        # No task state store: nothing outside the journal remembers, and the task log says so.
        assert "High-water mark off" in log and "Airflow >= 3.3" in log, log[-3000:]
        assert behind.returncode == 0, log[-5000:]
        assert receiver(airflow).duplicates() > 0  # what the check prevents on 3.3
        return
    assert behind.returncode != 0, log[-5000:]
    assert "JournalBehindError" in log and "is behind" in log and f"{kept} IN_FLIGHT mark(s)" in log, log[-5000:]
    assert "on_journal_behind='verify'" in log
    assert receiver(airflow).counts() == delivered  # nothing sent
    assert statsd_sink.counters("airflow.resumable.")["journal_behind"] == [1]
    # The CLI shows both counts (the mark read from Airflow's metadata database); so does the page.
    shown = cli(airflow, "marks", job.job_id)
    assert shown.returncode == 0, shown.stderr
    assert f"job {job.job_id}: {kept} IN_FLIGHT mark(s) in the journal" in shown.stdout, shown.stdout
    assert f"high-water mark of {DAG_ID}.send" in shown.stdout and "the journal is BEHIND" in shown.stdout
    (stored,) = json.loads(cli(airflow, "--json", "marks", job.job_id).stdout)["stored"]
    assert stored["marks"] > kept and stored["journal_behind"] and stored["task_id"] == "send"
    if how == "files":
        page_says_behind(airflow, job.job_id, stored["marks"])

    airflow.env["AIRFLOW__RESUMABLE__ON_JOURNAL_BEHIND"] = "verify"  # on-call's switch, no DAG edit
    settled = clear_and_rerun(airflow, run_id)
    log = output(airflow)
    assert settled.returncode == 0, log[-5000:]
    counts = receiver(airflow).counts()
    assert sorted(counts) == ITEMS and set(counts.values()) == {1}, "a duplicate or a lost item"
    summary = airflow.xcom(DAG_ID, "send", key="resumable_summary", run_id=run_id)
    # Items 83-150: delivered, forgotten by the restored journal, found at the receiver instead of sent.
    assert summary["verified_steps"] >= 150 - kept and summary["status"] == "completed", summary

    assert "ok: the journal has every mark recorded" in cli(airflow, "marks", job.job_id).stdout
    # Re-based: a Clear without the switch is not refused and sends nothing.
    del airflow.env["AIRFLOW__RESUMABLE__ON_JOURNAL_BEHIND"]
    again = clear_and_rerun(airflow, run_id)
    assert again.returncode == 0, output(airflow)[-5000:]
    assert receiver(airflow).counts() == counts


def test_a_later_pass_whose_journal_went_back_after_the_batch_task_is_refused(airflow):
    """The second pass (batch_task_id) has no mark of its own yet: it starts from the count the batch
    task's summary recorded (200 marks), and the journal restored between the passes (82) is refused."""
    dag_id = "journal_behind_two_passes"
    arm(airflow, "item-082", "back_up_journal_files")
    done = airflow.dags_test(dag_id)
    log = output(airflow)
    counts = receiver(airflow).counts()
    states = airflow.task_states(dag_id)
    assert states[("send", -1)][0] == "success" and states[("restore_journal", -1)][0] == "success", states
    if airflow_version() < (3, 3):
        assert "High-water mark off" in log and done.returncode == 0, log[-5000:]
        assert receiver(airflow).duplicates() > 0  # what the check prevents on 3.3
        return
    assert done.returncode != 0 and states[("second_pass", -1)][0] == "failed", states
    assert "JournalBehindError" in log and "82 IN_FLIGHT mark(s), but 200 were recorded" in log, log[-5000:]
    assert "task send (its summary)" in log
    assert sorted(counts) == ITEMS and set(counts.values()) == {1}  # the second pass sent nothing


@pytest.fixture
def primary_and_standby():
    """Two real clusters: a primary and its asynchronous streaming standby (``pg_basebackup -R``)."""
    import os

    from tests.support.postgres_server import HOW_TO_ENABLE, PostgresCluster, server_bindir

    bindir = server_bindir()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the PostgreSQL tests. " + HOW_TO_ENABLE)
        pytest.skip(HOW_TO_ENABLE)
    primary = PostgresCluster(bindir)
    standby = None
    try:
        database = primary.new_database().rsplit("/", 1)[1]
        standby = PostgresCluster.standby_of(primary)
        yield primary, standby, database
    finally:
        for cluster in (standby, primary):
            if cluster is not None:
                cluster.destroy()


@pytest.mark.postgres_server
def test_a_promoted_asynchronous_standby_is_refused_then_verify_completes_with_nothing_sent_twice(
    airflow, primary_and_standby
):
    from tests.airflow_layer.test_airflow_shared_journal import connection, use_shared_journal

    primary, standby, database = primary_and_standby
    use_shared_journal(airflow, primary.url(database))
    airflow.env["RESUMABLE_TEST_PRIMARY_URL"] = primary.url(database)
    airflow.env["RESUMABLE_TEST_STANDBY_URL"] = standby.url(database)
    dag_id = "journal_behind_shared"
    arm(airflow, "item-082", "cut_off_standby")
    arm(airflow, "item-151", "sigkill")
    assert airflow.dags_test(dag_id).returncode != 0, "the try was to be SIGKILLed"
    log = output(airflow)
    assert "streams to 1 standby(s) asynchronously" in log and "synchronous_standby_names" in log, log[-5000:]
    run_id = airflow.last_run_id(dag_id)
    delivered = receiver(airflow).counts()
    assert sorted(delivered) == ITEMS[:150] and set(delivered.values()) == {1}

    primary.kill()  # the primary is lost; the standby, cut off at item 82, is promoted
    standby.promote()
    airflow.env["AIRFLOW_CONN_RESUMABLE_JOURNAL"] = connection(standby.url(database))
    with StepJournal(standby.url(database)) as journal:
        (job,) = journal.jobs()
        assert journal.marks(job.job_id) == 82

    def clear_and_rerun_shared(*, after_a_kill: bool = False):
        for _ in range(2 if after_a_kill else 1):
            assert airflow.run("tasks", "clear", dag_id, "-t", "send", "-y").returncode == 0, output(airflow)
        return airflow.rerun(dag_id, run_id)

    refused = clear_and_rerun_shared(after_a_kill=True)
    log = output(airflow)
    if airflow_version() < (3, 3):
        assert "High-water mark off" in log and refused.returncode == 0, log[-5000:]
        assert receiver(airflow).duplicates() > 0  # what the check prevents on 3.3
        return
    assert refused.returncode != 0 and "JournalBehindError" in log and "82 IN_FLIGHT mark(s)" in log, log[-5000:]
    assert receiver(airflow).counts() == delivered  # nothing sent

    airflow.env["AIRFLOW__RESUMABLE__ON_JOURNAL_BEHIND"] = "verify"
    assert clear_and_rerun_shared().returncode == 0, output(airflow)[-5000:]
    counts = receiver(airflow).counts()
    assert sorted(counts) == ITEMS and set(counts.values()) == {1}, "a duplicate or a lost item"


@pytest.mark.postgres_server
def test_a_promoted_synchronous_standby_has_every_mark_and_the_retry_goes_on_with_nothing_sent_twice(
    airflow, primary_and_standby
):
    """The table's last row: with synchronous replication a failover loses nothing; the retry is not
    refused, verifies the send that was in flight and finishes."""
    import psycopg

    from tests.airflow_layer.test_airflow_shared_journal import connection, use_shared_journal
    from tests.support.postgres_server import wait_until

    primary, standby, database = primary_and_standby
    with psycopg.connect(primary.url(database), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        conn.execute("SELECT pg_reload_conf()")
        assert wait_until(lambda: conn.execute(
            "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'").fetchone()[0] == 1, 60)
    use_shared_journal(airflow, primary.url(database))
    dag_id = "journal_behind_shared"
    arm(airflow, "item-151", "sigkill")
    assert airflow.dags_test(dag_id).returncode != 0, "the try was to be SIGKILLed"
    assert "asynchronously" not in output(airflow)
    run_id = airflow.last_run_id(dag_id)

    primary.kill()
    standby.promote()
    airflow.env["AIRFLOW_CONN_RESUMABLE_JOURNAL"] = connection(standby.url(database))
    for _ in range(2):  # the killed try's instance: "restarting", then cleared
        assert airflow.run("tasks", "clear", dag_id, "-t", "send", "-y").returncode == 0, output(airflow)
    retried = airflow.rerun(dag_id, run_id)
    log = output(airflow)
    assert retried.returncode == 0 and "JournalBehindError" not in log, log[-5000:]
    counts = receiver(airflow).counts()
    assert sorted(counts) == ITEMS and set(counts.values()) == {1}, "a duplicate or a lost item"


@pytest.mark.postgres_server
def test_an_asynchronous_standby_is_named_once_and_a_role_that_cannot_see_it_is_told_at_debug_level(
    primary_and_standby, caplog
):
    import logging

    import psycopg

    from tests.support.postgres_server import wait_until

    primary, _, database = primary_and_standby
    url = primary.url(database)
    with psycopg.connect(url, autocommit=True) as conn:
        assert wait_until(lambda: conn.execute("SELECT count(*) FROM pg_stat_replication").fetchone()[0] == 1, 60)
    caplog.set_level(logging.DEBUG, logger="airflow_resumable.journal.postgres")
    for _ in range(2):  # once per server and process
        with StepJournal(url):
            pass
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "streams to 1 standby(s) asynchronously" in warnings[0], warnings
    assert "synchronous_standby_names" in warnings[0]

    with psycopg.connect(url, autocommit=True) as conn:  # a role without pg_monitor: it sees no replication state
        conn.execute("CREATE ROLE plain LOGIN")
        conn.execute("GRANT USAGE ON SCHEMA resumable TO plain")
        conn.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA resumable TO plain")
    caplog.clear()
    with StepJournal(url.replace("postgres@", "plain@")):
        pass
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert any("may not read the replication state" in r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG)
