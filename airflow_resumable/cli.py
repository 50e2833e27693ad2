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
import contextlib
import csv
import functools
import getpass
import io
import itertools
import json
import sys
import traceback
import unicodedata
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, fields, is_dataclass
from datetime import datetime, timedelta
from enum import Enum
from pathlib import Path
from typing import Any

from airflow_resumable._time import DURATION_HELP, DurationError, parse_duration, when
from airflow_resumable.decision_input import (
    check_text,
    check_version,
    full_version,
    is_short_version,
    read_decisions,
    short_version,
)
from airflow_resumable.journal import (
    DECISIONS_BY_REASON,
    SCHEMA_VERSION,
    HeldReason,
    JournalError,
    NotHeldError,
    Page,
    PageError,
    ResolutionError,
    Status,
    StepJournal,
    is_postgres_url,
    migrate,
)
from airflow_resumable.journal.records import MAX_PAGE
from airflow_resumable.runner import idempotency_key as _key

EXIT_REFUSED, EXIT_USAGE, EXIT_BUG = 1, 2, 3
READ_COMMANDS = ("jobs", "show", "held", "audit", "export")
PAGE_SIZE = 100  # what jobs, held and show print without --limit: a screenful, never an unbounded read
FETCH_SIZE = 1000  # what --all and export read at a time: memory stays that of one page
# Text arguments that reach the journal, as the refusals name them. An argument's bytes that are not
# UTF-8 arrive as lone surrogates (Python's surrogateescape), which no journal can store or look up.
TEXT_ARGUMENTS = {"job_id": "job_id", "item_id": "item_id", "step": "step", "item": "--item", "receipt": "--receipt",
                  "note": "--note", "resolved_by": "--resolved-by", "expected_version": "--expected-version",
                  "dag_id": "--dag-id"}
EXPECTED_VERSION_HELP = ("the row's version as held/show printed it (whole, or its first 8 characters): refused, "
                         "with nothing changed, if the row changed since; without it the decision applies to the "
                         "row as it is now")
FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit code 2
        sys.stderr.write(f"airflow-resumable: {message} (see --help)\n")
        raise SystemExit(EXIT_USAGE)


def _duration(text: str) -> timedelta:
    try:
        return parse_duration(text)
    except DurationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _limit(text: str) -> int:
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_PAGE:
        raise argparse.ArgumentTypeError(f"invalid limit {text[:20]!r}: give a whole number from 1 to {MAX_PAGE}")
    return limit


def _plain(value: Any, time: Callable[[datetime], str] = datetime.isoformat) -> Any:
    """JSON-ready data; ``time`` writes datetimes (ISO 8601 UTC for JSON, local and relative for tables)."""
    if is_dataclass(value) and not isinstance(value, type):
        # Field by field, not asdict(): its deep copy is most of what a million-row export costs.
        return {f.name: _plain(getattr(value, f.name), time) for f in fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v, time) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, time) for v in value]
    if isinstance(value, datetime):
        return time(value)
    if isinstance(value, Enum):
        return value.value
    return value


def _printable(text: str) -> str:
    """``text`` with control, format (bidi overrides, zero-width), separator and surrogate characters
    escaped as ``\\x1b`` / ``\\u202e``: safe to print to a terminal, one row per line."""
    if text.isprintable():
        return text
    return "".join(
        ch if ch.isprintable() or unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")
        else (f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}" if ord(ch) < 0x10000
              else f"\\U{ord(ch):08x}")
        for ch in text
    )


def _csv_cell(value: Any) -> Any:
    """A cell a spreadsheet shows as text: a string that would start a formula gets a leading '."""
    if isinstance(value, (dict, list)):
        value = json.dumps(value)
    if isinstance(value, str) and value.startswith(FORMULA_STARTS):
        return "'" + value
    return value


def _table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    if not rows:
        return "(none)"
    cells = [[_printable(str("" if row.get(c) is None else row.get(c))) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
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
    _paging_options(jobs)
    show = add("show", help="a job's rows")
    show.add_argument("job_id")
    show.add_argument("--item", help="only this item")
    show.add_argument("--status", choices=list(Status.__members__))
    show.add_argument("--held", action="store_true", help="only held rows")
    _paging_options(show)
    held = add("held", help="held steps (of one job or all)")
    held.add_argument("job_id", nargs="?")
    _paging_options(held)
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
    prune = add("prune", help="forget finished jobs older than a cut-off")
    prune.add_argument("--older-than", type=_duration, required=True, help=DURATION_HELP)
    export = add("export", help="a job's rows as JSON or CSV (all of them, streamed)")
    export.add_argument("job_id")
    export.add_argument("--format", choices=["json", "csv"], default="json")
    add("migrate", help="move the journal to this release's schema (creates a shared journal's tables); a shared "
                        "journal is refused by new workers until this has run")
    return parser


def _paging_options(parser: argparse.ArgumentParser) -> None:
    amount = parser.add_mutually_exclusive_group()
    # No default here: --limit 100 --all must be refused like any other --limit with --all.
    amount.add_argument("--limit", type=_limit, help=f"at most this many (1 to {MAX_PAGE}, default {PAGE_SIZE})")
    amount.add_argument("--all", action="store_true", help=f"everything (read {FETCH_SIZE} at a time)")
    parser.add_argument("--cursor", help="go on where a page stopped: the cursor its 'more:' line gave (with the "
                                         "same filters)")


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
        build_parser().error(f"--file {_printable(name)}: cannot read it ({type(exc).__name__})")
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
        args.entries = read_decisions(args.file_data, f"--file {_printable(args.file)}")


def _target(args: argparse.Namespace) -> Any:
    """Where the journal is (an ``_airflow.JournalTarget``): --journal, --conn-id, else the Airflow config."""
    from airflow_resumable._airflow import JournalTarget, journal_target

    if args.journal and is_postgres_url(args.journal):
        from airflow_resumable.journal.postgres import redacted

        return JournalTarget(args.journal, True, redacted(args.journal), {"schema": args.schema} if args.schema else {})
    # Airflow logs to stdout while it looks a connection up; stdout is for our tables and JSON.
    with contextlib.redirect_stdout(sys.stderr):
        return journal_target(conn_id=args.conn_id, path=args.journal)


def _open(args: argparse.Namespace) -> StepJournal:
    target = _target(args)
    if not target.exists():  # no command creates a journal: a typo must not leave an empty one behind
        raise JournalError(
            f"no journal at {target.display}; pass --journal or --conn-id, or set [resumable] journal_path"
        )
    # Read commands write nothing (they work on a full disk); resolve and prune are writers.
    journal: StepJournal = target.open(readonly=args.command in READ_COMMANDS)
    return journal


def run(args: argparse.Namespace, out: io.TextIOBase | Any) -> int:
    _read_arguments(args)
    if args.command == "migrate":
        return _migrate(args, out)
    with _open(args) as journal:
        return _dispatch(args, journal, out)


def _migrate(args: argparse.Namespace, out: Any) -> int:
    """``migrate``: the journal the other commands would open, moved to this release's schema.

    A shared journal's tables are created if there are none. A SQLite file that does not exist is left
    so (the first task creates it, at this version; a typo must not leave an empty journal behind): a
    single-host deployment can run the same init command as a fleet.
    """
    target = _target(args)
    where = target.display
    if target.shared:
        from airflow_resumable.journal.postgres import DEFAULT_SCHEMA

        where += f" (schema {target.options.get('schema', DEFAULT_SCHEMA)})"
    where = _printable(where)
    if not target.exists():
        found: int | None = None
        said = (f"journal {where}: none yet; a task creates it at schema version {SCHEMA_VERSION} when it first "
                "opens it")
        version = None
    else:
        found, version = migrate(target.location, **target.options)
        said = (f"journal {where}: created at schema version {version}" if found is None
                else f"journal {where}: already at schema version {version}" if found == version
                else f"journal {where}: schema version {found} -> {version}")
    if args.json:
        out.write(json.dumps({"journal": where, "found": found, "version": version}) + "\n")
    else:
        out.write(said + "\n")
    return 0


def _current_version(journal: StepJournal, job_id: str, item_id: str, step: str | None) -> str | None:
    """The version of the row a decision is about: the step's (a send's outcome), or the item's
    input-change hold (``step`` None); None if there is no such row."""
    for row in journal.rows(job_id, item_id):
        if (row.step == step) if step is not None else (row.held_reason == HeldReason.INPUT_CHANGED):
            return row.version
    return None


def _expected(journal: StepJournal, given: str | None, job_id: str, item_id: str, step: str | None) -> str | None:
    """The version a decision carries: the short form a table shows stands for the row's current version
    when it starts it; anything else goes to the journal as given (a changed row is refused there)."""
    if given is None or not is_short_version(given):
        return given
    return full_version(given, _current_version(journal, job_id, item_id, step))


def _with_full_versions(journal: StepJournal, entries: list[Any]) -> list[Any]:
    """``resolve --file`` entries, each short-form version completed as :func:`_expected` does. An entry
    that names no row clearly is left as it is, for the journal to refuse."""
    completed = []
    for entry in entries:
        version = entry.get("version") if isinstance(entry, dict) else None
        if isinstance(version, str) and is_short_version(version):
            job_id, item_id, step, decision = (entry.get(f) for f in ("job_id", "item_id", "step", "decision"))
            named = isinstance(job_id, str) and isinstance(item_id, str)
            if named and decision in DECISIONS_BY_REASON[HeldReason.UNKNOWN_OUTCOME] and isinstance(step, str):
                entry = {**entry, "version": _expected(journal, version, job_id, item_id, step)}
            elif named and decision in DECISIONS_BY_REASON[HeldReason.INPUT_CHANGED]:  # about the item's hold
                entry = {**entry, "version": _expected(journal, version, job_id, item_id, None)}
        completed.append(entry)
    return completed


def _listing(read: Callable[..., Page[Any]], args: argparse.Namespace) -> Page[Any]:
    """What the paging options ask for: one page (``--limit``, default :data:`PAGE_SIZE`) from
    ``--cursor``, or with ``--all`` every page from there on."""
    if not args.all:
        return read(limit=args.limit or PAGE_SIZE, cursor=args.cursor)
    return Page(_each(read, args.cursor))


def _each(read: Callable[..., Page[Any]], cursor: str | None = None) -> Iterator[Any]:
    """Every record ``read`` pages through from ``cursor`` on, :data:`FETCH_SIZE` at a time."""
    while True:
        page = read(limit=FETCH_SIZE, cursor=cursor)
        cursor = page.next_cursor
        yield from page
        del page  # not kept while the next one is read: one page in memory, not two
        if cursor is None:
            return


def _more(out: Any, page: Page[Any]) -> None:
    """Where the next page starts, on stderr: stdout stays a table, or JSON another tool reads."""
    if page.next_cursor is not None:
        out.flush()  # after the page on a terminal
        sys.stderr.write(f"more: --cursor {page.next_cursor}  (or --all)\n")


def _write_json_list(out: Any, records: Iterable[Any]) -> None:
    """``json.dumps(list(records), indent=2)`` and a newline, written one record at a time."""
    first = True
    for record in records:
        # A list's entries are its elements' own indented text, one level in (JSON text has no raw newlines).
        out.write(("[\n  " if first else ",\n  ") + json.dumps(record, indent=2).replace("\n", "\n  "))
        first = False
    out.write("[]\n" if first else "\n]\n")


def _write_csv(out: Any, records: Iterable[dict[str, Any]]) -> None:
    """One row per record, the columns those of the first (an empty export is a lone ``item_id`` header)."""
    records = iter(records)
    first = next(records, None)
    writer = csv.DictWriter(out, fieldnames=list(first) if first else ["item_id"], lineterminator="\n")
    writer.writeheader()
    for row in itertools.chain([first], records) if first else ():
        writer.writerow({k: _csv_cell(v) for k, v in row.items()})


def _emit(out: Any, as_json: bool, data: Any, columns: Sequence[str]) -> None:
    if as_json:
        out.write(json.dumps(_plain(data), indent=2) + "\n")
    else:  # times in Airflow's [core] default_timezone, with "3 hours ago"; versions short
        plain = _plain(data, time=when)
        rows = [{**r, "version": short_version(r["version"])} if r.get("version") else r
                for r in (plain if isinstance(plain, list) else [plain])]
        out.write(_table(rows, columns) + "\n")


def _dispatch(args: argparse.Namespace, journal: StepJournal, out: Any) -> int:
    who = getattr(args, "resolved_by", None) or getpass.getuser()
    if args.command == "jobs":
        page = _listing(functools.partial(journal.jobs, status=args.status, dag_id=args.dag_id), args)
        jobs = [{**asdict(j), "status": j.status, **j.counts, "held": j.held, "unresolved": j.unresolved}
                for j in page]
        _emit(out, args.json, jobs, ["job_id", "status", "items", "SUCCEEDED", "IN_FLIGHT", "FAILED", "held",
                                     "unresolved", "updated_at"])
        _more(out, page)
    elif args.command == "show":
        if journal.job(args.job_id) is None:
            raise JournalError(f"unknown job {args.job_id!r}; list jobs with: airflow-resumable jobs")
        if args.held and args.item is None:  # through the held steps (their cursor), not every row
            page = _listing(functools.partial(journal.held_rows, args.job_id), args)
        else:  # one item's rows are few: its held ones are picked here
            page = _listing(functools.partial(journal.rows, args.job_id, args.item, status=args.status), args)
        rows = [{**asdict(r), "idempotency_key": _key(r.job_id, r.item_id, r.step, r.generation) if r.side_effect else None}
                for r in page
                if (args.status is None or r.status == args.status) and (not args.held or r.held_reason)]
        _emit(out, args.json, rows, ["item_id", "step", "status", "held_reason", "attempts", "error_type", "receipt",
                                     "version", "idempotency_key", "updated_at"])
        _more(out, page)
    elif args.command == "held":
        page = _listing(functools.partial(journal.held, args.job_id), args)
        # The key to ask the receiver about; an input_changed hold is not about a send (no key).
        held = [{**asdict(h), "idempotency_key": _key(h.job_id, h.item_id, h.step, h.generation)
                 if h.reason == HeldReason.UNKNOWN_OUTCOME else None} for h in page]
        _emit(out, args.json, held, ["job_id", "item_id", "step", "reason", "version", "idempotency_key"])
        _more(out, page)
    elif args.command == "resolve" and args.file:
        resolutions = journal.apply_decisions(_with_full_versions(journal, args.entries), resolved_by=who)
        _emit(out, args.json, resolutions, ["job_id", "item_id", "step", "decision", "resolved_by", "resolved_at"])
    elif args.command == "resolve":
        resolution = journal.resolve(
            args.job_id, args.item_id, args.step, delivered=args.delivered, receipt=args.receipt, resolved_by=who,
            note=args.note, expected_version=_expected(journal, args.expected_version, args.job_id, args.item_id,
                                                       args.step))
        _emit(out, args.json, resolution, ["job_id", "item_id", "step", "decision", "resolved_by", "resolved_at"])
    elif args.command == "resolve-input":
        resolution = journal.resolve_input_change(
            args.job_id, args.item_id, use_new_input=args.use_new, resolved_by=who, note=args.note,
            expected_version=_expected(journal, args.expected_version, args.job_id, args.item_id, None))
        _emit(out, args.json, resolution, ["job_id", "item_id", "step", "decision", "resolved_by", "resolved_at"])
    elif args.command == "audit":
        _emit(out, args.json, journal.resolutions(args.job_id),
              ["id", "item_id", "step", "decision", "receipt", "resolved_by", "resolved_at", "note"])
    elif args.command == "prune":
        pruned = journal.prune(args.older_than)
        if args.json:
            out.write(json.dumps({"pruned": pruned}) + "\n")
        else:
            out.write(f"pruned {len(pruned)} job(s)" + "".join(f"\n  {_printable(j)}" for j in pruned) + "\n")
    elif args.command == "export":  # streamed: a page in memory at a time, however big the job
        exported = (_plain(r) for r in _each(functools.partial(journal.rows, args.job_id)))
        if args.format == "json":
            _write_json_list(out, exported)
        else:
            _write_csv(out, exported)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from airflow_resumable._airflow import JournalConfigError

    try:
        return run(args, sys.stdout)
    except PageError as exc:  # a --cursor this journal did not give, a --dag-id it cannot take: nothing read
        sys.stderr.write(f"airflow-resumable: {_printable(str(exc))}\n")
        return EXIT_USAGE
    except (ResolutionError, NotHeldError) as exc:
        # Refused decisions (bad input, a row changed since it was looked at): the journal is unchanged.
        # Messages quote ids, which may hold terminal escapes: printed escaped, on one line.
        sys.stderr.write(f"airflow-resumable: refused: {_printable(str(exc))}\n")
        return EXIT_REFUSED
    except (JournalError, JournalConfigError) as exc:
        sys.stderr.write(f"airflow-resumable: {_printable(str(exc))}\n")
        return EXIT_REFUSED
    except Exception:  # noqa: BLE001 - a bug is not a refusal: say so, with the traceback
        traceback.print_exc()
        sys.stderr.write("airflow-resumable: internal error (a bug, not a refusal); please report it with the "
                         "traceback above\n")
        return EXIT_BUG


if __name__ == "__main__":
    sys.exit(main())
