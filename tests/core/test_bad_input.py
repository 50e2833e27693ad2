"""Every bad input is refused with a clear ValueError naming the item, and the journal
is left exactly as it was (checked row by row through a separate connection), on SQLite and PostgreSQL."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from airflow_resumable.exceptions import InvalidStepOutputError, ResolutionError
from airflow_resumable.journal import HeldReason, HeldStep, NotHeldError, Status, StepJournal
from airflow_resumable.runner import InvalidItemError, Step, StepContext, canonical_digest, idempotency_key, run_batch
from airflow_resumable.runner.batch import CHUNK_SIZE
from tests.support.backends import snapshot

pytestmark = pytest.mark.core

JOB = "bad-input/job"


# ------------------------------------------------------------------------------------- helpers


def without_jobs(snap: dict[str, list[tuple[Any, ...]]]) -> dict[str, list[tuple[Any, ...]]]:
    return {k: v for k, v in snap.items() if k != "jobs"}


class Recorder:
    """validate -> transform -> notify (side effect); records every call and every delivery."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []
        self.delivered: dict[str, str] = {}  # idempotency key -> receipt
        self.fail_notify: set[str] = set()
        self.transform_returns: dict[str, Any] = {}
        self.notify_returns: dict[str, Any] = {}

    def steps(self) -> list[Step]:
        def validate(item: Mapping[str, Any], ctx: StepContext) -> dict[str, Any]:
            self.calls.append((ctx.item_id, "validate"))
            return {"ok": True}

        def transform(item: Mapping[str, Any], ctx: StepContext) -> Any:
            self.calls.append((ctx.item_id, "transform"))
            if ctx.item_id in self.transform_returns:
                return self.transform_returns[ctx.item_id]
            return {"n": len(str(item))}

        def notify(item: Mapping[str, Any], ctx: StepContext) -> Any:
            self.calls.append((ctx.item_id, "notify"))
            if ctx.item_id in self.fail_notify:
                raise ConnectionError("receiver down")
            receipt = f"rcpt-{len(self.delivered) + 1}"
            self.delivered[ctx.idempotency_key] = receipt
            if ctx.item_id in self.notify_returns:
                return self.notify_returns[ctx.item_id]
            return receipt

        return [Step("validate", validate), Step("transform", transform), Step("notify", notify, side_effect=True)]


@pytest.fixture
def journal_path(journal_location: str) -> str:
    return journal_location  # every test here runs on SQLite and on PostgreSQL


@pytest.fixture
def journal(journal_path: Path):
    with StepJournal(journal_path) as j:
        yield j


@pytest.fixture
def seeded(journal: StepJournal, journal_path: Path) -> Recorder:
    """A job that already has SUCCEEDED rows, so a refusal has something it could damage."""
    rec = Recorder()
    result = run_batch(journal, JOB, [{"id": "a", "v": 1}, {"id": "b", "v": 2}], rec.steps(), settle_in_task=False)
    assert result.status == "completed" and result.executed_steps == 6
    rec.calls.clear()
    return rec


def refused_run(journal: StepJournal, journal_path: Path, rec: Recorder, items: Any, error: type[Exception],
                *names: str, job_id: str = JOB) -> Exception:
    """Run a batch that must be refused; check nothing ran, nothing was sent, no row changed."""
    before = snapshot(journal_path)
    delivered_before = dict(rec.delivered)
    with pytest.raises(error) as info:
        run_batch(journal, job_id, items, rec.steps(), settle_in_task=False)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in {message!r}"
    assert "Traceback" not in message and len(message) < 400
    assert rec.calls == [], "no step of any item may run before the bad item is refused"
    assert rec.delivered == delivered_before
    after = snapshot(journal_path)
    assert without_jobs(after) == without_jobs(before)
    return info.value


# ---------------------------------------------------------------------------------- run_batch


@pytest.mark.parametrize("job_id", ["", "   ", None, 7, "job\x00with-nul", "lone-\ud800-surrogate",
                                    "j" * (64 * 1024 + 1)])  # longer than any decision may name
def test_empty_or_non_string_job_id_is_refused(journal, journal_path, seeded, job_id):
    before = snapshot(journal_path)
    with pytest.raises(ValueError, match="job_id"):
        run_batch(journal, job_id, [{"id": "c"}], seeded.steps(), settle_in_task=False)
    assert seeded.calls == []
    assert snapshot(journal_path) == before  # not even the jobs table is touched


@pytest.mark.parametrize(
    ("name", "why"),
    [("", "non-empty"), ("send\x00", "NUL"), ("send-\udcff", "lone surrogate"), ("s" * 1025, "1025 characters")],
    ids=["empty", "nul", "lone-surrogate", "too-long"],
)
def test_a_step_name_no_journal_or_decision_could_take_is_refused_when_the_step_is_made(name, why):
    """A lone surrogate failed at the first journal write, after the item's user code ran; a name over the
    id limit was journaled, and no decision could name its holds (every surface refused it)."""
    with pytest.raises(ValueError, match=why):
        Step(name, lambda item, ctx: "ok", side_effect=True)


def test_ids_too_long_for_the_journals_key_are_refused_before_anything_is_sent(journal, journal_path, seeded):
    """PostgreSQL's B-tree holds a key (job_id + item_id + step) of about 2,700 bytes: a longer one failed
    at its row's first write, after the items before it were sent, with "retry the task" - on every retry.
    Refused before anything is touched now; SQLite, which has no such limit, keeps taking them."""
    long_job = "j" * 2700
    cjk_item = {"id": "".join(chr(0x4E00 + n) for n in range(1000))}  # 1,000 characters, 3,000 bytes
    room = 2600 - len(JOB) - len("transform")  # the key's bytes left for an item id
    fits = {"id": "\u4e00" * (room // 3) + "i" * (room % 3)}  # exactly that many bytes, under 1,024 characters
    if journal.max_key_bytes is None:
        assert run_batch(journal, long_job, [{"id": "a"}], seeded.steps(), settle_in_task=False).status == "completed"
        assert run_batch(journal, JOB, [cjk_item], seeded.steps(), settle_in_task=False).status == "completed"
        return
    before = snapshot(journal_path)
    with pytest.raises(ValueError, match="take 2709 bytes.*at most 2600 bytes .*shorten the job_id"):
        run_batch(journal, long_job, [{"id": "a"}], seeded.steps(), settle_in_task=False)
    assert snapshot(journal_path) == before and seeded.calls == []
    refused_run(journal, journal_path, seeded, [{"id": "c"}, cjk_item], InvalidItemError,
                "position 1", "3000 bytes", "shorten the id")
    assert run_batch(journal, JOB, [fits], seeded.steps(), settle_in_task=False).status == "completed"
    assert len(seeded.delivered) == 3


@pytest.mark.parametrize("concurrency", [0, -1, 257, True, 2.0, "4", None])
def test_bad_concurrency_is_refused(journal, journal_path, seeded, concurrency):
    before = snapshot(journal_path)
    with pytest.raises(ValueError, match="concurrency must be an integer from 1 to 256"):
        run_batch(journal, JOB, [{"id": "c"}], seeded.steps(), concurrency=concurrency, settle_in_task=False)
    assert seeded.calls == []
    assert snapshot(journal_path) == before


@pytest.mark.parametrize("interval", [None, "30", -1, float("nan"), float("inf"), True])
def test_a_bad_progress_interval_is_refused_before_any_send(journal, journal_path, seeded, interval):
    """It was taken, and raised TypeError after the first send (each retry then sent one more item)."""
    before = snapshot(journal_path)
    with pytest.raises(ValueError, match="progress_interval must be a number of seconds"):
        run_batch(journal, JOB, [{"id": "c"}], seeded.steps(), progress_interval=interval,
                  on_progress=lambda progress: None, settle_in_task=False)
    assert seeded.calls == []
    assert snapshot(journal_path) == before


@pytest.mark.parametrize("concurrency", [1, 16])
def test_duplicate_id_is_refused_before_anything_is_touched_at_any_concurrency(journal, journal_path, seeded,
                                                                               concurrency):
    before = snapshot(journal_path)
    with pytest.raises(InvalidItemError, match="'b' appears twice"):
        run_batch(journal, JOB, [{"id": "x"}, {"id": "b"}, {"id": "b"}], seeded.steps(), concurrency=concurrency,
                  settle_in_task=False)
    assert seeded.calls == []
    assert snapshot(journal_path) == before


@pytest.mark.parametrize(
    ("bad", "names"),
    [
        (5, ("position 2", "not a mapping")),
        ("a string", ("position 2", "not a mapping")),
        (["id", "x"], ("position 2", "not a mapping")),
        (None, ("position 2", "not a mapping")),
    ],
)
def test_item_that_is_not_a_mapping(journal, journal_path, seeded, bad, names):
    items = [{"id": "a", "v": 1}, {"id": "c", "v": 3}, bad, {"id": "d", "v": 4}]
    refused_run(journal, journal_path, seeded, items, InvalidItemError, *names)


def test_item_without_the_id_field(journal, journal_path, seeded):
    items = [{"id": "c"}, {"key": "x"}]
    refused_run(journal, journal_path, seeded, items, InvalidItemError, "position 1", "'id'")
    # With id_field, the same item is fine and the one without that field is refused.
    before = snapshot(journal_path)
    with pytest.raises(InvalidItemError, match="position 0.*'key'"):
        run_batch(journal, JOB, [{"id": "c"}], seeded.steps(), id_field="key", settle_in_task=False)
    assert without_jobs(snapshot(journal_path)) == without_jobs(before) and seeded.calls == []


@pytest.mark.parametrize("bad_text", ["d\x00", "d\udc80"])
def test_item_id_with_a_nul_character_or_a_lone_surrogate(journal, journal_path, seeded, bad_text):
    refused_run(journal, journal_path, seeded, [{"id": "c"}, {"id": bad_text}], InvalidItemError, "position 1", "NUL")


@pytest.mark.parametrize("empty", ["", " ", "\t\n"])
def test_item_with_an_empty_id(journal, journal_path, seeded, empty):
    refused_run(journal, journal_path, seeded, [{"id": "c"}, {"id": empty}], InvalidItemError,
                "position 1", "empty")


@pytest.mark.parametrize("bad_id", [True, 1.5, None, ["x"], {"x": 1}])
def test_item_with_an_id_of_the_wrong_type(journal, journal_path, seeded, bad_id):
    refused_run(journal, journal_path, seeded, [{"id": "c"}, {"id": bad_id}], InvalidItemError, "position 1")


def _circular() -> dict[str, Any]:
    item: dict[str, Any] = {"id": "loop"}
    item["self"] = item
    return item


@pytest.mark.parametrize(
    ("item", "item_id"),
    [
        ({"id": "obj", "x": object()}, "obj"),
        ({"id": "set", "x": {1, 2}}, "set"),
        ({"id": "bytes", "x": b"\x00"}, "bytes"),
        ({"id": "nan", "x": float("nan")}, "nan"),
        ({"id": "inf", "x": float("inf")}, "inf"),
        ({"id": "mixed-keys", "x": {1: "a", "b": 2}}, "mixed-keys"),
        ({"id": "surrogate", "x": "\ud800"}, "surrogate"),
        (_circular(), "loop"),
    ],
)
def test_item_that_is_not_json_serialisable(journal, journal_path, seeded, item, item_id):
    items = [{"id": "a", "v": 1}, {"id": "c", "v": 3}, item]
    refused_run(journal, journal_path, seeded, items, InvalidItemError, repr(item_id), "JSON")


def test_an_item_nested_too_deeply_or_holding_a_lone_surrogate_is_refused(journal, journal_path, seeded):
    deep: dict = {"id": "deep"}
    for _ in range(100_000):
        deep = {"id": "deep", "x": deep}
    refused_run(journal, journal_path, seeded, [{"id": "c"}, deep], InvalidItemError, "'deep'", "nested")
    refused_run(journal, journal_path, seeded, [{"id": "c"}, {"id": "s", "v": "\udc80"}], InvalidItemError,
                "'s'", "UnicodeEncodeError")


def test_same_id_twice_in_one_chunk_refused_before_anything_is_touched(journal, journal_path, seeded):
    items = [{"id": "c", "v": 1}, {"id": "d", "v": 2}, {"id": "c", "v": 9}]
    refused_run(journal, journal_path, seeded, items, InvalidItemError, "'c'", "twice")


def test_integer_and_string_forms_of_one_id_are_the_same_id(journal, journal_path, seeded):
    refused_run(journal, journal_path, seeded, [{"id": 7}, {"id": "7"}], InvalidItemError, "'7'", "twice")


def test_duplicate_across_a_chunk_boundary(journal, journal_path):
    """The first chunk is processed; the duplicate (and the rest of its chunk) is never touched."""
    size = CHUNK_SIZE
    assert size == 500
    rec = Recorder()
    first = [{"id": f"i{n:04d}", "v": n} for n in range(size)]
    second = [{"id": "fresh-1", "v": -1}, {"id": "i0003", "v": "changed"}, {"id": "fresh-2", "v": -2}]
    with pytest.raises(InvalidItemError) as info:
        run_batch(journal, JOB, first + second, rec.steps(), settle_in_task=False)
    assert "'i0003'" in str(info.value) and "twice" in str(info.value)

    # Chunk 1 ran completely, once per step; nothing of chunk 2 ran at all.
    assert len(rec.calls) == 3 * size
    assert sorted(rec.calls) == sorted((f"i{n:04d}", s) for n in range(size) for s in ("validate", "transform", "notify"))
    assert len(rec.delivered) == size
    rows = journal.rows(JOB)
    assert len(rows) == 3 * size
    assert {r.item_id for r in rows} == {f"i{n:04d}" for n in range(size)}
    assert all(r.status == Status.SUCCEEDED and r.attempts == 1 and r.held_reason is None for r in rows)
    # The duplicate carried another payload: had it been looked at, i0003 would be held input_changed.
    assert journal.held(JOB) == []
    assert {r.digest for r in journal.rows(JOB, "i0003")} == {canonical_digest(first[3])}

    # Resuming without the duplicate completes the job without sending anything again.
    rec.calls.clear()
    result = run_batch(journal, JOB, first + [second[0], second[2]], rec.steps(), settle_in_task=False)
    assert (result.executed_steps, result.skipped_steps, result.status) == (6, 3 * size, "completed")
    assert sorted(rec.calls) == sorted((i, s) for i in ("fresh-1", "fresh-2") for s in ("validate", "transform", "notify"))
    assert len(rec.delivered) == size + 2


def test_duplicate_across_chunks_of_a_generator(journal, journal_path):
    size = CHUNK_SIZE
    rec = Recorder()
    def items():
        for n in range(size):
            yield {"id": n, "v": n}  # integer ids
        yield {"id": "0", "v": "again"}  # the decimal string of the first integer id
        yield {"id": "never", "v": 0}

    with pytest.raises(InvalidItemError, match="'0'.*twice"):
        run_batch(journal, JOB, items(), rec.steps(), settle_in_task=False)
    assert len(rec.calls) == 3 * size
    assert journal.held(JOB) == []
    assert [r.item_id for r in journal.rows(JOB, "0")] == ["0", "0", "0"]
    assert all(r.attempts == 1 for r in journal.rows(JOB, "0"))
    assert journal.rows(JOB, "never") == []


def test_integer_ids_are_used_as_their_decimal_string(journal, journal_path):
    rec = Recorder()
    result = run_batch(journal, JOB, [{"id": 7}, {"id": -3}, {"id": 10**20}, {"id": 0}], rec.steps(), settle_in_task=False)
    assert result.status == "completed" and result.items_completed == 4
    ids = {r.item_id for r in journal.rows(JOB)}
    assert ids == {"7", "-3", "100000000000000000000", "0"}
    assert all(isinstance(r.item_id, str) for r in journal.rows(JOB))
    assert {c[0] for c in rec.calls} == ids
    assert idempotency_key(JOB, "7", "notify") in rec.delivered
    # The same integer ids again: everything is skipped, nothing sent twice.
    rec.calls.clear()
    again = run_batch(journal, JOB, [{"id": 7}, {"id": -3}, {"id": 10**20}, {"id": 0}], rec.steps(), settle_in_task=False)
    assert (again.executed_steps, again.skipped_steps) == (0, 12) and rec.calls == []


# ------------------------------------------------------------------------------- step outputs


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("value", "why"),
    [(object(), "not JSON"), ({"x": {1, 2}}, "not JSON"), (float("nan"), "not JSON"),
     ("x" * (64 * 1024), "bytes of output"), ({"blob": "é" * 40000}, "bytes of output"),
     # text decoded with surrogateescape; a structure nested past Python's recursion limit
     ({"x": b"ok-\xff".decode("utf-8", "surrogateescape")}, "UnicodeEncodeError"), (_nested(100_000), "RecursionError")],
)
def test_bad_local_step_output_records_failed_and_loses_nothing(journal, journal_path, seeded, value, why):
    seeded.transform_returns["c"] = value
    before = snapshot(journal_path)
    items = [{"id": "a", "v": 1}, {"id": "b", "v": 2}, {"id": "c", "v": 3}, {"id": "d", "v": 4}]
    with pytest.raises(InvalidStepOutputError) as info:
        run_batch(journal, JOB, items, seeded.steps(), settle_in_task=False)
    assert isinstance(info.value, InvalidItemError) and isinstance(info.value, ValueError)
    assert "'c'" in str(info.value) and "'transform'" in str(info.value) and why in str(info.value)
    # a, b skipped; c validated, transform ran and was refused; notify never ran; d never reached.
    assert seeded.calls == [("c", "validate"), ("c", "transform")]
    after = snapshot(journal_path)
    new_rows = [r for r in after["steps"] if r not in before["steps"]]
    assert [r for r in before["steps"] if r not in after["steps"]] == [], "an existing row changed"
    assert sorted((r[1], r[2]) for r in new_rows) == [("c", "transform"), ("c", "validate")]
    assert after["resolutions"] == before["resolutions"] and after["meta"] == before["meta"]
    by_step = {r.step: r for r in journal.rows(JOB, "c")}
    assert by_step["validate"].status == Status.SUCCEEDED and by_step["validate"].output == {"ok": True}
    t = by_step["transform"]
    assert (t.status, t.error_type, t.output, t.receipt, t.held_reason, t.attempts) == (
        Status.FAILED, "InvalidStepOutputError", None, None, None, 1)
    assert "notify" not in by_step and journal.rows(JOB, "d") == []
    assert journal.held(JOB) == []

    # The next run (step fixed) re-runs the local step and finishes; a and b are still not re-sent.
    del seeded.transform_returns["c"]
    seeded.calls.clear()
    result = run_batch(journal, JOB, items, seeded.steps(), settle_in_task=False)
    assert result.status == "completed" and result.executed_steps == 2 + 3 and result.skipped_steps == 6 + 1
    assert {r.step: r.attempts for r in journal.rows(JOB, "c")} == {"validate": 1, "transform": 2, "notify": 1}
    assert len(seeded.delivered) == 4


def test_output_of_exactly_64_kib_is_accepted(journal, journal_path):
    rec = Recorder()
    rec.transform_returns["edge"] = "x" * (64 * 1024 - 2)  # JSON text with its quotes: exactly 65536 bytes
    rec.transform_returns["over"] = "x" * (64 * 1024 - 1)
    result = run_batch(journal, JOB, [{"id": "edge"}], rec.steps(), settle_in_task=False)
    assert result.status == "completed"
    assert {r.step: r.output for r in journal.rows(JOB, "edge")}["transform"] == "x" * (64 * 1024 - 2)
    with pytest.raises(InvalidStepOutputError, match="65537 bytes"):
        run_batch(journal, JOB, [{"id": "edge"}, {"id": "over"}], rec.steps(), settle_in_task=False)


@pytest.mark.parametrize("receipt", [{"huge": "y" * (70 * 1024)}, "rcpt-\udcff", _nested(100_000)],
                         ids=["too-big", "lone-surrogate", "nested-too-deep"])
def test_bad_receipt_of_a_send_is_an_unknown_outcome_not_a_resend(journal, journal_path, seeded, receipt):
    """The send happened, then its return value was refused: the row is FAILED and next run holds it (a
    receipt that could not be encoded left the row IN_FLIGHT with a raw exception out of the run)."""
    seeded.notify_returns["c"] = receipt
    before = snapshot(journal_path)
    with pytest.raises(InvalidStepOutputError, match="'notify' of item 'c'"):
        run_batch(journal, JOB, [{"id": "a", "v": 1}, {"id": "c", "v": 3}], seeded.steps(), settle_in_task=False)
    after = snapshot(journal_path)
    assert [r for r in before["steps"] if r not in after["steps"]] == []
    n = {r.step: r for r in journal.rows(JOB, "c")}["notify"]
    assert (n.status, n.error_type, n.attempts, n.receipt, n.output) == (
        Status.FAILED, "InvalidStepOutputError", 1, None, None)
    assert len(seeded.delivered) == 3
    seeded.calls.clear()
    again = run_batch(journal, JOB, [{"id": "a", "v": 1}, {"id": "c", "v": 3}], seeded.steps(), settle_in_task=False)
    assert again.held == [HeldStep(JOB, "c", "notify", HeldReason.UNKNOWN_OUTCOME)]
    assert seeded.calls == [] and len(seeded.delivered) == 3


# A refused run must not even leave a trace in the jobs table (a phantom job, or a fresher
# updated_at that postpones prune).
@pytest.mark.parametrize("existing", [False, True], ids=["new-job", "existing-job"])
def test_refused_batch_leaves_jobs_table_unchanged(journal, journal_path, existing):
    rec = Recorder()
    if existing:
        run_batch(journal, JOB, [{"id": "a"}], rec.steps(), settle_in_task=False)
        rec.calls.clear()
    before = snapshot(journal_path)
    with pytest.raises(InvalidItemError):
        run_batch(journal, JOB, [{"id": "c"}, {"no-id": 1}], rec.steps(), settle_in_task=False)
    assert snapshot(journal_path) == before
    assert [j.job_id for j in journal.jobs()] == ([JOB] if existing else [])


# --------------------------------------------------------------------------------- resolution


@pytest.fixture
def held_job(journal: StepJournal, journal_path: Path) -> Recorder:
    """JOB with: a, c done; b's send failed (held unknown_outcome); d's input changed (held
    input_changed); e's local transform failed (a FAILED local row)."""
    rec = Recorder()
    rec.fail_notify.add("b")
    with pytest.raises(ConnectionError):
        run_batch(journal, JOB, [{"id": "a"}, {"id": "c"}, {"id": "d", "v": 1}, {"id": "b"}], rec.steps(),
                  settle_in_task=False)
    second = run_batch(journal, JOB, [{"id": "a"}, {"id": "c"}, {"id": "d", "v": 2}, {"id": "b"}], rec.steps(),
                       settle_in_task=False)
    assert sorted(second.held, key=lambda h: h.item_id) == [
        HeldStep(JOB, "b", "notify", HeldReason.UNKNOWN_OUTCOME),
        HeldStep(JOB, "d", "validate", HeldReason.INPUT_CHANGED),
    ]
    rec.transform_returns["e"] = object()
    with pytest.raises(InvalidStepOutputError):
        run_batch(journal, JOB, [{"id": "e"}], rec.steps(), settle_in_task=False)
    del rec.transform_returns["e"]
    rec.fail_notify.clear()
    rec.calls.clear()
    return rec


def _refused(journal_path: Path, error: type[Exception], call, *names: str) -> Exception:
    before = snapshot(journal_path)
    with pytest.raises(error) as info:
        call()
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in {message!r}"
    assert "Traceback" not in message and len(message) < 400
    assert snapshot(journal_path) == before, "a refused resolution changed the journal"
    return info.value


@pytest.mark.parametrize(
    ("job_id", "item_id", "step", "names"),
    [
        ("no/such/job", "b", "notify", ("no/such/job",)),
        (JOB, "zzz", "notify", ("zzz",)),
        (JOB, "b", "nonexistent-step", ("'b'", "nonexistent-step")),
        (JOB, "a", "notify", ("/ a / notify", "SUCCEEDED")),  # delivered and done: not held
        (JOB, "b", "validate", ("/ b / validate", "local step")),  # a local step
        (JOB, "e", "transform", ("/ e / transform", "FAILED", "local step")),  # a FAILED local step
        (JOB, "d", "validate", ("/ d / validate", "resolve_input_change")),  # input_changed, not a send
        (JOB, "b\x00", "notify", ("NUL",)),  # no id holds NUL (PostgreSQL's text cannot)
    ],
)
@pytest.mark.parametrize("delivered", [True, False])
def test_resolve_refuses_rows_that_are_not_held(journal, journal_path, held_job, job_id, item_id, step, names,
                                                 delivered):
    _refused(journal_path, NotHeldError,
             lambda: journal.resolve(job_id, item_id, step, delivered=delivered, receipt="rcpt-1",
                                     resolved_by="oncall"),
             *names)


@pytest.mark.parametrize("receipt", [None, "", "   "])
def test_delivered_without_a_receipt_is_refused(journal, journal_path, held_job, receipt):
    _refused(journal_path, ResolutionError,
             lambda: journal.resolve(JOB, "b", "notify", delivered=True, receipt=receipt, resolved_by="oncall"),
             "receipt")
    assert journal.held(JOB)[0] == HeldStep(JOB, "b", "notify", HeldReason.UNKNOWN_OUTCOME)


@pytest.mark.parametrize("resolved_by", ["", "  ", None, 42])
def test_resolution_without_resolved_by_is_refused(journal, journal_path, held_job, resolved_by):
    _refused(journal_path, ResolutionError,
             lambda: journal.resolve(JOB, "b", "notify", delivered=False, resolved_by=resolved_by), "resolved_by")
    _refused(journal_path, ResolutionError,
             lambda: journal.resolve_input_change(JOB, "d", use_new_input=True, resolved_by=resolved_by),
             "resolved_by")


def test_resolution_arguments_of_the_wrong_type_are_refused(journal, journal_path, held_job):
    _refused(journal_path, ResolutionError,
             lambda: journal.resolve(JOB, "b", "notify", delivered="yes", receipt="r", resolved_by="x"), "delivered")
    _refused(journal_path, ResolutionError,
             lambda: journal.resolve(JOB, "b", "notify", delivered=True, receipt=123, resolved_by="x"), "receipt")
    _refused(journal_path, ResolutionError,
             lambda: journal.resolve(JOB, "b", "notify", delivered=False, resolved_by="x", note=None), "note")
    _refused(journal_path, ResolutionError,
             lambda: journal.resolve_input_change(JOB, "d", use_new_input=1, resolved_by="x"), "use_new_input")


@pytest.mark.parametrize(
    ("job_id", "item_id", "names"),
    [
        ("no/such/job", "d", ("no/such/job",)),
        (JOB, "zzz", ("zzz",)),
        (JOB, "a", ("/ a ", "not held")),  # done, never held
        (JOB, "b", ("/ b ", "not held")),  # held, but for an unknown outcome, not an input change
        (JOB, "e", ("/ e ", "not held")),  # a failed local step
    ],
)
@pytest.mark.parametrize("use_new_input", [True, False])
def test_resolve_input_change_refuses_items_not_held_for_a_change(journal, journal_path, held_job, job_id,
                                                                   item_id, names, use_new_input):
    _refused(journal_path, NotHeldError,
             lambda: journal.resolve_input_change(job_id, item_id, use_new_input=use_new_input,
                                                  resolved_by="oncall"),
             *names)


def test_refusals_left_the_held_rows_resolvable(journal, journal_path, held_job):
    """After every kind of refusal the real resolutions still work, and do change the journal."""
    for call in (
        lambda: journal.resolve(JOB, "b", "notify", delivered=True, receipt=None, resolved_by="x"),
        lambda: journal.resolve(JOB, "a", "notify", delivered=False, resolved_by="x"),
        lambda: journal.resolve_input_change(JOB, "b", use_new_input=False, resolved_by="x"),
    ):
        _refused(journal_path, ValueError, call)
    before = snapshot(journal_path)
    journal.resolve(JOB, "b", "notify", delivered=False, resolved_by="oncall", note="receiver has nothing")
    journal.resolve_input_change(JOB, "d", use_new_input=False, resolved_by="oncall")
    after = snapshot(journal_path)
    assert after != before
    assert len(after["resolutions"]) == len(before["resolutions"]) + 2
    assert journal.held(JOB) == []
    held_job.calls.clear()
    result = run_batch(journal, JOB, [{"id": "a"}, {"id": "c"}, {"id": "d", "v": 2}, {"id": "b"}, {"id": "e"}],
                       held_job.steps(), settle_in_task=False)
    assert result.status == "completed"
    assert sorted(held_job.calls) == [("b", "notify"), ("e", "notify"), ("e", "transform")]
