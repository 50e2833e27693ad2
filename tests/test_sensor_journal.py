"""The sensor's journal is its own configuration's, never a path or a connection from XCom (XCom can be
written through the REST API): a crafted summary can neither choose a file nor point at another journal."""

from __future__ import annotations

import pytest

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, run_batch
from airflow_resumable.sensors.held_items import HeldItemSensor

JOB = "dag/send/run-1"


class CraftedTI:
    def __init__(self, summary: dict) -> None:
        self.summary = summary

    def xcom_pull(self, task_ids: str, key: str) -> dict:
        return self.summary


@pytest.fixture
def journal_path(tmp_path, monkeypatch):
    path = tmp_path / "worker" / "journal.sqlite3"
    monkeypatch.setenv("AIRFLOW__RESUMABLE__JOURNAL_PATH", str(path))
    monkeypatch.delenv("AIRFLOW__RESUMABLE__JOURNAL_CONN_ID", raising=False)
    with StepJournal(path) as journal:
        run_batch(journal, JOB, [{"id": "a"}], [Step("send", lambda item, ctx: "ok", side_effect=True)])
    return path


def test_a_path_in_the_summary_is_never_opened(tmp_path, journal_path):
    with StepJournal(journal_path) as journal:
        journal_id = journal.journal_id
    chosen = tmp_path / "chosen-by-xcom" / "created.sqlite3"
    sensor = HeldItemSensor(task_id="wait", batch_task_id="send")
    summary = {"job_id": JOB, "journal_path": str(chosen), "journal_id": journal_id}
    assert sensor.poke({"ti": CraftedTI(summary)}) is True  # read from the sensor's own journal
    assert not chosen.parent.exists()


def test_a_summary_naming_another_journal_is_refused(tmp_path, journal_path):
    chosen = tmp_path / "elsewhere" / "journal.sqlite3"
    sensor = HeldItemSensor(task_id="wait", batch_task_id="send")
    summary = {"job_id": JOB, "journal_path": str(chosen), "journal_id": "0" * 32}
    with pytest.raises(ValueError, match="another journal"):
        sensor.poke({"ti": CraftedTI(summary)})
    assert not chosen.parent.exists()
