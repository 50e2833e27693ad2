"""Shared pieces of the test DAGs: the article's 50 items and steps against a durable receiver.

The receiver's SQLite file comes from the RESUMABLE_TEST_RECEIVER environment variable (set by the
tests), never from dag_run.conf. Faults are armed in the receiver's own store, so "fails once"
holds across tries and processes.
"""

from __future__ import annotations

import os
import shutil
import signal
import sqlite3
import threading
from pathlib import Path

from airflow_resumable.runner import NOT_DELIVERED, Step
from tests.support.receivers import AcceptedThenLost, DurableReceiver, RefusedBeforeAccept


def receiver() -> DurableReceiver:
    return DurableReceiver(Path(os.environ["RESUMABLE_TEST_RECEIVER"]))


def items(n: int = 50, prefix: str = "item") -> list[dict]:
    return [{"id": f"{prefix}-{i:03d}", "amount": i * 100, "text": "Hello {{ name }} {% raw %}x"} for i in range(1, n + 1)]


def arm(item_id: str, mode: str) -> None:
    conn = sqlite3.connect(os.environ["RESUMABLE_TEST_RECEIVER"], isolation_level=None)
    conn.execute("CREATE TABLE IF NOT EXISTS faults (item_id TEXT PRIMARY KEY, mode TEXT, fired INTEGER)")
    conn.execute("INSERT OR REPLACE INTO faults VALUES (?, ?, 0)", (item_id, mode))
    conn.close()


def _fire(item_id: str, mode: str) -> bool:
    conn = sqlite3.connect(os.environ["RESUMABLE_TEST_RECEIVER"], isolation_level=None, timeout=30)
    try:
        conn.execute("CREATE TABLE IF NOT EXISTS faults (item_id TEXT PRIMARY KEY, mode TEXT, fired INTEGER)")
        cur = conn.execute(
            "UPDATE faults SET fired = 1 WHERE item_id = ? AND mode = ? AND fired = 0", (item_id, mode)
        )
        return cur.rowcount == 1
    finally:
        conn.close()


def validate(item, ctx):
    return {"ok": item["amount"] >= 0}


def transform(item, ctx):
    return {"cents": item["amount"] * 100}


def _move_journal_away() -> None:
    """As if the retry landed on another worker: this host's journal is gone."""
    journal = os.environ["AIRFLOW__RESUMABLE__JOURNAL_PATH"]
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(journal + suffix):
            os.rename(journal + suffix, journal + suffix + ".elsewhere")


def _switch_shared_journal() -> None:
    """As if the retry were configured with another shared journal: the connection now names another database."""
    os.environ["AIRFLOW_CONN_RESUMABLE_JOURNAL"] = os.environ["RESUMABLE_TEST_OTHER_JOURNAL_CONN"]


def _back_up_journal(how: str = "files") -> None:
    """A backup of this host's journal, taken now: what a restore brings back (SPEC §13). ``files``: its
    file, -wal and -shm copied; ``api``: SQLite's online backup API; ``live``: the files copied by a thread
    while the run goes on."""
    journal = os.environ["AIRFLOW__RESUMABLE__JOURNAL_PATH"]

    def copy_files() -> None:
        for suffix in ("", "-wal", "-shm"):
            if os.path.exists(journal + suffix):
                shutil.copyfile(journal + suffix, journal + ".backup" + suffix)

    if how == "api":
        source, target = sqlite3.connect(journal), sqlite3.connect(journal + ".backup")
        try:
            source.backup(target)
        finally:
            source.close()
            target.close()
    elif how == "live":
        threading.Thread(target=copy_files).start()  # the run does not wait for it
    else:
        copy_files()


def restore_journal_backup() -> None:
    """Bring the backup `_back_up_journal` took back over this host's journal, as a restore does."""
    journal = os.environ["AIRFLOW__RESUMABLE__JOURNAL_PATH"]
    for suffix in ("", "-wal", "-shm"):
        if os.path.exists(journal + suffix):
            os.unlink(journal + suffix)
        if os.path.exists(journal + ".backup" + suffix):
            shutil.copyfile(journal + ".backup" + suffix, journal + suffix)
    os.chmod(journal, 0o600)


def notify(item, ctx):
    for how in ("files", "api", "live"):
        if _fire(ctx.item_id, f"back_up_journal_{how}"):
            _back_up_journal(how)  # this send's mark is committed, the send not made yet
    if _fire(ctx.item_id, "cut_off_standby"):  # the asynchronous standby stops here (this mark included)
        from tests.support.postgres_server import catch_up_and_cut_off

        catch_up_and_cut_off(os.environ["RESUMABLE_TEST_PRIMARY_URL"], os.environ["RESUMABLE_TEST_STANDBY_URL"])
    if _fire(ctx.item_id, "sigkill"):
        os.kill(os.getpid(), signal.SIGKILL)  # the runner dies before this send
    if _fire(ctx.item_id, "before_accept"):
        raise RefusedBeforeAccept()
    if _fire(ctx.item_id, "switch_journal"):
        _switch_shared_journal()
        raise RefusedBeforeAccept()
    if _fire(ctx.item_id, "lose_journal"):
        _move_journal_away()
        raise RefusedBeforeAccept()
    receipt = receiver().deliver(ctx.job_id, ctx.item_id, ctx.step, ctx.idempotency_key, item["text"])
    if _fire(ctx.item_id, "after_accept"):
        raise AcceptedThenLost()
    return receipt


def verify(ctx):
    # Tests model a receiver that records asynchronously: while this flag file exists, its
    # look-up does not answer yet.
    if os.path.exists(os.environ["RESUMABLE_TEST_RECEIVER"] + ".lookup-off"):
        return None
    return receiver().lookup(ctx.idempotency_key)


def verify_three_way(ctx):
    """The receiver's look-up as an authoritative one: it records a delivery before it answers, so an
    unknown key was never delivered."""
    return receiver().lookup(ctx.idempotency_key) or NOT_DELIVERED


def steps(with_verify: bool) -> list[Step]:
    return [
        Step("validate", validate),
        Step("transform", transform),
        Step("notify_external", notify, side_effect=True, verify=verify if with_verify else None),
    ]


def items_bad_once() -> list[dict]:
    """The batch's items; the first time (fault "bad_item" armed on "batch") one of them has no id."""
    batch = items()
    if _fire("batch", "bad_item"):
        batch[0] = {"amount": 1}
    return batch


def unblock_journal(context) -> None:
    """on_retry_callback: the folder the journal goes in was a file (try 1 could not open it); fix it."""
    folder = os.path.dirname(os.environ["AIRFLOW__RESUMABLE__JOURNAL_PATH"])
    if os.path.isfile(folder):
        os.unlink(folder)
