"""Re-run an existing DAG run in-process, as the scheduler would after a UI "Clear".

Usage: python -m tests.airflow_rerun DAG_ID RUN_ID. `dag.test()` with the run's own logical date and
run_after finds the existing DagRun, clears its task instances with Airflow's own clear, and runs
them again (try_number goes up, the task state store is kept).
"""

from __future__ import annotations

import sys


def main(dag_id: str, run_id: str) -> int:
    from airflow.dag_processing.dagbag import DagBag
    from airflow.models.dagrun import DagRun
    from airflow.utils.session import create_session

    with create_session() as session:
        run = session.query(DagRun).filter_by(dag_id=dag_id, run_id=run_id).one()
        logical_date, run_after = run.logical_date, run.run_after
    dag = DagBag().get_dag(dag_id)
    finished = dag.test(logical_date=logical_date, run_after=run_after)
    print(f"RERUN {dag_id} {finished.run_id} {finished.state}")
    assert finished.run_id == run_id, "dag.test() created a new run instead of re-running the old one"
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
