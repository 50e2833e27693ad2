"""The sensor's journal is its own configuration's, never a path or a connection from XCom (XCom can be
written through the REST API): a crafted summary can neither choose a file nor point at another journal.
Its verify asks the receiver and settles under the job's claim: while a run holds the job it is "not
settled yet", and no run can send a step between the sensor's question and its settlement."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import NOT_DELIVERED, Step, idempotency_key, run_batch
from airflow_resumable.sensors.held_items import HeldItemSensor
from tests.support.crash_child import EXIT_BUSY, EXIT_COMPLETED, ChildRun
from tests.support.crash_child import items as crash_child_items
from tests.support.receivers import DurableReceiver, RefusedBeforeAccept
from tests.support.scenario import FaultOnce, article_steps, held_job

pytestmark = pytest.mark.compat

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
        run_batch(journal, JOB, [{"id": "a"}], [Step("send", lambda item, ctx: "ok", side_effect=True)],
                  settle_in_task=False)
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
    from tests.support.backends import snapshot

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
    from tests.airflow_layer.test_airflow_shared_journal import connection

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
    from tests.airflow_layer.test_airflow_shared_journal import connection

    journal_id = held_job(postgres_url, JOB)
    monkeypatch.setenv("AIRFLOW_CONN_SHARED_JOURNAL", connection(postgres.new_database()))
    trigger = HeldItemTrigger(job_id=JOB, journal_conn_id="shared_journal", journal_id=journal_id, poll_interval=0.2)
    event = asyncio.run(asyncio.wait_for(trigger.run().__anext__(), timeout=60))
    assert event.payload["status"] == "error" and "another journal" in event.payload["message"]


# ------------------------------------------------------------------ verify under the job's claim, both engines


def journal_arguments(location: str, monkeypatch: pytest.MonkeyPatch, conn_id: str = "task_journal") -> dict:
    """A task's journal arguments for a test's journal: its file, or an Airflow connection (from the
    environment) to its PostgreSQL database. The task opens its own journal from them, as on a worker."""
    if location.startswith("postgresql"):
        from tests.airflow_layer.test_airflow_shared_journal import connection

        monkeypatch.setenv(f"AIRFLOW_CONN_{conn_id.upper()}", connection(location))
        return {"journal_conn_id": conn_id}
    return {"journal_path": location}


def test_sensor_verify_while_the_job_runs_is_not_settled_yet_not_an_error(journal_location, monkeypatch):
    held_job(journal_location, JOB)
    asked: list[str] = []

    def lookup(ctx):
        asked.append(ctx.idempotency_key)
        return NOT_DELIVERED

    sensor = HeldItemSensor(task_id="wait", job_id=JOB, verify=lookup, **journal_arguments(journal_location, monkeypatch))
    with StepJournal(journal_location) as other, other.open_job(JOB):  # a run of the job is under way
        assert sensor.poke({}) is False
    assert asked == []  # the receiver is not even asked while a run may be sending the step
    with StepJournal(journal_location) as journal:
        assert [h.item_id for h in journal.held(JOB)] == ["a"] and journal.resolutions(JOB) == []
    assert sensor.poke({}) is True  # the run is over: the receiver's answer settles it
    assert asked == [idempotency_key(JOB, "a", "send")]


def test_no_run_can_send_between_the_sensors_look_up_and_its_settlement(tmp_path, journal_location, monkeypatch):
    """The receiver's answer reaches the sensor late. Had a run sent the item in between, settling on
    that answer ("not delivered") would send it again; the look-up and the settlement happen under the
    job's claim, so a run started meanwhile (another process) is refused and sends nothing."""
    receiver = DurableReceiver(tmp_path / "receiver.sqlite3")
    items = crash_child_items(3)  # the child process's batch: the same items and steps
    with StepJournal(journal_location) as journal:
        with pytest.raises(RefusedBeforeAccept):  # item-002's send never arrived, and the run cannot tell
            run_batch(journal, JOB, items, article_steps(receiver, FaultOnce("item-002", "before_accept")),
                      settle_in_task=False)
        assert [h.item_id for h in run_batch(journal, JOB, items, article_steps(receiver),
                                             settle_in_task=False).held] == ["item-002"]
    assert receiver.counts(JOB) == {"item-001": 1, "item-003": 1}

    asked, answer_arrives = threading.Event(), threading.Event()

    def slow_lookup(ctx):
        answer = receiver.lookup(ctx.idempotency_key) or NOT_DELIVERED  # what the receiver says now...
        asked.set()
        answer_arrives.wait(60)  # ...reaches the sensor only later
        return answer

    sensor = HeldItemSensor(task_id="wait", job_id=JOB, verify=slow_lookup,
                            **journal_arguments(journal_location, monkeypatch))
    poked: list[object] = []
    sensor_thread = threading.Thread(target=lambda: poked.append(_poke(sensor)))
    sensor_thread.start()
    try:
        assert asked.wait(60), "the sensor never asked the receiver"
        # A run of the job (with its own verify, which would send item-002 now) starts in another process.
        code, summary, err = ChildRun(tmp_path, journal_location, receiver.path, JOB, n_items=3,
                                      verify="three_way").finish()
        assert (code, summary.get("busy")) == (EXIT_BUSY, True), (code, summary, err)
        assert receiver.counts(JOB) == {"item-001": 1, "item-003": 1}  # it sent nothing
    finally:
        answer_arrives.set()
        sensor_thread.join(60)
    assert poked == [True]  # settled on its answer: "not delivered", about the step as it was asked about
    with StepJournal(journal_location) as journal:
        (audit,) = journal.resolutions(JOB)
        assert (audit.item_id, audit.decision, audit.resolved_by) == ("item-002", "not_delivered", "sensor wait")

    code, summary, err = ChildRun(tmp_path, journal_location, receiver.path, JOB, n_items=3).finish()
    assert (code, summary["status"]) == (EXIT_COMPLETED, "completed"), (code, summary, err)
    assert receiver.counts(JOB) == {"item-001": 1, "item-002": 1, "item-003": 1}  # one delivery per key


def _poke(sensor: HeldItemSensor) -> object:
    try:
        return sensor.poke({})
    except Exception as exc:  # the test asserts on it: a poke must not raise
        return exc


# ------------------------------------------------------- a journal on a network or cloud-sync mount


def test_allow_network_filesystem_in_the_config_reaches_every_surface(tmp_path, monkeypatch):
    """A deployment that keeps its journal on such a mount on purpose says so once, in the config: the
    batch task, the sensor and the CLI all open it (the sensor refused a journal its batch task used)."""
    import subprocess

    from airflow_resumable._location import journal_target
    from airflow_resumable.exceptions import JournalConfigError
    from airflow_resumable.journal import JournalLocationError
    from airflow_resumable.operators.resumable_batch import ResumableBatchOperator
    from tests.faces.test_cli import CLI
    from tests.support.backends import snapshot

    path = tmp_path / "Dropbox" / "journal.sqlite3"  # a cloud-sync folder: refused by default
    monkeypatch.setenv("AIRFLOW__RESUMABLE__JOURNAL_PATH", str(path))
    monkeypatch.delenv("AIRFLOW__RESUMABLE__JOURNAL_CONN_ID", raising=False)
    monkeypatch.delenv("AIRFLOW__RESUMABLE__ALLOW_NETWORK_FILESYSTEM", raising=False)
    sensor = HeldItemSensor(task_id="wait", job_id=JOB)
    with pytest.raises(JournalLocationError, match="cloud-sync"):
        journal_target().open()
    assert not path.parent.exists()

    monkeypatch.setenv("AIRFLOW__RESUMABLE__ALLOW_NETWORK_FILESYSTEM", "True")
    batch = ResumableBatchOperator(task_id="send", items=[], notify=lambda item, ctx: "ok")
    with batch.hook.get_conn() as journal:
        run_batch(journal, JOB, [{"id": "a"}], [Step("send", lambda item, ctx: "ok", side_effect=True)],
                  settle_in_task=False)
    assert sensor.poke({"ti": CraftedTI({})}) is True
    listed = subprocess.run([CLI, "jobs", "--json"], capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert JOB in listed.stdout
    # The task's own setting wins over the config's.
    refusing = ResumableBatchOperator(task_id="strict", items=[], notify=lambda item, ctx: "ok",
                                      allow_network_filesystem=False)
    with pytest.raises(JournalLocationError, match="cloud-sync"):
        refusing.hook.get_conn()

    before = snapshot(str(path))
    monkeypatch.setenv("AIRFLOW__RESUMABLE__ALLOW_NETWORK_FILESYSTEM", "maybe")
    sensor = HeldItemSensor(task_id="wait", job_id=JOB)  # a poke in reschedule mode: a new task try
    with pytest.raises(JournalConfigError, match="allow_network_filesystem must be true or false, not 'maybe'"):
        sensor.poke({"ti": CraftedTI({})})
    refused = subprocess.run([CLI, "jobs"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "allow_network_filesystem must be true or false" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert snapshot(str(path)) == before


# ----------------------------------------------------------- a later pass of the job: batch_task_id


class PassTI:
    """A task instance of this DAG run, as far as the batch operator asks one (first try, no state store)."""

    def __init__(self, task_id: str, xcom: dict) -> None:
        self.dag_id, self.task_id, self.run_id, self.map_index = "dag", task_id, "run-1", -1
        self.try_number, self.hostname = 1, "worker-b"
        self.xcom = xcom

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcom[(self.task_id, key)] = value

    def xcom_pull(self, task_ids: str, key: str) -> Any:
        return self.xcom.get((task_ids, key))


def test_a_later_pass_on_a_journal_that_never_saw_the_job_sends_nothing(tmp_path):
    """A second pass (after a sensor or a review) is another task: its first try found nothing in its own
    task state, so on a worker whose journal never saw the job it started over and sent every item again,
    the held one blindly. With batch_task_id= it takes the job from the batch task's summary and refuses a
    journal other than the one that summary recorded."""
    from airflow_resumable.operators.resumable_batch import ResumableBatchOperator, WrongWorkerError

    sent: list[str] = []

    def notify(item: dict, ctx: Any) -> str:
        sent.append(item["id"])
        return "ok"

    items = [{"id": "a"}, {"id": "b"}]
    worker_a, worker_b = tmp_path / "a" / "journal.sqlite3", tmp_path / "b" / "journal.sqlite3"
    xcom: dict = {}
    summary = ResumableBatchOperator(task_id="send", items=items, notify=notify, journal_path=worker_a).execute(
        {"ti": PassTI("send", xcom)})
    assert sent == ["a", "b"] and summary["job_id"] == "dag/send/run-1"

    def second_pass(journal: Path, **kwargs: Any) -> dict:
        return ResumableBatchOperator(task_id="second_pass", items=items, notify=notify, journal_path=journal,
                                      batch_task_id="send", **kwargs).execute({"ti": PassTI("second_pass", xcom)})

    with pytest.raises(WrongWorkerError, match="continues the job task 'send' ran.* is not the one that task used"):
        second_pass(worker_b)
    # A summary that names no journal (an earlier release's): a journal that never saw the job is refused.
    xcom[("send", "resumable_summary")] = {k: v for k, v in summary.items() if k != "journal_id"}
    with pytest.raises(WrongWorkerError, match="continues the job task 'send' ran.* has never seen that job"):
        second_pass(worker_b)
    assert sent == ["a", "b"]
    with StepJournal(worker_b) as journal:
        assert journal.jobs() == []
    assert second_pass(worker_a)["job_id"] == summary["job_id"] and sent == ["a", "b"]  # resumed: all done
    # The author's opt-in starts over on the other journal (every item is sent again, by design).
    second_pass(worker_b, start_afresh=True)
    assert sent == ["a", "b", "a", "b"]
    with pytest.raises(ValueError, match="job_id= or batch_task_id="):
        ResumableBatchOperator(task_id="x", items=items, notify=notify, job_id="j", batch_task_id="send")
