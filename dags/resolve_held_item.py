"""The resolve DAG in your DAGs folder: this file is all it takes (``[core] load_examples`` off).

Settle a held step by triggering it after checking the receiver's records (with the ``version`` that
``airflow-resumable held`` or the Resumable jobs page showed: a step that changed since is refused), then
Clear the batch task.
Who may trigger it may settle any job it reaches: see ``resolve_held_item_dag`` for per-team copies.
"""

from airflow_resumable.operators.resolve import resolve_held_item_dag

dag = resolve_held_item_dag()
