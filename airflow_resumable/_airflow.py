"""The first name of :mod:`airflow_resumable.hooks.journal` (where the journal is), kept so that code
importing it keeps working: it is that very module."""

import sys

from airflow_resumable.hooks import journal

sys.modules[__name__] = journal
