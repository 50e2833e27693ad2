"""The demo receiver over real HTTP on 127.0.0.1, and the HttpHook notifier against it."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from airflow_resumable.demo_receiver import serve
from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, run_batch


@pytest.fixture
def receiver_factory(tmp_path):
    servers = []

    def start(dedupe=True, reply_ms=0.0):
        server = serve(0, tmp_path / f"receiver-{len(servers)}.sqlite3", dedupe=dedupe, reply_ms=reply_ms)
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


def test_a_sender_killed_between_the_head_and_the_body_delivered_nothing(receiver_factory):
    """http.client writes a request's head and its body apart: a sender SIGKILLed in between leaves the
    head (with the key) and part of the body or none. The receiver must not record that as a delivery,
    or a later look-up by the key would vouch for an item that never arrived."""
    _, url = receiver_factory()
    port = int(url.rsplit(":", 1)[1])
    body = json.dumps({"item_id": "a", "step": "notify"}).encode()
    for sent in (b"", body[:10]):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"POST /notifications HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k1\r\n"
                         b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + sent)
            conn.shutdown(socket.SHUT_WR)  # the sender is gone
            assert conn.recv(1024) == b""  # no answer: there is nobody to answer
    assert call(url + "/notifications/k1")[0] == 404
    assert call(url + "/stats")[1]["deliveries"] == 0
    # The whole request, sent again, is delivered once.
    assert call(url + "/notifications", "POST", {"item_id": "a"}, {"Idempotency-Key": "k1"})[0] == 200
    assert call(url + "/stats")[1]["per_item"] == {"a": 1}


def test_a_request_without_content_length_is_refused_and_delivers_nothing(receiver_factory):
    """A chunked body (no Content-Length) that stopped after its head was recorded as an empty delivery,
    and the key's look-up then vouched for it."""
    _, url = receiver_factory()
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(b"POST /notifications HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k-chunked\r\n"
                     b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n")
        conn.shutdown(socket.SHUT_WR)
        status_line = conn.recv(1024).split(b"\r\n")[0]
        assert b" 411 " in status_line, status_line
    assert call(url + "/notifications/k-chunked")[0] == 404
    assert call(url + "/stats")[1]["deliveries"] == 0


def test_a_lookup_while_the_receiver_works_on_a_request_finds_it(receiver_factory):
    """With --reply-ms the receiver works before it answers: a look-up meanwhile must already know the
    key (the demo's look-up is authoritative), or "not delivered" would send it twice."""
    _, url = receiver_factory(dedupe=False, reply_ms=3000)
    sender = threading.Thread(target=call, args=(url + "/notifications", "POST", {"item_id": "a"},
                                                 {"Idempotency-Key": "k-slow"}))
    sender.start()
    deadline = time.monotonic() + 10
    while call(url + "/notifications/k-slow")[0] != 200:
        assert sender.is_alive() and time.monotonic() < deadline, "looked up only after the reply"
        time.sleep(0.05)
    assert sender.is_alive()  # found while the request is still being worked on
    sender.join(timeout=10)


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
    from airflow_resumable.receivers.http import HttpReceiver

    server, url = receiver_factory(dedupe=dedupe)
    monkeypatch.setenv("AIRFLOW_CONN_RECEIVER", json.dumps({"conn_type": "http", "host": url}))
    http = HttpReceiver("receiver", timeout=5)
    items = [{"id": f"item-{i:03d}", "text": "{{ name }}"} for i in range(1, 51)]
    steps = [Step("notify_external", http.notify, side_effect=True, verify=http.verify)]
    server.store.arm("item-041", "after_accept")
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(Exception) as failure:
            run_batch(journal, "job", items, steps, settle_in_task=False)
        assert "item-041" not in str(failure.value)
        second = run_batch(journal, "job", items, steps, settle_in_task=False)
        assert second.held == [] and second.verified_steps == 1 and second.executed_steps == 9
    stats = server.store.stats()
    # With dedupe off, the receiver would count any re-send: the journal alone prevents them.
    assert stats["duplicates"] == 0 and stats["items"] == 50


def fault_then_run_again(server, http, tmp_path, count: int, item_id: str, fault: str):
    """Items item-001.. of job 'job' sent through ``http`` (send and verify), ``fault`` armed for ``item_id``:
    the first run raises there, the second runs again. Returns the second run's result and the job's audit."""
    items = [{"id": f"item-{i:03d}"} for i in range(1, count + 1)]
    steps = [Step("notify_external", http.notify, side_effect=True, verify=http.verify)]
    server.store.arm(item_id, fault)
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(Exception):
            run_batch(journal, "job", items, steps, settle_in_task=False)
        return run_batch(journal, "job", items, steps, settle_in_task=False), journal.resolutions("job")


@pytest.mark.parametrize("extra", [{"lookup_authoritative": True}, {"lookup_authoritative": "true"}, {}])
def test_http_verify_answers_not_delivered_only_for_an_authoritative_lookup(receiver_factory, monkeypatch, tmp_path,
                                                                            extra):
    """A send refused before the receiver accepted it: with an authoritative look-up (the connection's
    extra says so) the retry sends it once; without, it is held as before."""
    from airflow_resumable.receivers.http import HttpReceiver

    server, url = receiver_factory(dedupe=False)
    monkeypatch.setenv("AIRFLOW_CONN_RECEIVER", json.dumps({"conn_type": "http", "host": url, "extra": extra}))
    second, audits = fault_then_run_again(server, HttpReceiver("receiver", timeout=5), tmp_path, 10,
                                          "item-004", "before_accept")
    if extra:
        assert (second.held, second.resent_steps) == ([], 1)
        (audit,) = audits
        assert (audit.item_id, audit.decision, audit.resolved_by) == ("item-004", "not_delivered", "verify")
    else:
        assert [h.item_id for h in second.held] == ["item-004"] and second.resent_steps == 0
    stats = server.store.stats()
    assert stats["duplicates"] == 0 and stats["items"] == (10 if extra else 9)


@pytest.mark.parametrize("lookup_endpoint", ["/v1/notifications/{key}", "/notification/{key}"])
def test_an_authoritative_lookup_on_a_wrong_path_holds_and_never_sends_again(receiver_factory, monkeypatch,
                                                                              tmp_path, lookup_endpoint):
    """The receiver stored the send, its reply was lost; the look-up is configured on a path the receiver
    does not serve. Its 404 ("not found", no receipt field) says nothing about the key: held, not sent
    again as "not delivered"."""
    from airflow_resumable.receivers.http import HttpReceiver

    server, url = receiver_factory(dedupe=False)
    monkeypatch.setenv("AIRFLOW_CONN_RECEIVER", json.dumps({"conn_type": "http", "host": url}))
    http = HttpReceiver("receiver", timeout=5, lookup_endpoint=lookup_endpoint, lookup_authoritative=True)
    second, _ = fault_then_run_again(server, http, tmp_path, 5, "item-003", "after_accept")
    assert [h.item_id for h in second.held] == ["item-003"] and second.resent_steps == 0
    stats = server.store.stats()
    assert stats["duplicates"] == 0 and stats["items"] == 5


def test_lookup_authoritative_must_be_a_boolean(monkeypatch):
    from airflow_resumable.receivers.http import HttpReceiver

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

    from airflow_resumable.exceptions import ReceiverUnreachable
    from airflow_resumable.receivers.http import HttpReceiver
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
                run_batch(journal, "job", items, steps(conn_id), settle_in_task=False)
            (row,) = journal.rows("job")
            assert (row.item_id, row.status.value, row.not_sent, row.error_type) == (
                "item-1", "FAILED", True, "ReceiverUnreachable")
        server.store.arm("item-2", "after_accept")
        with pytest.raises(Exception) as lost:
            run_batch(journal, "job", items, steps("receiver"), settle_in_task=False)
        assert not isinstance(lost.value, NotSentError)
        assert {r.item_id: r.not_sent for r in journal.rows("job")} == {"item-1": False, "item-2": False}
        done = run_batch(journal, "job", items, steps("receiver"), settle_in_task=False)
        assert done.status == "completed" and done.verified_steps == 1 and verified == ["item-2"]
    assert server.store.stats() == {"deliveries": 3, "items": 3, "duplicates": 0,
                                    "per_item": {"item-1": 1, "item-2": 1, "item-3": 1}}


def test_a_redirect_after_the_post_is_an_unknown_outcome_not_a_refused_connection(monkeypatch, tmp_path):
    """The receiver took the POST and answered 303 to a host that refuses connections: following it would
    fail with "could not connect" although the first request arrived. It is not followed."""
    import socket
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from airflow_resumable.exceptions import ReceiverError
    from airflow_resumable.receivers.http import HttpReceiver

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
                run_batch(journal, "job", [{"id": "a"}], [Step("notify", http.notify, side_effect=True)],
                          settle_in_task=False)
            (row,) = journal.rows("job")
            assert (row.status.value, row.not_sent) == ("FAILED", False)  # unknown: verify or hold, never resend
    finally:
        server.shutdown()
        server.server_close()
    assert len(received) == 1


# ----------------------------------------------------------------- look-ups and replies that carry no answer


def reply(status, body=b"", **headers):
    """A scripted answer: ``body`` as bytes, or any other value as its JSON text."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return status, headers, data


class Seen(list):
    """The (method, path) of each request a scripted receiver was sent; ``headers``: each one's headers."""

    def __init__(self) -> None:
        super().__init__()
        self.headers: list[dict[str, str]] = []


@pytest.fixture
def scripted_receiver(monkeypatch):
    """A receiver on 127.0.0.1 that answers as ``answer(method, path)`` says, behind the Airflow connection
    ``scripted``; returns the list of (method, path) it was asked, in order."""
    from http.server import BaseHTTPRequestHandler, HTTPServer

    servers = []

    def start(answer, extra=None):
        seen = Seen()

        class Scripted(BaseHTTPRequestHandler):
            def _answer(self):
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                seen.append((self.command, self.path))
                seen.headers.append({name.lower(): value for name, value in self.headers.items()})
                status, headers, body = answer(self.command, self.path)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name.replace("_", "-"), value)
                if status != 204:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = _answer  # noqa: N815

            def log_message(self, *args):
                pass

        server = HTTPServer(("127.0.0.1", 0), Scripted)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        monkeypatch.setenv("AIRFLOW_CONN_SCRIPTED", json.dumps(
            {"conn_type": "http", "host": f"http://127.0.0.1:{server.server_address[1]}", "extra": extra or {}}))
        return seen

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def a_context():
    from airflow_resumable.runner import StepContext

    return StepContext("job", "a", "notify", "digest")


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_verify_never_follows_a_redirect_to_a_page_that_answers_404(scripted_receiver, status):
    """An authoritative look-up answering 3xx to a login page that answers 404: following it would read
    the login page's 404 as "never got it" and send the item again. A 3xx is "cannot tell": hold. The
    connection's extra asking for redirects does not change that."""
    from airflow_resumable.receivers.http import HttpReceiver

    def answer(method, path):
        if path.startswith("/notifications/"):
            return reply(status, Location="/login?next=" + path)
        return reply(404, {"error": "no such page"})

    seen = scripted_receiver(answer, extra={"lookup_authoritative": True, "allow_redirects": True})
    http = HttpReceiver("scripted", timeout=5)
    assert http.lookup_authoritative is True
    ctx = a_context()
    assert http.verify(ctx) is None
    assert seen == [("GET", f"/notifications/{ctx.idempotency_key}")]  # the redirect's target was never asked


def test_a_lookup_redirected_to_a_404_holds_the_send_and_never_sends_it_again(scripted_receiver, tmp_path):
    """The whole run: a send whose reply was a 502 (the receiver may have it), then a run whose
    authoritative look-up answers 302 to a page that answers 404. The step is held; one POST in all."""
    from airflow_resumable.exceptions import ReceiverError
    from airflow_resumable.journal import HeldReason
    from airflow_resumable.receivers.http import HttpReceiver

    def answer(method, path):
        if method == "POST":
            return reply(502, {"error": "bad gateway"})
        if path.startswith("/notifications/"):
            return reply(302, Location="/login")
        return reply(404, {"error": "no such page"})

    seen = scripted_receiver(answer, extra={"lookup_authoritative": "true"})
    http = HttpReceiver("scripted", timeout=5)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(ReceiverError, match="502"):
            run_batch(journal, "job", [{"id": "a"}], steps, settle_in_task=False)
        second = run_batch(journal, "job", [{"id": "a"}], steps, settle_in_task=False)
        assert [(h.item_id, h.reason) for h in second.held] == [("a", HeldReason.UNKNOWN_OUTCOME)]
        assert second.resent_steps == 0 and journal.resolutions("job") == []
    assert [method for method, _ in seen] == ["POST", "GET"] and ("GET", "/login") not in seen


NO_RECEIPT = {
    "receipt null": reply(200, {"receipt": None}),
    "receipt missing": reply(200, {"status": "ok"}),
    "receipt empty": reply(200, {"receipt": ""}),
    "receipt blank": reply(200, {"receipt": "  "}),
    "receipt false": reply(200, {"receipt": False}),
    "receipt an empty list": reply(200, {"receipt": []}),
    "body not an object": reply(200, ["r-1"]),
    "body a JSON string": reply(200, "r-1"),
    "body not JSON": reply(200, b"<html>Sign in</html>", Content_Type="text/html"),
    "no body": reply(204),
}


@pytest.mark.parametrize("answer", list(NO_RECEIPT.values()), ids=list(NO_RECEIPT))
def test_verify_treats_a_2xx_without_receipt_as_cannot_tell(scripted_receiver, answer):
    """A 2xx look-up that names no receipt does not say what it found: None (hold), never the
    receipt "None", never an exception about the body."""
    from airflow_resumable.receivers.http import HttpReceiver

    seen = scripted_receiver(lambda method, path: answer, extra={"lookup_authoritative": True})
    assert HttpReceiver("scripted", timeout=5).verify(a_context()) is None
    assert len(seen) == 1


@pytest.mark.parametrize(("receipt", "text"), [("r-1", "r-1"), (42, "42"), (0, "0"), ({"id": "r-1"}, '{"id": "r-1"}')])
def test_verify_returns_a_2xx_receipt_as_text(scripted_receiver, receipt, text):
    """Any receipt the reply names, falsy numbers included, is that receipt as text (an object: its JSON)."""
    from airflow_resumable.receivers.http import HttpReceiver

    scripted_receiver(lambda method, path: reply(200, {"receipt": receipt}))
    assert HttpReceiver("scripted", timeout=5).verify(a_context()) == text


# The receiver's own word (its JSON object, or a 204) without a receipt: it took the POST.
RECEIVER_SAID_NO_RECEIPT = {k: v for k, v in NO_RECEIPT.items() if k.startswith(("receipt", "no body"))}
NOT_THE_RECEIVERS_WORD = {k: v for k, v in NO_RECEIPT.items() if k not in RECEIVER_SAID_NO_RECEIPT}


@pytest.mark.parametrize("answer", list(NOT_THE_RECEIVERS_WORD.values()), ids=list(NOT_THE_RECEIVERS_WORD))
def test_notify_takes_a_2xx_that_is_not_the_receivers_json_as_an_unknown_outcome(scripted_receiver, tmp_path, answer):
    """A 200 HTML page (a proxy's, a portal's) or a body that is no JSON object is no word from the
    receiver: the send may never have arrived, so it is neither done (lost) nor sent again blindly -
    the next run asks the look-up, and a non-authoritative 404 holds it for a human."""
    from airflow_resumable.exceptions import ReceiverError
    from airflow_resumable.journal import HeldReason
    from airflow_resumable.receivers.http import HttpReceiver

    seen = scripted_receiver(lambda method, path: answer if method == "POST" else reply(404, {}))
    http = HttpReceiver("scripted", timeout=5)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(ReceiverError):
            run_batch(journal, "job", [{"id": "a"}], steps, settle_in_task=False)
        again = run_batch(journal, "job", [{"id": "a"}], steps, settle_in_task=False)
        assert [h.reason for h in again.held] == [HeldReason.UNKNOWN_OUTCOME]
    assert [m for m, _ in seen].count("POST") == 1


@pytest.mark.parametrize("answer", list(RECEIVER_SAID_NO_RECEIPT.values()), ids=list(RECEIVER_SAID_NO_RECEIPT))
def test_notify_records_a_2xx_without_receipt_as_delivered_never_as_receipt_none(scripted_receiver, tmp_path,
                                                                                answer):
    """The receiver accepted the POST (2xx) but named no receipt: the send arrived, so the step is done
    and is never sent again - recorded with a receipt that says so, not "None" (nor an exception that
    would leave a delivered send as an unknown outcome)."""
    from airflow_resumable.journal import Status
    from airflow_resumable.receivers.http import HttpReceiver

    status = answer[0]
    seen = scripted_receiver(lambda method, path: answer if method == "POST" else reply(404, {}))
    http = HttpReceiver("scripted", timeout=5)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        first = run_batch(journal, "job", [{"id": "a"}], steps, settle_in_task=False)
        again = run_batch(journal, "job", [{"id": "a"}], steps, settle_in_task=False)
        (row,) = journal.rows("job")
    assert (first.status, first.executed_steps, again.executed_steps) == ("completed", 1, 0)
    assert row.status == Status.SUCCEEDED and row.receipt == f"HTTP {status}, no receipt in the reply"
    assert seen == [("POST", "/notifications")]


# ----------------------------------------------------------------- "not now": a refusal the receiver states


def refuse_second_post(status, **headers):
    """An answer that refuses the second POST it gets with ``status`` (and ``headers``) and takes the rest."""
    posts = []

    def answer(method, path):
        if method != "POST":
            return reply(404, {"receipt": None})
        posts.append(path)
        if len(posts) == 2:
            return reply(status, {"error": "not now"}, **headers)
        return reply(200, {"receipt": f"r-{len(posts)}"})

    return answer


def test_a_429_is_sent_again_with_the_same_key_never_looked_up_or_held(scripted_receiver, tmp_path):
    """A rate limit's 429 is the receiver's word that it did not take the POST: the run stops with
    ReceiverRefused carrying the Retry-After; the item is recorded as not sent, and the next run sends it
    again with the same idempotency key - no look-up, no hold - while every other item is sent once."""
    from airflow_resumable.exceptions import ReceiverRefused
    from airflow_resumable.journal import Status
    from airflow_resumable.receivers.http import HttpReceiver

    seen = scripted_receiver(refuse_second_post(429, Retry_After="7"))
    http = HttpReceiver("scripted", timeout=5)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify)]
    items = [{"id": i} for i in ("a", "b", "c")]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(ReceiverRefused) as refused:
            run_batch(journal, "job", items, steps, settle_in_task=False)
        assert (refused.value.status, refused.value.retry_after) == (429, 7.0)
        (b_row,) = journal.rows("job", "b")
        assert (b_row.status, b_row.not_sent, b_row.error_type) == (Status.FAILED, True, "ReceiverRefused")
        again = run_batch(journal, "job", items, steps, settle_in_task=False)
        assert (again.status, again.held, again.executed_steps) == ("completed", [], 2)
        assert {r.item_id: r.receipt for r in journal.rows("job")} == {"a": "r-1", "b": "r-3", "c": "r-4"}
    assert [method for method, _ in seen] == ["POST"] * 4  # a, b refused, then b and c: never a look-up
    keys = [headers["idempotency-key"] for headers in seen.headers]
    assert keys[1] == keys[2] and len(set(keys)) == 3


def test_a_503_is_an_unknown_outcome_unless_the_connection_names_it_a_refusal(scripted_receiver, tmp_path):
    """A 503 may come from a receiver that took the request and failed after: it stays an unknown outcome
    (the next run asks the look-up). A connection whose extra names it a refusal sends it again instead -
    and that extra, like every setting of ours, never reaches the receiver as a header."""
    from airflow_resumable.exceptions import ReceiverError, ReceiverRefused
    from airflow_resumable.journal import HeldReason
    from airflow_resumable.receivers.http import HttpReceiver

    items = [{"id": i} for i in ("a", "b")]
    seen = scripted_receiver(refuse_second_post(503))
    http = HttpReceiver("scripted", timeout=5)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify)]
    with StepJournal(tmp_path / "unknown.sqlite3") as journal:
        with pytest.raises(ReceiverError) as unknown:
            run_batch(journal, "job", items, steps, settle_in_task=False)
        assert not isinstance(unknown.value, ReceiverRefused)
        again = run_batch(journal, "job", items, steps, settle_in_task=False)
        assert [h.reason for h in again.held] == [HeldReason.UNKNOWN_OUTCOME]
    assert [method for method, _ in seen] == ["POST", "POST", "GET"]

    seen = scripted_receiver(refuse_second_post(503), extra={"refusal_statuses": [429, 503]})
    http = HttpReceiver("scripted", timeout=5)
    steps = [Step("notify", http.notify, side_effect=True, verify=http.verify)]
    with StepJournal(tmp_path / "refused.sqlite3") as journal:
        with pytest.raises(ReceiverRefused) as refused:
            run_batch(journal, "job", items, steps, settle_in_task=False)
        assert (refused.value.status, refused.value.retry_after) == (503, None)
        assert run_batch(journal, "job", items, steps, settle_in_task=False).held == []
    assert [method for method, _ in seen] == ["POST", "POST", "POST"]
    assert not any("refusal_statuses" in headers or "lookup_authoritative" in headers for headers in seen.headers)


def test_a_retry_after_given_as_an_http_date_is_read_as_seconds(scripted_receiver):
    from email.utils import formatdate

    from airflow_resumable.exceptions import ReceiverRefused
    from airflow_resumable.receivers.http import HttpReceiver

    for retry_after, expected in ((formatdate(time.time() + 30, usegmt=True), (20, 30)), ("soon", None)):
        scripted_receiver(lambda method, path, value=retry_after: reply(429, {}, Retry_After=value))
        with pytest.raises(ReceiverRefused) as refused:
            HttpReceiver("scripted", timeout=5).notify({"id": "a"}, a_context())
        if expected is None:
            assert refused.value.retry_after is None
        else:
            assert expected[0] <= refused.value.retry_after <= expected[1]


@pytest.mark.parametrize(("extra", "message"), [
    ("abc", "'abc' is not an HTTP status code"),
    ([200], "'200' is not an error status"),
    ({"429": True}, "must be a list of HTTP status codes"),
])
def test_refusal_statuses_that_are_not_error_statuses_are_refused_before_anything_is_sent(
        scripted_receiver, tmp_path, extra, message):
    """A 2xx named a refusal would send a delivered item again: refused, in the constructor or (the
    connection's extra) before the request - nothing sent, the item left to send when it is fixed."""
    from airflow_resumable.exceptions import NotSentError
    from airflow_resumable.journal import Status
    from airflow_resumable.receivers.http import HttpReceiver

    with pytest.raises(ValueError, match="is not an error status"):
        HttpReceiver("scripted", refusal_statuses=[429, 204])
    seen = scripted_receiver(lambda method, path: reply(200, {"receipt": "r"}), extra={"refusal_statuses": extra})
    http = HttpReceiver("scripted", timeout=5)
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(NotSentError, match=message):
            run_batch(journal, "job", [{"id": "a"}], [Step("notify", http.notify, side_effect=True)], settle_in_task=False)
        (row,) = journal.rows("job")
        assert (row.status, row.not_sent) == (Status.FAILED, True)
    assert seen == []
