"""E-mail that is never sent twice: SmtpReceiver against real mail servers the tests start.

``TestWithoutServers`` needs only Airflow's SMTP provider (it also runs on the older Airflow matrix
cells). The rest sends through a fault proxy to an aiosmtpd sink that files every message into a
Maildir before it answers, and counts what arrived over IMAP from Debian's dovecot: the count that
decides is messages per Message-ID in the recipients' INBOX and in the archive folder.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from airflow_resumable.journal import HeldReason, Status, StepJournal
from airflow_resumable.runner import NotSentError, Step, StepContext, idempotency_key, run_batch
from tests.support.mail_servers import (
    ARCHIVE_ADDRESS,
    ARCHIVE_FOLDER,
    REPO,
    Fault,
    FaultProxy,
    free_port,
    items,
)

STEP = "send_mail"
SENDER = "batch@example.test"


def receiver(**overrides):
    from airflow_resumable.receivers.smtp import SmtpReceiver

    settings = dict(from_email=SENDER, to="{to}", subject="Invoice {id}", body="Amount: {amount}",
                    archive_to=ARCHIVE_ADDRESS, imap_conn_id="mail_imap", archive_mailbox=ARCHIVE_FOLDER)
    settings.update(overrides)
    return SmtpReceiver("mail_smtp", **settings)


def message_id(job_id: str, item_id: str, generation: int = 0) -> str:
    return f"<{idempotency_key(job_id, item_id, STEP, generation)}@example.test>"


def smtp_to(monkeypatch, port: int) -> None:
    monkeypatch.setenv("AIRFLOW_CONN_MAIL_SMTP", json.dumps(
        {"conn_type": "smtp", "host": "127.0.0.1", "port": port,
         "extra": {"disable_tls": True, "disable_ssl": True, "retry_limit": 1, "timeout": 10}}))


def closed_port() -> int:
    return free_port()  # free a moment ago: nobody listens, connecting is refused


@pytest.mark.compat
class TestWithoutServers:
    """What needs no mail server: the Message-ID, refusals of bad settings and bad items, a refused connect."""

    def test_message_id_is_the_same_on_every_retry_and_new_for_each_key_generation(self):
        mail = receiver()
        first = StepContext("job", "item-1", STEP, "digest")
        again = StepContext("job", "item-1", STEP, "other digest")
        next_generation = StepContext("job", "item-1", STEP, "digest", generation=1)
        assert mail.message_id(first, SENDER) == mail.message_id(again, SENDER) == message_id("job", "item-1")
        assert mail.message_id(next_generation, SENDER) == message_id("job", "item-1", 1) != message_id("job", "item-1")
        assert receiver(message_id_domain="mx.example.org").message_id(first, SENDER).endswith("@mx.example.org>")

    @pytest.mark.parametrize(("settings", "says"), [
        ({"to": None}, "to must be a str.format template or a callable"),
        ({"to": "  "}, "to is empty"),
        ({"subject": 42}, "subject must be a str.format template or a callable"),
        ({"body": b"bytes"}, "body must be"),
        ({"from_email": "not an address"}, "from_email must be one e-mail address"),
        ({"archive_to": "a@b@c"}, "archive_to must be one e-mail address"),
        ({"subtype": "rtf"}, "subtype must be 'plain' or 'html'"),
        ({"archive_mailbox": "Archiv\u00e9"}, "archive_mailbox must be a folder name"),
        ({"archive_authoritative": "yes"}, "archive_authoritative must be True, False or None"),
    ])
    def test_bad_settings_are_refused_with_a_short_message(self, settings, says):
        with pytest.raises(ValueError, match=says) as refused:
            receiver(**settings)
        assert len(str(refused.value)) < 200 and "\n" not in str(refused.value)

    @pytest.mark.parametrize(("item", "says"), [
        ({"id": "a", "amount": 1}, "to names the field 'to', which the item lacks"),
        ({"id": "a", "to": "", "amount": 1}, "not one e-mail address"),
        ({"id": "a", "to": "x@example.test\r\nBcc: all@example.test", "amount": 1}, "not one e-mail address"),
    ])
    def test_an_item_that_makes_no_message_is_refused_before_connecting(self, monkeypatch, tmp_path, item, says):
        """Nothing is sent (there is not even a server: the port is closed) and the row says so: the
        next run sends the item again, and no other row is touched."""
        from airflow_resumable.receivers.smtp import InvalidMessage

        smtp_to(monkeypatch, closed_port())
        with StepJournal(tmp_path / "journal.sqlite3") as journal:
            with pytest.raises(InvalidMessage, match=says):
                run_batch(journal, "job", [item, {"id": "b", "to": "b@example.test", "amount": 2}],
                          [Step(STEP, receiver().notify, side_effect=True)], settle_in_task=False)
            (row,) = journal.rows("job")
        assert (row.item_id, row.status, row.not_sent, row.error_type) == ("a", Status.FAILED, True, "InvalidMessage")

    def test_subject_given_as_a_callable_must_give_text(self, monkeypatch, tmp_path):
        from airflow_resumable.receivers.smtp import InvalidMessage

        smtp_to(monkeypatch, closed_port())
        mail = receiver(subject=lambda item, ctx: item["amount"])
        with pytest.raises(InvalidMessage, match="subject gave a int, not text"):
            mail.notify({"id": "a", "to": "a@example.test", "amount": 3}, StepContext("job", "a", STEP, "d"))

    def test_a_refused_connection_is_not_sent_and_the_next_run_sends_it_without_verify(self, monkeypatch, tmp_path):
        from airflow_resumable.exceptions import MailNotSent

        smtp_to(monkeypatch, closed_port())
        asked = []
        mail = receiver()
        steps = [Step(STEP, mail.notify, side_effect=True, verify=lambda ctx: asked.append(ctx) or None)]
        with StepJournal(tmp_path / "journal.sqlite3") as journal:
            with pytest.raises(MailNotSent) as failure:
                run_batch(journal, "job", items(2), steps, settle_in_task=False)
            assert isinstance(failure.value, NotSentError) and "ConnectionRefusedError" in str(failure.value)
            (row,) = journal.rows("job")
            assert (row.status, row.not_sent, row.error_type) == (Status.FAILED, True, "MailNotSent")
            with pytest.raises(MailNotSent):
                run_batch(journal, "job", items(2), steps, settle_in_task=False)  # sent again, not verified (still refused)
        assert asked == []


# ------------------------------------------------------------------------------ real mail servers


@pytest.fixture
def proxy(mail_servers):
    relay = FaultProxy(mail_servers.smtp_port)
    yield relay
    relay.stop()


@pytest.fixture
def connections(monkeypatch, mail_servers, proxy):
    """mail_smtp through the proxy; mail_imap to the archive, authoritative unless a test says not."""
    smtp_to(monkeypatch, proxy.port)

    def imap(authoritative: bool | None = True) -> None:
        monkeypatch.setenv("AIRFLOW_CONN_MAIL_IMAP", json.dumps(mail_servers.imap_connection(authoritative=authoritative)))
    imap()
    return imap


def assert_each_mail_once(mail_servers, job_id: str, count: int) -> None:
    """Exactly one message per item's Message-ID in the recipients' INBOX and in the archive (IMAP)."""
    expected = {message_id(job_id, item["id"]) for item in items(count)}
    for folder in ("INBOX", ARCHIVE_FOLDER):
        found = mail_servers.message_ids(folder)
        mine = {mid: n for mid, n in found.items() if mid in expected}
        assert mine == dict.fromkeys(expected, 1), f"{folder}: {sorted(mine.items())}"


class Verify:
    """The receiver's verify, recording which items it was asked about."""

    def __init__(self, mail) -> None:
        self.mail, self.asked = mail, []

    def __call__(self, ctx):
        self.asked.append(ctx.item_id)
        return self.mail.verify(ctx)


# What the first run raises, and how the second settles item-004.
FAULTS = {
    Fault.BEFORE_MARKER: ("MailNotSent", "sent again, not verified"),
    Fault.MARKER_LOST: ("MailOutcomeUnknown", "not in the archive: sent once"),
    Fault.AFTER_MARKER: ("MailOutcomeUnknown", "found in the archive"),
    Fault.REPLY_LOST: ("MailOutcomeUnknown", "found in the archive"),
}


@pytest.mark.parametrize("fault", list(FAULTS), ids=[f.value for f in FAULTS])
def test_a_cut_session_then_a_retry_delivers_every_mail_exactly_once(mail_servers, proxy, connections,
                                                                     journal_location, fault):
    job_id = f"mail-{uuid.uuid4().hex[:8]}"
    mail = receiver()
    verify = Verify(mail)
    steps = [Step(STEP, mail.notify, side_effect=True, verify=verify)]
    armed = proxy.arm(fault, "user4@example.test")
    raised, settles = FAULTS[fault]
    with StepJournal(journal_location) as journal:
        with pytest.raises(Exception) as first:
            run_batch(journal, job_id, items(8), steps, settle_in_task=False)
        assert armed.fired.is_set() and type(first.value).__name__ == raised
        if fault == Fault.AFTER_MARKER:  # the retry comes once the server has answered the marker
            assert armed.answered.wait(60), "the server never answered the marker"
        (row,) = [r for r in journal.rows(job_id) if r.item_id == "item-004"]
        assert (row.status, row.not_sent) == (Status.FAILED, fault == Fault.BEFORE_MARKER)
        second = run_batch(journal, job_id, items(8), steps, settle_in_task=False)
        resolutions = journal.resolutions(job_id)
    assert second.status == "completed" and second.held == []
    if settles == "sent again, not verified":
        assert verify.asked == [] and second.executed_steps == 5 and resolutions == []
    elif settles == "not in the archive: sent once":
        assert verify.asked == ["item-004"] and second.resent_steps == 1 and second.executed_steps == 5
        assert [(r.item_id, r.decision, r.resolved_by) for r in resolutions] == [("item-004", "not_delivered", "verify")]
    else:
        assert verify.asked == ["item-004"] and second.verified_steps == 1 and second.executed_steps == 4
    assert_each_mail_once(mail_servers, job_id, 8)


def test_a_session_cut_while_the_body_is_written_is_not_sent(mail_servers, proxy, connections, tmp_path):
    """Item 2's 20 MB body is more than the socket buffers hold: the proxy resets the session after
    its first bytes, the write fails before the marker, and the retry sends it with no verify."""
    from airflow_resumable.exceptions import MailNotSent

    job_id = f"mail-{uuid.uuid4().hex[:8]}"
    big = "A line of a long report, much longer than any socket buffer.\n" * 340_000
    mail = receiver(body=lambda item, ctx: big if item["id"] == "item-002" else f"Amount: {item['amount']}")
    verify = Verify(mail)
    steps = [Step(STEP, mail.notify, side_effect=True, verify=verify)]
    armed = proxy.arm(Fault.BODY_CUT, "user2@example.test")
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(MailNotSent) as cut:
            run_batch(journal, job_id, items(3), steps, settle_in_task=False)
        assert armed.fired.is_set() and cut.value.stage == "the body"
        assert run_batch(journal, job_id, items(3), steps, settle_in_task=False).status == "completed"
    assert verify.asked == []
    assert_each_mail_once(mail_servers, job_id, 3)


def test_only_a_mail_the_archive_cannot_show_is_held_when_the_archive_is_not_authoritative(mail_servers, proxy,
                                                                                         connections, tmp_path):
    """Without archive_authoritative, "not in the archive" may mean "not filed yet": the marker that
    never reached the server is held for a human. A cut before the marker still settles by itself,
    and a lost reply is found in the archive."""
    connections(authoritative=None)
    job_id = f"mail-{uuid.uuid4().hex[:8]}"
    mail = receiver()
    steps = [Step(STEP, mail.notify, side_effect=True, verify=mail.verify)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        for fault, rcpt in ((Fault.BEFORE_MARKER, "user2@example.test"), (Fault.MARKER_LOST, "user4@example.test"),
                            (Fault.REPLY_LOST, "user6@example.test")):
            proxy.arm(fault, rcpt)
            with pytest.raises(Exception):
                run_batch(journal, job_id, items(8), steps, settle_in_task=False)
        last = run_batch(journal, job_id, items(8), steps, settle_in_task=False)
        assert [(h.item_id, h.reason) for h in last.held] == [("item-004", HeldReason.UNKNOWN_OUTCOME)]
        # The on-call engineer finds nothing in the archive and confirms it: the next run sends it once.
        journal.resolve(job_id, "item-004", STEP, delivered=False, resolved_by="on-call", note="not in the archive")
        assert run_batch(journal, job_id, items(8), steps, settle_in_task=False).status == "completed"
    assert_each_mail_once(mail_servers, job_id, 8)


def test_a_refusal_sends_nothing_and_a_permanent_one_fails_without_retrying(mail_servers, connections, tmp_path):
    """451 (try later) and 550 (no such mailbox) to RCPT: nothing delivered, the row says not sent.
    The 550 is also an AirflowFailException: a retry would meet the same refusal."""
    from airflow_resumable._compat import airflow_fail_exception
    from airflow_resumable.exceptions import MailNotSent
    from airflow_resumable.receivers.smtp import MailRejected

    mail = receiver()
    steps = [Step(STEP, mail.notify, side_effect=True, verify=mail.verify)]
    job_id = f"mail-{uuid.uuid4().hex[:8]}"
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        for local, error in (("later", MailNotSent), ("reject", MailRejected)):
            batch = [{"id": "item-001", "to": f"{local}@example.test", "amount": 1}]
            with pytest.raises(error) as refused:
                run_batch(journal, job_id + local, batch, steps, settle_in_task=False)
            assert ("550" if local == "reject" else "451") in str(refused.value)
            assert isinstance(refused.value, airflow_fail_exception()) == (local == "reject")
            (row,) = journal.rows(job_id + local)
            assert (row.status, row.not_sent, row.error_type) == (Status.FAILED, True, error.__name__)
    found = mail_servers.message_ids("INBOX") + mail_servers.message_ids(ARCHIVE_FOLDER)
    assert not {mid for mid in found if job_id in mid or idempotency_key(job_id + "later", "item-001", STEP) in mid}


def test_in_the_task_a_451_is_sent_again_after_a_backoff_and_a_550_fails_at_once(mail_servers, connections,
                                                                                    tmp_path):
    """Settled in the task (the default): a 451 to RCPT is the server's "not now" before the message was
    taken, sent again after a backoff until its attempts run out - then left for the next try, not held -
    while the other items go on; a 550 is permanent and fails the run at once."""
    from airflow_resumable.exceptions import ReceiverUnavailableError
    from airflow_resumable.receivers.smtp import MailRejected
    from airflow_resumable.runner import Settlement

    mail = receiver()
    steps = [Step(STEP, mail.notify, side_effect=True, verify=mail.verify)]
    settlement = Settlement(max_attempts=3, first_backoff=0.05, max_backoff=0.1)
    job_id = f"mail-{uuid.uuid4().hex[:8]}"
    batch = [{"id": "item-001", "to": "later@example.test", "amount": 1},
             *({"id": f"item-00{n}", "to": f"user{n}@example.test", "amount": n} for n in (2, 3))]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(ReceiverUnavailableError, match="1 item\\(s\\) waiting") as waiting:
            run_batch(journal, job_id, batch, steps, settle_in_task=settlement)
        assert waiting.value.reason == "attempts_exhausted"
        rows = {row.item_id: row for row in journal.rows(job_id)}
        assert (rows["item-001"].status, rows["item-001"].not_sent, rows["item-001"].held_reason) == \
            (Status.FAILED, True, None)
        assert rows["item-001"].attempts == settlement.max_attempts
        assert {rows[i].status for i in ("item-002", "item-003")} == {Status.SUCCEEDED}
        rejected = [{"id": "item-004", "to": "reject@example.test", "amount": 4}]
        with pytest.raises(MailRejected):
            run_batch(journal, job_id + "-reject", rejected, steps, settle_in_task=settlement)
        (row,) = journal.rows(job_id + "-reject")
        assert (row.attempts, row.error_type) == (1, "MailRejected")  # never sent again in the task
    inbox = mail_servers.message_ids("INBOX")
    assert [inbox.get(message_id(job_id, i)) for i in ("item-002", "item-003")] == [1, 1]


# ------------------------------------------------------------------------- SIGKILL at each point


def sender(journal_location, job_id: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.support.mail_servers", "send", "--journal", str(journal_location),
                             "--job", job_id, "--count", "10"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)


def test_sigkill_at_each_point_of_the_session_then_a_fresh_process_resumes(mail_servers, proxy, journal_location):
    """A batch process is SIGKILLed while the proxy holds the session (a) before the marker,
    (b) after the marker reached the server, before its reply, (c) after the server answered; each
    time a fresh process resumes and verifies the step left IN_FLIGHT by IMAP. Every mail once."""
    env = {**os.environ, "PYTHONPATH": str(REPO),
           "AIRFLOW_CONN_MAIL_SMTP": json.dumps(mail_servers.smtp_connection(proxy.port)),
           "AIRFLOW_CONN_MAIL_IMAP": json.dumps(mail_servers.imap_connection(authoritative=True))}
    job_id = f"mail-{uuid.uuid4().hex[:8]}"
    for fault, item in ((Fault.BEFORE_MARKER, 3), (Fault.AFTER_MARKER, 6), (Fault.REPLY_LOST, 9)):
        armed = proxy.arm(fault, f"user{item}@example.test", pause=True)
        child = sender(journal_location, job_id, env)
        try:
            assert armed.paused.wait(60), f"the sender never reached {fault.value}"
            child.send_signal(signal.SIGKILL)
            assert child.wait(30) == -signal.SIGKILL
        finally:
            armed.release()
            if child.poll() is None:
                child.kill()
            child.stdout.close()
        if fault != Fault.BEFORE_MARKER:  # the next process comes once the server has answered the marker
            assert armed.answered.wait(60), "the server never answered the marker"
        with StepJournal(journal_location) as journal:
            killed = {r.item_id: r.status for r in journal.rows(job_id)}
        assert killed[f"item-{item:03d}"] == Status.IN_FLIGHT
    last = sender(journal_location, job_id, env)
    out, _ = last.communicate(timeout=120)
    summary = json.loads(out.strip().splitlines()[-1])
    assert last.returncode == 0, summary
    # Item 9 was left IN_FLIGHT by the last kill: this run found it in the archive.
    assert summary == {"status": "completed", "executed": 1, "verified": 1, "resent": 0, "held": []}
    assert_each_mail_once(mail_servers, job_id, 10)


# ---------------------------------------------------------------- replies cut part-way, odd replies

# What the sink answers the end-of-data marker with (its queue id is 12 characters).
MARKER_REPLY_LENGTH = len(b"250 2.0.0 Ok: queued as 0123456789AB\r\n")


def test_a_marker_reply_cut_at_any_byte_is_verified_never_sent_again(mail_servers, proxy, connections, tmp_path):
    """The sink files each message, then its ``250 2.0.0 Ok: queued as ...`` reaches the client only
    up to byte k, for every k: ``25`` is no refusal, it is an unknown outcome. Each next run asks the
    archive, finds the message and sends it no second time."""
    from airflow_resumable.exceptions import MailOutcomeUnknown

    job_id = f"mail-{uuid.uuid4().hex[:8]}"
    count = MARKER_REPLY_LENGTH
    mail = receiver()
    verify = Verify(mail)
    steps = [Step(STEP, mail.notify, side_effect=True, verify=verify)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        for keep in range(count):
            armed = proxy.arm(Fault.REPLY_CUT, f"user{keep + 1}@example.test", keep=keep)
            with pytest.raises(MailOutcomeUnknown):
                run_batch(journal, job_id, items(count), steps, settle_in_task=False)
            assert armed.fired.is_set() and armed.answered.is_set()
        last = run_batch(journal, job_id, items(count), steps, settle_in_task=False)
    assert last.status == "completed" and last.verified_steps == 1 and last.executed_steps == 0
    assert verify.asked == [f"item-{n:03d}" for n in range(1, count + 1)]
    assert_each_mail_once(mail_servers, job_id, count)


@pytest.mark.parametrize(("answer", "forward", "raised", "settled_by"), [
    (b"25\r\n", True, "MailOutcomeUnknown", "found"),
    (b"2", True, "MailOutcomeUnknown", "found"),
    (b"252 2.0.0 Cannot say\r\n", True, "MailOutcomeUnknown", "found"),
    (b"250", True, "MailOutcomeUnknown", "found"),  # no CRLF: the line may have gone on
    (b"250-2.0.0 Ok\r\n", True, "MailOutcomeUnknown", "found"),  # a last line that never came
    (b"250-2.0.0 Ok\r\n251 Ok\r\n", True, "MailOutcomeUnknown", "found"),  # two codes in one reply
    (b"2500 Ok\r\n", True, "MailOutcomeUnknown", "found"),
    (b"250Ok\r\n", True, "MailOutcomeUnknown", "found"),
    (b"\x00\xff garbage\r\n", True, "MailOutcomeUnknown", "found"),
    (b"451 4.3.0 Try again later\r\n", False, "MailNotSent", "sent again"),
    (b"451-4.3.0 Try\r\n451 4.3.0 again later\r\n", False, "MailNotSent", "sent again"),
    (b"45", False, "MailOutcomeUnknown", "not found: sent once"),
    (b"554 5.6.0 Message refused\r\n", False, "MailRejected", "sent again"),
], ids=lambda value: value.decode("ascii", "replace") if isinstance(value, bytes) else None)
def test_only_a_whole_refusal_of_the_marker_counts_as_not_sent(mail_servers, proxy, connections, tmp_path, answer,
                                                               forward, raised, settled_by):
    """The marker's reply is replaced: after the sink took the message (``forward``), anything but a
    whole ``250`` is an unknown outcome, verified; a whole 4xx or 5xx line (the sink never saw the
    marker) is a refusal, sent again with no verify. Every mail once."""
    job_id = f"mail-{uuid.uuid4().hex[:8]}"
    mail = receiver()
    verify = Verify(mail)
    steps = [Step(STEP, mail.notify, side_effect=True, verify=verify)]
    armed = proxy.arm(Fault.REPLY_FORGED, "user2@example.test", answer=answer, forward=forward)
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        with pytest.raises(Exception) as first:
            run_batch(journal, job_id, items(3), steps, settle_in_task=False)
        assert armed.fired.is_set() and type(first.value).__name__ == raised
        (row,) = journal.rows(job_id, "item-002")
        assert (row.status, row.not_sent) == (Status.FAILED, raised != "MailOutcomeUnknown")
        second = run_batch(journal, job_id, items(3), steps, settle_in_task=False)
    assert second.status == "completed" and second.held == []
    if settled_by == "found":
        assert verify.asked == ["item-002"] and second.verified_steps == 1 and second.executed_steps == 1
    elif settled_by == "not found: sent once":
        assert verify.asked == ["item-002"] and second.resent_steps == 1 and second.executed_steps == 2
    else:
        assert verify.asked == [] and second.executed_steps == 2
    assert_each_mail_once(mail_servers, job_id, 3)


# The sink's replies before the marker (aiosmtpd's own greeting and replies to EHLO, MAIL and DATA,
# the sink's to RCPT): a cut at each of their bytes, and somewhere in the middle of EHLO's long one.
EARLY_REPLIES = {"greeting": 40, "EHLO": 40, "MAIL": len(b"250 OK\r\n"), "RCPT": len(b"250 2.1.5 Ok\r\n"),
                 "DATA": len(b"354 End data with <CR><LF>.<CR><LF>\r\n")}
REJECTION = b"550 5.1.1 Recipient address rejected: no such user\r\n"


def test_a_reply_cut_before_the_marker_is_not_sent_and_never_a_refusal_for_good(mail_servers, proxy, connections,
                                                                                tmp_path):
    """The greeting or the reply to EHLO, MAIL, RCPT or DATA cut at every byte (the greeting's and
    EHLO's first 40): nothing was delivered, the row says not sent and the next run sends the item
    again with no verify. A cut ``550 5.1.1 Recipient addr`` is not the server's refusal for good (the
    task may retry); only the whole line is."""
    from airflow_resumable._compat import airflow_fail_exception
    from airflow_resumable.exceptions import MailNotSent
    from airflow_resumable.receivers.smtp import MailRejected

    job_id = f"mail-{uuid.uuid4().hex[:8]}"
    cuts = [(stage, keep) for stage, length in EARLY_REPLIES.items() for keep in range(length)]
    mail = receiver()
    verify = Verify(mail)
    steps = [Step(STEP, mail.notify, side_effect=True, verify=verify)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        for n, (stage, keep) in enumerate(cuts, start=1):
            rcpt = f"user{n}@example.test" if stage in ("RCPT", "DATA") else "*"
            armed = proxy.arm(Fault.REPLY_CUT, rcpt, stage=stage, keep=keep)
            if stage == "greeting":  # SmtpHook connects again after a lost greeting (retry_limit 1): cut both
                proxy.arm(Fault.REPLY_CUT, rcpt, stage=stage, keep=keep)
            with pytest.raises(MailNotSent) as cut:
                run_batch(journal, job_id, items(len(cuts)), steps, settle_in_task=False)
            proxy.disarm()
            assert armed.fired.is_set() and not isinstance(cut.value, MailRejected)
            # smtplib reads a whole "250" cut off before its "-" as EHLO's answer: MAIL then finds the session gone.
            assert cut.value.stage in ("connect", "EHLO", "MAIL", "RCPT", "DATA"), (stage, keep, cut.value.stage)
            (row,) = [r for r in journal.rows(job_id) if r.status != Status.SUCCEEDED]  # MAIL's: the next item's
            assert (row.status, row.not_sent) == (Status.FAILED, True)
        assert run_batch(journal, job_id, items(len(cuts)), steps, settle_in_task=False).status == "completed"
        assert verify.asked == []
        rejected = [{"id": "item-001", "to": "reject-me@example.test", "amount": 1}]
        for keep in range(len(REJECTION) + 1):
            proxy.arm(Fault.REPLY_CUT, "reject-me@example.test", stage="RCPT", keep=keep)
            with pytest.raises(MailNotSent) as refused:
                run_batch(journal, f"{job_id}-reject-{keep}", rejected, steps, settle_in_task=False)
            whole = keep == len(REJECTION)
            assert isinstance(refused.value, MailRejected) == whole, keep
            assert isinstance(refused.value, airflow_fail_exception()) == whole, keep
    assert_each_mail_once(mail_servers, job_id, len(cuts))
