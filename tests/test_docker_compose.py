"""docker-compose.yaml is checked by parsing it (no Docker engine here): the pieces must agree."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def load():
    return yaml.safe_load((REPO / "docker-compose.yaml").read_text())


def test_services_and_executor():
    compose = load()
    services = compose["services"]
    for name in ("postgres", "airflow-init", "airflow-apiserver", "airflow-scheduler",
                 "airflow-dag-processor", "airflow-triggerer", "demo-receiver"):
        assert name in services, name
    for name in ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer"):
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith("postgresql")
        assert "@postgres/" in env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        assert services[name]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"
        assert "AIRFLOW__CORE__EXECUTION_API_SERVER_URL" in env
    assert services["airflow-init"]["command"][-1] == "airflow db migrate"


def test_provider_installed_from_the_repo_by_a_dockerfile():
    compose = load()
    assert compose["services"]["airflow-scheduler"]["build"] == "."
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "FROM apache/airflow:${AIRFLOW_VERSION}" in dockerfile and "ARG AIRFLOW_VERSION=3." in dockerfile
    assert "pip install" in dockerfile and "/opt/provider[http]" in dockerfile
    assert "_PIP_ADDITIONAL_REQUIREMENTS" not in (REPO / "docker-compose.yaml").read_text()


def test_dags_mounted_and_journal_on_a_named_volume():
    compose = load()
    scheduler = compose["services"]["airflow-scheduler"]
    volumes = dict(v.split(":", 1) for v in scheduler["volumes"])
    assert volumes["./dags"] == "/opt/airflow/dags" and (REPO / "dags" / "resolve_held_item.py").exists()
    journal_path = scheduler["environment"]["AIRFLOW__RESUMABLE__JOURNAL_PATH"]
    mount = volumes["journal"]
    assert "journal" in compose["volumes"] and journal_path.startswith(mount + "/")


def test_receiver_service_and_connection_agree():
    compose = load()
    receiver = compose["services"]["demo-receiver"]
    assert receiver["entrypoint"][-1] == "airflow_resumable.demo_receiver"
    port = receiver["command"][receiver["command"].index("--port") + 1]
    conn = json.loads(compose["services"]["airflow-scheduler"]["environment"]["AIRFLOW_CONN_DEMO_RECEIVER"])
    assert conn["conn_type"] == "http" and conn["host"] == f"http://demo-receiver:{port}"
    # The DAGs use the same connection id.
    assert 'HttpNotifier("demo_receiver"' in (REPO / "dags" / "article_scenario.py").read_text()
