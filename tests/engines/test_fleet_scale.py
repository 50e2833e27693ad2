"""Fleet scale: the counts kept with each job, paging, bounded prune, explicit migration.

Both engines. The counts a job's row keeps are compared with a recount of its step rows after every kind
of change; pages are walked while other connections write, and every row that stays is seen once.
"""

from __future__ import annotations

import base64
import json
import random
import sqlite3
import threading
import time
from collections import Counter
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from airflow_resumable.exceptions import JobPrunedError, JournalVersionError, PageError
from airflow_resumable.journal import SCHEMA_VERSION, StepJournal, migrate
from airflow_resumable.journal import schema as journal_schema
from airflow_resumable.journal.records import MAX_ID_LENGTH, MAX_JOB_ID_LENGTH
from airflow_resumable.runner import NOT_DELIVERED, Step, run_batch
from tests.support import backends
from tests.support.scenario import held_job

pytestmark = pytest.mark.core

JOB = "fleet_dag/send/scheduled__2026-12-05"
STEPS_SQL = """INSERT INTO steps (job_id, item_id, step, side_effect, status, digest, receipt, output, error_type,
                                  held_reason, new_digest, attempts, created_at, updated_at)
               VALUES (?, ?, ?, ?, ?, ?, NULL, NULL, NULL, ?, NULL, 1, ?, ?)"""


def sending(sent: list[str], *, fail: set[str] = frozenset()) -> list[Step]:
    def render(item: dict[str, Any], ctx: Any) -> str:
        return f"hello {item['id']}"

    def send(item: dict[str, Any], ctx: Any) -> str:
        if item["id"] in fail:
            raise TimeoutError("the receiver did not answer")
        sent.append(item["id"])
        return f"r-{item['id']}"

    return [Step("render", render), Step("send", send, side_effect=True)]


def run(journal: StepJournal, job_id: str, items: list[dict[str, Any]], steps: list[Step], **options: Any) -> Any:
    """run_batch again while a send's outcome was unknown (that run fails; the next one holds it): without
    settlement in the task, as 0.2 ran."""
    options.setdefault("settle_in_task", False)
    for _ in range(len(items)):
        try:
            return run_batch(journal, job_id, items, steps, **options)
        except TimeoutError:
            continue
    return run_batch(journal, job_id, items, steps, **options)


def fill(location: str, job_id: str, count: int, *, held_every: int = 0, prefix: str = "item") -> None:
    """``count`` items of two steps, written by plain SQL from outside: the triggers count them."""
    rows = []
    for n in range(count):
        item = f"{prefix}-{n:06d}"
        held = "unknown_outcome" if held_every and n % held_every == 0 else None
        at = 1_700_000_000.0 + n
        rows += [(job_id, item, "render", 0, "SUCCEEDED", "d", None, at, at),
                 (job_id, item, "send", 1, "FAILED" if held else "SUCCEEDED", "d", held, at + 0.5, at + 0.5)]
    if backends.is_postgres(location):
        import psycopg

        with psycopg.connect(location, autocommit=True) as conn, conn.transaction():
            conn.execute("SET search_path = resumable")
            conn.cursor().executemany(STEPS_SQL.replace("?", "%s"), rows)
    else:
        conn = sqlite3.connect(location, isolation_level=None)
        conn.execute("BEGIN")
        conn.executemany(STEPS_SQL, rows)
        conn.execute("COMMIT")
        conn.close()


# ------------------------------------------------------------------------------------------ counts


def test_counts_follow_runs_resolutions_bulk_decisions_new_inputs_and_prune(journal_location):
    sent: list[str] = []
    with StepJournal(journal_location) as journal:
        items = [{"id": f"i{n}"} for n in range(40)]
        run(journal, JOB, items, sending(sent, fail={"i3", "i4", "i5", "i6"}), concurrency=4)
        backends.assert_counts_exact(journal_location)
        job = journal.job(JOB)
        assert (job.items, job.held, job.counts["SUCCEEDED"]) == (40, 4, 76)

        held = {h.item_id: h for h in journal.held(JOB)}
        journal.resolve(JOB, "i3", "send", delivered=True, receipt="r-i3", resolved_by="alice",
                        expected_version=held["i3"].version)
        journal.apply_decisions([
            {"job_id": JOB, "item_id": "i4", "step": "send", "decision": "not_delivered", "version": held["i4"].version},
            {"job_id": JOB, "item_id": "i5", "step": "send", "decision": "delivered", "receipt": "r-i5"},
        ], resolved_by="bob")
        backends.assert_counts_exact(journal_location)
        assert journal.job(JOB).held == 1 and journal.job(JOB).counts["FAILED"] == 2

        # An edited input is held, then run again on its new input.
        items[10] = {"id": "i10", "v": 2}
        run_batch(journal, JOB, items, sending(sent), settle_in_task=False)
        backends.assert_counts_exact(journal_location)
        journal.resolve_input_change(JOB, "i10", use_new_input=True, resolved_by="carol")
        backends.assert_counts_exact(journal_location)
        journal.resolve(JOB, "i6", "send", delivered=False, resolved_by="carol")
        run_batch(journal, JOB, items, sending(sent), settle_in_task=False)
        backends.assert_counts_exact(journal_location)
        assert journal.job(JOB).status == "completed"

        assert journal.prune(timedelta(0)) == [JOB]
        backends.assert_counts_exact(journal_location)
        job = journal.job(JOB)
        assert (job.status, job.items, job.held, dict(job.counts)) == (
            "pruned", 0, 0, {"IN_FLIGHT": 0, "SUCCEEDED": 0, "FAILED": 0})


def test_counts_of_rows_written_by_hand_are_kept_too(journal_location):
    with StepJournal(journal_location):
        pass
    fill(journal_location, JOB, 300, held_every=7)
    backends.execute(journal_location, "UPDATE steps SET status = 'IN_FLIGHT', held_reason = NULL "
                                       "WHERE job_id = ? AND item_id < 'item-000050' AND step = 'send'", (JOB,))
    backends.execute(journal_location, "DELETE FROM steps WHERE job_id = ? AND item_id > 'item-000280'", (JOB,))
    backends.assert_counts_exact(journal_location)
    with StepJournal(journal_location) as journal:
        job = journal.job(JOB)
        assert (job.items, job.unresolved) == (281, 50)


def test_a_row_never_moves_to_another_job(journal_location):
    with StepJournal(journal_location) as journal:
        run_batch(journal, JOB, [{"id": "a"}], sending([]), settle_in_task=False)
    with pytest.raises(Exception, match="keeps its job, item, step"):
        backends.execute(journal_location, "UPDATE steps SET job_id = 'other' WHERE job_id = ?", (JOB,))
    backends.assert_counts_exact(journal_location)


def test_jobs_and_job_read_no_step_rows(tmp_path):
    path = tmp_path / "journal.sqlite3"
    with StepJournal(path) as journal:
        run_batch(journal, JOB, [{"id": "a"}, {"id": "b"}], sending([]), settle_in_task=False)
        read: set[str] = set()

        def note(action: int, table: str | None, *rest: Any) -> int:
            if action == sqlite3.SQLITE_READ and table:
                read.add(table)
            return sqlite3.SQLITE_OK

        journal.engine._connection.set_authorizer(note)
        try:
            assert journal.job(JOB).items == 2 and [j.job_id for j in journal.jobs(limit=10, status="completed")] == [JOB]
        finally:
            journal.engine._connection.set_authorizer(None)
    assert "jobs" in read and "steps" not in read, read


def test_a_jobs_held_steps_cost_the_same_in_a_job_of_40000_items_as_in_one_of_40(tmp_path):
    """Reading one job's held steps (the job page, the review task, the sensor) goes through the
    index of held steps, not through every row of the job: counted in SQLite's virtual-machine
    steps, not timed."""
    path = str(tmp_path / "journal.sqlite3")
    with StepJournal(path):
        pass
    fill(path, "small/send/run", 40, held_every=8)  # 5 held sends each
    fill(path, "big/send/run", 40_000, held_every=8_000)
    steps = {}
    with StepJournal(path, readonly=True) as journal:
        for job_id in ("small/send/run", "big/send/run"):
            counted = [0]

            def count() -> int:
                counted[0] += 1
                return 0  # go on

            journal.engine._connection.set_progress_handler(count, 100)  # every 100 VM steps
            try:
                assert len(journal.held(job_id, limit=100)) == len(journal.held_rows(job_id, limit=100)) == 5
            finally:
                journal.engine._connection.set_progress_handler(None, 0)
            steps[job_id] = counted[0]
    assert steps["big/send/run"] <= 2 * steps["small/send/run"] + 5, steps


def test_jobs_and_job_read_no_step_rows_on_postgresql(postgres_url):
    """A role that may read the jobs table and not steps still lists jobs with their counts."""
    import psycopg

    with StepJournal(postgres_url) as journal:
        run_batch(journal, JOB, [{"id": "a"}, {"id": "b"}], sending([]), settle_in_task=False)
    role = f"onlyjobs_{random.randrange(10**9)}"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN")
        conn.execute(f"GRANT USAGE ON SCHEMA resumable TO {role}")
        conn.execute(f"GRANT SELECT ON resumable.jobs, resumable.meta TO {role}")
    url = postgres_url.replace("postgres@", f"{role}@", 1)
    with StepJournal(url, readonly=True) as journal:
        (job,) = journal.jobs(limit=100)
        assert (job.items, journal.job(JOB).counts["SUCCEEDED"]) == (2, 4)
        with pytest.raises(Exception):  # noqa: B017 - the proof: steps cannot be read by this role
            journal.rows(JOB)


# ------------------------------------------------------------------------------------------ paging


def test_paging_visits_every_row_once_while_others_write(journal_location):
    with StepJournal(journal_location):
        pass
    fill(journal_location, JOB, 400, held_every=3)
    fill(journal_location, "other/job", 50, held_every=2)
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        rng = random.Random(7)
        n = 0
        try:
            while not stop.is_set():
                n += 1
                # New items between and after existing ones, status changes, new jobs.
                backends.execute(journal_location, STEPS_SQL, (JOB, f"item-{rng.randrange(400):06d}x{n}", "send", 1,
                                                               "FAILED", "d", "unknown_outcome", 2e9 + n, 2e9 + n))
                backends.execute(journal_location, "UPDATE steps SET status = 'IN_FLIGHT' WHERE job_id = ? "
                                 "AND item_id = ? AND step = 'render'", (JOB, f"item-{rng.randrange(400):06d}"))
                backends.execute(journal_location, STEPS_SQL, (f"new/job{n}", "a", "send", 1, "SUCCEEDED", "d", None,
                                                               3e9 + n, 3e9 + n))
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    before_rows = {(f"item-{n:06d}", s) for n in range(400) for s in ("render", "send")}
    before_held = ({(JOB, f"item-{n:06d}") for n in range(0, 400, 3)}
                   | {("other/job", f"item-{n:06d}") for n in range(0, 50, 2)})
    thread = threading.Thread(target=writer)
    thread.start()
    try:
        with StepJournal(journal_location, readonly=True) as journal:
            seen_rows = walk(lambda c: journal.rows(JOB, limit=17, cursor=c), lambda r: (r.item_id, r.step))
            seen_held = walk(lambda c: journal.held(limit=11, cursor=c), lambda h: (h.job_id, h.item_id))
            seen_jobs = walk(lambda c: journal.jobs(limit=3, cursor=c), lambda j: j.job_id)
    finally:
        stop.set()
        thread.join()
    assert errors == []
    for seen, before in ((seen_rows, before_rows), (seen_held, before_held), (seen_jobs, {JOB, "other/job"})):
        assert max(seen.values()) == 1, [k for k, n in seen.items() if n > 1]  # nothing twice
        assert before <= set(seen), before - set(seen)  # nothing that stayed was missed


def walk(read, key) -> Counter:
    seen: Counter = Counter()
    cursor = None
    for _ in range(10_000):
        page = read(cursor)
        seen.update(key(r) for r in page)
        cursor = page.next_cursor
        if cursor is None:
            return seen
        time.sleep(0.001)  # let the writer in between pages
    raise AssertionError("paging did not end")


def test_pages_are_the_whole_list_in_its_order(journal_location):
    with StepJournal(journal_location) as journal:
        for n in range(7):
            run(journal, f"job{n}", [{"id": f"i{k}"} for k in range(5)], sending([], fail={"i1"} if n % 2 else set()))
        everything = journal.jobs()
        assert [j.job_id for j in everything] == [f"job{n}" for n in reversed(range(7))]  # newest first
        assert list(paged(lambda c: journal.jobs(limit=2, cursor=c))) == list(everything)
        assert list(paged(lambda c: journal.held(limit=2, cursor=c))) == list(journal.held())
        # The held steps as whole rows: the same steps, order and pages (a held cursor goes on in either).
        held_rows = list(paged(lambda c: journal.held_rows(limit=2, cursor=c)))
        assert [(r.job_id, r.item_id, r.step) for r in held_rows] == [(h.job_id, h.item_id, h.step) for h in journal.held()]
        assert all(r.held_reason is not None for r in held_rows) and held_rows == list(journal.held_rows())
        assert journal.held_rows(limit=1, cursor=journal.held(limit=1).next_cursor)[0].item_id == journal.held()[1].item_id
        assert list(paged(lambda c: journal.rows("job1", limit=3, cursor=c))) == list(journal.rows("job1"))
        assert [r.step for r in journal.rows("job1", "i0")] == ["render", "send"]  # the order they ran
        # Filters.
        assert [j.job_id for j in journal.jobs(status="needs_review")] == ["job5", "job3", "job1"]
        assert [j.job_id for j in paged(lambda c: journal.jobs(limit=1, cursor=c, status="completed"))] == [
            "job6", "job4", "job2", "job0"]
        assert {r.item_id for r in journal.rows("job1", status="FAILED")} == {"i1"}
        for status in ("needs_review", "completed", "pruned", "incomplete", "unfinished"):
            assert [j.job_id for j in journal.jobs(status=status)] == [j.job_id for j in everything if j.status == status]
        assert journal.jobs(dag_id="nobody") == []
        last = journal.jobs(limit=7)
        assert len(last) == 7 and last.next_cursor is None


def _b64(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode("utf-8", "surrogatepass")).decode("ascii").rstrip("=")


def forged(kind: str, *key) -> str:
    """A cursor as the journal writes them (base64 of its JSON), with any key: \\u escapes kept as written."""
    return _b64(json.dumps([kind, *key], separators=(",", ":")))


def paged(read):
    cursor = None
    while True:
        page = read(cursor)
        yield from page
        if page.next_cursor is None:
            return
        cursor = page.next_cursor


@pytest.mark.parametrize("call", [
    lambda j: j.jobs(limit=0), lambda j: j.jobs(limit=10_001), lambda j: j.jobs(limit="5"),
    lambda j: j.jobs(limit=True), lambda j: j.jobs(status="done"), lambda j: j.jobs(cursor="garbage!"),
    lambda j: j.held(cursor=j.jobs(limit=1).next_cursor), lambda j: j.rows(JOB, status="HELD"),
    lambda j: j.rows(JOB, cursor="W10"), lambda j: j.jobs(dag_id="a\x00b"), lambda j: j.jobs(dag_id="a\ud800"),
    # A job or item id no engine could store names nothing: refused in our words, not the driver's.
    lambda j: j.job("a\ud800"), lambda j: j.rows("a\x00b"), lambda j: j.rows(JOB, "a\ud800"),
    lambda j: j.held("a\ud800"), lambda j: j.held_rows("a\ud800"), lambda j: j.resolutions("a\ud800"),
    lambda j: j.has_job("a\ud800"), lambda j: j.open_rows("a\ud800"),
    # Cursors no journal gave: values past what either engine compares, JSON nested past Python's
    # limit, text with a lone surrogate or a NUL.
    lambda j: j.jobs(limit=1, cursor=forged("jobs", 10**400, "x")),
    lambda j: j.resolutions(f"{JOB}0", limit=1, cursor=forged("resolutions", f"{JOB}0", 10**30)),
    lambda j: j.jobs(limit=1, cursor=_b64("[" * 5000 + "]" * 5000)),
    lambda j: j.held(limit=1, cursor=forged("held", "\ud800", "a", "b")),
    lambda j: j.rows(f"{JOB}0", limit=1, cursor=forged("rows", f"{JOB}0", "a\x00", 1.0, "send")),
    # One job's cursor goes on only in its own list: in another's it would skip rows unseen.
    lambda j: j.rows(f"{JOB}1", limit=1, cursor=forged("rows", f"{JOB}0", "a", 0.0, "send")),
    lambda j: j.held(f"{JOB}1", limit=1, cursor=forged("held", f"{JOB}0", "a", "send")),
    lambda j: j.resolutions(f"{JOB}1", limit=1, cursor=forged("resolutions", f"{JOB}0", 1)),
])
def test_a_bad_page_request_is_refused_with_a_short_message(journal_location, call):
    with StepJournal(journal_location) as journal:
        for n in range(2):
            run_batch(journal, f"{JOB}{n}", [{"id": "a"}], sending([]), settle_in_task=False)
        before = backends.snapshot(journal_location)
        with pytest.raises(PageError) as info:
            call(journal)
        assert len(str(info.value)) < 200 and isinstance(info.value, ValueError)
        assert backends.snapshot(journal_location) == before


def test_the_cursors_of_the_longest_ids_go_on(tmp_path):
    """Job ids as long as any may be (and item ids too), of characters that take the most room in a cursor:
    every list still pages through them with its own cursors. (SQLite: PostgreSQL's btree index holds no
    key of more than about 2.7 KB, whatever the journal allows.)"""
    long_jobs = ["日" * MAX_JOB_ID_LENGTH, "\x01" * MAX_JOB_ID_LENGTH]
    items = [{"id": "\x01" * (MAX_ID_LENGTH - 1) + end} for end in "ab"]
    with StepJournal(str(tmp_path / "journal.sqlite3")) as journal:
        for job_id in long_jobs:
            run(journal, job_id, items, sending([], fail={i["id"] for i in items}))
        assert sorted(j.job_id for j in paged(lambda c: journal.jobs(limit=1, cursor=c))) == sorted(long_jobs)
        assert len(list(paged(lambda c: journal.held(limit=1, cursor=c)))) == 4
        for job_id in long_jobs:
            assert len(list(paged(lambda c, job_id=job_id: journal.rows(job_id, limit=1, cursor=c)))) == 4
            assert len(list(paged(lambda c, job_id=job_id: journal.held_rows(job_id, limit=1, cursor=c)))) == 2


# ------------------------------------------------------------------------------------------- prune


def test_an_interrupted_prune_leaves_a_tombstone_and_the_next_prune_finishes(journal_location, monkeypatch):
    with StepJournal(journal_location) as journal:
        run_batch(journal, JOB, [{"id": f"i{n:03d}"} for n in range(50)], sending([]), settle_in_task=False)
        monkeypatch.setattr(type(journal), "PRUNE_BATCH_ITEMS", 10)
        write, batches = journal.engine.write, []

        def dies_after_two_batches(*, durable):
            if not durable:
                batches.append(1)
                if len(batches) == 3:
                    raise KeyboardInterrupt  # the prune process is stopped part way
            return write(durable=durable)

        monkeypatch.setattr(journal.engine, "write", dies_after_two_batches)
        with pytest.raises(KeyboardInterrupt):
            journal.prune(timedelta(0))
        monkeypatch.setattr(journal.engine, "write", write)
        job = journal.job(JOB)
        assert job.status == "pruned" and job.items == 30  # two batches of ten items went
        backends.assert_counts_exact(journal_location)
        sent: list[str] = []
        with pytest.raises(JobPrunedError):  # a part of a history is never run again
            run_batch(journal, JOB, [{"id": "i000"}], sending(sent), settle_in_task=False)
        assert sent == []
        assert journal.prune(timedelta(days=365)) == [JOB]  # finishes what it started, whatever the age
        assert journal.job(JOB).items == 0 and journal.rows(JOB) == []
        backends.assert_counts_exact(journal_location)


def test_prune_pauses_between_batches_with_the_journal_free_for_a_waiting_writer(journal_location, monkeypatch):
    """A writer waiting for a batch must get in during the next pause: the pause is longer than the steps of
    SQLite's busy handler (up to 25 ms in a writer's first 100 ms), and nothing of the prune holds the journal
    while it lasts (on SQLite, another connection takes the write lock at once, with no busy wait)."""
    from airflow_resumable.journal import housekeeping

    with StepJournal(journal_location) as journal:
        run_batch(journal, JOB, [{"id": f"i{n:03d}"} for n in range(50)], sending([]), settle_in_task=False)
        monkeypatch.setattr(type(journal), "PRUNE_BATCH_ITEMS", 10)
        pauses: list[float] = []
        taken: list[bool] = []

        def pause(seconds: float) -> None:
            pauses.append(seconds)
            if not journal_location.startswith("postgresql"):
                other = sqlite3.connect(journal_location, timeout=0, isolation_level=None)
                try:
                    other.execute("BEGIN IMMEDIATE")  # raises "database is locked" if the prune held it
                    other.execute("ROLLBACK")
                    taken.append(True)
                finally:
                    other.close()

        monkeypatch.setattr(journal, "_pause", pause)
        assert journal.prune(timedelta(0)) == [JOB]
    assert len(pauses) == 5  # one after each batch of ten items
    assert min(pauses) >= housekeeping.JournalHousekeeping.PRUNE_PAUSE > 0.025
    assert taken == ([] if journal_location.startswith("postgresql") else [True] * 5)


def test_prune_leaves_jobs_that_are_not_finished(journal_location):
    with StepJournal(journal_location) as journal:
        run_batch(journal, "done", [{"id": "a"}], sending([]), settle_in_task=False)
        run(journal, "held", [{"id": "a"}], sending([], fail={"a"}))
        assert journal.prune(timedelta(0)) == ["done"]
        assert journal.job("held").status == "needs_review"


def test_a_job_run_again_while_prune_works_through_its_candidates_is_kept(journal_location, monkeypatch):
    """Prune reads its candidates once, then takes them one by one (a big one for minutes): a job run
    again meanwhile (a Clear, a later pass) is recent again and must be kept; it was pruned, its new
    history deleted and every later run refused."""
    sent: list[str] = []
    with StepJournal(journal_location) as journal:
        for job in ("old-1", "old-2"):
            run_batch(journal, job, [{"id": "a"}], sending(sent), settle_in_task=False)
            backends.execute(journal_location, "UPDATE jobs SET updated_at = updated_at - 86400 WHERE job_id = ?",
                             (job,))
        claim = journal.engine.claim

        def run_again_first(job_id: str, **kwargs: Any) -> Any:
            if job_id == "old-2":  # old-1 is being pruned; old-2 is run again before prune gets to it
                with StepJournal(journal_location) as other:
                    run_batch(other, "old-2", [{"id": "a"}, {"id": "b"}], sending(sent), settle_in_task=False)
            return claim(job_id, **kwargs)

        monkeypatch.setattr(journal.engine, "claim", run_again_first)
        assert journal.prune(timedelta(hours=1)) == ["old-1"]
        monkeypatch.undo()
        assert [r.item_id for r in journal.rows("old-2") if r.step == "send"] == ["a", "b"]
        assert journal.job("old-2").pruned_at is None
        assert run_batch(journal, "old-2", [{"id": "a"}, {"id": "b"}], sending(sent),
                         settle_in_task=False).status == "completed"
        assert sent == ["a", "a", "b"]


# --------------------------------------------------------------------------------------- migration


def _older_journal(location: str, version: int) -> None:
    """A journal as the release with schema ``version`` left it, with two jobs' rows."""
    rows = [("old/job", f"i{n}", step, int(step == "send"), status, "d", held, 1_600_000_000.0 + n, 1_600_000_001.0 + n)
            for n in range(5) for step, status, held in (("render", "SUCCEEDED", None),
                                                       ("send", "IN_FLIGHT" if n == 4 else "SUCCEEDED", None))]
    rows.append(("old/held", "h", "send", 1, "FAILED", "d", "unknown_outcome", 1_500_000_000.0, 1_500_000_000.0))
    if backends.is_postgres(location):
        import psycopg

        with psycopg.connect(location, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA resumable")
            conn.execute("SET search_path = resumable")
            for v in range(journal_schema.POSTGRES_FIRST_VERSION, version + 1):
                for statement in journal_schema.POSTGRES_MIGRATIONS[v]:
                    conn.execute(statement)
            conn.execute("INSERT INTO meta (key, value) VALUES ('schema_version', %s)", (str(version),))
            conn.cursor().executemany(STEPS_SQL.replace("?", "%s"), rows)
            conn.execute("INSERT INTO jobs (job_id, created_at, updated_at) SELECT job_id, min(created_at), "
                         "max(updated_at) FROM steps WHERE true GROUP BY job_id "
                         "ON CONFLICT (job_id) DO NOTHING")  # from version 7 on, its triggers made them
        return
    Path(location).parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(location, isolation_level=None)
    for v in range(1, version + 1):
        for statement in journal_schema.SQLITE_MIGRATIONS[v]:
            conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {version}")
    conn.executemany(STEPS_SQL, rows)
    if version >= 2:
        conn.execute("INSERT INTO jobs (job_id, created_at, updated_at) SELECT job_id, min(created_at), "
                     "max(updated_at) FROM steps WHERE true GROUP BY job_id "
                     "ON CONFLICT (job_id) DO NOTHING")  # from version 7 on, its triggers made them
    conn.close()


@pytest.mark.parametrize("version", range(1, SCHEMA_VERSION))
def test_every_older_sqlite_journal_gets_its_counts_once(tmp_path, version):
    check_migration_counts(str(tmp_path / "state" / "journal.sqlite3"), version)


@pytest.mark.parametrize("version", range(journal_schema.POSTGRES_FIRST_VERSION, SCHEMA_VERSION))
def test_every_older_postgresql_journal_gets_its_counts_once(postgres_url, version):
    check_migration_counts(postgres_url, version)


def check_migration_counts(journal_location: str, version: int) -> None:
    _older_journal(journal_location, version)
    if backends.is_postgres(journal_location):
        before = backends.snapshot(journal_location)
        with pytest.raises(JournalVersionError, match="airflow-resumable migrate"):
            StepJournal(journal_location)
        assert backends.snapshot(journal_location) == before  # a worker never migrates a shared journal
    assert migrate(journal_location) == (version, SCHEMA_VERSION)
    backends.assert_counts_exact(journal_location)
    with StepJournal(journal_location) as journal:
        old = journal.job("old/job")
        assert (old.items, old.counts["SUCCEEDED"], old.counts["IN_FLIGHT"], old.unresolved) == (5, 9, 1, 1)
        assert journal.job("old/held").held == 1
        # The migrated counts are live: a resolution moves them on.
        journal.resolve("old/held", "h", "send", delivered=True, receipt="r", resolved_by="alice")
    backends.assert_counts_exact(journal_location)
    assert migrate(journal_location) == (SCHEMA_VERSION, SCHEMA_VERSION)


def test_a_task_on_an_older_shared_journal_sends_nothing_and_names_the_command(postgres_url):
    held_job(postgres_url, JOB)
    backends.postgres_downgrade_to_6(postgres_url)
    before = backends.snapshot(postgres_url)
    sent: list[str] = []
    with pytest.raises(JournalVersionError) as info:
        with StepJournal(postgres_url) as journal:
            run_batch(journal, JOB, [{"id": "a"}], sending(sent), settle_in_task=False)
    assert "airflow-resumable migrate" in str(info.value) and "version 6" in str(info.value)
    assert sent == [] and backends.snapshot(postgres_url) == before
    with pytest.raises(JournalVersionError):  # the page and the CLI's reads too: they would misread it
        StepJournal(postgres_url, readonly=True)
    assert migrate(postgres_url) == (6, SCHEMA_VERSION)
    with StepJournal(postgres_url) as journal:
        assert journal.job(JOB).held == 1
        steps = [Step("send", lambda item, ctx: sent.append(item["id"]) or "r", side_effect=True,
                      verify=lambda ctx: NOT_DELIVERED)]
        run_batch(journal, JOB, [{"id": "a"}], steps, settle_in_task=False)
    assert sent == ["a"]
    backends.assert_counts_exact(postgres_url)


def test_a_new_shared_journal_is_created_by_its_first_user(postgres_url):
    with StepJournal(postgres_url) as journal:
        assert journal.migrated_from is None and journal.jobs() == []
    assert migrate(postgres_url) == (SCHEMA_VERSION, SCHEMA_VERSION)


def test_page_cursors_are_opaque_text(journal_location):
    with StepJournal(journal_location) as journal:
        for n in range(3):
            run_batch(journal, f"job{n}", [{"id": "a"}], sending([]), settle_in_task=False)
        cursor = journal.jobs(limit=1).next_cursor
        assert isinstance(cursor, str) and cursor.isascii() and "job" not in cursor
        assert json.dumps(cursor)  # fits in a URL parameter and a JSON document as it is
        assert [j.job_id for j in journal.jobs(limit=5, cursor=cursor)] == ["job1", "job0"]


def test_fill_helper_writes_what_it_says(tmp_path):
    path = str(tmp_path / "journal.sqlite3")
    with StepJournal(path):
        pass
    fill(path, JOB, 10, held_every=5)
    with StepJournal(path) as journal:
        assert journal.job(JOB).items == 10 and len(journal.held(JOB)) == 2
    assert Path(path).exists()


def test_the_audit_log_pages_both_ways(journal_location):
    with StepJournal(journal_location) as journal:
        run(journal, JOB, [{"id": f"i{n}"} for n in range(7)], sending([], fail={f"i{n}" for n in range(7)}))
        for h in journal.held(JOB):
            journal.resolve(JOB, h.item_id, h.step, delivered=True, receipt=f"r-{h.item_id}", resolved_by="alice")
        everything = journal.resolutions(JOB)
        assert [r.item_id for r in everything] == [f"i{n}" for n in range(7)]
        assert list(paged(lambda c: journal.resolutions(JOB, limit=3, cursor=c))) == list(everything)
        latest = journal.resolutions(JOB, limit=2, newest_first=True)
        assert [r.item_id for r in latest] == ["i6", "i5"]
        assert list(paged(lambda c: journal.resolutions(JOB, limit=3, cursor=c, newest_first=True))) == everything[::-1]
        with pytest.raises(PageError):  # an oldest-first cursor is not a newest-first one
            journal.resolutions(JOB, limit=3, newest_first=True, cursor=journal.resolutions(JOB, limit=3).next_cursor)
