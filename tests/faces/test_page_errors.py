"""A journal that fails while a page decides (locked by another writer past the busy timeout) answers
503 with what to do, never a bare 500; and nothing is applied."""

from __future__ import annotations

import sqlite3

import pytest
from fastapi import HTTPException

from airflow_resumable.journal import StepJournal
from airflow_resumable.plugins.journal_access import open_journal
from tests.support.backends import snapshot
from tests.support.scenario import held_job


def test_a_decision_on_a_journal_locked_past_the_busy_timeout_is_a_503_and_changes_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "journal.sqlite3")
    held_job(path, "j")
    with StepJournal(path) as journal:
        (held,) = journal.held("j")
    monkeypatch.setenv("AIRFLOW__RESUMABLE__JOURNAL_PATH", path)
    monkeypatch.delenv("AIRFLOW__RESUMABLE__JOURNAL_CONN_ID", raising=False)
    before = snapshot(path)
    other = sqlite3.connect(path, isolation_level=None)
    try:
        other.execute("BEGIN EXCLUSIVE")  # another writer holds the journal
        with pytest.raises(HTTPException) as info, open_journal(readonly=False) as page_journal:
            page_journal.engine._conn.execute("PRAGMA busy_timeout = 200")  # not the 30 s a worker waits
            page_journal.apply_decision("j", "a", "send", "not_delivered", resolved_by="alice",
                                        expected_version=held.version)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert info.value.status_code == 503
    assert info.value.detail.startswith("the journal failed (JournalError); reload and look again")
    assert snapshot(path) == before
