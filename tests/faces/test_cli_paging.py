"""`airflow-resumable` in a journal that has grown: listings come a page at a time (the cursor for the
next one on stderr, stdout clean), `--all` reads every page, and `export` streams a job of any size."""

from __future__ import annotations

import csv
import gc
import io
import json
import os
import re
import subprocess
import sys
import tracemalloc

import pytest

from airflow_resumable.cli import command_line, output, paging
from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, run_batch
from tests.faces.test_cli import SETTINGS_GIVEN, cli, two_holds
from tests.support import backends
from tests.support.backends import snapshot

MORE = re.compile(r"more: --cursor (\S+)  \(or --all\)")
FINISHED_JOBS = [f"job-{n}" for n in range(5)]  # created in this order; jobs lists newest first


def finished_jobs(location) -> None:
    """Five finished jobs, of DAG d1 (job-1, job-3) and d2 (job-0, job-2, job-4), three items each."""
    with StepJournal(location, durability="normal") as journal:
        for n, job_id in enumerate(FINISHED_JOBS):
            run_batch(journal, job_id, [{"id": f"item-{i}"} for i in range(3)], [Step("check", lambda i, c: True)],
                      dag_id="d1" if n % 2 else "d2", settle_in_task=False)


@pytest.fixture
def fleet(journal_location) -> str:
    """job-0 ... job-4 (:func:`finished_jobs`), then job 'j' (two held items, :func:`tests.faces.test_cli.two_holds`)."""
    finished_jobs(journal_location)
    two_holds(journal_location)
    return journal_location


@pytest.fixture
def sqlite_fleet(tmp_path) -> str:
    path = str(tmp_path / "journal.sqlite3")
    finished_jobs(path)
    two_holds(path)
    return path


def next_cursor(shown) -> str | None:
    """The cursor a page's one stderr line gives, None when it was the last page (stderr empty)."""
    if not shown.stderr:
        return None
    (line,) = shown.stderr.splitlines()
    found = MORE.fullmatch(line)
    assert found, line
    return found.group(1)


def page_through(location, *command: str) -> list[list[dict]]:
    """Every page of ``command --json``, each asked for with the cursor the one before printed."""
    pages, cursor = [], None
    while True:
        shown = cli(location, *command, "--json", *(["--cursor", cursor] if cursor else []))
        assert shown.returncode == 0, shown.stderr
        pages.append(json.loads(shown.stdout))  # stdout is only the JSON, whatever stderr says
        cursor = next_cursor(shown)
        if cursor is None:
            return pages


def everything(location, *command: str) -> list[dict]:
    shown = cli(location, *command, "--all", "--json")
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    return json.loads(shown.stdout)


def test_jobs_come_a_page_at_a_time_newest_first_with_the_next_cursor_on_stderr(fleet):
    pages = page_through(fleet, "jobs", "--limit", "2")
    assert [[j["job_id"] for j in page] for page in pages] == [["j", "job-4"], ["job-3", "job-2"], ["job-1", "job-0"]]
    assert [j["job_id"] for j in everything(fleet, "jobs")] == ["j", *reversed(FINISHED_JOBS)]
    table = cli(fleet, "jobs", "--limit", "2")
    header, *lines = table.stdout.splitlines()
    assert header.split()[:2] == ["JOB_ID", "STATUS"] and [line.split()[0] for line in lines] == ["j", "job-4"]
    assert next_cursor(table) is not None  # on stderr: the table alone on stdout
    default = cli(fleet, "jobs")  # fewer than the default page of 100: all of them, no more line
    assert len(default.stdout.splitlines()) == 1 + 6 and default.stderr == ""


def test_jobs_filter_by_status_and_dag_and_page_within_the_filter(fleet):
    assert [j["job_id"] for j in everything(fleet, "jobs", "--status", "needs_review")] == ["j"]
    assert [j["job_id"] for j in everything(fleet, "jobs", "--dag-id", "d1")] == ["job-3", "job-1"]
    pages = page_through(fleet, "jobs", "--status", "completed", "--dag-id", "d2", "--limit", "1")
    assert [[j["job_id"] for j in page] for page in pages] == [["job-4"], ["job-2"], ["job-0"]]
    assert all(j["status"] == "completed" for page in pages for j in page)


def test_show_pages_a_jobs_rows_and_its_held_rows(fleet):
    with StepJournal(fleet) as journal:
        rows = [(r.item_id, r.step) for r in journal.rows("j")]
    assert len(rows) == 6
    pages = page_through(fleet, "show", "j", "--limit", "4")
    assert [len(page) for page in pages] == [4, 2]
    assert [(r["item_id"], r["step"]) for page in pages for r in page] == rows
    assert everything(fleet, "show", "j") == [r for page in pages for r in page]
    held = page_through(fleet, "show", "j", "--held", "--limit", "1")
    assert [[(r["item_id"], r["step"], r["held_reason"]) for r in page] for page in held] == [
        [("b", "notify", "unknown_outcome")], [("c", "validate", "input_changed")]]
    failed = page_through(fleet, "show", "j", "--status", "FAILED", "--limit", "1")
    assert [[(r["item_id"], r["step"]) for r in page] for page in failed] == [[("b", "notify")]]


def test_a_page_of_held_json_round_trips_through_resolve_file(fleet, tmp_path):
    first, second = page_through(fleet, "held", "j", "--limit", "1")
    assert [h["item_id"] for h in first + second] == ["b", "c"]
    assert set(first[0]) == {"job_id", "item_id", "step", "reason", "generation", "version", "idempotency_key"}
    decisions = tmp_path / "decisions.json"
    decisions.write_text(json.dumps([{**first[0], "decision": "not_delivered"}]))
    applied = cli(fleet, "resolve", "--file", str(decisions))
    assert applied.returncode == 0, applied.stderr
    assert json.loads(cli(fleet, "held", "j", "--json").stdout) == second


READ_LISTINGS = [
    ["jobs"], ["jobs", "--all"], ["jobs", "--status", "completed"], ["held"], ["held", "j", "--all"],
    ["show", "j"], ["show", "j", "--all"], ["show", "j", "--held"], ["show", "j", "--held", "--all"],
    ["show", "j", "--item", "b", "--held"], ["show", "j", "--status", "FAILED", "--all"],
    ["export", "j"], ["export", "j", "--format", "csv"], ["audit", "j"], ["audit", "j", "--all"],
]


@pytest.mark.parametrize("command", READ_LISTINGS, ids=" ".join)
def test_no_listing_command_reads_an_unbounded_list(sqlite_fleet, monkeypatch, command):
    """Every read of a list the CLI makes carries a limit: a page, or --all and export a page at a time."""
    limits: list[int | None] = []
    for name in ("jobs", "held", "held_rows", "rows", "resolutions"):  # every listing the journal has
        real = getattr(StepJournal, name)

        def observed(self, *args, _real=real, **kwargs):
            limits.append(kwargs.get("limit"))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(StepJournal, name, observed)
    out = io.StringIO()
    assert command_line.run(command_line.parse_args(["--journal", sqlite_fleet, *command]), out) == 0
    assert limits and all(limit is not None and limit <= paging.FETCH_SIZE for limit in limits), limits
    if "--all" not in command and command[0] != "export":
        assert limits[0] == paging.PAGE_SIZE  # a screenful by default


LIMIT_RANGE = "give a whole number from 1 to 10000"
FIRST_PAGE = "start again from the first page (no cursor)"


@pytest.mark.parametrize(("args", "said"), [
    (["jobs", "--limit", "0"], LIMIT_RANGE),
    (["jobs", "--limit", "10001"], LIMIT_RANGE),  # past the largest page the journal hands out
    (["held", "--limit", "ten"], LIMIT_RANGE),
    (["show", "j", "--limit", "-1"], LIMIT_RANGE),
    (["jobs", "--limit", "100", "--all"], "--all: not allowed with argument --limit"),  # even the default
    (["jobs", "--cursor", "not-a-cursor"], FIRST_PAGE),
    (["show", "j", "--cursor", "eyJ4Ijox"], FIRST_PAGE),  # base64 of something else
    (["jobs", "--status", "on_fire"], "unknown job status 'on_fire'; use one of pruned, needs_review"),
    (["show", "j", "--status", "HELD"], "invalid choice: 'HELD'"),
])
def test_bad_paging_arguments_exit_2_with_one_line(sqlite_fleet, args, said):
    before = snapshot(sqlite_fleet)
    refused = cli(sqlite_fleet, *args)
    assert refused.returncode == 2, refused.stderr
    assert refused.stdout == "" and refused.stderr.count("\n") == 1 and said in refused.stderr, refused.stderr
    assert snapshot(sqlite_fleet) == before


def test_a_cursor_from_another_listing_is_refused(sqlite_fleet):
    jobs_cursor = next_cursor(cli(sqlite_fleet, "jobs", "--limit", "1"))
    held_cursor = next_cursor(cli(sqlite_fleet, "held", "j", "--limit", "1"))
    for args in (["held", "--cursor", jobs_cursor], ["show", "j", "--cursor", held_cursor],
                 ["show", "j", "--held", "--cursor", jobs_cursor]):
        refused = cli(sqlite_fleet, *args)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, (args, refused.stderr)
        assert "start again from the first page" in refused.stderr
    assert cli(sqlite_fleet, "show", "j", "--held", "--cursor", held_cursor).returncode == 0


# -- export streams -----------------------------------------------------------------------------------


def big_job(location, job_id: str, items: int) -> None:
    """``items`` items of two steps each; one item id a spreadsheet would run as a formula."""
    ids = ["=1+1", *(f"item-{i:06d}" for i in range(items - 1))]
    with StepJournal(location, durability="normal") as journal:
        run_batch(journal, job_id, ({"id": i} for i in ids),
                  [Step("fetch", lambda item, ctx: {"id": item["id"]}), Step("score", lambda item, ctx: 7)],
                  settle_in_task=False)


def test_an_export_over_several_pages_is_the_document_one_read_gives(journal_location, monkeypatch):
    big_job(journal_location, "big", 1_100)  # 2,200 rows: three pages
    with StepJournal(journal_location) as journal:
        whole = [output.plain(r) for r in journal.rows("big")]  # one unbounded read, as export was
    expected_csv = io.StringIO()
    writer = csv.DictWriter(expected_csv, fieldnames=list(whole[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: output.csv_cell(v) for k, v in row.items()} for row in whole)
    limits: list[int | None] = []
    real_rows = StepJournal.rows

    def observed(self, *args, **kwargs):
        limits.append(kwargs.get("limit"))
        return real_rows(self, *args, **kwargs)

    monkeypatch.setattr(StepJournal, "rows", observed)
    for form, expected in (("json", json.dumps(whole, indent=2) + "\n"), ("csv", expected_csv.getvalue())):
        out = io.StringIO()
        command_line.run(command_line.parse_args(["--journal", journal_location, "export", "big", "--format", form]), out)
        assert out.getvalue() == expected, form  # the seams between pages do not show
    assert limits == [1000] * 3 * 2  # three pages, for each form
    assert "\nbig,'=1+1,fetch," in expected_csv.getvalue()  # quoted as text, as before


class Discard:
    """An output that keeps nothing (so only what export itself holds is measured) but how much came."""

    def __init__(self) -> None:
        self.characters = 0

    def write(self, text: str) -> None:
        self.characters += len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("form", ["json", "csv"])
def test_exports_memory_stays_that_of_a_page_however_big_the_job(tmp_path, form):
    path = str(tmp_path / "journal.sqlite3")
    big_job(path, "tiny", 10)
    big_job(path, "small", 1_000)  # 2,000 rows
    big_job(path, "large", 5_000)  # 10,000 rows

    def export(job_id: str) -> tuple[int, int]:
        """(the peak of Python memory export allocated, how many characters it wrote)."""
        out = Discard()
        gc.collect()  # garbage of what ran before is not export's
        tracemalloc.start()
        try:
            command_line.run(command_line.parse_args(["--journal", path, "export", job_id, "--format", form]), out)
            return tracemalloc.get_traced_memory()[1], out.characters
        finally:
            tracemalloc.stop()

    export("tiny")  # imports and caches warmed up outside the measurement
    small_peak, small_size = export("small")
    large_peak, large_size = export("large")
    assert large_size > 4 * small_size  # five times the rows written ...
    # ... in the same memory: one page's worth (read whole, the large job took five times as much).
    assert large_peak < 2 * small_peak, (small_peak, large_peak)


# -- --all streams --------------------------------------------------------------------------------------

# The CLI in a process of its own, which reports its peak resident memory (VmHWM) on its last stderr line.
MEASURED_CLI = """
import sys
from airflow_resumable.cli import main
try:
    code = main(sys.argv[1:])
finally:
    sys.stderr.write([line for line in open("/proc/self/status") if line.startswith("VmHWM:")][0])
sys.exit(code)
"""


def many_rows(location, job_id: str, items: int) -> None:
    """Job ``job_id`` with ``items`` rows of one step, and as many audit rows, written in SQL at once:
    ten items through the runner, their rows copied, then one audit row per item."""
    with StepJournal(location, durability="normal") as journal:
        run_batch(journal, job_id, [{"id": f"seed-{i}"} for i in range(10)], [Step("fetch", lambda i, c: {"n": 1})],
                  settle_in_task=False)
    columns = backends.columns(location, "steps")
    copied = ", ".join("item_id || '~' || CAST(k AS TEXT)" if c == "item_id" else c for c in columns)
    numbers = ("generate_series(1, ?) AS n(k)" if backends.is_postgres(location)
               else "(WITH RECURSIVE n(k) AS (SELECT 1 UNION ALL SELECT k + 1 FROM n WHERE k < ?) SELECT k FROM n)")
    backends.execute(location, f"INSERT INTO steps ({', '.join(columns)}) SELECT {copied} FROM steps, {numbers} "
                               "WHERE job_id = ?", (items // 10 - 1, job_id))
    backends.execute(location, "INSERT INTO resolutions (job_id, item_id, step, decision, receipt, note, resolved_by, "
                               "resolved_at, previous_status, previous_held_reason) "
                               "SELECT ?, 'item-' || CAST(k AS TEXT), 'fetch', 'delivered', 'receipt-' || CAST(k AS TEXT), "
                               f"'found on the receiver', 'on-call', 1e9, 'FAILED', 'unknown_outcome' FROM {numbers}",
                     (job_id, items))


def long_listings(location: str) -> str:
    """Jobs 'small' (5,000 rows, 5,000 audit rows) and 'large' (50,000 and 50,000) in the journal at ``location``."""
    many_rows(location, "small", 5_000)
    many_rows(location, "large", 50_000)
    return location


@pytest.fixture(scope="module")
def long_sqlite(tmp_path_factory) -> str:
    return long_listings(str(tmp_path_factory.mktemp("long-listings") / "journal.sqlite3"))


@pytest.fixture(scope="module")
def long_postgres(postgres) -> str:
    return long_listings(postgres.new_database())


# Every form on SQLite; on PostgreSQL (whose driver reads a page whole, as SQLite's does) one per listing.
@pytest.mark.parametrize(("journal", "command"), [
    ("long_sqlite", "show --json"), ("long_sqlite", "show"), ("long_sqlite", "audit --json"), ("long_sqlite", "audit"),
    ("long_postgres", "show --json"), ("long_postgres", "audit"),
])
def test_a_listing_of_every_row_streams_in_the_memory_of_a_page(request, tmp_path, journal, command):
    """``--all`` over 50,000 rows peaks within 8 MiB of the same listing over 5,000 (the child's own
    VmHWM): every row is written as it comes, a table sized a chunk at a time."""
    location = request.getfixturevalue(journal)
    name, *options = command.split()
    env = {**SETTINGS_GIVEN, **os.environ}  # the CLI need not import Airflow to read them

    def peak(job_id: str, rows: int) -> int:
        out = tmp_path / f"{job_id}.out"
        with out.open("w") as stdout:
            shown = subprocess.run([sys.executable, "-c", MEASURED_CLI, "--journal", location, name, job_id,
                                    "--all", *options], stdout=stdout, stderr=subprocess.PIPE, text=True, timeout=300,
                                   env=env)
        assert shown.returncode == 0, shown.stderr
        if options:
            assert len(json.loads(out.read_text())) == rows
        else:
            assert sum(1 for _ in out.open()) == 1 + rows  # the header, a line a row
        return int(shown.stderr.splitlines()[-1].split()[1]) * 1024

    small, large = peak("small", 5_000), peak("large", 50_000)
    assert large - small <= 8 * 2**20, (small, large)
