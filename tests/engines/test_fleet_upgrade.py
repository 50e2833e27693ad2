"""Upgrading a fleet that shares one journal: workers of the previous release (0.2.0, its wheel built
from its commit and run in a virtual environment of its own) and of this one, against one PostgreSQL
journal and one receiver that counts every delivery per idempotency key.

A worker of the new release never migrates a shared journal as a side effect of its task: it refuses
a journal of an older schema, naming ``airflow-resumable migrate``, and sends nothing, while the old
workers go on. After the explicit migration the new release resumes the old release's job without
sending anything twice, and the old release refuses the journal as too new, sending nothing.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from airflow_resumable.exceptions import JournalVersionError
from airflow_resumable.journal import SCHEMA_VERSION, StepJournal, migrate
from airflow_resumable.runner import Step, StepContext, idempotency_key, run_batch
from tests.support import backends
from tests.support.old_release import RELEASE, RELEASE_SCHEMA_VERSION, OldRelease, build, has_commit
from tests.support.receivers import DurableReceiver

JOB = "fleet/newsletter"
OTHER_JOB = "fleet/digest"  # another job of the same fleet, which a worker of the new release picks up
ITEMS = [{"id": f"reader-{n:02d}"} for n in range(10)]
CLI = Path(sys.executable).with_name("airflow-resumable")


@pytest.fixture(scope="session")
def old_release(postgres, tmp_path_factory) -> OldRelease:
    """The previous release, built and installed once per test session."""
    if not has_commit():
        if os.environ.get("CI"):
            pytest.fail(f"the fleet upgrade tests build {RELEASE} from this repository's history: clone it in full")
        pytest.skip(f"no git history holding release {RELEASE} (a shallow clone or a source tarball)")
    return build(tmp_path_factory.mktemp(f"release-{RELEASE}"))


@pytest.fixture
def receiver(tmp_path) -> DurableReceiver:
    return DurableReceiver(tmp_path / "receiver.sqlite3")


def new_release_steps(receiver: DurableReceiver) -> list[Step]:
    """The old workers' batch (tests/support/old_release.py's WORKER) as a worker of this release runs it."""

    def render(item: Mapping[str, Any], ctx: StepContext) -> str:
        return "Hello " + item["id"]

    def send(item: Mapping[str, Any], ctx: StepContext) -> str:
        return receiver.deliver(ctx.job_id, ctx.item_id, ctx.step, ctx.idempotency_key)

    return [Step("render", render), Step("send", send, side_effect=True)]


def deliveries_per_key(receiver: DurableReceiver) -> dict[str, int]:
    with sqlite3.connect(receiver.path) as conn:
        return dict(conn.execute("SELECT idempotency_key, count(*) FROM deliveries GROUP BY 1").fetchall())


def schema_version(url: str) -> int:
    ((value,),) = backends.execute(url, "SELECT value FROM meta WHERE key = 'schema_version'")
    return int(value)


def assert_new_release_refuses(url: str, receiver: DurableReceiver, job_id: str) -> None:
    """A worker of this release, as a task runs it, refuses the old journal: it names the command that
    migrates it, sends nothing and leaves the journal exactly as it was."""
    journal_before, delivered_before = backends.snapshot(url), deliveries_per_key(receiver)
    with pytest.raises(JournalVersionError) as refused:
        with StepJournal(url) as journal:
            run_batch(journal, job_id, ITEMS, new_release_steps(receiver), settle_in_task=False)
    message = str(refused.value)
    assert "airflow-resumable migrate" in message and "Nothing was sent" in message, message
    assert f"schema version {RELEASE_SCHEMA_VERSION}" in message, message
    assert backends.snapshot(url) == journal_before
    assert deliveries_per_key(receiver) == delivered_before


def test_a_new_worker_refuses_the_old_journal_mid_run_and_the_old_workers_go_on(old_release, postgres_url, receiver):
    with old_release.start(postgres_url, JOB, receiver.path, items=ITEMS, pause_after=3, stop_after=5) as old:
        old.wait_until_paused()  # an old worker is part way through its job, its third send just made
        # The first upgraded worker takes another job of the fleet: it must not move the schema under the old one.
        assert_new_release_refuses(postgres_url, receiver, OTHER_JOB)
        first = old.go_on_and_finish()
    assert (first.version, first.outcome, first.sent) == (RELEASE, "stopped", 5)
    assert first.package.startswith(str(old_release.venv))  # the installed wheel, not this checkout
    # A worker of the old release that starts now still opens the journal and resumes the job.
    second = old_release.run(postgres_url, JOB, receiver.path, items=ITEMS, stop_after=2)
    assert (second.outcome, second.sent) == ("stopped", 2)
    assert schema_version(postgres_url) == RELEASE_SCHEMA_VERSION
    assert receiver.counts(JOB) == {item["id"]: 1 for item in ITEMS[:7]}
    assert receiver.counts(OTHER_JOB) == {}


def migrate_with_the_function(url: str) -> None:
    assert migrate(url) == (RELEASE_SCHEMA_VERSION, SCHEMA_VERSION)
    assert migrate(url) == (SCHEMA_VERSION, SCHEMA_VERSION)  # once is enough; again changes nothing


def migrate_with_the_command(url: str) -> None:
    def command(*args: str) -> str:
        done = subprocess.run([str(CLI), "--journal", url, *args, "migrate"], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    reported = json.loads(command("--json"))
    assert (reported["found"], reported["version"]) == (RELEASE_SCHEMA_VERSION, SCHEMA_VERSION), reported
    assert f"already at schema version {SCHEMA_VERSION}" in command()


@pytest.mark.parametrize("migrate_journal", [migrate_with_the_function, migrate_with_the_command],
                         ids=["migrate-function", "migrate-command"])
def test_after_migrate_the_new_release_resumes_the_old_job_sending_nothing_twice_and_the_old_release_refuses(
    old_release, postgres_url, receiver, migrate_journal
):
    stopped = old_release.run(postgres_url, JOB, receiver.path, items=ITEMS, stop_after=6)
    assert (stopped.outcome, stopped.sent) == ("stopped", 6)
    assert_new_release_refuses(postgres_url, receiver, JOB)

    migrate_journal(postgres_url)
    assert schema_version(postgres_url) == SCHEMA_VERSION
    backends.assert_counts_exact(postgres_url)  # the migration counted the old release's rows
    with StepJournal(postgres_url) as journal:
        job = journal.job(JOB)
        assert (dict(job.counts), job.items, job.held, job.unresolved, job.status) == (
            {"IN_FLIGHT": 0, "SUCCEEDED": 12, "FAILED": 0}, 6, 0, 0, "unfinished")
        assert journal.marks(JOB) == 0  # schema 9 counts marks from the migration on
        result = run_batch(journal, JOB, ITEMS, new_release_steps(receiver), settle_in_task=False)
        assert (result.status, result.executed_steps, result.skipped_steps) == ("completed", 8, 12)
        assert journal.marks(JOB) == 4  # the four sends this release made
        job = journal.job(JOB)
        assert (dict(job.counts), job.items, job.held, job.unresolved, job.status) == (
            {"IN_FLIGHT": 0, "SUCCEEDED": 20, "FAILED": 0}, 10, 0, 0, "completed")
    backends.assert_counts_exact(postgres_url)
    # One delivery per item, under the key the old release used for it.
    assert deliveries_per_key(receiver) == {idempotency_key(JOB, item["id"], "send"): 1 for item in ITEMS}

    journal_before = backends.snapshot(postgres_url)
    refused = old_release.run(postgres_url, JOB, receiver.path, items=ITEMS)
    assert (refused.version, refused.outcome, refused.sent) == (RELEASE, "refused", 0)
    assert f"schema version {SCHEMA_VERSION}" in refused.message and "newer release" in refused.message
    assert backends.snapshot(postgres_url) == journal_before
    assert receiver.counts(JOB) == {item["id"]: 1 for item in ITEMS}
