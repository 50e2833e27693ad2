"""Every documented name imports from the path the documentation gives, and every error the provider
raises on purpose is one class under one root, whichever of its import paths a caller uses."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

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
AIRFLOW_NAMES = {
    "airflow_resumable.operators.resumable_batch": [
        "ResumableBatchOperator", "WrongWorkerError", "HeldItemsError", "HeldItemsNeedAHumanError",
    ],
    "airflow_resumable.operators.resolve": ["ResolveOperator", "ResolutionRefused", "resolve_held_item_dag"],
    "airflow_resumable.sensors.held_items": ["HeldItemSensor"],
    "airflow_resumable.receivers.http": ["HttpReceiver", "ReceiverError", "ReceiverUnreachable"],
    "airflow_resumable.receivers.smtp": [
        "SmtpReceiver", "MailNotSent", "MailRejected", "InvalidMessage", "MailOutcomeUnknown", "ArchiveError",
    ],
    # The receivers' first home, kept (with a DeprecationWarning) for DAGs written against it.
    "airflow_resumable.notifiers.http": ["HttpReceiver", "ReceiverError", "ReceiverUnreachable"],
    "airflow_resumable.notifiers.smtp": ["SmtpReceiver", "MailNotSent", "MailOutcomeUnknown", "ArchiveError"],
    "airflow_resumable.hooks.journal": ["JournalConfigError", "journal_target", "JournalTarget"],
    "airflow_resumable._airflow": ["JournalConfigError", "journal_target", "JournalTarget"],
    "airflow_resumable.decision_input": ["DecisionInputError"],
    "airflow_resumable._time": ["DurationError"],
}


def _import(module: str):
    # The old receiver paths warn that they are deprecated: asserted below, not wanted here.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return importlib.import_module(module)


def _airflow_installed() -> bool:
    try:
        importlib.import_module("airflow.sdk")
    except ImportError:
        return False
    return True


needs_airflow = pytest.mark.skipif(not _airflow_installed(), reason="the Airflow layer needs Airflow installed")


@pytest.mark.parametrize("module", sorted(CORE_NAMES))
def test_the_cores_documented_names_import_from_their_documented_paths(module):
    imported = _import(module)
    missing = [name for name in CORE_NAMES[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"


@needs_airflow
@pytest.mark.parametrize("module", sorted(AIRFLOW_NAMES))
def test_the_airflow_layers_documented_names_import_from_their_documented_paths(module):
    imported = _import(module)
    missing = [name for name in AIRFLOW_NAMES[module] if not hasattr(imported, name)]
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


@needs_airflow
@pytest.mark.parametrize(("module", "name"), _error_names(AIRFLOW_NAMES))
def test_each_airflow_layer_error_is_one_class_in_exceptions_under_resumable_error(module, name):
    _check_one_class_under_one_root(module, name)


def test_the_exceptions_module_imports_nothing_from_airflow():
    # A fresh interpreter: this one may have Airflow loaded by other tests.
    code = ("import sys, airflow_resumable.exceptions as e, airflow_resumable.journal, airflow_resumable.runner; "
            "print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


@needs_airflow
@pytest.mark.parametrize("name", ["http", "smtp"])
def test_a_receivers_old_import_path_is_the_same_module_with_a_deprecation_warning(name):
    # A fresh interpreter: in this one the module may be imported already (a warning is given once).
    code = (f"import warnings; warnings.simplefilter('always')\n"
            f"with warnings.catch_warnings(record=True) as seen:\n"
            f"    import airflow_resumable.notifiers.{name} as old\n"
            f"import airflow_resumable.receivers.{name} as new\n"
            f"assert old is new, (old, new)\n"
            f"print([str(w.message) for w in seen if issubclass(w.category, DeprecationWarning)])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "airflow_resumable.notifiers is deprecated: import the receivers from airflow_resumable.receivers" in out


def test_errors_are_built_with_their_fields():
    from airflow_resumable.exceptions import JobBusyError, MailNotSent, ReceiverError

    busy = JobBusyError("job 'a' is already running", holder="pid 7 on w1", runner="task")
    assert (busy.holder, busy.runner, str(busy)) == ("pid 7 on w1", "task", "job 'a' is already running")
    assert JobBusyError("busy").holder == "holder unknown"
    assert ReceiverError(503).status == 503
    not_sent = MailNotSent("DATA", "ConnectionResetError")
    assert (not_sent.stage, not_sent.cause) == ("DATA", "ConnectionResetError")


@needs_airflow
def test_the_mail_errors_that_fail_a_task_keep_their_fields():
    from airflow_resumable.exceptions import InvalidItemError, InvalidMessage, MailNotSent, MailRejected

    rejected = MailRejected("RCPT", 550)
    assert (rejected.stage, rejected.cause, rejected.code) == ("RCPT", "SMTP 550", 550)
    assert isinstance(rejected, MailNotSent) and "refused by the server: 550 at RCPT" in str(rejected)
    invalid = InvalidMessage("order-1", "no recipient")
    assert (invalid.stage, invalid.cause) == ("composing", "no recipient")
    assert isinstance(invalid, InvalidItemError) and str(invalid) == "item 'order-1': no recipient; nothing was sent"


def test_an_unknown_name_is_an_attribute_error():
    exceptions = importlib.import_module("airflow_resumable.exceptions")
    with pytest.raises(AttributeError, match="NoSuchError"):
        exceptions.NoSuchError  # noqa: B018
