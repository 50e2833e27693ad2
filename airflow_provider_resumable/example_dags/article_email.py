"""The article's scenario for e-mail: 50 items x 3 steps, the send an e-mail through Airflow's SMTP hook.

* ``article_email``: ResumableBatchOperator with :class:`~airflow_resumable.receivers.smtp.SmtpReceiver`
  (retries=1): a message per item whose Message-ID is derived from its idempotency key, a blind copy
  to the archive address, and ``verify`` searching the archive over IMAP. When item-041's session is
  cut, try 1 fails there and try 2 resumes: a cut before the end-of-data marker is sent again at once;
  a cut after it is looked up in the archive. As in the article, with ``settle_in_task=False`` (the
  defaults would settle the cut in try 1).
* ``article_email_rerun_everything``: the same mails with no journal: a retry mails everyone again.

Connections (their ids can be changed with the environment variables named, read when the DAG file is
parsed - never from a DAG run's conf): ``smtp_default`` (``ARTICLE_EMAIL_SMTP_CONN_ID``), the SMTP
server; ``imap_default`` (``ARTICLE_EMAIL_IMAP_CONN_ID``), the mailbox that receives the archive copies,
with ``{"archive_authoritative": true}`` in its extra if the server files that copy before it answers.
The archive address and folder: ``ARTICLE_EMAIL_ARCHIVE_TO`` (default ``archive@example.test``) and
``ARTICLE_EMAIL_ARCHIVE_MAILBOX`` (default ``Archive``).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import pendulum
from airflow.providers.standard.operators.python import PythonOperator
from airflow.sdk import DAG

from airflow_resumable.operators.resumable_batch import ResumableBatchOperator
from airflow_resumable.receivers.smtp import SmtpReceiver
from airflow_resumable.runner import StepContext, idempotency_key

ITEMS = [{"id": f"item-{i:03d}", "amount": i * 100, "to": f"user{i}@example.test"} for i in range(1, 51)]
START = pendulum.datetime(2026, 1, 1, tz="UTC")
retry_once = {"retries": 1, "retry_delay": timedelta(seconds=0)}

mail = SmtpReceiver(
    os.environ.get("ARTICLE_EMAIL_SMTP_CONN_ID", "smtp_default"),
    from_email="billing@example.test",
    to="{to}",
    subject="Your invoice {id}",
    body=lambda item, ctx: f"Amount due: {ctx.outputs['transform']['cents'] / 100:.2f}\n",
    archive_to=os.environ.get("ARTICLE_EMAIL_ARCHIVE_TO", "archive@example.test"),
    imap_conn_id=os.environ.get("ARTICLE_EMAIL_IMAP_CONN_ID", "imap_default"),
    archive_mailbox=os.environ.get("ARTICLE_EMAIL_ARCHIVE_MAILBOX", "Archive"),
)


def validate(item, ctx):
    time.sleep(0.0015)
    return {"ok": item["amount"] >= 0}


def transform(item, ctx):
    time.sleep(0.0015)
    return {"cents": item["amount"] * 100}


def rerun_everything(**context):
    """No journal: every try mails every item again. Returns the steps this try executed."""
    executed = 0
    job_id = f"article_email_rerun_everything/{context['run_id']}"
    for item in ITEMS:
        outputs: dict = {}
        for name, fn in (("validate", validate), ("transform", transform), ("notify", mail.notify)):
            ctx = StepContext(job_id, item["id"], name, "", idempotency_key(job_id, item["id"], name), outputs)
            outputs[name] = fn(item, ctx)
            executed += 1
    return executed


with DAG("article_email", schedule=None, start_date=START, catchup=False,
         default_args=retry_once, tags=["resumable", "demo", "email"]) as article_email:
    ResumableBatchOperator(task_id="send", items=ITEMS, validate=validate, transform=transform,
                           notify=mail.notify, verify=mail.verify, settle_in_task=False)

with DAG("article_email_rerun_everything", schedule=None, start_date=START, catchup=False,
         default_args=retry_once, tags=["demo", "email"]) as article_email_rerun_everything:
    PythonOperator(task_id="send", python_callable=rerun_everything)
