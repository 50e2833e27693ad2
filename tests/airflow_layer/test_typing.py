"""A DAG author's type checker checks their callbacks against the operator's signature: ``mypy --strict``
passes a DAG whose ``notify``/``verify`` have the shapes :data:`~airflow_resumable.runner.StepFn` and
``VerifyFn`` name, and fails one that gets them wrong.

mypy reads this package as a user's would (its ``py.typed``); Airflow's own modules are skipped
(``follow_imports = skip``): what is under test is this package's hints, and analysing Airflow would
cost a minute of CPU for nothing this test asserts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

MYPY_CONFIG = """\
[mypy]
strict = True
[mypy-airflow_resumable.*]
follow_imports = silent
[mypy-airflow.*]
follow_imports = skip
ignore_missing_imports = True
"""

HEADER = """\
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow.sdk import DAG

from airflow_resumable.operators.resumable_batch import ResumableBatchOperator
from airflow_resumable.runner import NOT_DELIVERED, NotDelivered, Step, StepContext
"""

GOOD_DAG = HEADER + """

def notify(item: Mapping[str, Any], ctx: StepContext) -> str:
    return f"receipt-{item['id']}-{ctx.idempotency_key}"


def verify(ctx: StepContext) -> str | NotDelivered | None:
    return NOT_DELIVERED if ctx.generation == 0 else None


with DAG("typed_callbacks"):
    ResumableBatchOperator(task_id="shorthand", items=[{"id": 1}], notify=notify, verify=verify)
    ResumableBatchOperator(task_id="steps", items=[{"id": 1}],
                           steps=[Step("notify", notify, side_effect=True, verify=verify)])
"""

BAD_DAG = HEADER + """

def notify(item: Mapping[str, Any]) -> str:  # forgets the step context
    return str(item["id"])


def verify(ctx: StepContext) -> int:  # a receipt is text, NOT_DELIVERED or None
    return 0


with DAG("mistyped_callbacks"):
    ResumableBatchOperator(task_id="shorthand", items=[{"id": 1}], notify=notify, verify=verify)
    Step("notify", notify, side_effect=True, verify=verify)
"""


def mypy(tmp_path: Path, dag: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "dag.py").write_text(dag)
    (tmp_path / "mypy.ini").write_text(MYPY_CONFIG)
    # The editable install is an import hook mypy does not follow: the checkout is its search path.
    env = {**os.environ, "MYPYPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--cache-dir", str(tmp_path / "cache"),
         "--no-error-summary", "dag.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )


def test_the_package_says_it_is_typed():
    assert (REPO / "airflow_resumable" / "py.typed").is_file()


def test_callbacks_of_the_right_shape_pass_mypy_strict(tmp_path):
    done = mypy(tmp_path, GOOD_DAG)
    assert done.returncode == 0, done.stdout + done.stderr


def test_callbacks_of_the_wrong_shape_fail_mypy_strict(tmp_path):
    done = mypy(tmp_path, BAD_DAG)
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert done.returncode == 1, done.stdout + done.stderr
    # Each misuse is named, at the argument it was passed as, and nothing else is reported.
    assert len(errors) == 4, errors
    assert sum('Argument "notify" to "ResumableBatchOperator"' in e for e in errors) == 1, errors
    assert sum('Argument "verify" to "ResumableBatchOperator"' in e for e in errors) == 1, errors
    assert sum('to "Step"' in e for e in errors) == 2, errors
    assert all("[arg-type]" in e for e in errors), errors
