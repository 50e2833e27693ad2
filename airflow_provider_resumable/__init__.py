"""The provider's example DAGs, under the import name of the distribution (``airflow-provider-resumable``).

The provider's code is ``airflow_resumable``. This package holds only ``example_dags/``: Airflow (3.3+)
finds a provider's example DAGs in ``<import name of the distribution>/example_dags`` and loads them
when ``[core] load_examples`` is on. They are:

* ``resolve_held_item``: the resolve DAG (see ``airflow_resumable.operators.resolve.resolve_held_item_dag``);
* ``article_resumable``, ``article_resumable_verify``, ``article_rerun_everything``: the article's
  scenario against the demo receiver (Airflow connection ``demo_receiver``);
* ``article_review``: the same batch whose held items become Airflow "Required actions"
  (``airflow_resumable.operators.review.ReviewHeldItemsOperator``), then a second pass;
* ``receiver_paced_retry``: a batch whose next try comes when the receiver's ``Retry-After`` says
  (``airflow_resumable.retry_policy.RetryAfterPolicy``, Airflow 3.3).

With examples off (production), put ``dag = resolve_held_item_dag()`` in a file of your DAGs folder.
"""
