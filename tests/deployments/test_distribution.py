"""The package as a user gets it: build the sdist and wheel, check them, install the wheel into a fresh
virtual environment (no editable install, not run from this checkout) and run the article DAG from the
installed provider's own example DAGs through ``airflow dags test``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.support.airflow_harness import REPO

pytestmark = pytest.mark.airflow

TEMPLATES = {"base.html", "error.html", "held_table.html", "job.html", "jobs.html", "resolve.html"}
EXAMPLES = {"resolve_held_item.py", "article_scenario.py", "article_email.py", "paced_retry.py"}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(REPO)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out


def _one(folder: Path, pattern: str) -> Path:
    (found,) = folder.glob(pattern)
    return found


def _json_line(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("["))


def test_twine_check_passes(dist):
    proc = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, dist.iterdir())],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASSED") == 2, proc.stdout


def test_wheel_holds_templates_example_dags_license_and_provider_metadata(dist):
    from airflow_resumable import __version__

    wheel = _one(dist, f"airflow_provider_resumable-{__version__}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        info = f"airflow_provider_resumable-{__version__}.dist-info"
        entry_points = zf.read(f"{info}/entry_points.txt").decode()
        metadata = zf.read(f"{info}/METADATA").decode()
    assert {f"airflow_resumable/plugins/templates/{t}" for t in TEMPLATES} <= names
    assert {f"airflow_provider_resumable/example_dags/{e}" for e in EXAMPLES} <= names
    assert "airflow_resumable/py.typed" in names  # a DAG author's type checker reads the package's hints
    assert f"{info}/licenses/LICENSE" in names
    assert not any(n.startswith(("tests/", "demo/", "benchmarks/", "dags/")) for n in names), sorted(names)
    assert "provider_info = airflow_resumable.get_provider_info:get_provider_info" in entry_points
    assert "resumable_jobs = airflow_resumable.plugins:ResumableJobsPlugin" in entry_points
    assert "airflow-resumable = airflow_resumable.cli:main" in entry_points
    assert "Requires-Python: >=3.10" in metadata
    assert "License-Expression: Apache-2.0" in metadata
    assert "Requires-Dist: pendulum>=3.0" in metadata
    assert "Requires-Dist: apache-airflow>=3.1; extra == \"airflow\"" in metadata
    # The classifiers name exactly the Python minors the matrix proves (3.10 and 3.13 in the matrix,
    # 3.11 in `make test`, 3.12 between them).
    assert {line.rsplit(":: ", 1)[1] for line in metadata.splitlines()
            if line.startswith("Classifier: Programming Language :: Python :: 3.")} == {"3.10", "3.11", "3.12", "3.13"}


def test_sdist_holds_the_package_and_license(dist):
    from airflow_resumable import __version__

    sdist = _one(dist, f"airflow_provider_resumable-{__version__}.tar.gz")
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "LICENSE", "airflow_resumable/journal/sqlite.py",
            "airflow_provider_resumable/example_dags/resolve_held_item.py"} <= names
    assert {f"airflow_resumable/plugins/templates/{t}" for t in TEMPLATES} <= names


def test_installed_wheel_lists_as_a_provider_and_runs_the_article_dag(dist, tmp_path):
    from airflow_resumable import __version__

    wheel = _one(dist, "*.whl")
    venv = tmp_path / "venv"
    # uv (the test extra) makes the environment and installs into it as pip would, in seconds of CPU, not a minute.
    uv = [sys.executable, "-m", "uv"]
    uv_env = {**os.environ, "UV_PYTHON_DOWNLOADS": "never"}
    subprocess.run([*uv, "venv", "--quiet", "--python", sys.executable, str(venv)], check=True, timeout=120, env=uv_env)
    python, bin_dir = venv / "bin" / "python", venv / "bin"
    pip = subprocess.run(
        [*uv, "pip", "install", "--quiet", "--compile-bytecode", "--python", str(python), f"{wheel}[http]",
         f"apache-airflow=={version('apache-airflow')}"],
        capture_output=True, text=True, timeout=900, env=uv_env,
    )
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]

    work = tmp_path / "elsewhere"  # not this checkout: nothing may be imported from the repository
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON", "VIRTUAL_ENV"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", AIRFLOW_HOME=str(tmp_path / "home"),
               AIRFLOW__CORE__LOAD_EXAMPLES="False", AIRFLOW__CORE__UNIT_TEST_MODE="False")

    def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(list(args), cwd=work, env=env, capture_output=True, text=True, timeout=timeout)

    where = run(str(python), "-c", "import airflow_provider_resumable.example_dags as e, airflow_resumable as r, "
                                   "json; print(json.dumps([r.__file__, list(e.__path__)[0], r.__version__]))")
    assert where.returncode == 0, where.stderr
    package_file, examples, installed_version = json.loads(where.stdout)
    site = str(venv / "lib")
    assert package_file.startswith(site) and examples.startswith(site), (package_file, examples)
    assert installed_version == __version__
    assert {p.name for p in Path(examples).glob("*.py")} >= EXAMPLES

    migrate = run(str(bin_dir / "airflow"), "db", "migrate")
    assert migrate.returncode == 0, migrate.stderr[-3000:]
    providers = run(str(bin_dir / "airflow"), "providers", "list", "-o", "json")
    assert providers.returncode == 0, providers.stderr[-3000:]
    ours = [p for p in json.loads(_json_line(providers.stdout)) if p["package_name"] == "airflow-provider-resumable"]
    assert [p["version"] for p in ours] == [__version__], providers.stdout
    # With [core] load_examples on, Airflow finds the provider's example DAGs (the resolve DAG among them).
    examples_env = {**env, "AIRFLOW__CORE__LOAD_EXAMPLES": "True"}
    listed = subprocess.run([str(bin_dir / "airflow"), "dags", "list", "--local", "-o", "json",
                             "-B", "airflow-provider-resumable-example-dags"],
                            cwd=work, env=examples_env, capture_output=True, text=True, timeout=300)
    assert listed.returncode == 0, listed.stderr[-3000:]
    # Airflow prints its warnings (no graphviz) to stdout as well: the JSON is the line that starts with "[".
    dags = {d["dag_id"]: d["fileloc"] for d in json.loads(_json_line(listed.stdout))}
    assert set(dags) == {"resolve_held_item", "article_resumable", "article_resumable_verify",
                         "article_rerun_everything", "article_review", "article_email",
                         "article_email_rerun_everything", "receiver_paced_retry", "article_settled"}, listed.stdout
    assert all(path.startswith(examples) for path in dags.values()), dags

    receiver = subprocess.Popen(
        [str(python), "-m", "airflow_resumable.demo_receiver", "--port", "0", "--db", str(tmp_path / "received.db"),
         "--no-dedupe"], cwd=work, env=env, stdout=subprocess.PIPE, text=True,
    )
    try:
        url = receiver.stdout.readline().split()[3]  # "demo receiver on http://127.0.0.1:PORT (...)"
        # The article DAG straight from the installed package's example DAGs.
        env.update(AIRFLOW__CORE__DAGS_FOLDER=examples,
                   AIRFLOW_CONN_DEMO_RECEIVER=json.dumps({"conn_type": "http", "host": url}))
        test = run(str(bin_dir / "airflow"), "dags", "test", "article_resumable", timeout=600)
        assert test.returncode == 0, (test.stdout + test.stderr)[-4000:]
        import urllib.request

        with urllib.request.urlopen(url + "/stats", timeout=10) as response:
            stats = json.loads(response.read())
    finally:
        receiver.terminate()
        receiver.wait(timeout=10)
    assert (stats["items"], stats["duplicates"]) == (50, 0), stats
    # The installed CLI reads the journal the installed operator wrote (default path under AIRFLOW_HOME).
    jobs = run(str(bin_dir / "airflow-resumable"), "jobs", "--json")
    assert jobs.returncode == 0, jobs.stderr
    (job,) = json.loads(jobs.stdout)
    assert job["job_id"].startswith("article_resumable/send/") and (job["SUCCEEDED"], job["held"]) == (150, 0), job
