"""The operators and the sensor inside real Airflow (SQLite metadata DB in a
temporary AIRFLOW_HOME, `airflow dags test`, retries honoured, Clear through Airflow's own clear)."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from airflow_resumable._compat import airflow_version
from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, run_batch
from tests.support.receivers import DurableReceiver

pytestmark = [pytest.mark.airflow, pytest.mark.compat]

ALL_ITEMS = [f"item-{i:03d}" for i in range(1, 51)]


def arm(airflow, item_id: str, mode: str) -> None:
    conn = sqlite3.connect(airflow.receiver, isolation_level=None)
    conn.execute("CREATE TABLE IF NOT EXISTS faults (item_id TEXT PRIMARY KEY, mode TEXT, fired INTEGER)")
    conn.execute("INSERT OR REPLACE INTO faults VALUES (?, ?, 0)", (item_id, mode))
    conn.close()


def receiver(airflow) -> DurableReceiver:
    return DurableReceiver(airflow.receiver)


def output(airflow) -> str:
    return (airflow.home / "last-output.txt").read_text()


def journal_snapshot(path) -> list:
    conn = sqlite3.connect(path)
    try:
        return [conn.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3").fetchall() for t in ("steps", "resolutions", "jobs")]
    finally:
        conn.close()


def resolve(airflow, **conf):
    return airflow.dags_test("resolve_held_item", conf)


def test_retry_after_accept_verifies_item_41_and_sends_the_rest_once(airflow):
    arm(airflow, "item-041", "after_accept")
    assert airflow.dags_test("article_verify").returncode == 0, output(airflow)
    assert airflow.task_states("article_verify") == {("send", -1): ("success", 2)}
    counts = receiver(airflow).counts()
    assert sorted(counts) == ALL_ITEMS and set(counts.values()) == {1}
    summary = airflow.xcom("article_verify", "send")
    assert summary["status"] == "completed"
    assert (summary["executed_steps"], summary["skipped_steps"], summary["verified_steps"]) == (27, 123, 1)
    assert summary["items_total"] == summary["items_completed"] == 50
    # The task log's progress lines give true counts: try 1 failed at item 41 with 40 items done.
    lines = [line[line.index("Progress: "):] for line in output(airflow).splitlines() if "Progress: " in line]
    for expected in ("Progress: 40/50 items done, 122 steps executed, 0 skipped, 0 held",
                     "Progress: 50/50 items done, 27 steps executed, 123 skipped, 0 held"):
        assert any(line.startswith(expected) for line in lines), lines
    # The host as Airflow records it (hostname_callable), as the UI shows it; not socket.gethostname().
    assert summary["hostname"] == airflow.hostname("article_verify", "send")
    assert summary["journal_path"] == str(airflow.journal)
    # Item contents are data: a templated field did not render the payload's Jinja.
    conn = sqlite3.connect(airflow.receiver)
    payloads = {p for (p,) in conn.execute("SELECT payload FROM deliveries")}
    assert payloads == {"Hello {{ name }} {% raw %}x"}
    # The journal file is private to the worker's user.
    assert oct(airflow.journal.stat().st_mode & 0o777) == "0o600"


def test_concurrent_sends_retry_verifies_item_41_and_sends_every_item_once(airflow):
    arm(airflow, "item-041", "after_accept")
    assert airflow.dags_test("article_concurrent").returncode == 0, output(airflow)
    assert airflow.task_states("article_concurrent") == {("send", -1): ("success", 2)}
    counts = receiver(airflow).counts()
    assert sorted(counts) == ALL_ITEMS and set(counts.values()) == {1}
    summary = airflow.xcom("article_concurrent", "send")
    # Which items had run alongside item 41 when it failed depends on thread timing; the result not.
    assert summary["status"] == "completed" and summary["verified_steps"] == 1
    assert summary["executed_steps"] + summary["skipped_steps"] == 150
    assert summary["items_total"] == summary["items_completed"] == 50
    with StepJournal(airflow.journal) as journal:
        rows = journal.rows(summary["job_id"])
        assert len(rows) == 150 and {r.status.value for r in rows} == {"SUCCEEDED"}


def test_clear_of_a_finished_batch_task_resends_nothing(airflow):
    arm(airflow, "item-041", "after_accept")
    assert airflow.dags_test("article_verify").returncode == 0, output(airflow)
    run_id = airflow.last_run_id("article_verify")
    before = receiver(airflow).counts()
    assert airflow.run("tasks", "clear", "article_verify", "-t", "send", "-y").returncode == 0, output(airflow)
    assert airflow.task_states("article_verify", run_id)[("send", -1)][0] is None  # really cleared
    assert airflow.rerun("article_verify", run_id).returncode == 0, output(airflow)
    assert airflow.task_states("article_verify", run_id)[("send", -1)] == ("success", 3)
    assert receiver(airflow).counts() == before
    summary = airflow.xcom("article_verify", "send", run_id=run_id)
    assert (summary["executed_steps"], summary["skipped_steps"]) == (0, 150)


def test_shorthand_callables_name_their_steps(airflow):
    arm(airflow, "item-041", "after_accept")
    assert airflow.dags_test("article_shorthand").returncode == 0, output(airflow)
    with StepJournal(airflow.journal) as journal:
        (job,) = journal.jobs()
        assert {r.step for r in journal.rows(job.job_id, "item-001")} == {"validate", "transform", "notify"}
    assert set(receiver(airflow).counts().values()) == {1}


def test_hold_fails_the_task_then_resolve_dag_and_clear_send_item_41_once(airflow):
    arm(airflow, "item-041", "before_accept")
    assert airflow.dags_test("article_hold").returncode != 0
    log = output(airflow)
    run_id = airflow.last_run_id("article_hold")
    # Try 1 failed at item 41, try 2 held it; no verify: tries 3 and 4 would change nothing and are not spent.
    assert airflow.task_states("article_hold") == {("send", -1): ("failed", 2)}
    assert "item-041 / notify_external: unknown_outcome" in log and "resolve_held_item" in log
    assert "HeldItemsNeedAHumanError" in log and "without using the remaining retries" in log
    counts = receiver(airflow).counts()
    assert "item-041" not in counts and len(counts) == 49 and set(counts.values()) == {1}
    job_id = f"article_hold/send/{run_id}"

    result = resolve(airflow, job_id=job_id, item_id="item-041", step="notify_external",
                     decision="not_delivered", note="receiver has no record")
    assert result.returncode == 0, output(airflow)

    assert airflow.run("tasks", "clear", "article_hold", "-t", "send", "-y").returncode == 0, output(airflow)
    assert airflow.rerun("article_hold", run_id).returncode == 0, output(airflow)
    assert airflow.task_states("article_hold", run_id)[("send", -1)] == ("success", 3)
    counts = receiver(airflow).counts()
    assert sorted(counts) == ALL_ITEMS and set(counts.values()) == {1}
    summary = airflow.xcom("article_hold", "send", run_id=run_id)
    assert (summary["executed_steps"], summary["status"]) == (1, "completed")
    with StepJournal(airflow.journal) as journal:
        (audit,) = journal.resolutions(job_id)
    assert (audit.decision, audit.resolved_by, audit.note) == ("not_delivered", "dag_test", "receiver has no record")


def wait_for_held(location, proc, timeout=120) -> str:
    """The job of the first held item once the running DAG has one; ``location`` is a journal file
    (not opened before it exists: opening would create it) or a PostgreSQL URL."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-5000:]
        if not isinstance(location, Path) or location.exists():
            with StepJournal(location) as journal:
                held = journal.held()
            if held:
                return held[0].job_id
        time.sleep(0.5)
    raise AssertionError("nothing was held in time")


def rescheduled(text: str) -> bool:
    return "up_for_reschedule" in text or "rescheduled" in text.lower()


def wait_for_a_reschedule(proc, timeout=120) -> None:
    """Until the background `dags test` logged its sensor's reschedule (it goes on running)."""
    deadline = time.monotonic() + timeout
    while not rescheduled(proc.output.read_text(errors="replace")):
        assert proc.poll() is None, proc.communicate()[0][-5000:]
        assert time.monotonic() < deadline, "the sensor did not reschedule in time"
        time.sleep(0.5)


def test_on_held_succeed_sensor_waits_for_the_resolve_dag_then_second_pass_sends_once(airflow):
    arm(airflow, "item-041", "before_accept")
    proc = airflow.popen("dags", "test", "article_sensor")
    try:
        job_id = wait_for_held(airflow.journal, proc)
        wait_for_a_reschedule(proc)  # the sensor poked while item 41 was held, and waits
        assert proc.poll() is None, "the sensor must wait while item 41 is held"
        assert resolve(airflow, job_id=job_id, item_id="item-041", step="notify_external",
                       decision="not_delivered").returncode == 0, output(airflow)
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-5000:]
    states = airflow.task_states("article_sensor")
    assert {k[0]: v[0] for k, v in states.items()} == {
        "send": "success", "wait_for_resolution": "success", "second_pass": "success"}
    assert airflow.xcom("article_sensor", "send")["status"] == "needs_review"
    second = airflow.xcom("article_sensor", "second_pass")
    assert (second["job_id"], second["executed_steps"], second["status"]) == (job_id, 1, "completed")
    counts = receiver(airflow).counts()
    assert sorted(counts) == ALL_ITEMS and set(counts.values()) == {1}
    assert rescheduled(out)


def test_sensor_verify_marks_held_step_succeeded_once_the_receiver_answers(airflow):
    arm(airflow, "item-041", "after_accept")
    lookup_off = airflow.receiver.with_name(airflow.receiver.name + ".lookup-off")
    lookup_off.write_text("")
    proc = airflow.popen("dags", "test", "article_sensor_verify")
    try:
        job_id = wait_for_held(airflow.journal, proc)
        time.sleep(3)
        assert proc.poll() is None
        lookup_off.unlink()  # the receiver finally records it
        out, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-5000:]
    with StepJournal(airflow.journal) as journal:
        (row,) = [r for r in journal.rows(job_id, "item-041") if r.step == "notify_external"]
        assert row.status == "SUCCEEDED" and row.receipt and row.held_reason is None
        assert journal.held(job_id) == []
        assert [a.resolved_by for a in journal.resolutions(job_id)] == ["sensor wait_for_receipt"]
    counts = receiver(airflow).counts()
    assert sorted(counts) == ALL_ITEMS and set(counts.values()) == {1}


def test_wrong_worker_guard_refuses_and_sends_nothing(airflow):
    arm(airflow, "item-011", "lose_journal")
    assert airflow.dags_test("article_wrong_worker").returncode != 0
    log = output(airflow)
    assert airflow.task_states("article_wrong_worker") == {("send", -1): ("failed", 2)}
    host = airflow.hostname("article_wrong_worker", "send")
    if airflow_version() >= (3, 3):  # task_state_store recorded where try 1 ran
        assert f"host {host!r}" in log
    else:  # no task_state_store: the journal on this host never saw the job
        assert f"on {host!r} has never seen this job" in log
    assert "Nothing was sent" in log and "start_afresh" in log
    counts = receiver(airflow).counts()
    assert sorted(counts) == ALL_ITEMS[:10] and set(counts.values()) == {1}


def test_a_clear_on_another_worker_is_refused_after_airflow_dropped_the_tasks_state(airflow):
    """[state_store] clear_on_success drops what try 1 recorded of its journal when it succeeds. A Clear
    that then runs on another worker (here: the first worker's journal is gone) is refused: it sent every
    item again."""
    airflow.env["AIRFLOW__STATE_STORE__CLEAR_ON_SUCCESS"] = "True"
    assert airflow.dags_test("article_verify").returncode == 0, output(airflow)
    run_id = airflow.last_run_id("article_verify")
    before = receiver(airflow).counts()
    assert sorted(before) == ALL_ITEMS
    airflow.journal.parent.rename(airflow.journal.parent.with_name("first-worker"))  # this worker: no journal
    assert airflow.run("tasks", "clear", "article_verify", "-t", "send", "-y").returncode == 0, output(airflow)
    assert airflow.rerun("article_verify", run_id).returncode != 0
    log = output(airflow)
    assert "has never seen this job" in log and "Nothing was sent" in log and "start_afresh" in log
    assert receiver(airflow).counts() == before


def test_a_try_that_failed_before_the_guard_after_the_state_was_dropped_exempts_no_later_try(airflow):
    """Try 1 succeeds and [state_store] clear_on_success drops its record. The Clear lands on another
    worker, whose journal cannot be opened: try 2 and its retry fail before the guard, each leaving
    its start in the store. Once the journal opens, the next Clear is refused all the same: a start
    written after the state was dropped proves nothing about the try that sent every item."""
    airflow.env["AIRFLOW__STATE_STORE__CLEAR_ON_SUCCESS"] = "True"
    assert airflow.dags_test("article_verify").returncode == 0, output(airflow)
    run_id = airflow.last_run_id("article_verify")
    before = receiver(airflow).counts()
    assert sorted(before) == ALL_ITEMS
    folder = airflow.journal.parent
    folder.rename(folder.with_name("first-worker"))  # this worker: no journal
    folder.write_text("")  # a file where the journal's folder goes: the journal cannot be opened
    assert airflow.run("tasks", "clear", "article_verify", "-t", "send", "-y").returncode == 0, output(airflow)
    assert airflow.rerun("article_verify", run_id).returncode != 0
    assert "cannot open the journal" in output(airflow) and receiver(airflow).counts() == before
    assert airflow.task_states("article_verify") == {("send", -1): ("failed", 3)}
    folder.unlink()  # the disk is mended
    assert airflow.run("tasks", "clear", "article_verify", "-t", "send", "-y").returncode == 0, output(airflow)
    assert airflow.rerun("article_verify", run_id).returncode != 0
    log = output(airflow)
    assert "has never seen this job" in log and "Nothing was sent" in log and "start_afresh" in log
    assert receiver(airflow).counts() == before


def test_wrong_worker_opt_in_starts_afresh(airflow):
    arm(airflow, "item-011", "lose_journal")
    assert airflow.dags_test("article_wrong_worker_afresh").returncode == 0, output(airflow)
    counts = receiver(airflow).counts()
    # The author opted in to starting over: the first 10 reach the receiver again, by design.
    assert sorted(counts) == ALL_ITEMS
    assert [counts[i] for i in ALL_ITEMS[:10]] == [2] * 10 and set(counts[i] for i in ALL_ITEMS[10:]) == {1}


def test_mapped_shards_are_independent_jobs_and_a_retry_resumes_only_its_own(airflow):
    arm(airflow, "chunk2-005", "after_accept")
    assert airflow.dags_test("article_mapped").returncode == 0, output(airflow)
    run_id = airflow.last_run_id("article_mapped")
    states = airflow.task_states("article_mapped")
    assert states == {("send", 0): ("success", 1), ("send", 1): ("success", 1),
                      ("send", 2): ("success", 2), ("send", 3): ("success", 1)}
    with StepJournal(airflow.journal) as journal:
        assert sorted(j.job_id for j in journal.jobs()) == [f"article_mapped/send/{run_id}/{m}" for m in range(4)]
    summaries = [airflow.xcom("article_mapped", "send", map_index=m) for m in range(4)]
    assert [s["executed_steps"] for s in summaries] == [30, 30, 15, 30]
    assert summaries[2]["skipped_steps"] == 15 and summaries[2]["verified_steps"] == 1
    counts = receiver(airflow).counts()
    assert len(counts) == 40 and set(counts.values()) == {1}


@pytest.fixture
def held_journal(airflow):
    """A journal where job 'j' has item 'a' held (unknown outcome) and item 'b' delivered."""
    airflow.journal.parent.mkdir(parents=True, exist_ok=True)

    def notify(item, ctx):
        if item["id"] == "a":
            raise TimeoutError()
        return "rcpt-" + item["id"]

    steps = [Step("notify", notify, side_effect=True)]
    with StepJournal(airflow.journal) as journal:
        with pytest.raises(TimeoutError):
            run_batch(journal, "j", [{"id": "a"}, {"id": "b"}], steps, settle_in_task=False)
        run_batch(journal, "j", [{"id": "a"}, {"id": "b"}], steps, settle_in_task=False)
        assert [h.item_id for h in journal.held("j")] == ["a"]
    return airflow


@pytest.mark.parametrize(
    ("conf", "message"),
    [
        ({"job_id": "nope", "item_id": "a", "step": "notify", "decision": "not_delivered"}, "unknown job"),
        ({"job_id": "j", "item_id": "b", "step": "notify", "decision": "delivered", "receipt": "r"}, "nothing to resolve"),
        ({"job_id": "j", "item_id": "a", "step": "notify", "decision": "delivered"}, "receipt"),
        ({"job_id": "j", "item_id": "a", "step": "notify", "decision": "sent_probably"}, "sent_probably"),
        ({"job_id": "j", "item_id": 5, "step": "notify", "decision": "not_delivered"}, "item_id"),
        ({"job_id": "j", "item_id": "a", "step": "nope", "decision": "not_delivered"}, "no step"),
        ({"job_id": "j", "item_id": "a", "decision": "keep_previous_input"}, "not held for an input change"),
    ],
)
def test_resolve_dag_refuses_bad_conf_and_leaves_the_journal_unchanged(held_journal, conf, message):
    before = journal_snapshot(held_journal.journal)
    result = resolve(held_journal, **conf)
    assert result.returncode != 0
    assert message in output(held_journal)
    assert journal_snapshot(held_journal.journal) == before


def test_resolve_dag_records_who_resolved_what_and_when(held_journal):
    started = time.time()
    result = resolve(held_journal, job_id="j", item_id="a", step="notify", decision="delivered",
                     receipt="rcpt-a", note="found in the receiver's dashboard")
    assert result.returncode == 0, output(held_journal)
    with StepJournal(held_journal.journal) as journal:
        (audit,) = journal.resolutions("j")
        assert (audit.item_id, audit.step, audit.decision, audit.receipt) == ("a", "notify", "delivered", "rcpt-a")
        assert audit.resolved_by == "dag_test"  # the triggering user Airflow knows for `dags test`
        assert audit.resolved_at.timestamp() >= started - 1
        assert journal.held("j") == []
    assert held_journal.xcom("resolve_held_item", "resolve")["audit_id"] == audit.id


def test_provider_is_registered_with_its_config_section(airflow):
    providers = airflow.run("providers", "list", "-o", "json", check=True).stdout
    assert "airflow-provider-resumable" in providers
    config = airflow.run("config", "list", "--section", "resumable", check=True).stdout
    assert "journal_path" in config and "durability" in config and "allow_network_filesystem" in config
    value = airflow.run("config", "get-value", "resumable", "durability", check=True).stdout.strip()
    assert value.splitlines()[-1] == "full"
    assert json.loads(providers[providers.index("["):])  # valid JSON listing


def test_the_operator_refuses_a_bad_progress_interval_when_the_dag_is_parsed():
    from airflow_resumable.operators.resumable_batch import ResumableBatchOperator

    for interval in (None, "30", -5):
        with pytest.raises(ValueError, match="^t: progress_interval must be a number of seconds"):
            ResumableBatchOperator(task_id="t", items=[], notify=lambda i, c: "r", progress_interval=interval)


def test_an_items_callable_may_take_the_context_as_keywords_or_as_one_argument():
    """def items(**context), as Airflow's own callables take it, was called with one positional argument."""
    from airflow_resumable.operators.resumable_batch import ResumableBatchOperator

    context = {"ds": "2026-12-05", "params": {"n": 2}}

    def as_keywords(**context):
        return [{"id": f"{context['ds']}-{n}"} for n in range(context["params"]["n"])]

    def as_one(context):
        return as_keywords(**context)

    def without():
        return [{"id": "2026-12-05-0"}, {"id": "2026-12-05-1"}]

    for items in (as_keywords, as_one, without):
        task = ResumableBatchOperator(task_id="t", items=items, notify=lambda i, c: "r")
        assert list(task._iter_items(context)) == [{"id": "2026-12-05-0"}, {"id": "2026-12-05-1"}]


def test_only_a_hold_that_verify_may_settle_is_worth_a_retry():
    from airflow_resumable._compat import airflow_fail_exception
    from airflow_resumable.journal import HeldReason, HeldStep
    from airflow_resumable.operators.resumable_batch import (
        HeldItemsError,
        HeldItemsNeedAHumanError,
        ResumableBatchOperator,
        held_items_error,
    )
    from airflow_resumable.runner import BatchResult

    def fails_with(verify, *reasons):
        steps = ResumableBatchOperator(task_id="t", items=[], notify=lambda i, c: "r", verify=verify).steps
        result = BatchResult("j", "needs_review", held=[HeldStep("j", f"i{n}", "notify", r) for n, r in enumerate(reasons)])
        error = held_items_error(result, steps)
        assert "were held for a human" in str(error)
        return type(error)

    unknown, changed = HeldReason.UNKNOWN_OUTCOME, HeldReason.INPUT_CHANGED
    assert fails_with(lambda c: None, unknown) is HeldItemsError  # the receiver may record late: retry
    assert fails_with(lambda c: None, changed, unknown) is HeldItemsError
    assert fails_with(lambda c: None, changed) is HeldItemsNeedAHumanError  # only a human settles changed input
    assert fails_with(None, unknown) is HeldItemsNeedAHumanError  # no verify: a retry would hold it again
    # A retry-less failure is still a HeldItemsError (callers catching it keep working).
    assert issubclass(HeldItemsNeedAHumanError, HeldItemsError)
    assert issubclass(HeldItemsNeedAHumanError, airflow_fail_exception())
    assert not issubclass(HeldItemsError, airflow_fail_exception())


def test_resolve_dag_settles_fifteen_held_items_in_one_run_all_or_nothing(airflow):
    from tests.core.test_bulk_resolution import JOB, decisions, held_15

    airflow.journal.parent.mkdir(parents=True, exist_ok=True)
    with StepJournal(airflow.journal) as journal:
        held_15(journal)
    bad = decisions()
    bad[6]["item_id"] = "item-99"
    before = journal_snapshot(airflow.journal)
    assert airflow.dags_test("resolve_held_item", {"resolutions": bad}).returncode != 0
    assert "entry 7: job 'bulk/job' has no item 'item-99'" in output(airflow)
    assert journal_snapshot(airflow.journal) == before  # one bad entry: nothing changed

    result = airflow.dags_test("resolve_held_item", {"resolutions": decisions()})
    assert result.returncode == 0, output(airflow)
    with StepJournal(airflow.journal) as journal:
        audit = journal.resolutions(JOB)
        assert journal.held(JOB) == [] and len(audit) == 15 and {a.resolved_by for a in audit} == {"dag_test"}
    assert airflow.xcom("resolve_held_item", "resolve")["count"] == 15


# ------------------------------------------------------------------ decisions made on what was seen


def held_again(location) -> str:
    """Job 'j' at ``location`` (a file or a PostgreSQL URL): items a and c held (their sends arrived, no
    reply ever came), b delivered. Then a changed while an on-call looked at it: another person settled it
    "not delivered", a run sent it again and held it again. Returns a's version as the on-call saw it."""
    def notify(item, ctx):
        if item["id"] in ("a", "c"):
            raise TimeoutError()
        return "rcpt-" + item["id"]

    steps, items = [Step("notify", notify, side_effect=True)], [{"id": i} for i in ("a", "b", "c")]
    with StepJournal(location) as journal:
        for _ in range(2):  # a's reply is lost, then c's
            with pytest.raises(TimeoutError):
                run_batch(journal, "j", items, steps, settle_in_task=False)
        assert [h.item_id for h in run_batch(journal, "j", items, steps, settle_in_task=False).held] == ["a", "c"]
        seen = {h.item_id: h.version for h in journal.held("j")}
        journal.resolve("j", "a", "notify", delivered=False, resolved_by="carol", note="not in its list yet")
        with pytest.raises(TimeoutError):
            run_batch(journal, "j", items, steps, settle_in_task=False)
        assert [h.item_id for h in run_batch(journal, "j", items, steps, settle_in_task=False).held] == ["a", "c"]
    return seen["a"]


def current_versions(location) -> dict[str, str]:
    with StepJournal(location) as journal:
        return {h.item_id: h.version for h in journal.held("j")}


def test_a_stale_resolution_through_the_resolve_dag_is_refused_and_changes_nothing(airflow):
    airflow.journal.parent.mkdir(parents=True, exist_ok=True)
    seen_a = held_again(airflow.journal)
    now = current_versions(airflow.journal)
    before = journal_snapshot(airflow.journal)
    resolutions = [
        {"job_id": "j", "item_id": "c", "step": "notify", "decision": "not_delivered", "version": now["c"]},
        {"job_id": "j", "item_id": "a", "step": "notify", "decision": "not_delivered", "version": seen_a},
    ]
    assert airflow.dags_test("resolve_held_item", {"resolutions": resolutions}).returncode != 0
    log = output(airflow)
    assert "ResolutionRefused: entry 2: j / a / notify changed since it was looked at" in log
    assert journal_snapshot(airflow.journal) == before  # entry 1, about c as it is, is not applied either


class DagRun:
    """What the resolve task reads of its DAG run: the conf, and who triggered it."""

    def __init__(self, conf: dict) -> None:
        self.conf, self.triggering_user_name = conf, "alice"


def resolve_task(location, monkeypatch, **conf):
    """Run the resolve DAG's task in this process, with the DAG's params and ``conf``, on the journal at
    ``location`` (opened by the task itself, as on a worker)."""
    from airflow_resumable.operators.resolve import ResolveOperator, resolve_held_item_dag
    from tests.airflow_layer.test_sensor_journal import journal_arguments

    task = ResolveOperator(task_id="resolve", **journal_arguments(location, monkeypatch))
    return task.execute({"params": resolve_held_item_dag().params.dump(), "dag_run": DagRun(conf)})


def journal_state(location, job_id: str) -> tuple:
    with StepJournal(location) as journal:
        return journal.rows(job_id), journal.resolutions(job_id)


def test_the_resolve_task_decides_on_the_version_it_is_given(journal_location, monkeypatch):
    from airflow_resumable.exceptions import ResolutionRefused

    seen_a = held_again(journal_location)
    now = current_versions(journal_location)
    before = journal_state(journal_location, "j")
    decision = {"job_id": "j", "item_id": "a", "step": "notify", "decision": "delivered", "receipt": "rcpt-a"}
    with pytest.raises(ResolutionRefused, match="^j / a / notify changed since it was looked at .*is now FAILED, held"):
        resolve_task(journal_location, monkeypatch, **decision, version=seen_a)
    assert journal_state(journal_location, "j") == before

    assert resolve_task(journal_location, monkeypatch, **decision, version=now["a"])["decision"] == "delivered"
    # Without a version the decision is about the step as it is now (a hand-written conf).
    resolve_task(journal_location, monkeypatch, job_id="j", item_id="c", step="notify", decision="not_delivered")
    with StepJournal(journal_location) as journal:
        assert journal.held("j") == []
        assert [(r.item_id, r.decision, r.resolved_by) for r in journal.resolutions("j")] == [
            ("a", "not_delivered", "carol"), ("a", "delivered", "alice"), ("c", "not_delivered", "alice")]


@pytest.mark.parametrize("field", ["expected_version", "versoin", "colour"])
def test_a_conf_field_the_resolve_dag_does_not_know_is_refused_not_dropped(journal_location, monkeypatch, field):
    """A version given under the API's name (expected_version) was dropped: the decision on what a person
    saw became unconditional and was applied to a row held since."""
    from airflow_resumable.exceptions import ResolutionRefused

    seen_a = held_again(journal_location)
    before = journal_state(journal_location, "j")
    decision = {"job_id": "j", "item_id": "a", "step": "notify", "decision": "not_delivered", field: seen_a}
    with pytest.raises(ResolutionRefused, match=f"^unknown field\\(s\\) in the conf: '{field}'; use .*'version'"):
        resolve_task(journal_location, monkeypatch, **decision)
    assert journal_state(journal_location, "j") == before


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("note", "checked\x00", "note contains a NUL character"),
        ("receipt", "rcpt-\udc80", "receipt contains a lone surrogate"),
        ("note", "\u20ac" * 1400, "note is 4200 bytes; at most 4096"),
        ("receipt", "r" * (64 * 1024 + 1), "receipt is 65537 bytes; at most 65536"),
        ("item_id", "a" * 1025, "item_id is 1025 characters; at most 1024"),
        ("step", "s" * 1025, "step is 1025 characters; at most 1024"),
        ("job_id", "j" * (64 * 1024 + 1), "job_id is 65537 characters; at most 65536"),
        ("version", "\ud800", "version contains a lone surrogate"),
    ],
    ids=["nul", "lone-surrogate", "note-too-long", "receipt-too-long", "item-id-too-long", "step-too-long",
         "job-id-too-long", "bad-version"],
)
def test_bad_text_in_a_resolution_fails_the_resolve_task_naming_the_entry_and_changes_nothing(
    journal_location, monkeypatch, field, value, message,
):
    from airflow_resumable.exceptions import ResolutionRefused
    from tests.support.scenario import held_job

    held_job(journal_location, "j", "a")
    held_job(journal_location, "j2", "b")
    before = journal_state(journal_location, "j"), journal_state(journal_location, "j2")
    good = {"job_id": "j2", "item_id": "b", "step": "send", "decision": "not_delivered"}
    bad = {"job_id": "j", "item_id": "a", "step": "send", "decision": "delivered", "receipt": "rcpt-a", field: value}
    with pytest.raises(ResolutionRefused, match=f"^entry 2: {message}"):
        resolve_task(journal_location, monkeypatch, resolutions=[good, bad])
    assert (journal_state(journal_location, "j"), journal_state(journal_location, "j2")) == before


def test_the_resolve_dag_form_asks_for_the_version_and_takes_what_the_journal_takes():
    from airflow_resumable.operators.resolve import resolve_held_item_dag

    params = resolve_held_item_dag().params
    version = params.get_param("version").serialize()
    assert version["value"] == "" and version["schema"]["type"] == "string"  # optional: empty decides on "now"
    assert "if the step changed since, the decision is refused" in version["description"]
    # The form refuses no text the journal takes: a receiver's receipt may be long (the journal: 64 KiB).
    params["receipt"] = "r" * 60_000
    params["step"] = "s" * 1000
    params.validate()


@pytest.mark.parametrize("concurrency", [1, 16])
def test_sigterm_starts_no_new_send_and_a_clear_resumes_the_unfinished_job(airflow, concurrency):
    """What "mark failed", "mark success" and Clear do to a running task: SIGTERM, then on_kill. The batch
    starts no new send (at most the sends then in flight reach the receiver), ends at once, and the job
    shows as unfinished until a Clear resumes it."""
    dag_id = f"stop_c{concurrency}"
    rec = receiver(airflow)
    proc = airflow.popen("dags", "test", dag_id)
    deadline = time.monotonic() + 240
    while sum(rec.counts().values()) < 60:
        assert proc.poll() is None and time.monotonic() < deadline, proc.output.read_text()[-4000:]
        time.sleep(0.05)
    killed_at = time.time()
    os.kill(proc.proc.pid, signal.SIGTERM)
    proc.proc.wait(timeout=240)
    log = proc.output.read_text()
    assert "Stopped on request" in log, log[-4000:]
    # At most the sends in flight at the SIGTERM arrive after it (the receiver's own clock).
    assert rec.received_after(killed_at) <= concurrency, rec.received_after(killed_at)
    run_id = airflow.last_run_id(dag_id)
    job_id = f"{dag_id}/send/{run_id}"
    sent = sum(rec.counts().values())
    assert 60 <= sent < 300 and rec.duplicates() == 0
    with StepJournal(airflow.journal) as journal:
        job = journal.job(job_id)
        assert job is not None and job.status == "unfinished"
        assert job.updated_at.timestamp() - killed_at < 5  # the batch ended within 5 s of the SIGTERM
    cli = subprocess.run([str(Path(sys.executable).with_name("airflow-resumable")), "jobs", "--json"],
                         env=airflow.env, capture_output=True, text=True, timeout=120)
    assert {j["job_id"]: j["status"] for j in json.loads(cli.stdout)}[job_id] == "unfinished", cli.stderr

    assert airflow.run("tasks", "clear", dag_id, "-t", "send", "-y").returncode == 0, output(airflow)
    assert airflow.rerun(dag_id, run_id).returncode == 0, output(airflow)
    counts = rec.counts()
    assert len(counts) == 300 and set(counts.values()) == {1}
    with StepJournal(airflow.journal) as journal:
        assert journal.job(job_id).status == "completed"


def test_a_team_resolve_dag_settles_jobs_by_their_recorded_dag_not_their_id(journal_location, monkeypatch):
    """job_dag_ids=["reports"] may not settle "reports/2026-12-05" when DAG payments ran it (a custom
    job_id), nor a job with no recorded DAG; job_dag_ids=["payments"] may."""
    from airflow_resumable.exceptions import ResolutionRefused
    from airflow_resumable.operators.resolve import ResolveOperator, resolve_held_item_dag
    from tests.airflow_layer.test_sensor_journal import journal_arguments

    def lost(item, ctx):
        raise ConnectionError("reply lost")

    with StepJournal(journal_location) as journal:
        for job_id, dag_id in (("reports/2026-12-05", "payments"), ("reports/outside", None)):
            with pytest.raises(ConnectionError):
                run_batch(journal, job_id, [{"id": "a"}], [Step("send", lost, side_effect=True)], dag_id=dag_id,
                          settle_in_task=False)

    def settle(job_id, team):
        task = ResolveOperator(task_id="resolve", job_dag_ids=[team], **journal_arguments(journal_location, monkeypatch))
        conf = {"job_id": job_id, "item_id": "a", "step": "send", "decision": "not_delivered"}
        return task.execute({"params": resolve_held_item_dag().params.dump(), "dag_run": DagRun(conf)})

    before = journal_state(journal_location, "reports/2026-12-05")
    with pytest.raises(ResolutionRefused, match="belongs to DAG 'payments'"):
        settle("reports/2026-12-05", "reports")
    with pytest.raises(ResolutionRefused, match="has no recorded DAG"):
        settle("reports/outside", "reports")
    assert journal_state(journal_location, "reports/2026-12-05") == before
    assert settle("reports/2026-12-05", "payments")["decision"] == "not_delivered"
