"""``airflow-resumable``: see what is held, why, and resolve it without opening SQLite by hand.

The journal comes from ``--journal`` (a file, or a ``postgresql://`` URL of a shared journal), or
``--conn-id`` (an Airflow Postgres connection), else the Airflow config as the operators read it:
``[resumable] journal_conn_id``, ``[resumable] journal_path``, ``$AIRFLOW_HOME/resumable/journal.sqlite3``.
Exit codes: 0 ok, 1 refused (nothing changed), 2 bad arguments, 3 an internal error (a bug: please report
it with the traceback).

Ids are data from DAG authors and upstream systems: tables show control and format characters escaped
(no terminal escape sequences reach your screen), and CSV cells that a spreadsheet would run as a
formula are quoted with a leading apostrophe. Tables show times in Airflow's ``[core] default_timezone``
with how long ago ("3 hours ago"); ``--json`` and ``export`` keep ISO 8601 in UTC.

Decisions are made about what was seen: ``held`` and ``show`` print each row's version (tables its first
8 characters, ``--json`` all of it), and ``resolve``/``resolve-input --expected-version V`` and the
``version`` of a ``resolve --file`` entry are refused (exit 1, nothing changed) if the row changed since.
``held --json`` round-trips: add ``decision`` (and ``receipt``) to its entries and pass it to
``resolve --file``. Without a version, a decision applies to the row as it is now.

Journals grow to millions of rows, so nothing reads an unbounded list: ``jobs``, ``held`` and ``show``
print one page (``--limit``, default 100) and, when there is more, a line on stderr with the
``--cursor`` that goes on from there (stdout stays a clean table or JSON list); ``--all`` reads every
page. ``export`` streams the job page by page, whatever its size.

``migrate`` moves the journal to this release's schema. A shared (PostgreSQL) journal is never
migrated behind your back: workers of a new release refuse an older one (and send nothing) until
``airflow-resumable migrate`` has run, once, like ``airflow db migrate``.
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import sys
import traceback
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

from airflow_resumable._time import DURATION_HELP, parse_duration
from airflow_resumable.cli.commands import dispatch, migrate_journal, open_journal
from airflow_resumable.cli.output import printable
from airflow_resumable.cli.paging import add_paging_options
from airflow_resumable.decision_input import check_text, check_version, read_decisions
from airflow_resumable.exceptions import (
    DurationError,
    JournalConfigError,
    JournalError,
    NotHeldError,
    PageError,
    ResolutionError,
)
from airflow_resumable.journal import Status

EXIT_REFUSED, EXIT_USAGE, EXIT_BUG = 1, 2, 3
EXIT_PIPE = 141  # the reader went away (`| head`): what a command killed by SIGPIPE reports
# Text arguments that reach the journal, as the refusals name them. An argument's bytes that are not
# UTF-8 arrive as lone surrogates (Python's surrogateescape), which no journal can store or look up.
TEXT_ARGUMENTS = {"job_id": "job_id", "item_id": "item_id", "step": "step", "item": "--item", "receipt": "--receipt",
                  "note": "--note", "resolved_by": "--resolved-by", "expected_version": "--expected-version",
                  "dag_id": "--dag-id"}
EXPECTED_VERSION_HELP = ("the row's version as held/show printed it (whole, or its first 8 characters): refused, "
                         "with nothing changed, if the row changed since; without it the decision applies to the "
                         "row as it is now")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit code 2
        sys.stderr.write(f"airflow-resumable: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)


def _duration(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except DurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The ``airflow-resumable`` parser: the global options, then one sub-parser per command."""
    parser = _Parser(prog="airflow-resumable", description=__doc__.splitlines()[0])
    _global_options(parser, argparse.SUPPRESS)
    # The global options are accepted after the sub-command too (``jobs --json``): each sub-parser knows
    # them, and a value given there wins.
    common = _Parser(add_help=False)
    _global_options(common, argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add = functools.partial(sub.add_parser, parents=[common])
    jobs = add("jobs", help="jobs with per-status counts, held count, last update (newest first)")
    # The journal knows the statuses (and names them when given another): one home for them.
    jobs.add_argument("--status", help="only jobs in this status, as the STATUS column shows it")
    jobs.add_argument("--dag-id", help="only the jobs of this DAG")
    add_paging_options(jobs)
    show = add("show", help="a job's rows")
    show.add_argument("job_id")
    show.add_argument("--item", help="only this item")
    show.add_argument("--status", choices=list(Status.__members__))
    show.add_argument("--held", action="store_true", help="only held rows")
    add_paging_options(show)
    held = add("held", help="held steps (of one job or all)")
    held.add_argument("job_id", nargs="?")
    add_paging_options(held)
    resolve = add("resolve", help="settle an unknown-outcome send (or many: --file)")
    resolve.add_argument("job_id", nargs="?")
    resolve.add_argument("item_id", nargs="?")
    resolve.add_argument("step", nargs="?")
    decision = resolve.add_mutually_exclusive_group()
    decision.add_argument("--delivered", action="store_true", help="the receiver has it (give --receipt)")
    decision.add_argument("--not-delivered", action="store_true", help="the receiver confirmed it never arrived")
    decision.add_argument("--file", help="many decisions at once, all or nothing: a JSON list of {job_id, item_id, "
                                         "step, decision, receipt, note, version} or a CSV with those columns "
                                         "('-': stdin); the output of held --json with a decision added to each "
                                         "entry is one")
    resolve.add_argument("--receipt")
    resolve.add_argument("--expected-version", help=EXPECTED_VERSION_HELP)
    resolve.add_argument("--note", default="")
    resolve.add_argument("--resolved-by", default=None, help="default: your OS user")
    resolve_input = add("resolve-input", help="settle an input_changed hold")
    resolve_input.add_argument("job_id")
    resolve_input.add_argument("item_id")
    choice = resolve_input.add_mutually_exclusive_group(required=True)
    choice.add_argument("--use-new", action="store_true", help="process the new input from scratch")
    choice.add_argument("--keep-previous", action="store_true", help="the new input counts as handled")
    resolve_input.add_argument("--note", default="")
    resolve_input.add_argument("--resolved-by", default=None)
    resolve_input.add_argument("--expected-version", help=EXPECTED_VERSION_HELP)
    audit = add("audit", help="the resolution audit log of a job")
    audit.add_argument("job_id")
    add_paging_options(audit)
    prune = add("prune", help="forget finished jobs older than a cut-off")
    prune.add_argument("--older-than", type=_duration, required=True, help=DURATION_HELP)
    compact = add("compact", help="keep the finished items of jobs not run for a while as one row each (every "
                                  "read shows them as it showed their rows)")
    compact.add_argument("--older-than", type=_duration, default=timedelta(hours=1),
                         help=DURATION_HELP + " Default 1h.")
    marks = add("marks", help="a job's IN_FLIGHT marks in the journal beside the high-water mark Airflow keeps "
                              "(a journal restored or failed over is behind it: SPEC section 13)")
    marks.add_argument("job_id")
    export = add("export", help="a job's rows as JSON or CSV (all of them, streamed)")
    export.add_argument("job_id")
    export.add_argument("--format", choices=["json", "csv"], default="json")
    add("migrate", help="move the journal to this release's schema (creates a shared journal's tables); a shared "
                        "journal is refused by new workers until this has run")
    return parser


def _global_options(parser: argparse.ArgumentParser, default: Any) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--journal", default=default, help="journal file, or postgresql:// URL of a shared journal "
                                                          "(default: the Airflow config)")
    where.add_argument("--conn-id", default=default, help="Airflow Postgres connection of a shared journal")
    parser.add_argument("--schema", default=default,
                        help="schema of a shared journal given by --journal URL (default: resumable)")
    parser.add_argument("--json", action="store_true", default=default, help="machine-readable output")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, global options before or after the sub-command (``--json jobs``, ``jobs --json``)."""
    args = build_parser().parse_args(argv)
    for name, value in (("journal", None), ("conn_id", None), ("schema", None), ("json", False)):
        if not hasattr(args, name):
            setattr(args, name, value)
    if args.journal is not None and args.conn_id is not None:
        build_parser().error("argument --conn-id: not allowed with argument --journal")
    if args.command == "resolve":
        if args.file:
            if args.job_id or args.receipt or args.note or args.expected_version:
                build_parser().error("resolve --file takes the decisions from the file only (no job, item, step, "
                                     "--receipt, --note or --expected-version; give each entry a version)")
            args.file_data = _read_file(args.file)
        elif not (args.job_id and args.item_id and args.step) or not (args.delivered or args.not_delivered):
            build_parser().error("resolve needs JOB ITEM STEP and --delivered or --not-delivered (or --file)")
    return args


def _read_file(name: str) -> bytes:
    """The bytes of ``resolve --file`` (``-``: stdin); a file that cannot be opened is a bad argument.
    What is in it is read (and refused, exit 1) by :func:`read_decisions`."""
    try:
        if name == "-":
            stdin = getattr(sys.stdin, "buffer", None)
            return stdin.read() if stdin is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
        return Path(name).read_bytes()
    except OSError as exc:
        build_parser().error(f"--file {printable(name)}: cannot read it ({type(exc).__name__})")
    raise AssertionError("unreachable")  # error() exits


def _read_arguments(args: argparse.Namespace) -> None:
    """Refuse (exit 1, before the journal is opened) text no journal can take, and read --file's decisions."""
    for name, what in TEXT_ARGUMENTS.items():
        value = getattr(args, name, None)
        if isinstance(value, str):
            check_text(value, what)
    if getattr(args, "expected_version", None):
        args.expected_version = check_version(args.expected_version, "--expected-version")
    if getattr(args, "file", None):
        args.entries = read_decisions(args.file_data, f"--file {printable(args.file)}")


def run(args: argparse.Namespace, out: io.TextIOBase | Any) -> int:
    """Run parsed ``args``, writing what the command prints to ``out``; journal refusals are raised.

    :param args: what :func:`parse_args` returned.
    :param out: where tables and JSON go (stdout); the ``more:`` line of a page goes to stderr.
    """
    _read_arguments(args)
    if args.command == "migrate":
        return migrate_journal(args, out)
    with open_journal(args) as journal:
        return dispatch(args, journal, out)


def main(argv: Sequence[str] | None = None) -> int:
    """The console script: the exit code of the command ``argv`` (default: ``sys.argv``) names."""
    for stream in (sys.stdout, sys.stderr):
        # A terminal that is not UTF-8 gets ids it cannot show escaped, never a UnicodeEncodeError mid-table.
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="backslashreplace")
    args = parse_args(argv)
    try:
        return run(args, sys.stdout)
    except BrokenPipeError:
        # Python flushes stdout again on the way out: point it at nothing, or that flush fails too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_PIPE
    except PageError as exc:  # a --cursor this journal did not give, a --dag-id it cannot take: nothing read
        sys.stderr.write(f"airflow-resumable: {printable(str(exc))}\n")
        return EXIT_USAGE
    except (ResolutionError, NotHeldError) as exc:
        # Refused decisions (bad input, a row changed since it was looked at): the journal is unchanged.
        # Messages quote ids, which may hold terminal escapes: printed escaped, on one line.
        sys.stderr.write(f"airflow-resumable: refused: {printable(str(exc))}\n")
        return EXIT_REFUSED
    except (JournalError, JournalConfigError) as exc:
        sys.stderr.write(f"airflow-resumable: {printable(str(exc))}\n")
        return EXIT_REFUSED
    except Exception:  # noqa: BLE001 - a bug is not a refusal: say so, with the traceback
        traceback.print_exc()
        sys.stderr.write("airflow-resumable: internal error (a bug, not a refusal); please report it with the "
                         "traceback above\n")
        return EXIT_BUG
