"""The resolve DAG: settle a step that a resumable batch held for a human.

Trigger it from the UI ("Trigger DAG" shows a form), the REST API or
``airflow dags trigger resolve_held_item --conf '{"job_id": ..., "item_id": ..., ...}'``,
after checking the receiver's records. Then Clear the batch task: it resumes.

Give the ``version`` of the held step as ``airflow-resumable held`` / ``show`` or the "Resumable jobs"
page showed it (and one on each entry of ``resolutions``): if the step changed since you looked - another
person settled it, a run sent it again, the sensor's verify settled it - the decision is refused, the
task fails naming it, and nothing changes; look again and decide on what it is now. Without a
``version`` the decision applies to the step as it is at that moment.

Who may settle what: anyone who may trigger this DAG may settle a held item of any job it can reach,
because a worker cannot ask Airflow whether that user may act on the job's DAG. Restrict who may
trigger it (``access_control`` with the FAB auth manager), or give each team a copy limited to its
DAGs: ``resolve_held_item_dag("resolve_team_a", job_dag_ids=[...])``. The "Resumable jobs" page's
form checks the job's DAG permission on the API server and is the recommended way to settle.
"""

from __future__ import annotations

from airflow_resumable.operators.resolve import resolve_held_item_dag

dag = resolve_held_item_dag()
