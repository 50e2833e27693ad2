from __future__ import annotations

import pytest

from tests.airflow_harness import Airflow, migrated_template


@pytest.fixture(scope="session")
def airflow_template(tmp_path_factory):
    return migrated_template(tmp_path_factory.mktemp("airflow"))


@pytest.fixture
def airflow(airflow_template, tmp_path) -> Airflow:
    return Airflow.create(airflow_template, tmp_path)
