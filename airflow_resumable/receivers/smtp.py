"""An e-mail receiver built on Airflow's SmtpHook: ``notify`` sends one message per item whose
``Message-ID`` is derived from the step's idempotency key; ``verify`` looks that Message-ID up by IMAP
in an archive mailbox (the IMAP provider's ImapHook, the ``email`` extra). Use it as a pair::

    mail = SmtpReceiver("smtp_default", from_email="billing@example.com", to="{email}",
                        subject="Invoice {id}", body="Amount due: {amount}",
                        archive_to="archive@example.com", imap_conn_id="imap_archive", archive_mailbox="INBOX")
    ResumableBatchOperator(task_id="send", items=..., notify=mail.notify, verify=mail.verify)

SMTP says exactly when a message is delivered: once the client has written the end-of-data marker
(``<CRLF>.<CRLF>``) and the server has answered it. A session that breaks before the marker was
completely written leaves nothing delivered. So ``notify`` drives the SMTP dialogue itself (MAIL,
RCPT, DATA, the body, then the marker in a write of its own) and knows which side of the marker a
failure fell on:

* before the marker was completely written (connect refused or timed out, an error at the greeting,
  EHLO, STARTTLS, AUTH, MAIL, RCPT or DATA, a reply cut part-way, a cut while the body was written),
  or a whole 4xx reply line to the marker (the server's word that it did not take the message):
  nothing was delivered - :class:`MailNotSent`, a ``NotSentError``: the next run sends it again, no
  verify, no hold;
* a whole 5xx reply line to MAIL, RCPT, DATA or the marker (a permanent refusal, e.g. no such
  mailbox): nothing was delivered and no retry can change that - :class:`MailRejected`, also not
  sent, and it fails the task without spending its retries (fix the item or the server, then Clear);
* after the marker was written, anything but a whole, well-formed reply of 250, 4xx or 5xx (a cut,
  a timeout, a reply cut part-way such as ``25``, an unparsable line, a 252): the server may have the
  message - :class:`MailOutcomeUnknown`; the next run asks ``verify``.

Replies to MAIL, RCPT, DATA and the marker are read as the bytes came (smtplib's ``getreply`` strips
line ends and parses a cut line, so ``25`` of a cut ``250 2.0.0 Ok`` would read as the code 25): a reply
counts only when each of its lines is three digits, then a space, a hyphen or nothing, ended by CRLF.
"""

from __future__ import annotations

import email.policy
import re
import smtplib
from collections.abc import Callable, Iterable, Mapping
from email.message import EmailMessage
from email.utils import formatdate
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.providers.smtp.hooks.smtp import SmtpHook

from airflow_resumable._compat import airflow_fail_exception
from airflow_resumable.exceptions import ArchiveError, MailNotSent, MailOutcomeUnknown
from airflow_resumable.runner import NOT_DELIVERED, InvalidItemError, NotDelivered, StepContext

if TYPE_CHECKING:
    import imaplib

__all__ = ["InvalidMessage", "MailRejected", "SmtpReceiver"]

# A field of the message: a ``str.format`` template over the item's fields ("Invoice {id}"), or a
# callable ``fn(item, ctx)`` returning the text (``ctx.outputs`` holds the item's earlier steps' outputs).
Field = str | Callable[[Mapping[str, Any], StepContext], Any]

_ADDRESS = re.compile(r"^[^@\s<>,;\"]+@[^@\s<>,;\"]+$")
# The part of the server's reply kept in the receipt: enough for its queue id, never a whole banner.
_MAX_REPLY = 200


# Fails the task without spending its retries: a retry would meet the same refusal.
_NoRetry = airflow_fail_exception()


class MailRejected(MailNotSent, _NoRetry):  # type: ignore[misc,valid-type]
    """The server refused the message for good (a 5xx reply): nothing was delivered, and a retry would
    be refused the same way, so the task fails without spending its retries."""

    def __init__(self, stage: str, code: int) -> None:
        super().__init__(stage, f"SMTP {code}", message=f"e-mail refused by the server: {code} at {stage}; nothing "
                         "was delivered. Fix the recipient or the server, then Clear the task")
        self.code = code


class InvalidMessage(MailNotSent, InvalidItemError, _NoRetry):  # type: ignore[misc,valid-type]
    """The item does not make a message (no recipient, a field that is not text, a line break in a
    header): checked before connecting, so nothing was sent, and the task fails without spending its
    retries (the same item would fail the same way)."""

    def __init__(self, item_id: str, problem: str) -> None:
        super().__init__("composing", problem, message=f"item {item_id!r}: {problem}; nothing was sent")


def _check_field(name: str, value: object) -> None:
    if not (isinstance(value, str) or callable(value)):
        raise ValueError(f"SmtpReceiver: {name} must be a str.format template or a callable(item, ctx), "
                         f"not {type(value).__name__}")


def _flag(value: object, what: str) -> bool:
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        value = value.strip().lower() == "true"
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be true or false")
    return value


def _dot_stuffed(message: bytes) -> bytes:
    """The message as DATA carries it: CRLF line ends, a leading '.' doubled, ending in CRLF (the
    marker is written separately)."""
    data = re.sub(rb"\r\n|\n|\r", b"\r\n", message)
    data = re.sub(rb"(?m)^\.", b"..", data)
    return data if data.endswith(b"\r\n") else data + b"\r\n"


def _session_of(hook: SmtpHook) -> smtplib.SMTP | None:
    """The hook's open SMTP session. SmtpHook offers no public accessor: the SMTP provider keeps it in
    ``_smtp_client`` (3.x, beside an async client) or ``smtp_client`` (2.x)."""
    client = getattr(hook, "_smtp_client", None) or getattr(hook, "smtp_client", None)
    return client if isinstance(client, smtplib.SMTP) else None


# One line of a reply as RFC 5321 writes it: three digits, then a space, a hyphen (more lines follow)
# or nothing, the text, and CRLF. The text never holds a line end: readline stops at the first LF.
_REPLY_LINE = re.compile(rb"([0-9]{3})(?:([ -])([^\r\n]*))?\r\n")
# smtplib's own limit on a reply line; a longer one is no reply we can read.
_MAX_REPLY_LINE = 8192


def _read_reply(client: smtplib.SMTP) -> tuple[int | None, bytes]:
    """The server's next reply read from the session's own buffered reader, as its bytes came:
    ``(code, text of its last line)`` when every line is whole and well formed and all carry one code,
    else ``(None, b"")`` - a reply cut part-way (``25`` of ``250 2.0.0 Ok``), a line without its CRLF,
    a line that is not a reply. An error while reading (a timeout, a reset) is raised."""
    if client.file is None:  # smtplib makes the same reader on its first reply; the greeting made it
        assert client.sock is not None
        client.file = client.sock.makefile("rb")
    code: bytes | None = None
    while True:
        line = client.file.readline(_MAX_REPLY_LINE + 1)
        found = _REPLY_LINE.fullmatch(line)
        if found is None or (code is not None and found.group(1) != code):
            return None, b""
        code = found.group(1)
        if found.group(2) != b"-":
            return int(code), found.group(3) or b""


def _refusal(stage: str, code: int) -> MailNotSent:
    """What a whole reply ``code`` that says "not taken" means: a 5xx for good, anything else for now."""
    return MailRejected(stage, code) if 500 <= code < 600 else MailNotSent(stage, f"SMTP {code}")


def _quoted(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


class SmtpReceiver:
    """Send one e-mail per item, never twice, over an Airflow SMTP connection.

    :param smtp_conn_id: Airflow SMTP connection (host, port, login; extra ``disable_tls``,
        ``disable_ssl``, ``timeout``, ``from_email``... as the SMTP provider reads them).
    :param from_email: the sender; default: the connection's extra ``from_email``.
    :param to: the recipient(s): a template over the item's fields (``"{email}"``) or ``fn(item, ctx)``
        returning an address or a list of addresses.
    :param subject: the subject: a template or ``fn(item, ctx)``.
    :param body: the text: a template or ``fn(item, ctx)``.
    :param subtype: ``"plain"`` or ``"html"``.
    :param archive_to: an address that gets a blind copy of every message (a recipient of the SMTP
        envelope, never a header): the archive ``verify`` searches.
    :param imap_conn_id: Airflow IMAP connection of the archive mailbox; without it ``verify`` cannot
        tell (the runner holds every unknown outcome for a human).
    :param archive_mailbox: the IMAP folder holding the archive copies (the copies of ``archive_to``,
        or the Sent folder of a submission server that keeps one).
    :param message_id_domain: the right-hand side of the Message-ID; default: the sender's domain.
    :param archive_authoritative: the archive copy is written before the server answers the
        end-of-data marker, and keeps the Message-ID as sent, so a message the archive lacks was never
        delivered: ``verify`` then answers ``NOT_DELIVERED`` and the runner sends it once instead of
        holding. Default: the IMAP connection's extra ``archive_authoritative``, else False - a server
        that queues and delivers later (most MTAs) may not have filed the copy yet, and a relay that
        rewrites the Message-ID makes "not found" mean nothing (leave it False there).
    """

    def __init__(
        self,
        smtp_conn_id: str = "smtp_default",
        *,
        to: Field,
        subject: Field,
        body: Field,
        from_email: str | None = None,
        subtype: str = "plain",
        archive_to: str | None = None,
        imap_conn_id: str | None = None,
        archive_mailbox: str = "INBOX",
        message_id_domain: str | None = None,
        archive_authoritative: bool | None = None,
    ) -> None:
        for name, value in (("to", to), ("subject", subject), ("body", body)):
            _check_field(name, value)
        if isinstance(to, str) and not to.strip():
            raise ValueError("SmtpReceiver: to is empty; give a template such as '{email}' or a callable")
        for name, address in (("from_email", from_email), ("archive_to", archive_to)):
            if address is not None and not (isinstance(address, str) and _ADDRESS.match(address)):
                raise ValueError(f"SmtpReceiver: {name} must be one e-mail address such as 'name@example.com'")
        if subtype not in ("plain", "html"):
            raise ValueError("SmtpReceiver: subtype must be 'plain' or 'html'")
        if not isinstance(archive_mailbox, str) or not archive_mailbox or not archive_mailbox.isprintable() \
                or not archive_mailbox.isascii():
            raise ValueError("SmtpReceiver: archive_mailbox must be a folder name of printable ASCII characters")
        if imap_conn_id is not None and not isinstance(imap_conn_id, str):
            raise ValueError("SmtpReceiver: imap_conn_id must be a connection id (str) or None")
        if message_id_domain is not None and not (isinstance(message_id_domain, str)
                                                  and re.fullmatch(r"[A-Za-z0-9.-]+", message_id_domain)):
            raise ValueError("SmtpReceiver: message_id_domain must be a domain name such as 'example.com'")
        if archive_authoritative is not None and not isinstance(archive_authoritative, bool):
            raise ValueError("SmtpReceiver: archive_authoritative must be True, False or None "
                             "(None: the connection's extra)")
        self.smtp_conn_id = smtp_conn_id
        self.to, self.subject, self.body, self.subtype = to, subject, body, subtype
        self.from_email = from_email
        self.archive_to = archive_to
        self.imap_conn_id = imap_conn_id
        self.archive_mailbox = archive_mailbox
        self.message_id_domain = message_id_domain
        self._archive_authoritative = archive_authoritative

    # ------------------------------------------------------------------------------- the message

    def message_id(self, ctx: StepContext, sender: str) -> str:
        """``<key@domain>``: the same on every retry of the step, a new one for each key generation."""
        domain = self.message_id_domain or sender.rpartition("@")[2]
        return f"<{ctx.idempotency_key}@{domain}>"

    @staticmethod
    def _render(field: Field, item: Mapping[str, Any], ctx: StepContext, name: str) -> Any:
        try:
            return field(item, ctx) if callable(field) else field.format_map(item)
        except KeyError as exc:
            raise InvalidMessage(ctx.item_id, f"{name} names the field {exc.args[0]!r}, which the item lacks") from None
        except (IndexError, ValueError, AttributeError, TypeError) as exc:
            raise InvalidMessage(ctx.item_id, f"{name} could not be made from the item ({type(exc).__name__})") from None

    def _recipients(self, item: Mapping[str, Any], ctx: StepContext) -> list[str]:
        rendered = self._render(self.to, item, ctx, "to")
        recipients = [rendered] if isinstance(rendered, str) else rendered
        if not isinstance(recipients, Iterable) or isinstance(recipients, (bytes, Mapping)):
            raise InvalidMessage(ctx.item_id, f"to gave a {type(rendered).__name__}, not an address or a list of them")
        recipients = list(recipients)
        if not recipients:
            raise InvalidMessage(ctx.item_id, "no recipient (to is empty)")
        for address in recipients:
            if not isinstance(address, str) or not address.isascii() or not _ADDRESS.match(address.strip()):
                raise InvalidMessage(ctx.item_id, "to holds something that is not one e-mail address (ASCII)")
        return [address.strip() for address in recipients]

    def compose(self, item: Mapping[str, Any], ctx: StepContext) -> tuple[EmailMessage, str, list[str]]:
        """The message for ``item``, its sender and its recipients; :class:`InvalidMessage` if the item
        does not make one. Sends nothing."""
        recipients = self._recipients(item, ctx)
        texts = {name: self._render(field, item, ctx, name) for name, field in
                 (("subject", self.subject), ("body", self.body))}
        for name, text in texts.items():
            if not isinstance(text, str):
                raise InvalidMessage(ctx.item_id, f"{name} gave a {type(text).__name__}, not text")
        try:
            sender = self.from_email or self._smtp_from_email
        except Exception as exc:  # no sender configured, or the connection could not be read: nothing sent
            raise MailNotSent("composing", f"no sender ({type(exc).__name__})") from None
        message = EmailMessage(policy=email.policy.SMTP)
        try:
            message["From"] = sender
            message["To"] = ", ".join(recipients)
            message["Subject"] = texts["subject"]
        except ValueError:  # a CR or LF in a header: never let an item write headers of its own
            raise InvalidMessage(ctx.item_id, "a header holds a line break") from None
        message["Date"] = formatdate(localtime=False)
        message["Message-ID"] = self.message_id(ctx, sender)
        message.set_content(texts["body"], subtype=self.subtype)
        # The archive copy is a recipient of the envelope only: no Bcc header, so no recipient sees it.
        envelope = recipients + ([self.archive_to] if self.archive_to and self.archive_to not in recipients else [])
        return message, sender, envelope

    @cached_property
    def _smtp_from_email(self) -> str:
        sender = SmtpHook(self.smtp_conn_id).get_connection(self.smtp_conn_id).extra_dejson.get("from_email")
        if not (isinstance(sender, str) and _ADDRESS.match(sender)):
            raise ValueError(f"SmtpReceiver: give from_email, or set from_email in the extra of connection "
                             f"{self.smtp_conn_id!r}")
        return sender

    # ------------------------------------------------------------------------------- sending

    def notify(self, item: Mapping[str, Any], ctx: StepContext) -> str:
        message, sender, recipients = self.compose(item, ctx)
        data = _dot_stuffed(message.as_bytes())
        # One session per message: a cut session never carries the next item's message, and threads
        # (concurrency > 1) never share one.
        hook = SmtpHook(self.smtp_conn_id)
        try:
            reply = self._transaction(self._open(hook), sender, recipients, data)
        finally:
            client = _session_of(hook)
            if client is not None:
                try:
                    client.close()  # no QUIT: the message's fate is settled, and QUIT's answer is no news
                except OSError:
                    pass
        return f"{message['Message-ID']} {reply}"

    @staticmethod
    def _open(hook: SmtpHook) -> smtplib.SMTP:
        """A logged-in session (greeting, EHLO, STARTTLS, AUTH as the connection says): nothing of the
        message has been written yet, so any failure here is "not sent"."""
        try:
            hook.get_conn()
        except smtplib.SMTPResponseException as exc:
            if exc.smtp_code >= 500:
                raise MailRejected("connect", exc.smtp_code) from None
            raise MailNotSent("connect", f"SMTP {exc.smtp_code}") from None
        except Exception as exc:  # refused, timed out, TLS, "connection is not found" (AirflowException)
            raise MailNotSent("connect", type(exc).__name__) from None
        client = _session_of(hook)
        if client is None:
            raise MailNotSent("connect", "no SMTP session")
        return client

    @staticmethod
    def _command(client: smtplib.SMTP, stage: str, command: str, ok: tuple[int, ...]) -> None:
        """Send ``command`` before the marker and insist on one of the ``ok`` replies: anything else
        leaves nothing delivered. Only a whole 5xx line is a refusal for good: a cut ``550 5.1.1 no s``
        may be a cut of anything, and a retry is what settles it."""
        client.putcmd(command)
        code, _ = _read_reply(client)
        if code in ok:
            return
        if code is None:
            raise MailNotSent(stage, "a cut or malformed reply")
        raise _refusal(stage, code)

    def _transaction(self, client: smtplib.SMTP, sender: str, recipients: list[str], data: bytes) -> str:
        stage = "EHLO"
        try:
            # Everything up to the last byte of the body: a failure leaves nothing delivered (no server
            # takes a message responsibility before it has read the whole marker).
            client.ehlo_or_helo_if_needed()  # SmtpHook greets only when it starts TLS or logs in
            stage = "MAIL"
            self._command(client, stage, f"MAIL FROM:{smtplib.quoteaddr(sender)}", (250,))
            stage = "RCPT"
            for address in recipients:
                self._command(client, stage, f"RCPT TO:{smtplib.quoteaddr(address)}", (250, 251))
            stage = "DATA"
            self._command(client, stage, "DATA", (354,))
            stage = "the body"
            client.send(data)
            # The marker in a write of its own. If this sendall raises, the marker was not completely
            # written, so the server cannot have ended the DATA: still nothing delivered.
            stage = "the end-of-data marker"
            if client.sock is None:  # the session was closed under us: no marker can have gone out
                raise smtplib.SMTPServerDisconnected("the connection is closed")
            client.sock.sendall(b".\r\n")
        except MailNotSent:
            raise
        except Exception as exc:
            raise MailNotSent(stage, type(exc).__name__) from None
        # The marker is out: from here the server may have the message whatever happens to its reply.
        try:
            code, text = _read_reply(client)
        except Exception as exc:
            raise MailOutcomeUnknown(type(exc).__name__) from None
        if code == 250:
            return f"{code} {text.decode('utf-8', 'replace')[:_MAX_REPLY]}"
        # Only a whole 4xx or 5xx line is the server's word that it did not take the message.
        if code is not None and 400 <= code < 600:
            raise _refusal("end of data", code)
        # A cut or unparsable reply, or a 1xx/2xx/3xx that is not 250: no clear answer.
        raise MailOutcomeUnknown("a cut or malformed reply" if code is None else f"SMTP {code}")

    # ------------------------------------------------------------------------------- verifying

    @cached_property
    def archive_authoritative(self) -> bool:
        """Whether a Message-ID missing from the archive means the message was never delivered."""
        if self._archive_authoritative is not None:
            return self._archive_authoritative
        if self.imap_conn_id is None:
            return False
        from airflow.providers.imap.hooks.imap import ImapHook

        extra = ImapHook(self.imap_conn_id).get_connection(self.imap_conn_id).extra_dejson
        return _flag(extra.get("archive_authoritative", False),
                     f"connection {self.imap_conn_id!r}: extra archive_authoritative")

    def verify(self, ctx: StepContext) -> str | NotDelivered | None:
        if self.imap_conn_id is None:
            return None  # no archive to ask: cannot tell, the runner holds it for a human
        from airflow.providers.imap.hooks.imap import ImapHook  # the email extra; only verify needs it

        message_id = self.message_id(ctx, self.from_email or self._smtp_from_email)
        with ImapHook(self.imap_conn_id) as hook:
            client: imaplib.IMAP4 = hook.mail_client  # type: ignore[assignment]
            status, _ = client.select(_quoted(self.archive_mailbox), readonly=True)
            if status != "OK":
                raise ArchiveError(f"IMAP SELECT of the archive mailbox answered {status}")
            status, found = client.uid("SEARCH", "HEADER", "Message-ID", _quoted(message_id))
            if status != "OK":
                raise ArchiveError(f"IMAP SEARCH answered {status}")
        uids = b" ".join(part for part in found if isinstance(part, bytes)).split()
        if uids:
            return f"{message_id} found in the archive {self.archive_mailbox!r} (IMAP UID {uids[0].decode()})"
        return NOT_DELIVERED if self.archive_authoritative else None
