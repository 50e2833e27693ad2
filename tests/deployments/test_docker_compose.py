"""docker-compose.yaml (the official CeleryExecutor layout, shared journal) and its single-host override
are checked by parsing them (no Docker engine here): the pieces must agree with each other."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

REPO = Path(__file__).resolve().parents[2]
AIRFLOW_SERVICES = ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-worker",
                    "airflow-triggerer", "airflow-init")


def load(name: str = "docker-compose.yaml") -> dict[str, Any]:
    return yaml.safe_load((REPO / name).read_text())


def _merge_service(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Compose's merge rules for the keys these files use: mappings merge (override wins), volumes
    merge by their mount point, anything else is replaced."""
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if key in ("environment", "depends_on") and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        elif key == "volumes":
            mounts = {v.split(":")[1]: v for v in merged.get(key, [])}
            mounts.update({v.split(":")[1]: v for v in value})
            merged[key] = list(mounts.values())
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def single_host() -> dict[str, Any]:
    """`docker compose -f docker-compose.yaml -f docker-compose.single-host.yaml config`, as far as used here."""
    compose, override = load(), load("docker-compose.single-host.yaml")
    for name, service in override["services"].items():
        assert name in compose["services"], f"the override names a service the base file lacks: {name}"
        compose["services"][name] = _merge_service(compose["services"][name], service)
    compose["volumes"] = {**compose.get("volumes", {}), **override.get("volumes", {})}
    return compose


def active(compose: dict[str, Any]) -> dict[str, Any]:
    """The services `docker compose up` starts with no --profile."""
    return {name: s for name, s in compose["services"].items() if not s.get("profiles")}


def test_celery_layout_of_the_official_compose_file():
    services = load()["services"]
    for name in ("postgres", "redis", *AIRFLOW_SERVICES, "demo-receiver"):
        assert name in services and not services[name].get("profiles"), name
    broker = None
    for name in AIRFLOW_SERVICES:
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        assert urlsplit(env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]).hostname == "postgres"
        # SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3; Celery's result backend needs psycopg2.
        assert env["AIRFLOW__CELERY__RESULT_BACKEND"].startswith("db+postgresql+psycopg2://")
        broker = urlsplit(env["AIRFLOW__CELERY__BROKER_URL"])
        assert broker.scheme == "redis" and broker.hostname == "redis" and broker.port == 6379
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == "http://airflow-apiserver:8080/execution/"
        depends = services[name]["depends_on"]
        assert depends["postgres"]["condition"] == depends["redis"]["condition"] == "service_healthy", name
        if name != "airflow-init":
            assert depends["airflow-init"]["condition"] == "service_completed_successfully", name
    assert broker is not None and str(broker.port) in [str(p) for p in services["redis"]["expose"]]
    assert services["airflow-worker"]["command"] == "celery worker"
    assert services["airflow-worker"]["environment"]["DUMB_INIT_SETSID"] == "0"  # warm shutdown, as upstream
    assert services["airflow-worker"]["depends_on"]["airflow-apiserver"]["condition"] == "service_healthy"
    assert services["airflow-init"]["command"][-1].split(" && ")[0] == "airflow db migrate"
    commands = {"airflow-apiserver": "api-server", "airflow-scheduler": "scheduler",
                "airflow-dag-processor": "dag-processor", "airflow-triggerer": "triggerer"}
    for name, command in commands.items():
        assert services[name]["command"] == command, name
        assert services[name]["healthcheck"]["test"], name


def test_every_process_shares_the_token_secrets():
    services = load()["services"]
    for key in ("AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__API__SECRET_KEY"):
        assert len({services[name]["environment"][key] for name in AIRFLOW_SERVICES}) == 1, key


def test_the_journal_is_shared_on_the_postgres_service():
    services = load()["services"]
    pg_env = services["postgres"]["environment"]
    for name in AIRFLOW_SERVICES:  # workers write it; the triggerer and the API server read it
        env = services[name]["environment"]
        conn_id = env["AIRFLOW__RESUMABLE__JOURNAL_CONN_ID"]
        conn = json.loads(env[f"AIRFLOW_CONN_{conn_id.upper()}"])
        assert conn["conn_type"] == "postgres" and conn["host"] == "postgres", name
        assert (conn["login"], conn["password"], conn["schema"]) == (
            pg_env["POSTGRES_USER"], pg_env["POSTGRES_PASSWORD"], pg_env["POSTGRES_DB"])
        assert conn["extra"]["journal_schema"] == "resumable"  # its own schema, next to Airflow's tables
        assert "AIRFLOW__RESUMABLE__JOURNAL_PATH" not in env
    assert "postgres-db-volume" in load()["volumes"]


def test_provider_installed_from_the_repo_by_a_dockerfile():
    compose = load()
    assert compose["services"]["airflow-scheduler"]["build"] == "."
    dockerfile = (REPO / "Dockerfile").read_text()
    assert "FROM apache/airflow:${AIRFLOW_VERSION}" in dockerfile and "ARG AIRFLOW_VERSION=3." in dockerfile
    assert "pip install" in dockerfile and "/opt/provider[http,postgres]" in dockerfile
    assert "_PIP_ADDITIONAL_REQUIREMENTS" not in (REPO / "docker-compose.yaml").read_text()


def test_dags_mounted():
    for compose in (load(), single_host()):
        for name, service in active(compose).items():
            if name.startswith("airflow-"):
                volumes = dict(v.split(":", 1) for v in service["volumes"])
                assert volumes["./dags"] == "/opt/airflow/dags", name
    assert (REPO / "dags" / "resolve_held_item.py").exists()


def test_receiver_service_and_connection_agree():
    for compose in (load(), single_host()):
        receiver = compose["services"]["demo-receiver"]
        assert receiver["entrypoint"][-1] == "airflow_resumable.demo_receiver"
        port = receiver["command"][receiver["command"].index("--port") + 1]
        for name in AIRFLOW_SERVICES:
            conn = json.loads(compose["services"][name]["environment"]["AIRFLOW_CONN_DEMO_RECEIVER"])
            assert conn["conn_type"] == "http" and conn["host"] == f"http://demo-receiver:{port}"
    # The DAGs use the same connection id.
    article = REPO / "airflow_provider_resumable" / "example_dags" / "article_scenario.py"
    assert 'HttpReceiver("demo_receiver"' in article.read_text()
    assert "from airflow_provider_resumable.example_dags.article_scenario import" in (
        REPO / "dags" / "article_scenario.py").read_text()


def test_single_host_override_keeps_the_local_sqlite_layout():
    compose = single_host()
    services = active(compose)
    assert "airflow-worker" not in services  # only with --profile celery
    assert compose["services"]["airflow-worker"]["profiles"] == ["celery"]
    for name in ("airflow-apiserver", "airflow-scheduler", "airflow-dag-processor", "airflow-triggerer",
                 "airflow-init"):
        env = services[name]["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor", name
        assert env["AIRFLOW__RESUMABLE__JOURNAL_CONN_ID"] == "", name  # empty: journal_path wins
        assert env["AIRFLOW__RESUMABLE__JOURNAL_PATH"] == "/opt/airflow/journal/journal.sqlite3", name
    # Tasks run in the scheduler container (LocalExecutor): the journal is on a named volume there, and
    # the API server mounts the same volume for the "Resumable jobs" page.
    for name in ("airflow-scheduler", "airflow-apiserver"):
        service = services[name]
        volumes = {target: source for source, target in (v.split(":", 1) for v in service["volumes"])}
        journal_path = service["environment"]["AIRFLOW__RESUMABLE__JOURNAL_PATH"]
        mount = str(Path(journal_path).parent)
        assert volumes[mount] == "journal" and "journal" in compose["volumes"], name
        assert "./dags" in volumes.values(), name  # the base file's mounts are kept


def test_the_init_service_migrates_the_shared_journal_before_any_worker_starts():
    services = load()["services"]
    init = services["airflow-init"]
    assert init["entrypoint"] == "/bin/bash" and init["command"][0] == "-c"
    # Each step must succeed (&&): a failed journal migration fails the init, and nothing starts.
    assert init["command"][-1].split(" && ") == ["airflow db migrate", "airflow-resumable migrate"]
    # No --journal/--conn-id: it migrates the journal the config names, the one every process uses.
    assert init["environment"]["AIRFLOW__RESUMABLE__JOURNAL_CONN_ID"] == services["airflow-worker"]["environment"][
        "AIRFLOW__RESUMABLE__JOURNAL_CONN_ID"]
    for name in AIRFLOW_SERVICES:
        if name != "airflow-init":
            assert services[name]["depends_on"]["airflow-init"]["condition"] == "service_completed_successfully"


def test_the_single_host_init_runs_the_same_command_and_it_succeeds_without_a_journal(tmp_path):
    """One host: the journal is a SQLite file on a volume the init container does not mount. The same
    init command finds none there, says so, exits 0 (the init succeeds) and creates nothing."""
    import os
    import subprocess
    import sys

    init = single_host()["services"]["airflow-init"]
    assert init["command"] == load()["services"]["airflow-init"]["command"]
    journal_path = Path(init["environment"]["AIRFLOW__RESUMABLE__JOURNAL_PATH"])
    env = {**os.environ, **{k: v for k, v in init["environment"].items() if k.startswith("AIRFLOW__RESUMABLE__")},
           # the same layout here: a journal folder nothing has mounted
           "AIRFLOW__RESUMABLE__JOURNAL_PATH": str(tmp_path / "unmounted" / journal_path.name)}
    assert env["AIRFLOW__RESUMABLE__JOURNAL_CONN_ID"] == ""  # empty: journal_path wins
    cli = str(Path(sys.executable).with_name("airflow-resumable"))
    migrated = subprocess.run([cli, "migrate"], env=env, capture_output=True, text=True, timeout=60)
    assert migrated.returncode == 0, migrated.stderr
    assert "none yet" in migrated.stdout and not (tmp_path / "unmounted").exists()
