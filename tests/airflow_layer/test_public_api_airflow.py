"""The Airflow layer's public names import from their one path (pinned in tests/core/test_public_api.py),
and the errors it defines are Airflow exceptions under ResumableError."""

from __future__ import annotations

import importlib

import pytest

from tests.core.test_public_api import CORE_MODULES, PUBLIC_API

AIRFLOW_MODULES = sorted(set(PUBLIC_API) - set(CORE_MODULES))

pytestmark = pytest.mark.compat


@pytest.mark.parametrize("module", AIRFLOW_MODULES)
def test_the_airflow_layers_names_import_from_their_paths(module):
    from airflow_resumable._compat import airflow_version

    if module == "airflow_resumable.retry_policy" and airflow_version() < (3, 3):
        with pytest.raises(ImportError, match="needs Airflow 3.3 or newer"):
            importlib.import_module(module)
        return
    imported = importlib.import_module(module)
    missing = [name for name in PUBLIC_API[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"


def test_the_errors_the_airflow_layer_defines_are_under_the_one_root():
    from airflow.sdk.exceptions import AirflowException

    from airflow_resumable.exceptions import InvalidItemError, MailNotSent, ResumableError
    from airflow_resumable.operators.resumable_batch import HeldItemsError, HeldItemsNeedAHumanError, WrongWorkerError
    from airflow_resumable.receivers.smtp import InvalidMessage, MailRejected

    for error in (HeldItemsError, HeldItemsNeedAHumanError, WrongWorkerError, InvalidMessage, MailRejected):
        assert issubclass(error, ResumableError) and issubclass(error, AirflowException), error
    assert issubclass(MailRejected, MailNotSent) and issubclass(InvalidMessage, InvalidItemError)


def test_the_mail_errors_that_fail_a_task_keep_their_fields():
    from airflow_resumable.exceptions import MailNotSent
    from airflow_resumable.receivers.smtp import InvalidMessage, MailRejected

    rejected = MailRejected("RCPT", 550)
    assert (rejected.stage, rejected.cause, rejected.code) == ("RCPT", "SMTP 550", 550)
    assert isinstance(rejected, MailNotSent) and "refused by the server: 550 at RCPT" in str(rejected)
    invalid = InvalidMessage("order-1", "no recipient")
    assert (invalid.stage, invalid.cause) == ("composing", "no recipient")
    assert str(invalid) == "item 'order-1': no recipient; nothing was sent"


def test_the_provider_lists_its_hook():
    from airflow_resumable.get_provider_info import get_provider_info

    modules = [m for entry in get_provider_info()["hooks"] for m in entry["python-modules"]]
    assert modules == ["airflow_resumable.hooks.journal"]
