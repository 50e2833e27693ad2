"""Deprecated: the receivers moved to :mod:`airflow_resumable.receivers` (they are not Airflow notifiers).

``airflow_resumable.notifiers.http`` and ``.smtp`` are still importable - each is the very module under
its new name - with a DeprecationWarning."""

import warnings

warnings.warn(
    "airflow_resumable.notifiers is deprecated: import the receivers from airflow_resumable.receivers "
    "(e.g. airflow_resumable.receivers.http.HttpReceiver)",
    DeprecationWarning,
    stacklevel=2,
)
