"""The sensor's journal is its own configuration's, never a path or a connection from XCom (XCom can be
written through the REST API): a crafted summary can neither choose a file nor point at another journal."""

from __future__ import annotations

import pytest

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, run_batch
from airflow_resumable.sensors.held_items import HeldItemSensor
from tests.scenario import held_job

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


# ------------------------------------------------------------------ deferrable: shared journal only


def test_deferrable_on_a_local_journal_is_refused_and_changes_nothing(journal_path):
    from tests.backends import snapshot

    before = snapshot(str(journal_path))
    sensor = HeldItemSensor(task_id="wait", job_id=JOB, deferrable=True)
    with pytest.raises(ValueError, match="deferrable=True needs a shared journal .*triggerer cannot read"):
        sensor.execute({"ti": CraftedTI({})})
    assert snapshot(str(journal_path)) == before


def test_deferrable_with_verify_is_refused_when_the_dag_is_parsed():
    with pytest.raises(ValueError, match="verify= asks the receiver from a worker"):
        HeldItemSensor(task_id="wait", job_id=JOB, deferrable=True, verify=lambda ctx: None)


def test_trigger_waits_until_the_held_send_is_settled(postgres_url, monkeypatch):
    import asyncio
    import threading

    from airflow_resumable.triggers.held_items import HeldItemTrigger
    from tests.test_airflow_shared_journal import connection

    monkeypatch.setenv("AIRFLOW_CONN_SHARED_JOURNAL", connection(postgres_url))
    journal_id = held_job(postgres_url, JOB)
    classpath, kwargs = HeldItemTrigger(job_id=JOB, journal_conn_id="shared_journal", journal_id=journal_id,
                                        poll_interval=0.2).serialize()
    assert "postgresql://" not in str(kwargs)  # trigger arguments land in the metadata DB: no URL, no password
    trigger = HeldItemTrigger(**kwargs)

    def settle_later() -> None:
        import time

        time.sleep(1.0)
        with StepJournal(postgres_url) as journal:
            journal.resolve(JOB, "a", "send", delivered=True, receipt="r-1", resolved_by="on-call")

    async def first_event():
        return await asyncio.wait_for(trigger.run().__anext__(), timeout=60)

    settler = threading.Thread(target=settle_later)
    settler.start()
    try:
        event = asyncio.run(first_event())
    finally:
        settler.join()
    assert classpath == "airflow_resumable.triggers.held_items.HeldItemTrigger"
    assert event.payload == {"status": "settled", "job_id": JOB}


def test_trigger_refuses_a_connection_that_now_reaches_another_journal(postgres, postgres_url, monkeypatch):
    import asyncio

    from airflow_resumable.triggers.held_items import HeldItemTrigger
    from tests.test_airflow_shared_journal import connection

    journal_id = held_job(postgres_url, JOB)
    monkeypatch.setenv("AIRFLOW_CONN_SHARED_JOURNAL", connection(postgres.new_database()))
    trigger = HeldItemTrigger(job_id=JOB, journal_conn_id="shared_journal", journal_id=journal_id, poll_interval=0.2)
    event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), timeout=60))
    assert event.payload["status"] == "error" and "another journal" in event.payload["message"]
