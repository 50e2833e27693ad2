"""Compacted items (schema 8): a finished item's rows kept as one row - on both engines.

Compaction must change nothing anyone can see or rely on: every read (rows, pages, an item, a status, the
job's counts and versions) is the same before and after; a run of the job after it sends nothing it had
sent, and one whose item changed or gained a step puts the item's rows back first and goes on as before;
a decision about a compacted step is refused as about any settled one; prune forgets compacted items too;
and a compaction killed part way leaves a journal whose counts equal a recount and whose rows are whole.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from airflow_resumable.exceptions import StaleDecisionError
from airflow_resumable.journal import HeldReason, NotHeldError, Status, StepJournal
from airflow_resumable.journal.compaction import compact_item, expand_item
from airflow_resumable.runner import Step, StepContext, run_batch
from tests.support import backends

pytestmark = pytest.mark.core

JOB = "dag/send/run-1"


class Receiver:
    """Counts every send per item, and fails the ones it is told to."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.fail: set[str] = set()
        self.outputs: dict[str, dict[str, Any]] = {}  # what a step added later was handed, per item

    def steps(self, *, extra: bool = False) -> list[Step]:
        def validate(item: dict[str, Any], ctx: StepContext) -> bool:
            return True

        def transform(item: dict[str, Any], ctx: StepContext) -> dict[str, Any]:
            return {"n": item["n"] * 2, "text": f"\u00e9t\u00e9 {item['id']}"}

        def send(item: dict[str, Any], ctx: StepContext) -> str:
            if item["id"] in self.fail:
                raise TimeoutError("the reply was lost")
            self.sent.append(item["id"])
            return f"rcpt-{item['id']}-{len(self.sent)}"

        def audit(item: dict[str, Any], ctx: StepContext) -> None:
            self.outputs[ctx.item_id] = dict(ctx.outputs)

        steps = [Step("validate", validate), Step("transform", transform), Step("send", send, side_effect=True)]
        return [*steps, Step("audit", audit)] if extra else steps


def items(n: int = 40, **changed: int) -> list[dict[str, Any]]:
    return [{"id": f"item-{i:03d}", "n": changed.get(f"item-{i:03d}", i)} for i in range(n)]


def all_rows(journal: StepJournal, job: str = JOB) -> list[Any]:
    return list(journal.rows(job))


def paged(journal: StepJournal, limit: int, **kwargs: Any) -> list[Any]:
    found, cursor = [], None
    while True:
        page = journal.rows(JOB, limit=limit, cursor=cursor, **kwargs)
        found += page
        cursor = page.next_cursor
        if cursor is None:
            return found


def compacted_count(location: str) -> int:
    return int(backends.execute(location, "SELECT count(*) FROM compacted")[0][0])


def compact_every_item(journal: StepJournal, receiver: Receiver) -> None:
    """Settle the held send (the receiver had it), finish the job, compact all of it."""
    journal.resolve(JOB, "item-007", "send", delivered=True, receipt="r-7", resolved_by="oncall")
    run_batch(journal, JOB, items(), receiver.steps(), settle_in_task=False)
    assert journal.compact(timedelta(0)) == {JOB: 40}


@pytest.fixture
def finished_job(journal_location: str) -> Receiver:
    """JOB: 40 items sent; item-007's reply was lost, then held (unknown outcome) by the next run."""
    receiver = Receiver()
    with StepJournal(journal_location) as journal:
        receiver.fail.add("item-007")
        with pytest.raises(TimeoutError):
            run_batch(journal, JOB, items(), receiver.steps(), settle_in_task=False)
        receiver.fail.clear()
        result = run_batch(journal, JOB, items(), receiver.steps(), settle_in_task=False)
        assert [h.item_id for h in result.held] == ["item-007"]
    return receiver


def test_compaction_changes_nothing_a_reader_sees(journal_location, finished_job):
    with StepJournal(journal_location) as journal:
        before = all_rows(journal)
        summary, held = journal.job(JOB), list(journal.held(JOB))
        assert journal.compact(timedelta(0)) == {JOB: 39}  # all but the held one
        assert compacted_count(journal_location) == 39
        assert all_rows(journal) == before  # versions, attempts, receipts, outputs, times: to the bit
        assert journal.job(JOB) == summary and list(journal.held(JOB)) == held
        for limit in (1, 2, 3, 7, 100):
            assert paged(journal, limit) == before
        assert paged(journal, 5, status="SUCCEEDED") == [r for r in before if r.status == Status.SUCCEEDED]
        assert paged(journal, 5, status="FAILED") == [r for r in before if r.status == Status.FAILED]
        assert list(journal.rows(JOB, "item-012")) == [r for r in before if r.item_id == "item-012"]
        assert list(journal.rows(JOB, "item-007")) == [r for r in before if r.item_id == "item-007"]
        assert journal.compact(timedelta(0)) == {}  # nothing new since: the job is not gone through again
    backends.assert_counts_exact(journal_location)


def test_a_run_after_compaction_sends_nothing_again_and_resolves_as_before(journal_location, finished_job):
    receiver = finished_job
    with StepJournal(journal_location) as journal:
        journal.compact(timedelta(0))
        sent = list(receiver.sent)
        again = run_batch(journal, JOB, items(), receiver.steps(), settle_in_task=False)
        assert receiver.sent == sent and again.executed_steps == 0
        assert [h.item_id for h in again.held] == ["item-007"]  # still held, never sent blindly
        assert compacted_count(journal_location) == 39  # finished items stay compacted: nothing to look at
        journal.resolve(JOB, "item-007", "send", delivered=False, resolved_by="oncall")
        assert run_batch(journal, JOB, items(), receiver.steps(), settle_in_task=False).status == "completed"
        assert receiver.sent == [*sent, "item-007"]
        assert journal.compact(timedelta(0)) == {JOB: 1}  # finished again: its last item too
        assert compacted_count(journal_location) == 40
    backends.assert_counts_exact(journal_location)


def test_a_changed_item_is_put_back_and_held_and_its_new_input_sent_once(journal_location, finished_job):
    receiver = finished_job
    with StepJournal(journal_location) as journal:
        compact_every_item(journal, receiver)
        before = {r.step: r for r in journal.rows(JOB, "item-012")}
        sent = list(receiver.sent)
        result = run_batch(journal, JOB, items(**{"item-012": 999}), receiver.steps(), settle_in_task=False)
        assert [(h.item_id, h.reason) for h in result.held] == [("item-012", HeldReason.INPUT_CHANGED)]
        assert receiver.sent == sent
        assert compacted_count(journal_location) == 39  # item-012 alone is live again
        now = {r.step: r for r in journal.rows(JOB, "item-012")}
        assert now["send"] == before["send"]  # put back as it was; the hold is on its first step
        assert now["validate"].held_reason == HeldReason.INPUT_CHANGED
        journal.resolve_input_change(JOB, "item-012", use_new_input=True, resolved_by="oncall")
        assert run_batch(journal, JOB, items(**{"item-012": 999}), receiver.steps(),
                         settle_in_task=False).status == "completed"
        assert receiver.sent == [*sent, "item-012"]  # the new input, once, under its next key
    backends.assert_counts_exact(journal_location)


def test_a_step_added_later_runs_alone_with_the_compacted_steps_outputs(journal_location, finished_job):
    receiver = finished_job
    with StepJournal(journal_location) as journal:
        compact_every_item(journal, receiver)
        recorded = {i["id"]: {r.step: r.output for r in journal.rows(JOB, i["id"])} for i in items()}
        sent = list(receiver.sent)
        result = run_batch(journal, JOB, items(), receiver.steps(extra=True), settle_in_task=False)
        assert result.status == "completed" and result.executed_steps == 40 and receiver.sent == sent
        assert receiver.outputs == recorded  # validate's, transform's and the send's receipt, as journaled
        assert compacted_count(journal_location) == 0  # every item was looked at again
        assert journal.compact(timedelta(0)) == {JOB: 40}
        assert {len(journal.rows(JOB, i["id"])) for i in items()} == {4}
    backends.assert_counts_exact(journal_location)


def test_decisions_about_a_compacted_step_are_refused_as_about_a_settled_one(journal_location, finished_job):
    with StepJournal(journal_location) as journal:
        row = next(r for r in journal.rows(JOB, "item-012") if r.step == "send")
        refusals = {}
        for compacted in (False, True):
            if compacted:
                journal.compact(timedelta(0))
                before = backends.snapshot(journal_location)
            for version in (None, row.version, "0" * 16):  # none, the row's own, one it never had
                with pytest.raises((NotHeldError, StaleDecisionError)) as info:
                    journal.resolve(JOB, "item-012", "send", delivered=False, resolved_by="oncall",
                                    expected_version=version)
                refusals.setdefault(version, []).append((type(info.value), str(info.value)))
        # The very refusals the live row got: compaction is invisible to a decision too.
        assert all(live == compacted for live, compacted in refusals.values()), refusals
        assert refusals[row.version][0][0] is NotHeldError and refusals["0" * 16][0][0] is StaleDecisionError
        with pytest.raises(NotHeldError, match="not held for an input change"):
            journal.resolve_input_change(JOB, "item-012", use_new_input=True, resolved_by="oncall")
        with pytest.raises(NotHeldError, match="has no item"):
            journal.resolve(JOB, "item-999", "send", delivered=False, resolved_by="oncall")
        assert backends.snapshot(journal_location) == before


def owned_compacted_count(location: str) -> int:
    """Compacted items that belong to a job (PostgreSQL: prune forgets a job's items, its partition goes later)."""
    return int(backends.execute(location, "SELECT count(*) FROM compacted k JOIN jobs j ON j.job_no = k.job_no")[0][0])


def partitions(location: str) -> list[str]:
    return [r[0] for r in backends.execute(
        location, "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                  "WHERE i.inhparent = 'compacted'::regclass ORDER BY 1")]


def test_prune_forgets_compacted_items_too(journal_location, finished_job):
    with StepJournal(journal_location) as journal:
        compact_every_item(journal, finished_job)
        assert journal.prune(timedelta(0)) == [JOB]
        assert owned_compacted_count(journal_location) == 0 and all_rows(journal) == []
        assert journal.job(JOB).items == 0 and journal.job(JOB).pruned_at is not None
        # SQLite deletes them; PostgreSQL keeps them (no job's) until every job of their partition is pruned.
        assert compacted_count(journal_location) == (40 if backends.is_postgres(journal_location) else 0)
    backends.assert_counts_exact(journal_location)


@pytest.mark.parametrize("journal_location", ["postgres"], indirect=True)
def test_postgres_prune_drops_a_partition_once_no_job_has_a_number_in_it(journal_location, finished_job):
    """The partition of job numbers 0-63 goes only when every number in it was given and no job keeps one:
    a job of the partition with a held item keeps it (and its items readable); once it is pruned too, the
    whole partition is dropped, and a job compacted later gets a partition of its own."""
    other = "dag/send/run-2"
    with StepJournal(journal_location) as journal:
        compact_every_item(journal, finished_job)  # JOB: number 1
        finished_job.fail.add("item-003")
        with pytest.raises(TimeoutError):
            run_batch(journal, other, items(10), finished_job.steps(), settle_in_task=False)
        finished_job.fail.clear()
        assert [h.item_id for h in run_batch(journal, other, items(10), finished_job.steps(),
                                             settle_in_task=False).held] == ["item-003"]
        assert journal.compact(timedelta(0)) == {other: 9}  # number 2; item-003 held, live
        backends.execute(journal_location, "SELECT setval('job_numbers', 100)")  # 98 more jobs were numbered since
        kept = all_rows(journal, other)

        assert journal.prune(timedelta(0)) == [JOB]  # not the other: it holds an item
        assert partitions(journal_location) == ["compacted_0_64"] and compacted_count(journal_location) == 49
        assert all_rows(journal) == [] and journal.job(JOB).items == 0
        assert all_rows(journal, other) == kept and journal.job(other).items == 10
        backends.assert_counts_exact(journal_location)

        journal.resolve(other, "item-003", "send", delivered=True, receipt="r-3", resolved_by="oncall")
        run_batch(journal, other, items(10), finished_job.steps(), settle_in_task=False)
        assert journal.prune(timedelta(0)) == [other]
        assert partitions(journal_location) == [] and compacted_count(journal_location) == 0
        backends.assert_counts_exact(journal_location)

        third = "dag/send/run-3"
        run_batch(journal, third, items(5), finished_job.steps(), settle_in_task=False)
        before = all_rows(journal, third)
        assert journal.compact(timedelta(0)) == {third: 5}
        assert partitions(journal_location) == ["compacted_64_128"] and all_rows(journal, third) == before
        sent = len(finished_job.sent)
        assert run_batch(journal, third, items(5), finished_job.steps(), settle_in_task=False).executed_steps == 0
        assert len(finished_job.sent) == sent


def prune_within(journal: StepJournal, seconds: float = 120) -> list[str]:
    """prune(), which must return (not wait for a reader of compacted for ever)."""
    found: list[list[str]] = []
    worker = threading.Thread(target=lambda: found.append(journal.prune(timedelta(0))), daemon=True)
    worker.start()
    worker.join(seconds)
    assert found, "prune waited for the reader of compacted"
    return found[0]


@pytest.mark.parametrize("journal_location", ["postgres"], indirect=True)
def test_postgres_a_reader_of_compacted_puts_the_drop_off_to_the_next_prune(journal_location, finished_job):
    """Dropping a partition locks all of compacted, and its readers would queue behind it: with a transaction
    reading compacted open, prune forgets the job, gives the drop up after a moment (three tries), and the
    next prune drops the partition."""
    import psycopg

    with StepJournal(journal_location) as journal:
        compact_every_item(journal, finished_job)
        backends.execute(journal_location, "SELECT setval('job_numbers', 63)")
        with psycopg.connect(journal_location) as reader:  # a transaction, open
            reader.execute("SELECT count(*) FROM resumable.compacted").fetchone()
            assert prune_within(journal) == [JOB]
            assert partitions(journal_location) == ["compacted_0_64"] and journal.job(JOB).items == 0
        assert prune_within(journal) == []
        assert partitions(journal_location) == [] and compacted_count(journal_location) == 0
    backends.assert_counts_exact(journal_location)


@pytest.mark.parametrize("journal_location", ["postgres"], indirect=True)
def test_postgres_a_role_that_may_not_drop_prunes_and_leaves_the_partition(journal_location, finished_job, caplog):
    """Dropping a table takes its owner: a prune by a role that may only read and write the rows prunes the
    job, says why the partition stayed, and the owner's next prune drops it."""
    import psycopg

    with StepJournal(journal_location) as journal:
        compact_every_item(journal, finished_job)
    backends.execute(journal_location, "SELECT setval('job_numbers', 63)")
    with psycopg.connect(journal_location, autocommit=True) as conn:
        conn.execute("CREATE ROLE rows_only LOGIN")
        conn.execute("GRANT USAGE ON SCHEMA resumable TO rows_only")
        conn.execute("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA resumable TO rows_only")
        conn.execute("GRANT USAGE ON ALL SEQUENCES IN SCHEMA resumable TO rows_only")
    with StepJournal(journal_location.replace("postgres@", "rows_only@", 1)) as journal:
        assert journal.prune(timedelta(0)) == [JOB]
        assert journal.job(JOB).items == 0 and all_rows(journal) == []
    assert partitions(journal_location) == ["compacted_0_64"]
    assert "could not drop the partitions of compacted" in caplog.text and "owns the journal's tables" in caplog.text
    with StepJournal(journal_location) as journal:
        assert journal.prune(timedelta(0)) == []
    assert partitions(journal_location) == []
    backends.assert_counts_exact(journal_location)


def test_a_job_running_or_touched_since_the_cut_off_is_left_alone(journal_location, finished_job):
    with StepJournal(journal_location) as journal:
        assert journal.compact(timedelta(hours=1)) == {}  # run a moment ago
        with journal.open_job(JOB, runner="a run"):
            assert journal.compact(timedelta(0)) == {}
        assert compacted_count(journal_location) == 0
        with pytest.raises(ValueError, match="older_than"):
            journal.compact(timedelta(seconds=-1))


def test_paging_while_items_are_compacted_sees_each_row_once(journal_location):
    receiver = Receiver()
    with StepJournal(journal_location) as journal:
        run_batch(journal, JOB, items(300), receiver.steps(), settle_in_task=False)
        expected = [(r.item_id, r.step) for r in journal.rows(JOB)]
    done = threading.Event()

    def compact() -> None:
        with StepJournal(journal_location) as other:
            other.PRUNE_BATCH_ITEMS = 7  # many small batches, while the reader pages
            other.compact(timedelta(0))
        done.set()

    seen: list[tuple[str, str]] = []
    with StepJournal(journal_location) as journal:
        thread = threading.Thread(target=compact)
        thread.start()
        cursor = None
        while True:
            page = journal.rows(JOB, limit=13, cursor=cursor)
            seen += [(r.item_id, r.step) for r in page]
            cursor = page.next_cursor
            if cursor is None:
                break
        thread.join(120)
    assert done.is_set() and seen == expected
    backends.assert_counts_exact(journal_location)


KILLED_COMPACTION = textwrap.dedent("""
    import sys, time
    from datetime import timedelta
    from airflow_resumable.journal import StepJournal
    from airflow_resumable.journal import housekeeping

    def pause(self, seconds):
        print("batch", flush=True)
        time.sleep(0.2)

    housekeeping.JournalHousekeeping._pause = pause
    with StepJournal(sys.argv[1]) as journal:
        journal.PRUNE_BATCH_ITEMS = 10
        journal.compact(timedelta(0))
""")


def test_a_compaction_killed_part_way_leaves_whole_items_and_exact_counts(journal_location, tmp_path):
    receiver = Receiver()
    with StepJournal(journal_location) as journal:
        run_batch(journal, JOB, items(100), receiver.steps(), settle_in_task=False)
        before = all_rows(journal)
    script = tmp_path / "compact.py"
    script.write_text(KILLED_COMPACTION)
    child = subprocess.Popen([sys.executable, str(script), journal_location], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    for _ in range(3):  # three batches committed
        assert child.stdout.readline().strip() == "batch"
    child.send_signal(signal.SIGKILL)
    child.wait(30)
    assert 0 < compacted_count(journal_location) < 100
    backends.assert_counts_exact(journal_location)
    with StepJournal(journal_location) as journal:
        assert all_rows(journal) == before
        sent = list(receiver.sent)
        assert run_batch(journal, JOB, items(100), receiver.steps(),
                         settle_in_task=False).executed_steps == 0 and receiver.sent == sent
        left = 100 - compacted_count(journal_location)
        assert journal.compact(timedelta(0)) == {JOB: left}
        assert compacted_count(journal_location) == 100 and all_rows(journal) == before
    backends.assert_counts_exact(journal_location)


# ------------------------------------------------------------------------- the packed form itself

_floats = st.floats(min_value=0, max_value=4e9, allow_nan=False, allow_infinity=False)
_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)


@st.composite
def _item_rows(draw: Any) -> list[tuple[Any, ...]]:
    names = draw(st.lists(_text.filter(bool), min_size=1, max_size=6, unique=True))
    digest = draw(st.binary(min_size=32, max_size=32)).hex()
    created_at = draw(st.lists(_floats, min_size=len(names), max_size=len(names), unique=True))
    rows = []
    for name, created in zip(names, created_at, strict=True):
        side_effect = draw(st.sampled_from([0, 1]))
        receipt = draw(st.none() | _text) if side_effect else draw(st.none() | _text)
        output = draw(st.sampled_from([None, "null", "json-of-receipt", "other"]))
        if output == "json-of-receipt":
            output = None if receipt is None else __import__("json").dumps(receipt, ensure_ascii=False,
                                                                            separators=(",", ":"))
        elif output == "other":
            output = draw(_text)
        rows.append(("job/\u00e9", "item \u4e00", name, side_effect, "SUCCEEDED", digest, receipt, output, None, None,
                     None, draw(st.integers(0, 10**6)), created, draw(_floats), draw(st.integers(0, 10**4)), 0,
                     draw(st.integers(1, 10**9))))
    return rows


@settings(max_examples=300, deadline=None)
@given(_item_rows())
def test_an_item_packed_and_unpacked_is_the_same_rows(rows):
    packed = compact_item("job/\u00e9", "item \u4e00", rows)
    assert packed is not None
    unpacked = sorted(expand_item("job/\u00e9", "item \u4e00", packed.digest, packed.names, packed.data),
                      key=lambda r: r[2])
    rows = sorted(rows, key=lambda r: r[2])
    assert unpacked == rows
    # Times to the bit (== alone would take -0.0 for 0.0).
    assert [(r[12].hex(), r[13].hex()) for r in unpacked] == [(r[12].hex(), r[13].hex()) for r in rows]


ROW = ("j", "i", "send", 1, "SUCCEEDED", "ab" * 32, "r", '"r"', None, None, None, 1, 1.5, 2.5, 0, 0, 1)


@pytest.mark.parametrize(("column", "value"), [(4, "FAILED"), (4, "IN_FLIGHT"), (9, "unknown_outcome"),
                                                (8, "TimeoutError"), (10, "ab" * 32), (15, 1), (5, "not-hex"),
                                                (5, "AB" * 32), (11, -1), (1, "another item")])
def test_an_item_not_finished_is_never_packed(column, value):
    assert compact_item("j", "i", [ROW]) is not None
    row = list(ROW)
    row[column] = value
    assert compact_item("j", "i", [tuple(row)]) is None


def test_an_item_whose_steps_saw_two_inputs_is_never_packed():
    other = ("j", "i", "validate", 0, "SUCCEEDED", "cd" * 32, None, "null", None, None, None, 1, 1.0, 1.0, 0, 0, 1)
    assert compact_item("j", "i", [other, ROW]) is None


def test_an_item_whose_steps_were_written_at_one_instant_stays_live():
    """A reader orders an item's rows by creation time, then by name in the database's collation; two rows
    of one instant keep that order only where the database keeps them."""
    twin = ("j", "i", "validate", 0, "SUCCEEDED", "ab" * 32, None, "null", None, None, None, 1, 1.5, 1.5, 0, 0, 1)
    assert compact_item("j", "i", [twin, ROW]) is None


def test_a_run_of_fewer_steps_leaves_the_compacted_items_where_they_are(journal_location, finished_job):
    """An item compacted with validate, transform and send is finished for a run of validate and send, as
    its live rows were: nothing is put back, nothing sent."""
    receiver = finished_job
    with StepJournal(journal_location) as journal:
        compact_every_item(journal, receiver)
        sent = list(receiver.sent)
        validate, _, send = receiver.steps()
        result = run_batch(journal, JOB, items(), [validate, send], settle_in_task=False)
        assert (result.executed_steps, result.skipped_steps, receiver.sent) == (0, 80, sent)
        assert compacted_count(journal_location) == 40


def test_a_whole_job_read_at_once_names_no_item_in_a_statement(tmp_path):
    """A page of a compacted job was ordered by sending the database each of its item ids: an unbounded
    read (export, show --all) of a big job went past the engine's limit on bound parameters (999 on older
    SQLite), and the error said the journal was corrupt."""
    import sqlite3

    receiver = Receiver()
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        if not hasattr(journal.engine._connection, "setlimit"):
            pytest.skip("Python 3.10's sqlite3 cannot lower the parameter limit (Connection.setlimit is 3.11's)")
        run_batch(journal, JOB, items(600), receiver.steps(), settle_in_task=False)
        before = all_rows(journal)
        journal.compact(timedelta(0))
        journal.engine._connection.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
        assert all_rows(journal) == before and paged(journal, 1000) == before


@pytest.mark.parametrize("journal_location", ["postgres"], indirect=True)
def test_postgres_the_drop_checks_in_read_committed_whatever_the_servers_default(journal_location, finished_job):
    """compacted_drop() must see a job numbered while it waited for the lock: it runs in read committed (it
    refuses any other level), which prune asks for even when the database's default is repeatable read."""
    import psycopg

    database = journal_location.rsplit("/", 1)[1]
    backends.execute(journal_location, f'ALTER DATABASE "{database}" SET default_transaction_isolation = '
                                       "'repeatable read'")
    with StepJournal(journal_location) as journal:
        compact_every_item(journal, finished_job)
        backends.execute(journal_location, "SELECT setval('job_numbers', 63)")
        assert journal.prune(timedelta(0)) == [JOB]
        assert partitions(journal_location) == []
    with psycopg.connect(journal_location) as conn, pytest.raises(psycopg.errors.RaiseException, match="read committed"):
        conn.execute("SELECT resumable.compacted_drop(64, 128)")
    backends.assert_counts_exact(journal_location)


@pytest.mark.parametrize("journal_location", ["postgres"], indirect=True)
@pytest.mark.parametrize("stopped_at", ["forgetting", "dropping"])
def test_postgres_a_prune_stopped_before_it_forgot_or_dropped_is_finished_by_the_next(
    journal_location, finished_job, monkeypatch, stopped_at
):
    """Stopped after the tombstone, before the job's compacted items were forgotten: the job reads as pruned,
    is never run again, and the next prune forgets them. Stopped before the drop: the next prune drops."""
    from airflow_resumable.exceptions import JobPrunedError
    from airflow_resumable.journal import statements as sql

    with StepJournal(journal_location) as journal:
        compact_every_item(journal, finished_job)
        backends.execute(journal_location, "SELECT setval('job_numbers', 63)")
        write = journal.engine.write

        @contextlib.contextmanager
        def stops(*, durable):
            with write(durable=durable) as tx:
                run = tx.run

                def watched(statement, params=()):
                    if statement in (sql.FORGET_COMPACTED, sql.READ_COMMITTED)[stopped_at == "dropping"]:
                        raise KeyboardInterrupt  # the prune process is stopped here
                    return run(statement, params)

                tx.run = watched
                yield tx

        monkeypatch.setattr(journal.engine, "write", stops)
        with pytest.raises(KeyboardInterrupt):
            journal.prune(timedelta(0))
        monkeypatch.setattr(journal.engine, "write", write)
        backends.assert_counts_exact(journal_location)
        assert journal.job(JOB).status == "pruned" and partitions(journal_location) == ["compacted_0_64"]
        assert journal.job(JOB).items == (40 if stopped_at == "forgetting" else 0)
        sent = len(finished_job.sent)
        with pytest.raises(JobPrunedError):
            run_batch(journal, JOB, items(), finished_job.steps(), settle_in_task=False)
        assert len(finished_job.sent) == sent
        assert journal.prune(timedelta(days=365)) == ([JOB] if stopped_at == "forgetting" else [])
        assert journal.job(JOB).items == 0 and all_rows(journal) == [] and partitions(journal_location) == []
    backends.assert_counts_exact(journal_location)


# -- a decision meets a compaction batch -------------------------------------------------------------

# Holds the job's claim as a compaction batch does, in a process of its own, until its stdin closes.
HOLD_AS_COMPACTION = """
import sys
from airflow_resumable.journal import StepJournal
from airflow_resumable.journal.backend import COMPACTION_RUNNER

with StepJournal(sys.argv[1]) as journal:
    claim = journal.engine.claim(sys.argv[2], runner=COMPACTION_RUNNER, brief=True)
    print("held", flush=True)
    sys.stdin.read()
    claim.release()
"""


@contextlib.contextmanager
def compacting(location, job_id: str):
    """Another process holds ``job_id`` as a compaction batch; the block's value lets it go."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AS_COMPACTION, str(location), job_id],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        yield holder.stdin.close
    finally:
        holder.stdin.close()
        assert holder.wait(60) == 0


def test_a_decision_waits_out_a_compaction_batch(journal_location):
    """A person decides while a compaction batch holds the job: the decision waits until it lets go
    (as a run does), then applies."""
    from tests.support.scenario import held_job

    held_job(journal_location, JOB)
    with compacting(journal_location, JOB) as let_go, StepJournal(journal_location) as journal:
        threading.Timer(0.5, let_go).start()
        journal.resolve(JOB, "a", "send", delivered=True, receipt="r-1", resolved_by="on-call")
        assert [(r.status, r.receipt) for r in journal.rows(JOB)] == [(Status.SUCCEEDED, "r-1")]


def test_a_decision_refused_by_a_long_compaction_names_the_compaction(journal_location, monkeypatch):
    """A compaction batch that holds the job past the wait: the refusal names the compaction (never a
    run that is not there) and nothing changes; once it let go, the same decision applies."""
    from airflow_resumable.journal import JobBusyError, backend
    from tests.support.scenario import held_job

    held_job(journal_location, JOB)
    monkeypatch.setattr(backend, "BRIEF_WAIT_SECONDS", 0.3)
    with StepJournal(journal_location) as journal:
        before = backends.snapshot(journal_location)
        with compacting(journal_location, JOB):
            with pytest.raises(JobBusyError) as busy:
                journal.resolve(JOB, "a", "send", delivered=False, resolved_by="on-call")
            said = str(busy.value)
            assert "being compacted right now" in said and "running" not in said and "nothing was changed" in said
            assert busy.value.runner == "compaction"
            assert backends.snapshot(journal_location) == before
        journal.resolve(JOB, "a", "send", delivered=False, resolved_by="on-call")
        assert journal.held(JOB) == []
