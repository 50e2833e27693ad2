"""Resolve a step that airflow-provider-resumable held for a human.

Trigger it from the UI ("Trigger DAG" shows a form), the REST API or
``airflow dags trigger resolve_held_item --conf '{"job_id": ..., "item_id": ..., ...}'``,
after checking the receiver's records. Then Clear the batch task: it resumes.

Who may settle what: anyone who may trigger this DAG may settle a held item of any job it can reach,
because a worker cannot ask Airflow whether that user may act on the job's DAG. Restrict who may
trigger it (``access_control`` with the FAB auth manager), or give each team a copy limited to its
DAGs with ``ResolveOperator(job_dag_ids=[...])``. The "Resumable jobs" page's form checks the job's
DAG permission on the API server and is the recommended way to settle.
"""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import DAG, Param

from airflow_resumable.operators.resolve import DECISIONS, ResolveOperator

with DAG(
    dag_id="resolve_held_item",
    description="Record a human decision about a held step of a resumable batch",
    schedule=None,
    start_date=datetime(2026, 1, 1),
    catchup=False,
    max_active_runs=1,
    tags=["resumable"],
    params={
        "job_id": Param(type="string", minLength=1, maxLength=1024,
                        description="The job, as shown in the batch task's summary or failure message."),
        "item_id": Param(type="string", minLength=1, maxLength=1024, description="The held item's id."),
        "step": Param("", type="string", maxLength=256,
                      description="The held step (required for delivered / not_delivered)."),
        "decision": Param(type="string", enum=list(DECISIONS),
                          description="delivered: the receiver has it (give its receipt); not_delivered: "
                          "the receiver confirmed it never arrived (it is sent once on the next run); "
                          "keep_previous_input / use_new_input: for an input_changed hold."),
        "receipt": Param("", type="string", maxLength=4096,
                         description="The receiver's receipt / reference (required for delivered)."),
        "note": Param("", type="string", maxLength=4096, description="Why; what you checked."),
        "resolved_by": Param("", type="string", maxLength=256,
                             description="Who decides (used when Airflow does not know the triggering user)."),
    },
    render_template_as_native_obj=False,
):
    ResolveOperator(task_id="resolve")
