"""Every documented name of the Airflow layer imports from the path the documentation gives (the
receivers' old path too, with a DeprecationWarning), and its errors are the ones in
airflow_resumable.exceptions, under ResumableError."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.core.test_public_api import _check_one_class_under_one_root, _error_names, _import

pytestmark = pytest.mark.compat

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


@pytest.mark.parametrize("module", sorted(AIRFLOW_NAMES))
def test_the_airflow_layers_documented_names_import_from_their_documented_paths(module):
    imported = _import(module)
    missing = [name for name in AIRFLOW_NAMES[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"


@pytest.mark.parametrize(("module", "name"), _error_names(AIRFLOW_NAMES))
def test_each_airflow_layer_error_is_one_class_in_exceptions_under_resumable_error(module, name):
    _check_one_class_under_one_root(module, name)


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


def test_the_mail_errors_that_fail_a_task_keep_their_fields():
    from airflow_resumable.exceptions import InvalidItemError, InvalidMessage, MailNotSent, MailRejected

    rejected = MailRejected("RCPT", 550)
    assert (rejected.stage, rejected.cause, rejected.code) == ("RCPT", "SMTP 550", 550)
    assert isinstance(rejected, MailNotSent) and "refused by the server: 550 at RCPT" in str(rejected)
    invalid = InvalidMessage("order-1", "no recipient")
    assert (invalid.stage, invalid.cause) == ("composing", "no recipient")
    assert isinstance(invalid, InvalidItemError) and str(invalid) == "item 'order-1': no recipient; nothing was sent"
