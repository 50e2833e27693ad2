"""Provider metadata, read by Airflow through the ``apache_airflow_provider`` entry point."""

from __future__ import annotations

from typing import Any

from airflow_resumable import __version__


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "airflow-provider-resumable",
        "name": "Resumable batches",
        "description": "Resumable batch tasks: a durable step journal so retries and Clear resume "
        "instead of re-sending, and uncertain sends are held for a human.",
        "versions": [__version__],
    }
