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

from airflow_resumable.cli.command_line import (
    EXIT_BUG,
    EXIT_REFUSED,
    EXIT_USAGE,
    EXPECTED_VERSION_HELP,
    TEXT_ARGUMENTS,
    build_parser,
    main,
    parse_args,
    run,
)
from airflow_resumable.cli.commands import READ_COMMANDS
from airflow_resumable.cli.output import FORMULA_STARTS

# Not API: the export tests build the document they compare against with these two.
from airflow_resumable.cli.output import csv_cell as _csv_cell  # noqa: F401
from airflow_resumable.cli.output import plain as _plain  # noqa: F401
from airflow_resumable.cli.paging import FETCH_SIZE, PAGE_SIZE

__all__ = [
    "EXIT_BUG",
    "EXIT_REFUSED",
    "EXIT_USAGE",
    "EXPECTED_VERSION_HELP",
    "FETCH_SIZE",
    "FORMULA_STARTS",
    "PAGE_SIZE",
    "READ_COMMANDS",
    "TEXT_ARGUMENTS",
    "build_parser",
    "main",
    "parse_args",
    "run",
]
