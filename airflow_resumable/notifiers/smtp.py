"""Deprecated name of :mod:`airflow_resumable.receivers.smtp`: this module is that very module."""

import sys

from airflow_resumable.receivers import smtp

sys.modules[__name__] = smtp
