"""A failed step is recorded with the exception's type name only. A secret in
the exception's message must reach no byte of the journal: not the database file, not its -wal or
-shm, not the lock files - while the journal is open and after it is closed."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from airflow_resumable.journal import HeldReason, HeldStep, Status, StepJournal
from airflow_resumable.runner import Step, StepContext, run_batch

pytestmark = pytest.mark.core

SECRET = "sk_live_SECRET123"
JOB = "secrets/job"


class PaymentGatewayError(Exception):
    pass


def journal_bytes(path: Path) -> dict[str, bytes]:
    """Raw bytes of the journal, its -wal and -shm (those that exist) and its lock files."""
    found: dict[str, bytes] = {}
    for candidate in (path, Path(f"{path}-wal"), Path(f"{path}-shm")):
        if candidate.exists():
            found[candidate.name] = candidate.read_bytes()
    locks = Path(f"{path}.locks")
    if locks.is_dir():
        for lock in locks.iterdir():
            found[f"locks/{lock.name}"] = lock.read_bytes()
    return found


def leaks(files: dict[str, bytes], token: str) -> list[str]:
    needles = {token.encode("utf-8"), token.encode("utf-16-le"), token.encode("utf-16-be")}
    return [name for name, data in files.items() if any(n in data for n in needles)]


def steps(*, fail_in: str, secret: str = SECRET, leak_output: str | None = None) -> list[Step]:
    def validate(item: Mapping[str, Any], ctx: StepContext) -> dict[str, Any]:
        if fail_in == "validate" and item["id"] == "item-3":
            raise PaymentGatewayError(f"bad config: api_key={secret}")
        return {"ok": True} if leak_output is None else {"note": leak_output}

    def notify(item: Mapping[str, Any], ctx: StepContext) -> str:
        if fail_in == "notify" and item["id"] == "item-3":
            raise PaymentGatewayError(
                f"POST https://api.example.test/v1/charges?key={secret} failed: 401 "
                f"(Authorization: Bearer {secret}) for {item['to']}"
            )
        return f"rcpt-{ctx.item_id}"

    def verify(ctx: StepContext) -> str | None:
        raise PaymentGatewayError(f"lookup refused for token {secret}")

    return [Step("validate", validate), Step("notify", notify, side_effect=True, verify=verify)]


ITEMS = [{"id": f"item-{n}", "to": f"user{n}@example.test"} for n in range(1, 6)]


@pytest.mark.parametrize("fail_in", ["notify", "validate"])
@pytest.mark.parametrize("durability", ["full", "normal"])
def test_secret_in_an_exception_message_is_never_written(tmp_path, caplog, fail_in, durability):
    path = tmp_path / "journal.sqlite3"
    caplog.set_level(logging.DEBUG)
    journal = StepJournal(path, durability=durability)
    try:
        with pytest.raises(PaymentGatewayError) as info:
            run_batch(journal, JOB, ITEMS, steps(fail_in=fail_in), settle_in_task=False)
        assert SECRET in str(info.value)  # the caller (the Airflow task) still gets the real exception

        open_files = journal_bytes(path)
        assert {"journal.sqlite3", "journal.sqlite3-wal", "journal.sqlite3-shm"} <= set(open_files)
        assert len(open_files["journal.sqlite3-wal"]) > 0, "the records are in the WAL, not yet checkpointed"
        assert leaks(open_files, SECRET) == []
        # The error type did reach the file: the scan looks at the bytes the records are in.
        assert b"PaymentGatewayError" in open_files["journal.sqlite3-wal"]

        failed = {r.step: r for r in journal.rows(JOB, "item-3")}[fail_in]
        assert failed.status == Status.FAILED
        assert failed.error_type == "PaymentGatewayError"  # the type name, and only that
        assert failed.output is None and failed.receipt is None

        # The next run verifies the unknown-outcome send; verify raising (with the secret) holds it.
        if fail_in == "notify":
            second = run_batch(journal, JOB, ITEMS, steps(fail_in="none"), settle_in_task=False)
            assert second.held == [HeldStep(JOB, "item-3", "notify", HeldReason.UNKNOWN_OUTCOME)]
            assert leaks(journal_bytes(path), SECRET) == []
            journal.resolve(JOB, "item-3", "notify", delivered=False, resolved_by="oncall",
                            note="receiver says no such charge")
        third = run_batch(journal, JOB, ITEMS, steps(fail_in="none"), settle_in_task=False)
        assert third.status == "completed"
        assert leaks(journal_bytes(path), SECRET) == []
    finally:
        journal.close()

    closed_files = journal_bytes(path)
    assert "journal.sqlite3" in closed_files
    assert leaks(closed_files, SECRET) == []
    # Nor in our own logs (they end up in Airflow task logs).
    assert SECRET not in caplog.text
    assert "PaymentGatewayError" in caplog.text


def test_the_byte_scan_finds_a_token_that_was_written(tmp_path):
    """Control: the scan is able to fail. A step *output* is journaled, so a token in it is found."""
    path = tmp_path / "journal.sqlite3"
    canary = "canary_TOKEN_456"
    with StepJournal(path) as journal:
        run_batch(journal, JOB, ITEMS[:2], steps(fail_in="none", leak_output=canary), settle_in_task=False)
        assert "journal.sqlite3-wal" in leaks(journal_bytes(path), canary)
    assert leaks(journal_bytes(path), canary) == ["journal.sqlite3"]


# ------------------------------------------------------------------------------------- PostgreSQL


def postgres_bytes(postgres) -> dict[str, bytes]:
    """Every byte the PostgreSQL cluster keeps: its WAL and its data files (our own throwaway cluster)."""
    found: dict[str, bytes] = {}
    for file in sorted(Path(postgres.cluster.data).rglob("*")):
        if file.is_file() and file.name not in ("postmaster.pid",):
            found[str(file.relative_to(postgres.cluster.data))] = file.read_bytes()
    return found


@pytest.mark.parametrize("fail_in", ["notify", "validate"])
def test_secret_in_an_exception_message_never_reaches_a_postgres_journal(postgres, postgres_url, caplog, fail_in):
    if postgres.cluster is None:
        pytest.skip("the byte scan needs the test session's own cluster (RESUMABLE_TEST_POSTGRES_URL is set)")
    caplog.set_level(logging.DEBUG)
    with StepJournal(postgres_url) as journal:
        with pytest.raises(PaymentGatewayError) as info:
            run_batch(journal, JOB, ITEMS, steps(fail_in=fail_in), settle_in_task=False)
        assert SECRET in str(info.value)
        failed = {r.step: r for r in journal.rows(JOB, "item-3")}[fail_in]
        assert failed.status == Status.FAILED and failed.error_type == "PaymentGatewayError"
        if fail_in == "notify":
            second = run_batch(journal, JOB, ITEMS, steps(fail_in="none"), settle_in_task=False)
            assert second.held == [HeldStep(JOB, "item-3", "notify", HeldReason.UNKNOWN_OUTCOME)]
            journal.resolve(JOB, "item-3", "notify", delivered=False, resolved_by="oncall")
        assert run_batch(journal, JOB, ITEMS, steps(fail_in="none"), settle_in_task=False).status == "completed"
    # The WAL holds every value the journal ever wrote; the error type is there, the secret is not.
    written = postgres_bytes(postgres)
    assert any(b"PaymentGatewayError" in data for name, data in written.items() if name.startswith("pg_wal"))
    assert leaks(written, SECRET) == []
    assert SECRET not in caplog.text


def test_the_postgres_byte_scan_finds_a_token_that_was_written(postgres, postgres_url):
    """Control: a token in a step output is journaled, and the scan of the cluster's files finds it."""
    if postgres.cluster is None:
        pytest.skip("the byte scan needs the test session's own cluster (RESUMABLE_TEST_POSTGRES_URL is set)")
    canary = f"canary_PG_{os.getpid()}_789"
    with StepJournal(postgres_url) as journal:
        run_batch(journal, JOB, ITEMS[:2], steps(fail_in="none", leak_output=canary), settle_in_task=False)
    assert any(name.startswith("pg_wal") for name in leaks(postgres_bytes(postgres), canary))


def test_the_database_password_is_never_shown(postgres, postgres_url, caplog):
    """A journal URL carries a password: repr, location, errors and logs name the server, never the password."""
    from airflow_resumable.exceptions import JournalConnectionError
    from tests.support.postgres_server import free_port

    password = "pw_SECRET_777"
    caplog.set_level(logging.DEBUG)
    url = f"postgresql://someone:{password}@127.0.0.1:{free_port()}/nowhere"  # nothing listens there
    with pytest.raises(JournalConnectionError) as info:
        StepJournal(url, connect_timeout=2)
    assert password not in str(info.value) and "127.0.0.1" in str(info.value)
    context = info.value.__context__
    assert context is None or password not in str(context)
    # An open journal says where it is without the password.
    with_password = postgres_url.replace("postgresql://postgres@", f"postgresql://postgres:{password}@")
    with StepJournal(with_password) as journal:
        assert password not in repr(journal) and password not in journal.location
        assert "postgres@127.0.0.1" in journal.location
    assert password not in caplog.text
