"""Every documented name of the core imports from the path the documentation gives, and every error
the provider raises on purpose is one class under one root, whichever of its import paths a caller
uses (the Airflow layer's names: tests/airflow_layer/test_public_api_airflow.py)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

pytestmark = [pytest.mark.core, pytest.mark.compat]

# The documented import paths and the names callers rely on at each.
CORE_NAMES = {
    "airflow_resumable": ["ResumableError"],
    "airflow_resumable.journal": [
        "StepJournal", "JournalError", "JobBusyError", "JobPrunedError", "JournalLocationError",
        "JournalCorruptError", "JournalDiskFullError", "JournalVersionError", "JournalConnectionError",
        "NotHeldError", "ResolutionError", "StaleDecisionError", "PageError", "Page", "HeldStep",
        "JobSummary", "StepRecord", "Resolution", "Status", "HeldReason", "DECISIONS", "SCHEMA_VERSION",
        "migrate",
    ],
    "airflow_resumable.runner": [
        "Step", "StepContext", "BatchResult", "HeldStep", "run_batch", "verify_held", "InvalidItemError",
        "InvalidStepOutputError", "NotSentError", "BatchStopped", "NOT_DELIVERED", "canonical_digest",
        "idempotency_key", "BatchProgress", "decide", "Action",
    ],
    "airflow_resumable.errors": ["ResumableError"],
    "airflow_resumable.journal.errors": [
        "JournalError", "JobBusyError", "NotHeldError", "ResolutionError", "StaleDecisionError", "PageError",
    ],
}


def _import(module: str):
    # The old receiver paths warn that they are deprecated: asserted below, not wanted here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(module)


@pytest.mark.parametrize("module", sorted(CORE_NAMES))
def test_the_cores_documented_names_import_from_their_documented_paths(module):
    imported = _import(module)
    missing = [name for name in CORE_NAMES[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"


def _error_names(names: dict[str, list[str]]) -> list[tuple[str, str]]:
    return [(module, name) for module, listed in sorted(names.items()) for name in listed
            if name.endswith(("Error", "Unreachable", "NotSent", "Unknown", "Refused", "Stopped", "Rejected",
                              "Message"))]


def _check_one_class_under_one_root(module: str, name: str) -> None:
    from airflow_resumable.exceptions import ResumableError

    exceptions = importlib.import_module("airflow_resumable.exceptions")
    cls = getattr(_import(module), name)
    assert getattr(exceptions, name) is cls, f"{module}.{name} is not airflow_resumable.exceptions.{name}"
    assert issubclass(cls, ResumableError), f"{name} is not a ResumableError"


@pytest.mark.parametrize(("module", "name"), _error_names(CORE_NAMES))
def test_each_core_error_is_one_class_in_exceptions_under_resumable_error(module, name):
    _check_one_class_under_one_root(module, name)


def test_the_exceptions_module_imports_nothing_from_airflow():
    # A fresh interpreter: this one may have Airflow loaded by other tests.
    code = ("import sys, airflow_resumable.exceptions as e, airflow_resumable.journal, airflow_resumable.runner; "
            "print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_errors_are_built_with_their_fields():
    from airflow_resumable.exceptions import JobBusyError, MailNotSent, ReceiverError

    busy = JobBusyError("job 'a' is already running", holder="pid 7 on w1", runner="task")
    assert (busy.holder, busy.runner, str(busy)) == ("pid 7 on w1", "task", "job 'a' is already running")
    assert JobBusyError("busy").holder == "holder unknown"
    assert ReceiverError(503).status == 503
    not_sent = MailNotSent("DATA", "ConnectionResetError")
    assert (not_sent.stage, not_sent.cause) == ("DATA", "ConnectionResetError")


def test_an_unknown_name_is_an_attribute_error():
    exceptions = importlib.import_module("airflow_resumable.exceptions")
    with pytest.raises(AttributeError, match="NoSuchError"):
        exceptions.NoSuchError  # noqa: B018
