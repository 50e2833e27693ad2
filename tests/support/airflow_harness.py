"""Real Airflow for tests: a SQLite metadata DB in a temporary AIRFLOW_HOME, `airflow` CLI in
subprocesses (`airflow dags test` runs tasks in-process and honours retries)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tests.support import airflow_forkserver
from tests.support.airflow_metadata import MetadataDB

REPO = Path(__file__).resolve().parents[2]  # this file is tests/support/<name>.py
AIRFLOW = str(Path(sys.executable).with_name("airflow"))


def base_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
    env.update(
        AIRFLOW_HOME=str(home),
        AIRFLOW__CORE__LOAD_EXAMPLES="False",
        AIRFLOW__CORE__DAGS_FOLDER=str(home / "dags"),
        # airflow.cfg holds absolute paths: a copied home must point at its own metadata DB and logs.
        # Two `airflow dags test` processes share this metadata DB in some tests (a batch whose sensor
        # waits, and the resolve DAG): wait up to 60 s for the other's write, not sqlite3's default 5 s.
        AIRFLOW__DATABASE__SQL_ALCHEMY_CONN=f"sqlite:///{home / 'airflow.db'}?timeout=60",
        AIRFLOW__LOGGING__BASE_LOG_FOLDER=str(home / "logs"),
        AIRFLOW__CORE__UNIT_TEST_MODE="False",
        AIRFLOW__LOGGING__LOGGING_LEVEL="INFO",
        PYTHONPATH=os.pathsep.join([str(REPO), str(home / "dags")]),
    )
    return env


def migrated_template(root: Path, dag_files: list[Path] | None = None) -> Path:
    """An AIRFLOW_HOME with a migrated SQLite metadata DB and our DAGs, to copy per test."""
    home = root / "airflow-template"
    dags = home / "dags"
    dags.mkdir(parents=True)
    if dag_files is None:
        dag_files = [*(REPO / "tests" / "airflow_dags").glob("*.py"), REPO / "dags" / "resolve_held_item.py"]
    for source in dag_files:
        shutil.copy(source, dags / source.name)
    subprocess.run([AIRFLOW, "db", "migrate"], env=base_env(home), check=True, capture_output=True)
    return home


@dataclass
class Background:
    """A background `airflow` process whose output goes to a file (see :meth:`Airflow.popen`)."""

    proc: subprocess.Popen[bytes]
    output: Path

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=60)

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """Wait for the process to end; its whole output."""
        self.proc.wait(timeout=timeout)
        return self.output.read_text(errors="replace"), None


@dataclass
class Airflow:
    home: Path
    journal: Path
    receiver: Path
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, template: Path, tmp: Path) -> Airflow:
        home = tmp / "airflow"
        shutil.copytree(template, home)
        env = base_env(home)
        journal = tmp / "worker" / "journal.sqlite3"
        receiver = tmp / "receiver.sqlite3"
        env.update(AIRFLOW__RESUMABLE__JOURNAL_PATH=str(journal), RESUMABLE_TEST_RECEIVER=str(receiver))
        return cls(home, journal, receiver, env)

    def _command(self, argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
        """``airflow argv`` (or ``python -m ...`` when argv starts with "-m") run to its end: a fork of the
        pre-imported Airflow (tests/support/airflow_forkserver.py), or a new process when that is switched off."""
        server = airflow_forkserver.server(self.env, REPO)
        if server is not None:
            return server.run(argv, self.env, cwd, self.home / "commands", timeout)
        command = [sys.executable, *argv] if argv[0] == "-m" else [AIRFLOW, *argv]
        return subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout, cwd=cwd)

    def run(self, *args: str, check: bool = False, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        proc = self._command(list(args), Path.cwd(), timeout)
        (self.home / "last-output.txt").write_text(proc.stdout + proc.stderr)
        if check and proc.returncode != 0:
            raise AssertionError(f"airflow {' '.join(args)} failed:\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}")
        return proc

    def rerun(self, dag_id: str, run_id: str) -> subprocess.CompletedProcess[str]:
        """Re-run an existing DAG run after its tasks were cleared (what the scheduler does)."""
        proc = self._command(["-m", "tests.support.airflow_rerun", dag_id, run_id], REPO, 300)
        (self.home / "last-output.txt").write_text(proc.stdout + proc.stderr)
        return proc

    def popen(self, *args: str) -> Background:
        """`airflow <args>` in the background, its output going to a file: a pipe nobody reads while
        the test does other things fills up, and Airflow then blocks writing a log line - in
        `dags test`, with a write transaction of the SQLite metadata DB open, locking everyone out."""
        output = self.home / f"background-{len(list(self.home.glob('background-*')))}.txt"
        handle = output.open("w")
        try:
            proc = subprocess.Popen([AIRFLOW, *args], env=self.env, stdout=handle, stderr=subprocess.STDOUT)
        finally:
            handle.close()
        return Background(proc, output)

    def dags_test(self, dag_id: str, conf: dict | None = None, *extra: str) -> subprocess.CompletedProcess[str]:
        args = ["dags", "test", dag_id, *extra]
        if conf is not None:
            args += ["-c", json.dumps(conf)]
        return self.run(*args)

    # -- reading the metadata DB (tests/support/airflow_metadata.py: version-checked, read-only) ---

    @property
    def metadata(self) -> MetadataDB:
        return MetadataDB(self.home / "airflow.db")

    def last_run_id(self, dag_id: str) -> str:
        return self.metadata.last_run_id(dag_id)

    def run_state(self, dag_id: str) -> str:
        return self.metadata.run_state(dag_id)

    def task_states(self, dag_id: str, run_id: str | None = None) -> dict[tuple[str, int], tuple[str, int]]:
        return self.metadata.task_states(dag_id, run_id or self.last_run_id(dag_id))

    def hostname(self, dag_id: str, task_id: str, run_id: str | None = None) -> str:
        """The host Airflow recorded for the task's last try ([core] hostname_callable)."""
        return self.metadata.hostname(dag_id, task_id, run_id or self.last_run_id(dag_id))

    def xcom(self, dag_id: str, task_id: str, key: str = "return_value", map_index: int = -1,
             run_id: str | None = None):
        return self.metadata.xcom(dag_id, task_id, run_id or self.last_run_id(dag_id), key, map_index)
