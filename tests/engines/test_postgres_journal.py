"""What only the PostgreSQL engine has: its schema (versioned, its own, append-only audit), its
synchronous commits, its session claims and what happens when that session is lost.

Everything the two engines share (the contract: runner, bad input, resolutions, prune, crash
matrix, property test) runs on both through the ``journal_location`` fixture elsewhere.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import psycopg
import pytest

from airflow_resumable.exceptions import JournalConnectionError, JournalCorruptError, JournalVersionError
from airflow_resumable.journal import (
    SCHEMA_VERSION,
    HeldReason,
    HeldStep,
    JournalLocationError,
    Status,
    StepJournal,
    migrate,
)
from airflow_resumable.runner import Step, StepContext, run_batch
from tests.support import backends
from tests.support.backends import snapshot
from tests.support.scenario import held_job

pytestmark = pytest.mark.core

JOB = "pg/job"


def items(n: int) -> list[dict[str, Any]]:
    return [{"id": f"item-{i:03d}", "n": i} for i in range(1, n + 1)]


def sending(sent: list[str], hook=None) -> list[Step]:
    def transform(item: Mapping[str, Any], ctx: StepContext) -> int:
        return int(item["n"]) * 2

    def send(item: Mapping[str, Any], ctx: StepContext) -> str:
        if hook is not None:
            hook(ctx)
        sent.append(ctx.item_id)
        return f"rcpt-{ctx.item_id}"

    return [Step("transform", transform), Step("send", send, side_effect=True)]


def admin(url: str) -> psycopg.Connection:
    return psycopg.connect(url, autocommit=True)


# ------------------------------------------------------------------------------------ the schema


def test_tables_live_in_their_own_versioned_schema(postgres_url):
    with StepJournal(postgres_url) as journal:
        assert journal.kind == "postgresql" and len(journal.journal_id) == 32
        journal_id = journal.journal_id
    with admin(postgres_url) as conn:
        tables = {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'resumable'")}
        assert tables == {"steps", "jobs", "resolutions", "meta", "compacted", "step_sets"}
        assert conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()[0] == 0
        version = conn.execute("SELECT value FROM resumable.meta WHERE key = 'schema_version'").fetchone()[0]
        assert int(version) == SCHEMA_VERSION
    with StepJournal(postgres_url) as again:
        assert again.journal_id == journal_id  # stable across opens


def test_two_schemas_in_one_database_are_two_journals(postgres_url):
    sent: list[str] = []
    with StepJournal(postgres_url, schema="team_a") as a, StepJournal(postgres_url, schema="team_b") as b:
        assert a.journal_id != b.journal_id
        run_batch(a, JOB, items(3), sending(sent), settle_in_task=False)
        assert b.jobs() == [] and [j.job_id for j in a.jobs()] == [JOB]
        # The same job id in the other journal is another job (and not blocked by the first's claim).
        with a.open_job("shared-name"), b.open_job("shared-name"):
            pass


@pytest.mark.parametrize("schema", ["Bad-Name", "x; DROP TABLE y", "", "a" * 64, "public.x"])
def test_a_schema_name_that_is_not_plain_is_refused_and_nothing_is_created(postgres_url, schema):
    with pytest.raises(JournalLocationError, match="schema"):
        StepJournal(postgres_url, schema=schema)
    with admin(postgres_url) as conn:
        assert conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname NOT LIKE 'pg_%' "
                            "AND nspname NOT IN ('public', 'information_schema')").fetchone()[0] == 0


def test_a_newer_schema_version_is_refused_and_left_alone(postgres_url):
    with StepJournal(postgres_url) as journal:
        run_batch(journal, JOB, items(2), sending([]), settle_in_task=False)
    with admin(postgres_url) as conn:
        conn.execute("UPDATE resumable.meta SET value = %s WHERE key = 'schema_version'", (str(SCHEMA_VERSION + 1),))
    before = snapshot(postgres_url)
    with pytest.raises(JournalVersionError, match="newer release"):
        StepJournal(postgres_url)
    assert snapshot(postgres_url) == before


def test_a_version_3_journal_is_migrated_and_its_jobs_count_as_finished(postgres_url):
    """Version 4 added jobs.finished_at (unfinished: a run stopped or died part way)."""
    with StepJournal(postgres_url) as journal:
        run_batch(journal, JOB, items(2), sending([]), settle_in_task=False)
    backends.postgres_downgrade_to_6(postgres_url)
    with admin(postgres_url) as conn:  # back to what a version 3 journal looks like
        conn.execute("ALTER TABLE resumable.jobs DROP COLUMN finished_at, DROP COLUMN dag_id")
        conn.execute("ALTER TABLE resumable.steps DROP COLUMN generation, DROP COLUMN not_sent, DROP COLUMN version")
        conn.execute("UPDATE resumable.meta SET value = '3' WHERE key = 'schema_version'")
    assert migrate(postgres_url) == (3, SCHEMA_VERSION)
    with StepJournal(postgres_url) as journal:
        (job,) = journal.jobs()
        assert job.status == "completed" and job.finished_at == job.updated_at
    with admin(postgres_url) as conn:
        assert conn.execute("SELECT value FROM resumable.meta WHERE key = 'schema_version'").fetchone()[0] == str(
            SCHEMA_VERSION)


def test_a_version_4_journal_is_migrated_and_keeps_its_keys(postgres_url):
    """Version 5 added steps.generation and steps.not_sent: existing rows are generation 0 (the keys
    earlier releases sent under) and not flagged, so a held send stays held."""
    with StepJournal(postgres_url) as journal:
        with journal.open_job(JOB) as run:
            run.mark_in_flight("a", "send", "d" * 64)
    backends.postgres_downgrade_to_6(postgres_url)
    with admin(postgres_url) as conn:  # back to what a version 4 journal looks like
        conn.execute("ALTER TABLE resumable.steps DROP COLUMN generation, DROP COLUMN not_sent, DROP COLUMN version")
        conn.execute("ALTER TABLE resumable.jobs DROP COLUMN dag_id")
        conn.execute("UPDATE resumable.meta SET value = '4' WHERE key = 'schema_version'")
    assert migrate(postgres_url) == (4, SCHEMA_VERSION)
    with StepJournal(postgres_url) as journal:
        (row,) = journal.rows(JOB)
        assert (row.status.value, row.generation, row.not_sent) == ("IN_FLIGHT", 0, False)
        assert journal.jobs()[0].unresolved == 1
    with admin(postgres_url) as conn:
        assert conn.execute("SELECT value FROM resumable.meta WHERE key = 'schema_version'").fetchone()[0] == str(
            SCHEMA_VERSION)
        with pytest.raises(Exception, match="not_sent"):
            conn.execute("UPDATE resumable.steps SET not_sent = 2")


def test_a_schema_that_holds_other_tables_is_refused_and_left_alone(postgres_url):
    with admin(postgres_url) as conn:
        conn.execute("CREATE SCHEMA resumable")
        conn.execute("CREATE TABLE resumable.orders (id int)")
    with pytest.raises(JournalCorruptError, match="no step journal"):
        StepJournal(postgres_url)
    with admin(postgres_url) as conn:
        assert [r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'resumable'")] == [
            "orders"]


def test_the_audit_log_refuses_update_delete_and_truncate(postgres_url):
    with StepJournal(postgres_url) as journal:
        with journal.open_job(JOB) as run:
            run.mark_in_flight("a", "send", "d" * 64)
        journal.resolve(JOB, "a", "send", delivered=False, resolved_by="alice", note="not there")
    before = snapshot(postgres_url)["resolutions"]
    with admin(postgres_url) as conn:
        for statement in ("UPDATE resumable.resolutions SET resolved_by = 'mallory'",
                          "DELETE FROM resumable.resolutions", "TRUNCATE resumable.resolutions"):
            with pytest.raises(psycopg.Error, match="append-only"):
                conn.execute(statement)
        # Appending is what it is for.
        conn.execute("""INSERT INTO resumable.resolutions (job_id, item_id, step, decision, resolved_by, resolved_at)
                        VALUES ('j', 'i', 's', 'note', 'ops', 0)""")
    after = snapshot(postgres_url)["resolutions"]
    assert after[: len(before)] == before or set(before) <= set(after)
    assert len(after) == 2


def test_a_read_only_role_can_read_a_journal(postgres_url):
    sent: list[str] = []
    with StepJournal(postgres_url) as journal:
        run_batch(journal, JOB, items(3), sending(sent), settle_in_task=False)
    with admin(postgres_url) as conn:
        conn.execute("CREATE ROLE page_reader LOGIN")
        conn.execute("GRANT USAGE ON SCHEMA resumable TO page_reader")
        conn.execute("GRANT SELECT ON ALL TABLES IN SCHEMA resumable TO page_reader")
    reader_url = postgres_url.replace("postgresql://postgres@", "postgresql://page_reader@")
    with StepJournal(reader_url) as journal:  # opening writes nothing: no privilege to write is needed
        (job,) = journal.jobs()
        assert (job.job_id, job.items, job.settled) == (JOB, 3, True)


# ----------------------------------------------------------------------------------- durability


def wal_syncs(url: str) -> int:
    with admin(url) as conn:
        return int(conn.execute("SELECT wal_sync FROM pg_stat_wal").fetchone()[0])


@pytest.mark.parametrize("durability", ["full", "normal"])
def test_marks_commit_synchronously_under_full_whatever_the_server_default(postgres, postgres_url, durability):
    if postgres.cluster is None:
        pytest.skip("counts the cluster's WAL fsyncs: needs the test session's own cluster")
    with admin(postgres_url) as conn:  # the server's default for this database: asynchronous commits
        dbname = conn.execute("SELECT current_database()").fetchone()[0]
        conn.execute(f'ALTER DATABASE "{dbname}" SET synchronous_commit = off')
    with StepJournal(postgres_url, durability=durability) as journal:
        run_batch(journal, "warm-up", items(1), sending([]),
                  settle_in_task=False)  # the schema's own (synchronous) DDL first
        before = wal_syncs(postgres_url)
        result = run_batch(journal, JOB, items(60), sending([]), settle_in_task=False)
        assert result.executed_steps == 120
        marks = journal.durable_commit_count
    syncs = wal_syncs(postgres_url) - before  # the journal's session is closed: its statistics are in
    if durability == "full":
        # One synchronous commit (a WAL fsync before COMMIT returns) for each of the 60 marks.
        assert marks >= 60 and syncs >= 60, (marks, syncs)
    else:
        # No commit waits for the WAL: only the background writer syncs it, a few times a second.
        assert marks == 0 and syncs < 30, (marks, syncs)


@pytest.mark.parametrize("concurrency", [1, 8])
def test_a_separate_connection_sees_the_send_in_flight_inside_the_send(journal_location, concurrency):
    """The IN_FLIGHT mark is committed before the send starts: another session sees it from inside the send."""
    seen: dict[str, str] = {}
    lock = threading.Lock()

    def look(ctx: StepContext) -> None:
        with StepJournal(journal_location) as other:  # another connection (and, on SQLite, another file handle)
            (row,) = [r for r in other.rows(ctx.job_id, ctx.item_id) if r.step == ctx.step]
        with lock:
            seen[ctx.item_id] = row.status.value

    with StepJournal(journal_location) as journal:
        run_batch(journal, JOB, items(12), sending([], hook=look), concurrency=concurrency, settle_in_task=False)
        assert {r.status for r in journal.rows(JOB)} == {Status.SUCCEEDED}
    assert seen == {f"item-{i:03d}": "IN_FLIGHT" for i in range(1, 13)}


# ----------------------------------------------------------------------------------- lost session


def test_a_runner_whose_session_is_terminated_starts_no_further_send(postgres_url):
    """The server ends the runner's session mid-batch (as a restart, a failover or an admin would):
    the claim ends with it. The runner stops with a clear error before its next mark; it never
    reconnects silently; the next run resumes and the send caught in the middle is held, not resent."""
    sent: list[str] = []
    journal = StepJournal(postgres_url)
    pid = journal.engine.read("SELECT pg_backend_pid()")[0][0]

    def terminate_at_item_5(ctx: StepContext) -> None:
        if ctx.item_id == "item-005":
            with admin(postgres_url) as conn:
                conn.execute("SELECT pg_terminate_backend(%s)", (pid,))

    try:
        with pytest.raises(JournalConnectionError, match="lost the connection") as info:
            run_batch(journal, JOB, items(20), sending(sent, hook=terminate_at_item_5), settle_in_task=False)
        assert "no further send was started" in str(info.value)
        assert sent == [f"item-{i:03d}" for i in range(1, 6)], "nothing was sent after the session ended"
        # The journal object stays unusable: no silent reconnect with a session that holds no claim.
        with pytest.raises(JournalConnectionError):
            journal.jobs()
    finally:
        journal.close()

    with StepJournal(postgres_url) as resumed:
        rows = {r.item_id: r.status for r in resumed.rows(JOB) if r.step == "send"}
        assert rows["item-005"] == Status.IN_FLIGHT  # delivered, but its receipt never committed
        result = run_batch(resumed, JOB, items(20), sending(sent), settle_in_task=False)
        assert result.held == [HeldStep(JOB, "item-005", "send", HeldReason.UNKNOWN_OUTCOME)]
        resumed.resolve(JOB, "item-005", "send", delivered=True, receipt="rcpt-item-005", resolved_by="oncall")
    assert sorted(sent) == [f"item-{i:03d}" for i in range(1, 21)] and len(set(sent)) == 20


def test_claim_timeout_is_checked(postgres_url):
    for bad in (0, 1, 4.9, -5, "30", True, 10_000):
        with pytest.raises(ValueError, match="claim_timeout"):
            StepJournal(postgres_url, claim_timeout=bad)


@pytest.mark.parametrize("location", ["mysql://user@host/db", "sqlite:///journal.db", "http://host/journal"])
def test_a_url_of_another_kind_is_refused_and_nothing_is_created(tmp_path, monkeypatch, location):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(JournalLocationError, match="not supported"):
        StepJournal(location)
    assert list(tmp_path.iterdir()) == []


def test_a_server_that_does_not_answer_is_a_clear_error_and_nothing_is_sent():
    from tests.support.postgres_server import free_port

    sent: list[str] = []
    with pytest.raises(JournalConnectionError, match="cannot connect") as info:
        with StepJournal(f"postgresql://nobody@127.0.0.1:{free_port()}/none", connect_timeout=2) as journal:
            run_batch(journal, JOB, items(2), sending(sent), settle_in_task=False)
    assert sent == [] and "nothing was sent" in str(info.value)


def test_a_refused_statement_is_not_a_lost_session_and_the_claim_is_given_back(postgres_url):
    """A lock timeout (the session is fine) fails the run with a plain JournalError; the claim is
    released at the end of the run, so the next runner gets the job at once."""
    from airflow_resumable.journal import JobBusyError, JournalError

    sent: list[str] = []
    blocker = admin(postgres_url)
    journal = StepJournal(postgres_url)
    journal.engine._conn.execute("SET lock_timeout = '300ms'")

    def block_the_journal_at_item_3(ctx: StepContext) -> None:
        if ctx.item_id == "item-003":
            blocker.execute("BEGIN")
            blocker.execute("LOCK TABLE resumable.steps IN ACCESS EXCLUSIVE MODE")

    try:
        with pytest.raises(JournalError) as info:
            run_batch(journal, JOB, items(10), sending(sent, hook=block_the_journal_at_item_3), settle_in_task=False)
        assert not isinstance(info.value, JournalConnectionError), info.value
        assert "refused a statement" in str(info.value)
        assert sent == ["item-001", "item-002", "item-003"]
        blocker.execute("ROLLBACK")
        with StepJournal(postgres_url) as other:
            with other.open_job(JOB):  # not JobBusyError: the failed run gave its claim back
                pass
        assert journal.jobs()  # the same journal object still works: its session was never lost
    except JobBusyError as exc:  # pragma: no cover - the failure this test exists for
        raise AssertionError(f"the claim was kept after a refused statement: {exc}") from None
    finally:
        journal.close()
        blocker.close()


def test_a_version_5_journal_is_migrated_and_its_held_rows_can_be_decided_on_what_was_seen(postgres_url):
    """Version 6 added steps.version (every existing row at its first version) and jobs.dag_id (unknown
    for jobs journaled before: settling them needs permission on all DAGs)."""
    held_job(postgres_url, JOB)
    backends.postgres_downgrade_to_6(postgres_url)
    with admin(postgres_url) as conn:  # back to what a version 5 journal looks like
        conn.execute("ALTER TABLE resumable.steps DROP COLUMN version")
        conn.execute("ALTER TABLE resumable.jobs DROP COLUMN dag_id")
        conn.execute("UPDATE resumable.meta SET value = '5' WHERE key = 'schema_version'")
    assert migrate(postgres_url) == (5, SCHEMA_VERSION)
    with StepJournal(postgres_url) as journal:
        (hold,) = journal.held(JOB)
        assert hold.version and journal.job(JOB).dag_id is None
        journal.resolve(JOB, "a", "send", delivered=False, resolved_by="alice", expected_version=hold.version)
    with admin(postgres_url) as conn:
        assert conn.execute("SELECT value FROM resumable.meta WHERE key = 'schema_version'").fetchone()[0] == str(
            SCHEMA_VERSION)


# ------------------------------------------------------------------ sessions the server would end


def test_a_database_that_ends_idle_sessions_does_not_end_a_running_jobs_claim(postgres_url):
    """Managed PostgreSQL often ends idle sessions (idle_session_timeout on the role or database). A
    runner's session is idle while a send is under way: ended, it took the job's claim with it, and a
    second run of the job was let in and sent the item again while the first send was still going."""
    from airflow_resumable.journal import JobBusyError

    with admin(postgres_url) as conn:
        database = conn.info.dbname
        conn.execute(f'ALTER DATABASE "{database}" SET idle_session_timeout = \'1s\'')
        conn.execute(f'ALTER DATABASE "{database}" SET idle_in_transaction_session_timeout = \'1s\'')
    sent: list[str] = []
    sending_now, second_tried = threading.Event(), threading.Event()

    def slow(ctx: StepContext) -> None:
        sending_now.set()
        second_tried.wait(60)  # the send is under way, and the runner's session idle, all along

    outcome: dict[str, Any] = {}

    def first() -> None:
        with StepJournal(postgres_url) as journal:
            outcome["first"] = run_batch(journal, JOB, items(1), sending(sent, slow), settle_in_task=False).status

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert sending_now.wait(60)
        threading.Event().wait(2.5)  # well past both timeouts
        with StepJournal(postgres_url) as journal, pytest.raises(JobBusyError, match="already running"):
            run_batch(journal, JOB, items(1), sending(sent), settle_in_task=False)
    finally:
        second_tried.set()
        thread.join(60)
    assert outcome == {"first": "completed"}
    assert sent == ["item-001"]


def test_the_counts_follow_a_hand_written_statement_whatever_its_sessions_search_path(postgres_url):
    """The counting functions named jobs and steps unqualified: a statement from a plain session failed
    ("relation jobs does not exist"), and one on another journal's steps from a session whose search_path
    named the first journal counted into the first journal's jobs. Schema 8 fixes their search_path."""
    from airflow_resumable.journal.schema import COUNTERS, recount_statement

    held_job(postgres_url, JOB)
    with StepJournal(postgres_url, schema="other") as other:
        run_batch(other, JOB, items(2), sending([]), settle_in_task=False)
    with admin(postgres_url) as conn:
        conn.execute("UPDATE resumable.steps SET held_reason = NULL WHERE job_id = %s", (JOB,))  # a plain session
        conn.execute("SET search_path = resumable")
        conn.execute("UPDATE other.steps SET status = 'FAILED', not_sent = 1 WHERE job_id = %s", (JOB,))
    for schema in ("resumable", "other"):
        kept = backends.execute(postgres_url, f"SELECT job_id, {', '.join(COUNTERS)} FROM jobs", schema=schema)
        counted = backends.execute(postgres_url, recount_statement(), schema=schema)
        assert sorted(kept) == sorted(counted), schema
    with StepJournal(postgres_url) as journal:
        assert journal.job(JOB).held == 0
    with StepJournal(postgres_url, schema="other") as other:
        summary = other.job(JOB)
        assert (summary.counts["FAILED"], summary.counts["SUCCEEDED"]) == (4, 0)
