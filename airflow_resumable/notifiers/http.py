"""Deprecated name of :mod:`airflow_resumable.receivers.http`: this module is that very module."""

import sys

from airflow_resumable.receivers import http

sys.modules[__name__] = http
