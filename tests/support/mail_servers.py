"""Throwaway mail servers for the e-mail tests, and a TCP proxy that cuts SMTP sessions where we say.

* :class:`SmtpSink`: ``aiosmtpd`` (PyPI) in a process of its own, on a free 127.0.0.1 port. It writes
  every accepted message into a Maildir - once per recipient: the archive address's copy into the
  folder ``Archive``, every other recipient's into ``INBOX`` - *before* it answers the end-of-data
  marker, so its archive is authoritative. Recipients whose local part starts with ``reject`` are
  refused with a 550, ``later`` with a 451. (Why not Debian's postfix: a throwaway postfix instance
  answers the marker once the message is *queued* and delivers it afterwards, so its Maildir could
  not be the authoritative archive the tests need, and running one outside /etc/postfix as root in
  a temporary folder takes a master, a queue tree and a chroot of its own.)
* :class:`Dovecot`: Debian's ``dovecot-imapd`` serving that Maildir over plain IMAP on another free
  port (``dovecot -F -c <throwaway config>``), one passwd-file user. Stopped afterwards with its whole
  process group.
* :class:`FaultProxy`: threads in the test's process between the SMTP client and the sink, relaying
  a plain SMTP session command by command. Armed for one recipient, it cuts that message's session at
  one of the points of :class:`Fault`, optionally pausing there first so a test can SIGKILL the
  sending process at exactly that point.

``python -m tests.support.mail_servers smtp ...`` runs the sink; ``python -m tests.support.mail_servers send ...`` is
the batch process the crash tests kill (see :func:`_send_main`).
"""

from __future__ import annotations

import argparse
import enum
import imaplib
import json
import os
import pwd
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # this file is tests/support/<name>.py
ARCHIVE_FOLDER = "Archive"
ARCHIVE_ADDRESS = "archive@mail.test"
IMAP_USER, IMAP_PASSWORD = "mail", "mail-secret"
HOW_TO_ENABLE = ("e-mail tests SKIPPED: Debian's dovecot-imapd is not installed (apt-get install dovecot-imapd), "
                 "or aiosmtpd is missing (pip install -e '.[test]')")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def missing() -> str | None:
    """Why the mail servers cannot run here, or None."""
    if shutil.which("dovecot") is None and not Path("/usr/sbin/dovecot").exists():
        return HOW_TO_ENABLE
    try:
        import aiosmtpd  # noqa: F401
    except ImportError:
        return HOW_TO_ENABLE
    return None


def _mail_owner() -> tuple[int, int, str]:
    """Who owns the mail: as root, Debian's ``mail`` user (dovecot refuses to serve mail as root)."""
    if os.geteuid() == 0:
        entry = pwd.getpwnam("mail")
        return entry.pw_uid, entry.pw_gid, entry.pw_name
    return os.getuid(), os.getgid(), pwd.getpwuid(os.getuid()).pw_name


def _end(proc: subprocess.Popen, *, grace: float) -> None:
    """SIGTERM, and SIGKILL if ``proc`` is still there after ``grace`` seconds."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _wait_for_port(port: int, proc: subprocess.Popen, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            detail = log.read_text(errors="replace")[-3000:] if log and log.exists() else ""
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting\n{detail}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on 127.0.0.1:{port} within 30 s")


# ------------------------------------------------------------------------------------ the SMTP sink


class SmtpSink:
    """aiosmtpd in its own process, delivering into ``maildir`` before it answers the marker."""

    def __init__(self, maildir: Path) -> None:
        self.port = free_port()
        self.log = maildir.parent / "smtp-sink.log"
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.support.mail_servers", "smtp", "--port", str(self.port),
                 "--maildir", str(maildir), "--archive", ARCHIVE_ADDRESS],
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
            )
        _wait_for_port(self.port, self.proc, "the SMTP sink", self.log)

    def stop(self) -> None:
        _end(self.proc, grace=10)


def _sink_main(args: argparse.Namespace) -> None:
    import mailbox

    from aiosmtpd.controller import Controller

    root = mailbox.Maildir(args.maildir, create=True)
    # Dovecot's Maildir++ layout: a folder is a ".Name" sub-Maildir of the user's root.
    folders = {"inbox": root, "archive": root.add_folder(ARCHIVE_FOLDER)}
    archive = args.archive.lower()

    class Deliver:
        async def handle_RCPT(self, server, session, envelope, address, rcpt_options):  # noqa: N802
            local = address.partition("@")[0].lower()
            if local.startswith("reject"):
                return "550 5.1.1 Recipient address rejected: no such user"
            if local.startswith("later"):
                return "451 4.3.0 Try again later"
            envelope.rcpt_tos.append(address)
            return "250 2.1.5 Ok"

        async def handle_DATA(self, server, session, envelope):  # noqa: N802
            # Written to the Maildir before the 250 goes out: that is what makes the archive authoritative.
            for rcpt in envelope.rcpt_tos:
                folders["archive" if rcpt.lower() == archive else "inbox"].add(envelope.original_content)
            return f"250 2.0.0 Ok: queued as {uuid.uuid4().hex[:12].upper()}"

    controller = Controller(Deliver(), hostname="127.0.0.1", port=args.port, decode_data=False)
    controller.start()
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopped.set())
    print(f"smtp sink on 127.0.0.1:{args.port}", flush=True)
    stopped.wait()
    controller.stop()


# --------------------------------------------------------------------------------------- dovecot

_DOVECOT_CONF = """\
protocols = imap
listen = 127.0.0.1
base_dir = {root}/run
state_dir = {root}/state
instance_name = resumable-test-{port}
log_path = {root}/dovecot.log
ssl = no
disable_plaintext_auth = no
auth_mechanisms = plain login
default_internal_user = {internal_user}
default_login_user = {login_user}
first_valid_uid = {uid}
last_valid_uid = {uid}
mail_uid = {uid}
mail_gid = {gid}
mail_location = maildir:{mailroot}/%u
mail_fsync = never
passdb {{
  driver = passwd-file
  args = scheme=PLAIN username_format=%u {root}/passwd
}}
userdb {{
  driver = static
  args = uid={uid} gid={gid} home={mailroot}/%u
}}
service imap-login {{
  chroot =
  inet_listener imap {{
    address = 127.0.0.1
    port = {port}
  }}
  inet_listener imaps {{
    port = 0
  }}
}}
service anvil {{
  chroot =
}}
"""


class Dovecot:
    """Debian's dovecot serving ``mailroot/<user>`` (Maildir) over plain IMAP on 127.0.0.1."""

    def __init__(self, root: Path, mailroot: Path) -> None:
        self.root, self.port = root, free_port()
        uid, gid, name = _mail_owner()
        as_root = os.geteuid() == 0
        (root / "run").mkdir(mode=0o755)
        (root / "state").mkdir()
        (root / "passwd").write_text(f"{IMAP_USER}:{{PLAIN}}{IMAP_PASSWORD}\n")
        self.config = root / "dovecot.conf"
        self.config.write_text(_DOVECOT_CONF.format(
            root=root, port=self.port, uid=uid, gid=gid, mailroot=mailroot,
            internal_user="dovecot" if as_root else name, login_user="dovenull" if as_root else name))
        binary = shutil.which("dovecot") or "/usr/sbin/dovecot"
        # A session of its own: stop() ends the master and every process it started, by that group id.
        self.proc = subprocess.Popen([binary, "-F", "-c", str(self.config)], stdout=subprocess.DEVNULL,
                                     stderr=(root / "dovecot.stderr").open("w"), start_new_session=True)
        _wait_for_port(self.port, self.proc, "dovecot", root / "dovecot.log")

    def stop(self) -> None:
        _end(self.proc, grace=15)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # any child the master left behind
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------------------ both, and counting


class MailServers:
    """The sink and dovecot over one Maildir, in a throwaway folder; :meth:`stop` removes everything."""

    def __init__(self) -> None:
        problem = missing()
        if problem:
            raise RuntimeError(problem)
        uid, gid, _ = _mail_owner()
        # Not under pytest's 0700 tmp folders: the mail user must reach the Maildir.
        self.root = Path(tempfile.mkdtemp(prefix="resumable-mail-"))
        os.chmod(self.root, 0o755)
        self.mailroot = self.root / "mail"
        self.mailroot.mkdir()
        os.chown(self.mailroot, uid, gid)
        self.sink: SmtpSink | None = None
        self.dovecot: Dovecot | None = None
        # The Maildir and its archive folder belong to the mail user; the sink (which may run as root:
        # the venv's interpreter need not be reachable by that user) adds world-readable files to them.
        import mailbox

        mailbox.Maildir(self.mailroot / IMAP_USER, create=True).add_folder(ARCHIVE_FOLDER)
        for folder, _, files in os.walk(self.mailroot):
            os.chown(folder, uid, gid)
            for name_ in files:
                os.chown(os.path.join(folder, name_), uid, gid)
        try:
            self.sink = SmtpSink(self.mailroot / IMAP_USER)
            self.dovecot = Dovecot(self.root, self.mailroot)
        except BaseException:
            self.stop()
            raise

    @property
    def smtp_port(self) -> int:
        assert self.sink is not None
        return self.sink.port

    @property
    def imap_port(self) -> int:
        assert self.dovecot is not None
        return self.dovecot.port

    def smtp_connection(self, port: int | None = None) -> dict:
        """An Airflow SMTP connection (for ``AIRFLOW_CONN_...``) to the sink, or to ``port`` (a proxy)."""
        return {"conn_type": "smtp", "host": "127.0.0.1", "port": port or self.smtp_port,
                "extra": {"disable_tls": True, "disable_ssl": True, "retry_limit": 1, "timeout": 10}}

    def imap_connection(self, *, authoritative: bool | None = True) -> dict:
        extra: dict = {"use_ssl": False}
        if authoritative is not None:
            extra["archive_authoritative"] = authoritative
        return {"conn_type": "imap", "host": "127.0.0.1", "port": self.imap_port,
                "login": IMAP_USER, "password": IMAP_PASSWORD, "extra": extra}

    def message_ids(self, folder: str = "INBOX") -> Counter[str]:
        """How many messages ``folder`` holds per Message-ID, read over IMAP."""
        with imaplib.IMAP4("127.0.0.1", self.imap_port) as imap:
            imap.login(IMAP_USER, IMAP_PASSWORD)
            typ, data = imap.select(f'"{folder}"', readonly=True)
            assert typ == "OK", data
            if int(data[0]) == 0:
                return Counter()
            typ, fetched = imap.fetch("1:*", "(BODY.PEEK[HEADER.FIELDS (MESSAGE-ID)])")
            assert typ == "OK", fetched
        ids = []
        for part in fetched:
            if isinstance(part, tuple):
                found = re.search(rb"<[^>]+>", part[1])
                ids.append(found.group(0).decode() if found else "(none)")
        return Counter(ids)

    def stop(self) -> None:
        try:
            if self.dovecot is not None:
                self.dovecot.stop()
        finally:
            if self.sink is not None:
                self.sink.stop()
            shutil.rmtree(self.root, ignore_errors=True)


# ------------------------------------------------------------------------------- the fault proxy


class Fault(str, enum.Enum):
    """Where the proxy cuts the armed message's session (both sides closed unless said otherwise)."""

    # (a) The server answered DATA with 354; the proxy never relays it. The client has not written
    # a byte of the message: nothing can be delivered, and the client knows it.
    BEFORE_MARKER = "before_marker"
    # (a) while the client writes the body: the proxy reads the first bytes and resets the connection
    # (the body must be larger than the socket buffers for the client's write to fail).
    BODY_CUT = "body_cut"
    # The client wrote the body and the end-of-data marker; the proxy forwards the body but never the
    # marker. The server delivers nothing, but the client cannot know that: its outcome is unknown.
    MARKER_LOST = "marker_lost"
    # (b) The marker reaches the server and the client side is cut at once, before the server has
    # answered; the server side stays open until the server's reply comes (proof it saw the marker).
    AFTER_MARKER = "after_marker"
    # (c) The server answered the marker (the message is delivered); the proxy drops that reply.
    REPLY_LOST = "reply_lost"
    # The server's reply to the armed stage (MAIL, RCPT, DATA or the marker) reaches the client only up
    # to its first `keep` bytes, then both sides are closed. The server did what it answered.
    REPLY_CUT = "reply_cut"
    # The client gets `answer` instead of the server's reply to the armed stage, then both sides are
    # closed. forward=False: the server never sees the command (for the marker: nothing is delivered).
    REPLY_FORGED = "reply_forged"


@dataclass
class Armed:
    """One armed fault: fires on the first message with ``rcpt`` among its recipients."""

    fault: Fault
    rcpt: str  # "*": any message
    pause: bool = False
    stage: bytes = b"."  # REPLY_CUT / REPLY_FORGED: b"greeting", b"EHLO", b"MAIL", b"RCPT", b"DATA", b"." (the marker)
    keep: int = 0  # REPLY_CUT: how many bytes of the reply reach the client
    answer: bytes = b""  # REPLY_FORGED: what the client reads instead
    forward: bool = True  # REPLY_FORGED: whether the server sees the command
    fired: threading.Event = field(default_factory=threading.Event)
    paused: threading.Event = field(default_factory=threading.Event)
    released: threading.Event = field(default_factory=threading.Event)
    # The server has answered the marker (it filed the message first). A retry comes after that, as
    # Airflow's comes after its retry_delay: an authoritative archive is asked once the server is done.
    answered: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()


class _Cut(Exception):
    """The session ends here (a fault fired, or one side went away)."""


class _Side:
    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise _Cut
        self.buf += chunk

    def take(self, n: int) -> bytes:
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        return self.take(self.buf.index(b"\r\n") + 2)

    def reply(self) -> bytes:
        """A whole SMTP reply: lines "NNN-..." up to the last, "NNN ..."."""
        lines = b""
        while True:
            line = self.line()
            lines += line
            if len(line) < 4 or line[3:4] != b"-":
                return lines

    def data(self) -> bytes:
        """The message as the client sent it, up to and including the end-of-data marker."""
        while True:
            found = (b"\r\n" + self.buf).find(b"\r\n.\r\n")
            if found >= 0:
                return self.take(found + 3)
            self._fill()

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


class FaultProxy:
    """A plain-SMTP relay on a free 127.0.0.1 port to ``upstream_port``; :meth:`arm` injects a fault."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self._armed: list[Armed] = []
        self._lock = threading.Lock()
        self._sessions: list[tuple[_Side, _Side]] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="fault-proxy").start()

    def arm(self, fault: Fault | str, rcpt: str, *, pause: bool = False, stage: str = ".", keep: int = 0,
            answer: bytes = b"", forward: bool = True) -> Armed:
        """Fire ``fault`` on the first message to ``rcpt`` ("*": any; only "*" can fire before RCPT)."""
        if stage not in ("greeting", "EHLO", "MAIL", "RCPT", "DATA", "."):
            raise ValueError(f"no such stage {stage!r}")
        armed = Armed(Fault(fault), rcpt.lower(), pause, stage.encode(), keep, answer, forward)
        with self._lock:
            self._armed.append(armed)
        return armed

    def disarm(self) -> None:
        """Forget the faults that did not fire."""
        with self._lock:
            self._armed.clear()

    def _take(self, rcpts: list[str], stage: bytes = b".") -> Armed | None:
        with self._lock:
            for armed in self._armed:
                if armed.stage == stage and (armed.rcpt in rcpts or armed.rcpt == "*"):
                    self._armed.remove(armed)
                    return armed
        return None

    def _answer(self, client: _Side, armed: Armed, reply: bytes) -> None:
        """What a REPLY_CUT or REPLY_FORGED lets the client read of ``reply``; the session then ends."""
        armed.fired.set()  # before the client can read it: the test looks right after the client fails
        client.sock.sendall(reply[:armed.keep] if armed.fault == Fault.REPLY_CUT else armed.answer)
        self._hold(armed)
        raise _Cut

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._session, args=(client,), daemon=True).start()

    def _session(self, client_sock: socket.socket) -> None:
        client = _Side(client_sock)
        try:
            server = _Side(socket.create_connection(("127.0.0.1", self.upstream_port), timeout=30))
        except OSError:
            client.close()
            return
        client.sock.settimeout(60)
        with self._lock:
            self._sessions.append((client, server))
        try:
            self._relay(client, server)
        except (_Cut, OSError):
            pass
        finally:
            client.close()
            server.close()

    @staticmethod
    def _hold(armed: Armed) -> None:
        armed.fired.set()
        if armed.pause:
            armed.paused.set()
            armed.released.wait(120)

    def _relay(self, client: _Side, server: _Side) -> None:
        greeting = server.reply()
        armed = self._take([], b"greeting")
        if armed:
            self._answer(client, armed, greeting)
        client.sock.sendall(greeting)
        rcpts: list[str] = []
        while True:
            command = client.line()
            verb = command[:4].upper()
            if verb == b"MAIL":
                rcpts = []
            elif verb == b"RCPT":
                found = re.search(rb"<([^>]*)>", command)
                rcpts.append(found.group(1).decode("ascii", "replace").lower() if found else "")
            armed = self._take(rcpts, verb) if verb in (b"EHLO", b"MAIL", b"RCPT", b"DATA") else None
            if armed and not armed.forward:
                self._answer(client, armed, b"")
            server.sock.sendall(command)
            answer = server.reply()
            if armed:
                self._answer(client, armed, answer)
            if verb == b"DATA" and answer.startswith(b"354"):
                self._message(client, server, answer, self._take(rcpts))
                continue
            client.sock.sendall(answer)
            if verb == b"QUIT":
                return

    def _message(self, client: _Side, server: _Side, go_ahead: bytes, armed: Armed | None) -> None:
        fault = armed.fault if armed else None
        if armed and fault == Fault.BEFORE_MARKER:
            self._hold(armed)
            raise _Cut
        client.sock.sendall(go_ahead)
        if armed and fault == Fault.BODY_CUT:
            client._fill()  # the client has started writing the message
            self._hold(armed)
            # A reset, not a FIN: the client's write in progress fails instead of filling our buffer.
            client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            raise _Cut
        data = client.data()
        if armed and fault in (Fault.REPLY_CUT, Fault.REPLY_FORGED):
            if not armed.forward:
                server.sock.sendall(data[:-3])  # the body, never the marker: nothing is delivered
                self._answer(client, armed, b"")
            server.sock.sendall(data)
            reply = server.reply()
            armed.answered.set()
            self._answer(client, armed, reply)
        if armed and fault == Fault.MARKER_LOST:
            server.sock.sendall(data[:-3])  # the body, never the marker
            self._hold(armed)
            raise _Cut
        server.sock.sendall(data)
        if armed and fault == Fault.AFTER_MARKER:
            if armed.pause:
                self._hold(armed)
            else:
                armed.fired.set()
            client.close()
            server.reply()  # the server saw the marker and answered it: the message is delivered
            armed.answered.set()
            raise _Cut
        answer = server.reply()
        if armed and fault == Fault.REPLY_LOST:
            armed.answered.set()
            self._hold(armed)
            raise _Cut
        client.sock.sendall(answer)

    def stop(self) -> None:
        self._closed = True
        self.listener.close()
        with self._lock:
            for armed in self._armed:
                armed.release()
            for client, server in self._sessions:
                client.close()
                server.close()


# ------------------------------------------------------------------------- a batch process to kill


def items(count: int, domain: str = "example.test") -> list[dict]:
    return [{"id": f"item-{i:03d}", "to": f"user{i}@{domain}", "amount": i * 100} for i in range(1, count + 1)]


def _send_main(args: argparse.Namespace) -> None:
    """Run one batch of e-mails (connections from AIRFLOW_CONN_MAIL_SMTP / AIRFLOW_CONN_MAIL_IMAP).

    The last stdout line is a JSON summary. Exit 0: completed; 3: something held; 5: a send failed."""
    sys.path.insert(0, str(REPO))
    from airflow_resumable.journal import StepJournal
    from airflow_resumable.receivers.smtp import SmtpReceiver
    from airflow_resumable.runner import Step, run_batch

    receiver = SmtpReceiver("mail_smtp", from_email="batch@example.test", to="{to}",
                            subject="Invoice {id}", body="Amount: {amount}", archive_to=ARCHIVE_ADDRESS,
                            imap_conn_id="mail_imap", archive_mailbox=ARCHIVE_FOLDER)
    steps = [Step("send_mail", receiver.notify, side_effect=True, verify=receiver.verify)]
    with StepJournal(args.journal) as journal:
        try:
            result = run_batch(journal, args.job, items(args.count, args.domain), steps, settle_in_task=False)
        except Exception as exc:  # noqa: BLE001 - the parent reads the type
            print(json.dumps({"error": type(exc).__name__}), flush=True)
            sys.exit(5)
    print(json.dumps({"status": result.status, "executed": result.executed_steps,
                      "verified": result.verified_steps, "resent": result.resent_steps,
                      "held": [h.item_id for h in result.held]}), flush=True)
    sys.exit(3 if result.held else 0)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.support.mail_servers")
    commands = parser.add_subparsers(dest="command", required=True)
    smtp = commands.add_parser("smtp", help="run the SMTP sink")
    smtp.add_argument("--port", type=int, required=True)
    smtp.add_argument("--maildir", required=True)
    smtp.add_argument("--archive", required=True)
    send = commands.add_parser("send", help="run one batch of e-mails")
    send.add_argument("--journal", required=True)
    send.add_argument("--job", required=True)
    send.add_argument("--count", type=int, default=10)
    send.add_argument("--domain", default="example.test")
    args = parser.parse_args()
    _sink_main(args) if args.command == "smtp" else _send_main(args)


if __name__ == "__main__":
    main()
