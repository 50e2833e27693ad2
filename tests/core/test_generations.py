"""Key generations and provably-not-sent errors, against the demo receiver over real HTTP.

A ``use_new_input`` resolution makes the item's new content a new operation: its sends go out under
the next key generation, so a receiver that dedupes by key does not drop the new content (it would
answer the first delivery's receipt) and one that rejects a reused key with another body (as Stripe
does) accepts it. Generation 0 is the key earlier releases produced. ``NotSentError`` from a step
sends it again on the next run, without verify and without a hold.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from airflow_resumable.demo_receiver import serve
from airflow_resumable.journal import HeldReason, Status, StepJournal
from airflow_resumable.runner import NotSentError, Step, StepContext, idempotency_key, run_batch

pytestmark = pytest.mark.core

JOB = "nightly/2026-12-04"
CLI = str(Path(sys.executable).with_name("airflow-resumable"))


class HttpFailed(Exception):
    """The receiver answered an error status: the outcome is unknown to the runner."""


class Unreachable(NotSentError):
    pass


class Receiver:
    """The demo receiver on a free port of 127.0.0.1, and a ``notify`` step that POSTs to it."""

    def __init__(self, path, **options: Any) -> None:
        self.server = serve(0, path, **options)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.store = self.server.store  # type: ignore[attr-defined]
        self.unreachable: set[str] = set()  # items whose next send fails before any byte is written
        self.verify_calls: list[str] = []
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def call(self, path: str, body: Any = None, headers: Mapping[str, str] | None = None) -> tuple[int, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=dict(headers or {}),
                                         method="GET" if body is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def notify(self, item: Mapping[str, Any], ctx: StepContext) -> str:
        if ctx.item_id in self.unreachable:
            self.unreachable.discard(ctx.item_id)
            raise Unreachable()
        status, reply = self.call("/notifications", {"item_id": ctx.item_id, "item": dict(item)},
                                  {"Idempotency-Key": ctx.idempotency_key, "Content-Type": "application/json"})
        if status >= 400:
            raise HttpFailed(status)
        return str(reply["receipt"])

    def verify(self, ctx: StepContext) -> str | None:
        self.verify_calls.append(ctx.item_id)
        status, reply = self.call(f"/notifications/{ctx.idempotency_key}")
        return str(reply["receipt"]) if status == 200 else None

    def bodies(self, item_id: str) -> list[dict[str, Any]]:
        rows = self.store._conn.execute(
            "SELECT body FROM deliveries WHERE item_id = ? ORDER BY seq", (item_id,)).fetchall()
        return [json.loads(body)["item"] for (body,) in rows]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver(tmp_path) -> Iterator[Any]:
    started: list[Receiver] = []

    def start(**options: Any) -> Receiver:
        started.append(Receiver(tmp_path / f"receiver-{len(started)}.sqlite3", **options))
        return started[-1]

    yield start
    for r in started:
        r.close()


def steps(receiver: Receiver, *, with_verify: bool = True) -> list[Step]:
    return [
        Step("render", lambda item, ctx: {"text": f"amount {item['amount']}"}),
        Step("notify", receiver.notify, side_effect=True, verify=receiver.verify if with_verify else None),
    ]


def test_generation_zero_keys_are_the_keys_of_earlier_releases():
    for job, item, step in [(JOB, "item-041", "notify"), ("ジョブ", "品目/1", "送信"), ("j", "", "s")]:
        material = json.dumps([job, item, step], ensure_ascii=False, separators=(",", ":"))
        earlier = "rsm1-" + hashlib.sha256(material.encode("utf-8")).hexdigest()
        assert idempotency_key(job, item, step) == idempotency_key(job, item, step, 0) == earlier
        later = [idempotency_key(job, item, step, g) for g in (1, 2, 3)]
        assert len({earlier, *later}) == 4 and all(k.startswith("rsm1-") and len(k) == 69 for k in later)
    for bad in (-1, True, 1.0, "1", None):
        with pytest.raises(ValueError, match="generation must be an integer >= 0"):
            idempotency_key(JOB, "a", "notify", bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["dedupe", "reject_key_reuse"])
def test_new_content_after_use_new_input_arrives_exactly_once(journal_location, receiver, mode):
    """Acceptance 3: before generations the deduping receiver answered the first delivery's receipt
    (the new content silently dropped, the journal SUCCEEDED) and the Stripe-style one answered 422."""
    rx = receiver(reject_key_reuse=mode == "reject_key_reuse")
    items = [{"id": f"item-{i}", "amount": 100 * i} for i in range(1, 6)]
    changed = [dict(item, amount=999) if item["id"] == "item-3" else item for item in items]
    with StepJournal(journal_location) as journal:
        assert run_batch(journal, JOB, items, steps(rx), settle_in_task=False).status == "completed"
        held = run_batch(journal, JOB, changed, steps(rx), settle_in_task=False)
        assert [(h.item_id, h.reason) for h in held.held] == [("item-3", HeldReason.INPUT_CHANGED)]
        journal.resolve_input_change(JOB, "item-3", use_new_input=True, resolved_by="oncall")
        (send,) = [r for r in journal.rows(JOB, "item-3") if r.step == "notify"]
        assert (send.status, send.generation, send.not_sent, send.receipt) == (Status.FAILED, 1, True, None)
        assert journal.held(JOB) == [] and journal.job(JOB).status != "needs_review"

        after = run_batch(journal, JOB, changed, steps(rx), settle_in_task=False)
        assert after.status == "completed" and after.executed_steps == 2 and rx.verify_calls == []
        (send,) = [r for r in journal.rows(JOB, "item-3") if r.step == "notify"]
        assert (send.status, send.generation, send.not_sent) == (Status.SUCCEEDED, 1, False)
        # The receiver has the new content under the generation-1 key, and the journal its receipt.
        new_key = idempotency_key(JOB, "item-3", "notify", 1)
        assert rx.call(f"/notifications/{new_key}") == (200, {"receipt": send.receipt})
        assert rx.call(f"/notifications/{idempotency_key(JOB, 'item-3', 'notify')}")[0] == 200  # the old one
        assert rx.bodies("item-3") == [items[2], changed[2]]
        # Settled: nothing more is sent, and every other item kept its generation-0 key.
        assert run_batch(journal, JOB, changed, steps(rx), settle_in_task=False).executed_steps == 0
        assert {r.item_id: r.generation for r in journal.rows(JOB) if r.step == "notify"} == {
            "item-1": 0, "item-2": 0, "item-3": 1, "item-4": 0, "item-5": 0}
    assert rx.store.stats()["per_item"] == {"item-1": 1, "item-2": 1, "item-3": 2, "item-4": 1, "item-5": 1}


def test_the_old_key_is_what_a_deduping_receiver_would_drop(receiver):
    """Control for the test above: re-sending new content under the generation-0 key is dropped by the
    deduping receiver (the first receipt comes back) and refused by the Stripe-style one."""
    key = idempotency_key(JOB, "item-3", "notify")
    headers = {"Idempotency-Key": key, "Content-Type": "application/json"}
    for rx in (receiver(), receiver(reject_key_reuse=True)):
        first = rx.call("/notifications", {"item_id": "item-3", "item": {"amount": 300}}, headers)
        again = rx.call("/notifications", {"item_id": "item-3", "item": {"amount": 999}}, headers)
        if rx.store.reject_key_reuse:
            assert again[0] == 422
        else:
            assert again == (200, {"receipt": first[1]["receipt"], "duplicate": True})
        assert rx.bodies("item-3") == [{"amount": 300}]
    with pytest.raises(ValueError, match="needs dedupe"):
        receiver(dedupe=False, reject_key_reuse=True)


def test_retries_verify_and_not_delivered_keep_the_generation(journal_location, receiver):
    rx = receiver()
    items = [{"id": "a", "amount": 1}, {"id": "b", "amount": 2}]
    changed = [{"id": "a", "amount": 5}, {"id": "b", "amount": 6}]
    with StepJournal(journal_location) as journal:
        run_batch(journal, JOB, items, steps(rx), settle_in_task=False)
        run_batch(journal, JOB, changed, steps(rx), settle_in_task=False)
        for item_id in ("a", "b"):
            journal.resolve_input_change(JOB, item_id, use_new_input=True, resolved_by="oncall")
        # a: accepted, reply lost -> verify finds it under the generation-1 key.
        # b: refused before accept, no verify -> held; not_delivered -> sent once under the same key.
        rx.store.arm("a", "after_accept")
        with pytest.raises(Exception):
            run_batch(journal, JOB, changed[:1], steps(rx), settle_in_task=False)
        rx.store.arm("b", "before_accept")
        with pytest.raises(HttpFailed):
            run_batch(journal, JOB, changed[1:], steps(rx, with_verify=False), settle_in_task=False)
        assert run_batch(journal, JOB, changed[:1], steps(rx), settle_in_task=False).verified_steps == 1
        held = run_batch(journal, JOB, changed[1:], steps(rx, with_verify=False), settle_in_task=False)
        assert [(h.item_id, h.generation) for h in held.held] == [("b", 1)]
        # What the on-call engineer asks the receiver about: the key of the held generation.
        shown = subprocess.run([CLI, "--journal", journal_location, "held", JOB, "--json"], capture_output=True,
                               text=True, timeout=60, check=True)
        assert [h["idempotency_key"] for h in json.loads(shown.stdout)] == [idempotency_key(JOB, "b", "notify", 1)]
        journal.resolve(JOB, "b", "notify", delivered=False, resolved_by="oncall", note="not in their log")
        assert run_batch(journal, JOB, changed, steps(rx, with_verify=False), settle_in_task=False).status == "completed"
        rows = {r.item_id: r for r in journal.rows(JOB) if r.step == "notify"}
        assert {i: (r.status, r.generation, r.attempts) for i, r in rows.items()} == {
            "a": (Status.SUCCEEDED, 1, 2), "b": (Status.SUCCEEDED, 1, 3)}
        for item_id, row in rows.items():
            assert rx.call(f"/notifications/{idempotency_key(JOB, item_id, 'notify', 1)}") == (
                200, {"receipt": row.receipt})
    assert rx.store.stats()["per_item"] == {"a": 2, "b": 2} and rx.verify_calls == ["a"]


@pytest.mark.parametrize("concurrency", [1, 4])
def test_not_sent_error_is_sent_again_without_verify_or_hold(journal_location, receiver, concurrency):
    rx = receiver()
    items = [{"id": f"item-{i:02d}", "amount": i} for i in range(1, 13)]
    rx.unreachable = {"item-04", "item-09"}
    with StepJournal(journal_location) as journal:
        with pytest.raises(Unreachable):
            run_batch(journal, JOB, items, steps(rx), concurrency=concurrency, settle_in_task=False)
        failed = [r for r in journal.rows(JOB) if r.status == Status.FAILED]
        assert failed and all((r.step, r.not_sent, r.error_type) == ("notify", True, "Unreachable") for r in failed)
        # Not an unknown outcome: nothing to resolve, the job only waits for its next run.
        (job,) = journal.jobs()
        assert job.unresolved == 0 and job.held == 0
        # Once more unreachable: still not sent, still no hold.
        rx.unreachable = {failed[0].item_id}
        with pytest.raises(Unreachable):
            run_batch(journal, JOB, items, steps(rx), concurrency=concurrency, settle_in_task=False)
        result = run_batch(journal, JOB, items, steps(rx), concurrency=concurrency, settle_in_task=False)
        assert result.status == "completed" and result.held == [] and result.verified_steps == 0
        assert rx.verify_calls == []
        assert all(r.status == Status.SUCCEEDED and not r.not_sent for r in journal.rows(JOB))
    stats = rx.store.stats()
    assert stats["items"] == 12 and stats["duplicates"] == 0


def test_an_unknown_failure_after_a_not_sent_one_is_verified_again(journal_location, receiver):
    """The flag belongs to the last attempt: a later attempt that may have reached the receiver is an
    unknown outcome again (verify, else hold), never a blind re-send."""
    rx = receiver()
    items = [{"id": "a", "amount": 1}]
    with StepJournal(journal_location) as journal:
        rx.unreachable = {"a"}
        with pytest.raises(Unreachable):
            run_batch(journal, JOB, items, steps(rx, with_verify=False), settle_in_task=False)
        rx.store.arm("a", "after_accept")
        with pytest.raises(Exception):
            run_batch(journal, JOB, items, steps(rx, with_verify=False), settle_in_task=False)
        (row,) = [r for r in journal.rows(JOB) if r.step == "notify"]
        assert (row.status, row.not_sent) == (Status.FAILED, False)
        held = run_batch(journal, JOB, items, steps(rx, with_verify=False), settle_in_task=False)
        assert [(h.item_id, h.reason) for h in held.held] == [("a", HeldReason.UNKNOWN_OUTCOME)]
    assert rx.store.stats()["per_item"] == {"a": 1}
