"""``python -m airflow_resumable.cli``: the ``airflow-resumable`` console script, where it is not on PATH."""

import sys

from airflow_resumable.cli.command_line import main

sys.exit(main())
