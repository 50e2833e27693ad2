"""The article's scenario for e-mail through real Airflow (`airflow dags test`): dags/article_email.py
mails 50 items through a fault proxy to real mail servers; item 41's session is cut once, in each
fault mode; the retry resumes. Counted over IMAP: every item's mail exactly once."""

from __future__ import annotations

import json
import shutil

import pytest

from airflow_resumable.runner import idempotency_key
from tests.support.airflow_harness import REPO
from tests.support.mail_servers import ARCHIVE_ADDRESS, ARCHIVE_FOLDER, Fault, FaultProxy

pytestmark = pytest.mark.airflow

# How try 2 of the batch settles item-041's send, after try 1 failed there.
MODES = {
    Fault.BEFORE_MARKER: "sent again, not verified",  # (a) provably not sent: no verify, no human
    Fault.AFTER_MARKER: "found in the archive",  # (b) the server had it
    Fault.REPLY_LOST: "found in the archive",  # (c) the server had it, its reply was lost
}


def test_article_email_sends_each_mail_once_whatever_cut_item_41s_session(airflow, mail_servers):
    shutil.copy(REPO / "dags" / "article_email.py", airflow.home / "dags" / "article_email.py")
    proxy = FaultProxy(mail_servers.smtp_port)
    airflow.env["AIRFLOW_CONN_SMTP_DEFAULT"] = json.dumps(mail_servers.smtp_connection(proxy.port))
    airflow.env["AIRFLOW_CONN_IMAP_DEFAULT"] = json.dumps(mail_servers.imap_connection(authoritative=True))
    airflow.env["ARTICLE_EMAIL_ARCHIVE_TO"] = ARCHIVE_ADDRESS
    try:
        for mode, settles in MODES.items():
            armed = proxy.arm(mode, "user41@example.test")
            proc = airflow.dags_test("article_email")
            assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
            assert armed.fired.is_set(), f"{mode.value}: the proxy never cut item-041's session"
            assert airflow.task_states("article_email") == {("send", -1): ("success", 2)}
            summary = airflow.xcom("article_email", "send")
            # Try 2: items 1-40 skipped whole (3 steps each), item-041's local steps skipped, its send
            # either made again (a) or found in the archive (b, c); items 42-50 run (27 steps).
            assert (summary["status"], summary["held"]) == ("completed", [])
            counts = {k: summary[k] for k in ("executed_steps", "skipped_steps", "verified_steps")}
            if settles == "sent again, not verified":
                assert (counts["executed_steps"], counts["skipped_steps"], counts["verified_steps"]) == (28, 122, 0), counts
            else:
                assert (counts["executed_steps"], counts["skipped_steps"], counts["verified_steps"]) == (27, 123, 1), counts
            expected = {f"<{idempotency_key(summary['job_id'], f'item-{i:03d}', 'notify')}@example.test>"
                        for i in range(1, 51)}
            for folder in ("INBOX", ARCHIVE_FOLDER):
                mine = {mid: n for mid, n in mail_servers.message_ids(folder).items() if mid in expected}
                assert mine == dict.fromkeys(expected, 1), f"{mode.value}, {folder}: duplicates or missing mails"
    finally:
        proxy.stop()
