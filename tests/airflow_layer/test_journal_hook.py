"""The journal through Airflow's hook: a connection of each kind the journal accepts (SQLite, Postgres)
opens it, a connection of another kind is refused with what to do, and the operators open it that way
inside a real ``airflow dags test``."""

from __future__ import annotations

import json
import os
import stat

import pytest

from airflow_resumable.exceptions import JournalConfigError
from airflow_resumable.hooks.journal import ResumableJournalHook
from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, run_batch
from tests.airflow_layer.test_airflow_layer import ALL_ITEMS, output
from tests.airflow_layer.test_airflow_shared_journal import connection
from tests.support.receivers import DurableReceiver

pytestmark = pytest.mark.compat

CONN_ID = "resumable_journal"


def sqlite_connection(path) -> str:
    """An Airflow SQLite connection (JSON, as AIRFLOW_CONN_<ID> takes it): the file's path in host."""
    return json.dumps({"conn_type": "sqlite", "host": str(path)})


def send_three(journal: StepJournal, job_id: str) -> list[str]:
    sent: list[str] = []
    result = run_batch(journal, job_id, [{"id": f"i{n}"} for n in range(3)],
                       [Step("notify", lambda item, ctx: sent.append(item["id"]) or "ok", side_effect=True)],
                       settle_in_task=False)
    assert result.status == "completed"
    return sent


def test_a_sqlite_connection_opens_a_journal_file_on_the_worker(tmp_path, monkeypatch):
    path = tmp_path / "journals" / "by-connection.sqlite3"
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", sqlite_connection(path))
    hook = ResumableJournalHook(CONN_ID, tmp_path / "ignored.sqlite3")  # the connection wins over a path
    assert not hook.exists()
    with hook.get_conn() as journal:
        assert journal.kind == "sqlite" and not hook.target.shared
        assert send_three(journal, "hook/sqlite") == ["i0", "i1", "i2"]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and not (tmp_path / "ignored.sqlite3").exists()
    assert CONN_ID in hook.target.display and str(path) in hook.target.display
    with StepJournal(path) as journal:  # the same file, by its path: the run is there, nothing sent again
        assert send_three(journal, "hook/sqlite") == []


def test_a_postgres_connection_opens_a_shared_journal(postgres_url, monkeypatch):
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", connection(postgres_url))
    hook = ResumableJournalHook(journal_conn_id=CONN_ID)
    assert hook.exists() and hook.target.shared and hook.target.display == f"connection {CONN_ID}"
    with hook.get_conn() as journal:
        assert journal.kind == "postgresql"
        assert send_three(journal, "hook/postgres") == ["i0", "i1", "i2"]
    with StepJournal(postgres_url) as journal:
        assert [j.job_id for j in journal.jobs()] == ["hook/postgres"]


@pytest.mark.parametrize(("conn", "message"), [
    ({"conn_type": "http", "host": "example.com"}, "is a 'http' connection; a journal needs a Postgres connection"),
    ({"conn_type": "sqlite"}, "has no host; set it to the journal file's path"),
    ({"conn_type": "postgres"}, "has no host; set the PostgreSQL server's host name"),
])
def test_a_connection_the_journal_cannot_use_is_refused_with_what_to_do(tmp_path, monkeypatch, conn, message):
    monkeypatch.setenv(f"AIRFLOW_CONN_{CONN_ID.upper()}", json.dumps(conn))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(JournalConfigError, match=message):
        ResumableJournalHook(CONN_ID).get_conn()
    assert list(tmp_path.iterdir()) == []  # nothing was created


def test_a_missing_connection_says_which_one(monkeypatch):
    monkeypatch.delenv("AIRFLOW_CONN_NO_SUCH_JOURNAL", raising=False)
    with pytest.raises(JournalConfigError, match="the journal connection 'no_such_journal' cannot be found"):
        ResumableJournalHook("no_such_journal").get_conn()


@pytest.mark.airflow
def test_the_operator_opens_its_journal_through_a_sqlite_connection(airflow, tmp_path):
    """The batch task, given journal_conn_id of a SQLite connection, journals to that file and nowhere
    else (the configured journal_path is never created)."""
    journal_file = tmp_path / "by-connection" / "journal.sqlite3"
    airflow.env[f"AIRFLOW_CONN_{CONN_ID.upper()}"] = sqlite_connection(journal_file)
    done = airflow.dags_test("article_shared_plain")
    assert done.returncode == 0, output(airflow)[-3000:]
    summary = airflow.xcom("article_shared_plain", "send")
    assert (summary["journal_kind"], summary["status"]) == ("sqlite", "completed")
    counts = DurableReceiver(airflow.receiver).counts()
    assert sorted(counts) == ALL_ITEMS and set(counts.values()) == {1}
    with StepJournal(journal_file) as journal:
        assert len(journal.rows(summary["job_id"])) == len(ALL_ITEMS) * 3  # validate, transform, notify
    assert not airflow.journal.exists(), "the configured journal_path must not be written"
