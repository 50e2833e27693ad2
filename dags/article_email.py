"""The article's scenario for e-mail, for this repository's demo and docker-compose: the provider's example
DAGs (``airflow_provider_resumable/example_dags/article_email.py``), loaded from the installed package."""

from airflow_provider_resumable.example_dags.article_email import (  # noqa: F401
    article_email,
    article_email_rerun_everything,
)
