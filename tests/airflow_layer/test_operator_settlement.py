"""The batch task's settlement options (SPEC §12): checked when the DAG is parsed, defaults from
``[resumable]``, a templated limit key joining the notify step when the task runs."""

from __future__ import annotations

import pytest

from airflow_resumable.exceptions import JournalConfigError
from airflow_resumable.operators.resumable_batch import ResumableBatchOperator
from airflow_resumable.runner import Settlement, Step

pytestmark = pytest.mark.compat


def notify(item, ctx):
    return "ok"


def task(**options):
    return ResumableBatchOperator(task_id="send", items=[{"id": 1}], notify=notify, **options)


@pytest.mark.parametrize("options, message", [
    ({"max_sends_per_second": -1}, "send: step 'notify': max_sends_per_second must be a positive number"),
    ({"max_sends_per_second": "fast"}, "max_sends_per_second must be a positive number"),
    ({"max_attempts": 0}, "send: max_attempts must be a whole number of at least 1"),
    ({"max_sends_per_second": 10, "limit_key": 42}, "send: limit_key: limit_key must be non-empty text"),
    ({"limit_key": "crm"}, "send: limit_key shares a rate: give max_sends_per_second too"),
    ({"settle_in_task": "no"}, "send: settle_in_task must be True or False"),
    ({"idempotent": 1}, "idempotent must be True or False"),
    ({"on_journal_behind": "ignore"}, "send: on_journal_behind must be one of 'refuse', 'verify', got 'ignore'"),
])
def test_bad_options_are_refused_when_the_dag_is_parsed(options, message):
    with pytest.raises(ValueError, match=message):
        task(**options)


def test_pace_options_with_steps_belong_on_each_step():
    with pytest.raises(ValueError, match="give max_sends_per_second, limit_key and idempotent to each Step"):
        ResumableBatchOperator(task_id="send", items=[], steps=[Step("notify", notify, side_effect=True)],
                               max_sends_per_second=5)


def test_the_defaults_come_from_the_config(monkeypatch):
    assert task()._settlement() == Settlement()
    monkeypatch.setenv("AIRFLOW__RESUMABLE__MAX_ATTEMPTS", "3")
    assert task()._settlement() == Settlement(max_attempts=3)
    assert task(max_attempts=9)._settlement() == Settlement(max_attempts=9)  # the task's own wins
    monkeypatch.setenv("AIRFLOW__RESUMABLE__SETTLE_IN_TASK", "False")
    assert task()._settlement() is False
    assert task(settle_in_task=True)._settlement() == Settlement(max_attempts=3)
    monkeypatch.setenv("AIRFLOW__RESUMABLE__SETTLE_IN_TASK", "maybe")
    with pytest.raises(JournalConfigError, match=r"\[resumable\] settle_in_task must be true or false"):
        task()._settlement()


def test_a_templated_limit_key_joins_the_notify_step_once_rendered():
    op = task(max_sends_per_second=50, limit_key="crm-{{ params.account }}")
    assert "limit_key" in op.template_fields
    op.limit_key = "crm-acme"  # as rendered
    (step,) = op._steps()
    assert (step.limit_key, step.max_sends_per_second) == ("crm-acme", 50)
    op.limit_key = " "  # rendered to nothing usable: refused when the task runs, before anything is sent
    with pytest.raises(ValueError, match="send: step 'notify': limit_key must be non-empty text"):
        op._steps()


def test_on_journal_behind_comes_from_the_config_and_a_bad_value_is_refused(monkeypatch):
    from airflow_resumable._location import default_on_journal_behind

    assert default_on_journal_behind() == "refuse"
    monkeypatch.setenv("AIRFLOW__RESUMABLE__ON_JOURNAL_BEHIND", "Verify")
    assert default_on_journal_behind() == "verify"
    monkeypatch.setenv("AIRFLOW__RESUMABLE__ON_JOURNAL_BEHIND", "skip")
    with pytest.raises(JournalConfigError, match=r"\[resumable\] on_journal_behind must be refuse or verify"):
        default_on_journal_behind()
