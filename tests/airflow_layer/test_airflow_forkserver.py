"""The tests' Airflow fork server (tests/support/airflow_forkserver.py) answers as a new `airflow` process would:
the command's own home and settings, its exit code, its output, and a timeout that ends only it."""

from __future__ import annotations

import subprocess

import pytest

from tests.support import airflow_forkserver
from tests.support.airflow_harness import Airflow

pytestmark = pytest.mark.compat


@pytest.fixture
def two_homes(airflow_template, tmp_path) -> tuple[Airflow, Airflow]:
    return Airflow.create(airflow_template, tmp_path / "a"), Airflow.create(airflow_template, tmp_path / "b")


def both_ways(airflow: Airflow, monkeypatch, *args: str) -> tuple[subprocess.CompletedProcess[str], ...]:
    forked = airflow.run(*args)
    assert (airflow.home / "commands" / "fork-stdout.txt").read_text() == forked.stdout  # it was a fork
    with monkeypatch.context() as m:
        m.setenv(airflow_forkserver.ENV_SWITCH, "0")
        new = airflow.run(*args)
    return forked, new


def test_each_fork_reads_its_own_home_and_settings(two_homes, monkeypatch):
    first, second = two_homes
    first.run("version", check=True)  # the server starts now (if it did not yet), from another home's environment
    second.env["AIRFLOW__RESUMABLE__DURABILITY"] = "normal"
    for home, durability in ((second, "normal"), (first, "full")):
        for args, expected in ((("config", "get-value", "core", "dags_folder"), str(home.home / "dags")),
                               (("config", "get-value", "resumable", "durability"), durability)):
            forked, new = both_ways(home, monkeypatch, *args)
            assert forked.returncode == new.returncode == 0, (forked.stderr, new.stderr)
            assert forked.stdout.strip() == new.stdout.strip() == expected


def test_a_failing_command_fails_with_its_output(airflow, monkeypatch):
    forked, new = both_ways(airflow, monkeypatch, "dags", "test", "no_such_dag")
    assert forked.returncode == new.returncode != 0
    assert "no_such_dag" in forked.stdout + forked.stderr
    assert "no_such_dag" in new.stdout + new.stderr


def test_a_command_past_its_timeout_is_killed_and_the_server_serves_the_next(airflow):
    with pytest.raises(subprocess.TimeoutExpired):
        airflow._command(["-m", "http.server", "0", "--bind", "127.0.0.1"], airflow.home, timeout=5)
    assert airflow.run("version").returncode == 0
