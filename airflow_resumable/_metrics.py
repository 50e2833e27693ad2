"""Batch counters for Airflow's metrics (StatsD, Datadog or OpenTelemetry, as Airflow is configured).

Only the operator calls this: the journal and the runner import nothing from Airflow.
"""

from __future__ import annotations

from airflow_resumable._compat import stats_incr
from airflow_resumable.runner import BatchProgress, BatchResult

METRIC_PREFIX = "resumable.steps"


def emit_batch_metrics(result: BatchResult | BatchProgress, *, dag_id: str, task_id: str) -> None:
    """``resumable.steps.{executed,skipped,verified,held,resent_in_task,settled_in_task,waits,gave_up}``
    counters for one run of a batch (the last four: settlement in the task, SPEC §12).

    Given a :class:`BatchProgress` (a try that failed part way), it reports how far the try got.

    ``skipped`` includes ``verified`` (a send confirmed by the receiver is skipped, not re-sent).
    Tags (dag_id, task_id) reach backends that support them; plain StatsD gets the names only.
    """
    tags = {"dag_id": dag_id, "task_id": task_id}
    counts = {
        "executed": result.executed_steps,
        "skipped": result.skipped_steps,
        "verified": result.verified_steps,
        "held": result.held if isinstance(result, BatchProgress) else len(result.held),
        # Settlement in the task (SPEC §12).
        "resent_in_task": result.resent_in_task,
        "settled_in_task": result.settled_in_task,
        "waits": result.waits,
        "gave_up": result.gave_up,
    }
    for name, count in counts.items():
        stats_incr(f"{METRIC_PREFIX}.{name}", count, tags)


def emit_journal_behind(*, dag_id: str, task_id: str) -> None:
    """``resumable.journal_behind``: a try refused because its journal is behind the high-water mark
    kept outside it (SPEC §13): a restore or a failover lost sends the journal had recorded."""
    stats_incr("resumable.journal_behind", 1, {"dag_id": dag_id, "task_id": task_id})
