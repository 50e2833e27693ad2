"""The article's experiment for e-mail, end to end through real Airflow: `python -m demo.email`
(or `make demo-email`).

Real mail servers on 127.0.0.1 (an aiosmtpd sink that files each message into a Maildir before it
answers, and Debian's dovecot serving that Maildir over IMAP), a fault proxy that cuts item-041's
SMTP session once, and `airflow dags test` with retries. Every duplicate is counted over IMAP:
messages per Message-ID in the recipients' mailbox.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from airflow_resumable.runner import idempotency_key
from demo.__main__ import print_table
from tests.support.airflow_harness import REPO, Airflow, migrated_template
from tests.support.mail_servers import ARCHIVE_ADDRESS, Fault, FaultProxy, MailServers, missing

MODES = {Fault.BEFORE_MARKER: "cut before the end-of-data marker",
         Fault.REPLY_LOST: "reply lost after the server took it"}
ITEMS = [f"item-{i:03d}" for i in range(1, 51)]


def _airflow(template: Path, tmp: Path, servers: MailServers, proxy: FaultProxy) -> Airflow:
    airflow = Airflow.create(template, tmp)
    airflow.env["AIRFLOW_CONN_SMTP_DEFAULT"] = json.dumps(servers.smtp_connection(proxy.port))
    airflow.env["AIRFLOW_CONN_IMAP_DEFAULT"] = json.dumps(servers.imap_connection(authoritative=True))
    airflow.env["ARTICLE_EMAIL_ARCHIVE_TO"] = ARCHIVE_ADDRESS
    return airflow


def _must(proc: subprocess.CompletedProcess[str], what: str) -> None:
    if proc.returncode != 0:
        sys.exit(f"demo step failed: {what}\n{(proc.stdout + proc.stderr)[-4000:]}")


def _mails(servers: MailServers, job_id: str, step: str) -> Counter[str]:
    """Messages in the recipients' mailbox per item of ``job_id``, read over IMAP."""
    by_id = {f"<{idempotency_key(job_id, item, step)}@example.test>": item for item in ITEMS}
    return Counter({by_id[mid]: n for mid, n in servers.message_ids("INBOX").items() if mid in by_id})


def _stats(mails: Counter[str]) -> dict:
    return {"items": len(mails), "duplicates": sum(mails.values()) - len(mails)}


def baseline(template: Path, tmp: Path, servers: MailServers, proxy: FaultProxy, mode: Fault) -> dict:
    airflow = _airflow(template, tmp, servers, proxy)
    proxy.arm(mode, "user41@example.test")
    _must(airflow.dags_test("article_email_rerun_everything"), "re-run-everything DAG")
    job_id = f"article_email_rerun_everything/{airflow.last_run_id('article_email_rerun_everything')}"
    return {"executed": airflow.xcom("article_email_rerun_everything", "send"),
            "stats": _stats(_mails(servers, job_id, "notify"))}


def resumable(template: Path, tmp: Path, servers: MailServers, proxy: FaultProxy, mode: Fault) -> dict:
    airflow = _airflow(template, tmp, servers, proxy)
    proxy.arm(mode, "user41@example.test")
    _must(airflow.dags_test("article_email"), "resumable e-mail DAG")
    second = airflow.xcom("article_email", "send")
    return {"second": second, "stats": _stats(_mails(servers, second["job_id"], "notify"))}


def main() -> None:
    problem = missing()
    if problem:
        sys.exit(problem.replace("tests SKIPPED", "demo cannot run"))
    started = time.perf_counter()
    servers = MailServers()
    proxy = FaultProxy(servers.smtp_port)
    try:
        with tempfile.TemporaryDirectory(prefix="resumable-demo-email-") as tmpdir:
            root = Path(tmpdir)
            print("Setting up Airflow (SQLite metadata DB) in", root, flush=True)
            template = migrated_template(root, [REPO / "dags" / "article_email.py"])
            results = {}
            for mode, label in MODES.items():
                print(f"Mailing the article's 50 items, item-041's session {label} ...", flush=True)
                results[mode] = (baseline(template, root / f"plain-{mode.value}", servers, proxy, mode),
                                 resumable(template, root / f"resumable-{mode.value}", servers, proxy, mode))
    finally:
        proxy.stop()
        servers.stop()
    rows = [("", "re-send everything", "resumable (this provider)")]
    for mode, (plain, ours) in results.items():
        s2 = ours["second"]
        rows += [
            (f"[{MODES[mode]}]", "", ""),
            ("steps executed on re-run", str(plain["executed"]), f"2nd try: {s2['executed_steps']}"),
            ("steps skipped on re-run", "0", f"2nd try: {s2['skipped_steps']}"),
            ("duplicate mails (IMAP count)", str(plain["stats"]["duplicates"]), str(ours["stats"]["duplicates"])),
            ("items mailed", str(plain["stats"]["items"]), str(ours["stats"]["items"])),
            ("item-041", "mailed again blindly",
             "provably not sent: mailed again, no verify, no human" if mode == Fault.BEFORE_MARKER
             else f"found in the archive by IMAP ({s2['verified_steps']} verified), not mailed again"),
        ]
    print_table(rows, started)


if __name__ == "__main__":
    main()
