"""What each sub-command does with the journal, once its arguments are checked.

Read commands (:data:`READ_COMMANDS`) open the journal read-only, so they work on a full disk;
``resolve``, ``resolve-input``, ``prune`` and ``compact`` write. No command creates a journal: a typo in a path
must not leave an empty one behind.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import getpass
import json
import sys
from typing import Any

from airflow_resumable.cli.output import emit, fields_of, plain, printable, write_csv, write_json_list
from airflow_resumable.cli.paging import each, print_listing
from airflow_resumable.exceptions import JournalError
from airflow_resumable.journal import SCHEMA_VERSION, StepJournal, is_postgres_url, migrate

READ_COMMANDS = ("jobs", "show", "held", "audit", "export", "marks")
# What a table shows of a decision just applied (resolve, resolve --file, resolve-input).
RESOLUTION_COLUMNS = ["job_id", "item_id", "step", "decision", "resolved_by", "resolved_at"]


def locate_journal(args: argparse.Namespace) -> Any:
    """Where the journal is (a ``hooks.journal.JournalTarget``): --journal, --conn-id, else the Airflow config."""
    from airflow_resumable._location import JournalTarget, journal_target

    if args.journal and is_postgres_url(args.journal):
        from airflow_resumable.journal.postgres import redacted

        return JournalTarget(args.journal, True, redacted(args.journal), {"schema": args.schema} if args.schema else {})
    # Airflow logs to stdout while it looks a connection up; stdout is for our tables and JSON.
    with contextlib.redirect_stdout(sys.stderr):
        return journal_target(conn_id=args.conn_id, path=args.journal)


def open_journal(args: argparse.Namespace) -> StepJournal:
    """The journal the command works on; :class:`JournalError` if there is none there."""
    target = locate_journal(args)
    if not target.exists():  # no command creates a journal: a typo must not leave an empty one behind
        raise JournalError(
            f"no journal at {target.display}; pass --journal or --conn-id, or set [resumable] journal_path"
        )
    # Read commands write nothing (they work on a full disk); resolve and prune are writers.
    journal: StepJournal = target.open(readonly=args.command in READ_COMMANDS)
    return journal


def migrate_journal(args: argparse.Namespace, out: Any) -> int:
    """``migrate``: the journal the other commands would open, moved to this release's schema.

    A shared journal's tables are created if there are none. A SQLite file that does not exist is left
    so (the first task creates it, at this version; a typo must not leave an empty journal behind): a
    single-host deployment can run the same init command as a fleet.
    """
    target = locate_journal(args)
    where = target.display
    if target.shared:
        from airflow_resumable.journal.postgres import DEFAULT_SCHEMA

        where += f" (schema {target.options.get('schema', DEFAULT_SCHEMA)})"
    where = printable(where)
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


def dispatch(args: argparse.Namespace, journal: StepJournal, out: Any) -> int:
    """Run the sub-command ``args`` names against ``journal``, writing what it prints to ``out``."""
    who = getattr(args, "resolved_by", None) or getpass.getuser()
    if args.command == "jobs":
        print_listing(out, args, functools.partial(journal.jobs, status=args.status, dag_id=args.dag_id),
                      ["job_id", "status", "items", "SUCCEEDED", "IN_FLIGHT", "FAILED", "held", "unresolved",
                       "updated_at"],
                      shape=lambda j: {**fields_of(j), "status": j.status, **j.counts, "held": j.held,
                                       "unresolved": j.unresolved})
    elif args.command == "show":
        if journal.job(args.job_id) is None:
            raise JournalError(f"unknown job {args.job_id!r}; list jobs with: airflow-resumable jobs")
        if args.held and args.item is None:  # through the held steps (their cursor), not every row
            read = functools.partial(journal.held_rows, args.job_id)
        else:  # one item's rows are few: its held ones are picked here
            read = functools.partial(journal.rows, args.job_id, args.item, status=args.status)
        print_listing(out, args, read, ["item_id", "step", "status", "held_reason", "attempts", "error_type",
                                        "receipt", "version", "idempotency_key", "updated_at"],
                      shape=lambda r: {**fields_of(r), "idempotency_key": r.key_to_ask},
                      keep=lambda r: (args.status is None or r.status == args.status)
                      and (not args.held or bool(r.held_reason)))
    elif args.command == "held":
        print_listing(out, args, functools.partial(journal.held, args.job_id),
                      ["job_id", "item_id", "step", "reason", "version", "idempotency_key"],
                      shape=lambda h: {**fields_of(h), "idempotency_key": h.key_to_ask})
    elif args.command == "resolve" and args.file:
        resolutions = journal.apply_decisions(args.entries, resolved_by=who)
        emit(out, args.json, resolutions, RESOLUTION_COLUMNS)
    elif args.command == "resolve":
        resolution = journal.resolve(
            args.job_id, args.item_id, args.step, delivered=args.delivered, receipt=args.receipt, resolved_by=who,
            note=args.note, expected_version=args.expected_version)
        emit(out, args.json, resolution, RESOLUTION_COLUMNS)
    elif args.command == "resolve-input":
        resolution = journal.resolve_input_change(
            args.job_id, args.item_id, use_new_input=args.use_new, resolved_by=who, note=args.note,
            expected_version=args.expected_version)
        emit(out, args.json, resolution, RESOLUTION_COLUMNS)
    elif args.command == "audit":
        print_listing(out, args, functools.partial(journal.resolutions, args.job_id),
                      ["id", "item_id", "step", "decision", "receipt", "resolved_by", "resolved_at", "note"])
    elif args.command == "prune":
        pruned = journal.prune(args.older_than)
        if args.json:
            out.write(json.dumps({"pruned": pruned}) + "\n")
        else:
            out.write(f"pruned {len(pruned)} job(s)" + "".join(f"\n  {printable(j)}" for j in pruned) + "\n")
    elif args.command == "compact":
        compacted = journal.compact(args.older_than)
        if args.json:
            out.write(json.dumps({"compacted": compacted}) + "\n")
        else:
            out.write(f"compacted {sum(compacted.values())} item(s) of {len(compacted)} job(s)"
                      + "".join(f"\n  {printable(j)}: {n}" for j, n in compacted.items()) + "\n")
    elif args.command == "marks":
        print_marks(out, args, journal)
    elif args.command == "export":  # streamed: a page in memory at a time, however big the job
        exported = (plain(r) for r in each(functools.partial(journal.rows, args.job_id)))
        if args.format == "json":
            write_json_list(out, exported)
        else:
            write_csv(out, exported)
    return 0


def print_marks(out: Any, args: argparse.Namespace, journal: StepJournal) -> None:
    """A job's IN_FLIGHT marks in the journal beside the high-water marks Airflow keeps for it (SPEC §13)."""
    import dataclasses

    from airflow_resumable._stored_marks import stored_marks

    if journal.job(args.job_id) is None:
        raise JournalError(f"unknown job {args.job_id!r}; list jobs with: airflow-resumable jobs")
    count = journal.marks(args.job_id)
    stored = stored_marks(args.job_id)
    if args.json:
        out.write(json.dumps({
            "job_id": args.job_id, "journal_marks": count,
            "stored": [] if isinstance(stored, str) else [
                {**dataclasses.asdict(m), "journal_behind": m.journal_behind(count)} for m in stored],
            "stored_unavailable": stored if isinstance(stored, str) else None,
        }) + "\n")
        return
    lines = [f"job {printable(args.job_id)}: {count} IN_FLIGHT mark(s) in the journal"]
    if isinstance(stored, str):
        lines.append(f"  high-water mark: not readable here - {stored}")
    elif not stored:
        lines.append("  high-water mark: none recorded (a job run before 0.3, outside Airflow, on Airflow < 3.3, or "
                     "[state_store] clear_on_success wiped it)")
    for m in stored:
        where = f"{printable(m.dag_id)}.{printable(m.task_id)}" + (f"[{m.map_index}]" if m.map_index >= 0 else "")
        state = "ok: the journal has every mark recorded"
        if m.journal_behind(count):
            state = ("the journal is BEHIND: tries are refused (on_journal_behind=verify, then Clear, lets one go on "
                     "asking the receiver first)")
            if m.behind is not None:
                state = (f"the journal was found BEHIND ({m.behind.get('journal_marks')} of "
                         f"{m.behind.get('stored_marks')}): kept until a try with on_journal_behind=verify finishes")
        elif m.open:
            state += "; a window was left open: its items are verified before they are sent"
        lines.append(f"  high-water mark of {where} (run {printable(m.run_id)}): {m.marks}, recorded {m.at} by "
                     f"{printable(m.by or '?')} - {state}")
    out.write("\n".join(lines) + "\n")
