"""The ``airflow-resumable`` command: see what is held, why, and resolve it without opening SQLite by hand.

The console script (and ``python -m airflow_resumable.cli``) runs :func:`main`. What the command
promises (where the journal is found, exit codes, escaping, versions, paging, ``migrate``) is the
docstring of :mod:`.command_line`, whose first line ``--help`` prints. The parts:

* :mod:`.command_line`: the arguments, checked before any journal is opened, and the exit code of each
  outcome.
* :mod:`.commands`: what each sub-command does with the journal.
* :mod:`.paging`: one page or every page, and where the next one starts.
* :mod:`.output`: tables, JSON and CSV, safe to print and to open in a spreadsheet.
"""

from airflow_resumable.cli.command_line import main

__all__ = ["main"]
