"""The article's DAGs for this repository's demo and docker-compose: the provider's example DAGs
(``airflow_provider_resumable/example_dags/article_scenario.py``), loaded from the installed package."""

from airflow_provider_resumable.example_dags.article_scenario import (  # noqa: F401
    article_rerun_everything,
    article_resumable,
    article_resumable_verify,
    article_review,
    article_settled,
)
