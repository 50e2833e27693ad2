"""The demo receiver over real HTTP on 127.0.0.1, and the HttpHook notifier against it."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from airflow_resumable.demo_receiver import serve
from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, run_batch


@pytest.fixture
def receiver_factory(tmp_path):
    servers = []

    def start(dedupe=True):
        server = serve(0, tmp_path / f"receiver-{len(servers)}.sqlite3", dedupe=dedupe)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def call(url, method="GET", body=None, headers=None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_receiver_dedupes_by_key_and_answers_lookups(receiver_factory):
    _, url = receiver_factory()
    headers = {"Idempotency-Key": "k1", "Content-Type": "application/json"}
    first = call(url + "/notifications", "POST", {"item_id": "a"}, headers)
    second = call(url + "/notifications", "POST", {"item_id": "a"}, headers)
    assert first[0] == 200 and second == (200, {"receipt": first[1]["receipt"], "duplicate": True})
    assert call(url + "/notifications/k1") == (200, {"receipt": first[1]["receipt"]})
    assert call(url + "/notifications/nope")[0] == 404
    assert call(url + "/stats")[1]["per_item"] == {"a": 1}


def test_receiver_without_dedupe_counts_duplicates(receiver_factory):
    _, url = receiver_factory(dedupe=False)
    for _ in range(2):
        call(url + "/notifications", "POST", {"item_id": "a"}, {"Idempotency-Key": "k1"})
    assert call(url + "/stats")[1] == {"deliveries": 2, "items": 1, "duplicates": 1, "per_item": {"a": 2}}


def test_fault_before_accept_refuses_and_stores_nothing(receiver_factory):
    _, url = receiver_factory()
    assert call(url + "/faults", "POST", {"item_id": "a", "mode": "before_accept"})[0] == 200
    assert call(url + "/notifications", "POST", {"item_id": "a"}, {"Idempotency-Key": "k"})[0] == 503
    assert call(url + "/notifications/k")[0] == 404
    # Each fault fires once.
    assert call(url + "/notifications", "POST", {"item_id": "a"}, {"Idempotency-Key": "k"})[0] == 200


def test_fault_after_accept_stores_it_and_loses_the_reply(receiver_factory):
    _, url = receiver_factory()
    call(url + "/faults", "POST", {"item_id": "a", "mode": "after_accept"})
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        call(url + "/notifications", "POST", {"item_id": "a"}, {"Idempotency-Key": "k"})
    assert call(url + "/notifications/k")[0] == 200
    assert call(url + "/stats")[1]["per_item"] == {"a": 1}
    assert call(url + "/faults", "POST", {"item_id": "a", "mode": "sideways"})[0] == 400


@pytest.mark.parametrize("dedupe", [True, False])
def test_http_notifier_verifies_a_lost_reply_by_key_and_never_resends(receiver_factory, monkeypatch, tmp_path, dedupe):
    from airflow_resumable.notifiers.http import HttpReceiver

    server, url = receiver_factory(dedupe=dedupe)
    monkeypatch.setenv("AIRFLOW_CONN_RECEIVER", json.dumps({"conn_type": "http", "host": url}))
    http = HttpReceiver("receiver", timeout=5)
    items = [{"id": f"item-{i:03d}", "text": "{{ name }}"} for i in range(1, 51)]
    steps = [Step("notify_external", http.notify, side_effect=True, verify=http.verify)]
    server.store.arm("item-041", "after_accept")
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(Exception) as failure:
            run_batch(journal, "job", items, steps)
        assert "item-041" not in str(failure.value)
        second = run_batch(journal, "job", items, steps)
        assert second.held == [] and second.verified_steps == 1 and second.executed_steps == 9
    stats = server.store.stats()
    # With dedupe off, the receiver would count any re-send: the journal alone prevents them.
    assert stats["duplicates"] == 0 and stats["items"] == 50


@pytest.mark.parametrize("extra", [{"lookup_authoritative": True}, {"lookup_authoritative": "true"}, {}])
def test_http_verify_answers_not_delivered_only_for_an_authoritative_lookup(receiver_factory, monkeypatch, tmp_path,
                                                                            extra):
    """A send refused before the receiver accepted it: with an authoritative look-up (the connection's
    extra says so) the retry sends it once; without, it is held as before."""
    from airflow_resumable.notifiers.http import HttpReceiver

    server, url = receiver_factory(dedupe=False)
    monkeypatch.setenv("AIRFLOW_CONN_RECEIVER", json.dumps({"conn_type": "http", "host": url, "extra": extra}))
    http = HttpReceiver("receiver", timeout=5)
    items = [{"id": f"item-{i:03d}"} for i in range(1, 11)]
    steps = [Step("notify_external", http.notify, side_effect=True, verify=http.verify)]
    server.store.arm("item-004", "before_accept")
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(Exception):
            run_batch(journal, "job", items, steps)
        second = run_batch(journal, "job", items, steps)
        if extra:
            assert (second.held, second.resent_steps) == ([], 1)
            (audit,) = journal.resolutions("job")
            assert (audit.item_id, audit.decision, audit.resolved_by) == ("item-004", "not_delivered", "verify")
        else:
            assert [h.item_id for h in second.held] == ["item-004"] and second.resent_steps == 0
    stats = server.store.stats()
    assert stats["duplicates"] == 0 and stats["items"] == (10 if extra else 9)


def test_lookup_authoritative_must_be_a_boolean(monkeypatch):
    from airflow_resumable.notifiers.http import HttpReceiver

    with pytest.raises(ValueError, match="lookup_authoritative"):
        HttpReceiver("receiver", lookup_authoritative="yes")
    monkeypatch.setenv("AIRFLOW_CONN_ODD", json.dumps({"conn_type": "http", "host": "http://127.0.0.1:9",
                                                       "extra": {"lookup_authoritative": "maybe"}}))
    with pytest.raises(ValueError, match="extra lookup_authoritative must be true or false"):
        HttpReceiver("odd").lookup_authoritative
    assert HttpReceiver("odd", lookup_authoritative=True).lookup_authoritative is True


def test_http_notify_raises_not_sent_only_when_no_byte_was_written(receiver_factory, monkeypatch, tmp_path):
    """Refused connection (a free port nobody listens on) and a name that does not resolve: nothing
    left, so NotSentError and the next run sends without verify or hold. A reply lost after the
    receiver accepted stays an unknown outcome."""
    import socket

    from airflow_resumable.notifiers.http import HttpReceiver, ReceiverUnreachable
    from airflow_resumable.runner import NotSentError

    server, url = receiver_factory(dedupe=False)
    with socket.socket() as probe:  # a port that was free a moment ago: connecting to it is refused
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}"
    monkeypatch.setenv("AIRFLOW_CONN_CLOSED", json.dumps({"conn_type": "http", "host": closed}))
    monkeypatch.setenv("AIRFLOW_CONN_NOWHERE", json.dumps({"conn_type": "http", "host": "http://no-such-host.invalid"}))
    monkeypatch.setenv("AIRFLOW_CONN_RECEIVER", json.dumps({"conn_type": "http", "host": url}))
    items = [{"id": f"item-{i}"} for i in range(1, 4)]
    verified: list[str] = []

    def steps(conn_id: str) -> list[Step]:
        http = HttpReceiver(conn_id, timeout=5)

        def verify(ctx):
            verified.append(ctx.item_id)
            return http.verify(ctx)
        return [Step("notify_external", http.notify, side_effect=True, verify=verify)]

    assert issubclass(ReceiverUnreachable, NotSentError)
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        for conn_id in ("closed", "nowhere"):
            with pytest.raises(ReceiverUnreachable):
                run_batch(journal, "job", items, steps(conn_id))
            (row,) = journal.rows("job")
            assert (row.item_id, row.status.value, row.not_sent, row.error_type) == (
                "item-1", "FAILED", True, "ReceiverUnreachable")
        server.store.arm("item-2", "after_accept")
        with pytest.raises(Exception) as lost:
            run_batch(journal, "job", items, steps("receiver"))
        assert not isinstance(lost.value, NotSentError)
        assert {r.item_id: r.not_sent for r in journal.rows("job")} == {"item-1": False, "item-2": False}
        done = run_batch(journal, "job", items, steps("receiver"))
        assert done.status == "completed" and done.verified_steps == 1 and verified == ["item-2"]
    assert server.store.stats() == {"deliveries": 3, "items": 3, "duplicates": 0,
                                    "per_item": {"item-1": 1, "item-2": 1, "item-3": 1}}


def test_a_redirect_after_the_post_is_an_unknown_outcome_not_a_refused_connection(monkeypatch, tmp_path):
    """The receiver took the POST and answered 303 to a host that refuses connections: following it would
    fail with "could not connect" although the first request arrived. It is not followed."""
    import socket
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from airflow_resumable.notifiers.http import HttpReceiver, ReceiverError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{probe.getsockname()[1]}/receipt"
    received = []

    class Redirecting(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            received.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(303)
            self.send_header("Location", closed)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("AIRFLOW_CONN_REDIRECTING", json.dumps(
            {"conn_type": "http", "host": f"http://127.0.0.1:{server.server_address[1]}"}))
        http = HttpReceiver("redirecting", timeout=5)
        with StepJournal(tmp_path / "journal.sqlite3") as journal:
            with pytest.raises(ReceiverError, match="303"):
                run_batch(journal, "job", [{"id": "a"}], [Step("notify", http.notify, side_effect=True)])
            (row,) = journal.rows("job")
            assert (row.status.value, row.not_sent) == ("FAILED", False)  # unknown: verify or hold, never resend
    finally:
        server.shutdown()
        server.server_close()
    assert len(received) == 1
