"""Drive an existing, cleared DagRun in-process, as the scheduler would after a UI "Clear".

Usage: python -m tests.support.airflow_rerun DAG_ID RUN_ID (after `airflow tasks clear`).

`dag.test()` cannot do this: it deletes a run with the same logical date and makes a new one. This
mirrors the loop inside `DAG.test()` (Airflow 3.3) on the existing run instead, so try_number goes
up and the task state store is kept, as with a real Clear. It uses `_run_task`, the private helper
`dag.test()` itself calls. This is the one place the tests use Airflow's private APIs (and
tests/support/airflow_metadata.py the one place they read Airflow's tables); both check the Airflow version
first. The imports that moved between 3.1 and 3.2 are tried in order.
"""

from __future__ import annotations

import sys
import time


def main(dag_id: str, run_id: str) -> int:
    from tests.support.airflow_metadata import CHECKED_MINORS, airflow_version

    if airflow_version() not in CHECKED_MINORS:  # private APIs: checked on these minors only (the CI matrix)
        sys.exit(f"tests/support/airflow_rerun.py drives private Airflow APIs checked on {CHECKED_MINORS}, not on "
                 f"{airflow_version()}: compare DAG.test() of that Airflow and extend CHECKED_MINORS")
    from airflow import settings
    from airflow._shared.timezones import timezone
    from airflow.models.dagrun import DagRun
    from airflow.sdk.definitions.dag import _run_task

    try:  # Airflow 3.2+
        from airflow.dag_processing.dagbag import DagBag
    except ImportError:  # 3.1
        from airflow.models.dagbag import DagBag
    try:  # Airflow 3.2+
        from airflow.serialization.serialized_objects import DagSerialization
    except ImportError:  # 3.1
        from airflow.serialization.serialized_objects import SerializedDAG as DagSerialization
    from airflow.utils.state import DagRunState, TaskInstanceState
    from sqlalchemy import select

    dag = DagBag().get_dag(dag_id)
    session = settings.Session()
    scheduler_dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(dag))
    run = session.scalar(select(DagRun).where(DagRun.dag_id == dag_id, DagRun.run_id == run_id))
    run.dag = scheduler_dag
    if run.state != DagRunState.RUNNING:  # a cleared run is queued; the scheduler starts it
        run.state = DagRunState.RUNNING
        run.start_date = timezone.utcnow()
        session.commit()
    for _ in range(300):
        if run.state != DagRunState.RUNNING:
            break
        session.expire_all()
        schedulable, _ = run.update_state(session=session)
        for ti in schedulable:
            if ti.state != TaskInstanceState.UP_FOR_RESCHEDULE:
                ti.try_number += 1  # what the scheduler does when it queues a task instance
            ti.state = TaskInstanceState.SCHEDULED
            ti.scheduled_dttm = timezone.utcnow()
        session.commit()
        scheduled = [t for t in run.get_task_instances(session=session) if t.state == TaskInstanceState.SCHEDULED]
        if not scheduled and run.state == DagRunState.RUNNING:
            time.sleep(0.5)
        for ti in scheduled:
            try:
                _run_task(ti=ti, task=dag.task_dict[ti.task_id], run_triggerer=True)
            except Exception:  # noqa: BLE001 - the task's own state records the failure
                pass
    print(f"RERUN {dag_id} {run_id} {run.state}")
    return 0 if run.state == DagRunState.SUCCESS else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
