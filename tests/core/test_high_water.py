"""A journal that went back in time is refused before it sends (SPEC §13), through ``run_batch``.

Real SQLite files copied, backed up with SQLite's online backup API and copied while the run goes on;
the high-water mark kept in a JSON file (the operator keeps it in Airflow's task state store, tested
under ``tests/airflow_layer``). The receiver counts every delivery per idempotency key: duplicates and
lost items are read from it, never from the journal.
"""

from __future__ import annotations

import base64
import json
import shutil
import sqlite3
import threading
from pathlib import Path

import pytest

from airflow_resumable.exceptions import JournalBehindError
from airflow_resumable.journal import HeldReason, Status, StepJournal
from airflow_resumable.runner import NOT_DELIVERED, Step, run_batch
from airflow_resumable.runner.high_water import WINDOW_MAX, item_hash

pytestmark = pytest.mark.core

JOB = "high-water/job"
N = 200
ITEMS = [{"id": f"cust-{n:03d}"} for n in range(N)]


class Killed(BaseException):
    """The runner's process dying, as far as this process can tell it."""


class FileStore:
    """The mark kept in a JSON file, replaced atomically; ``dead``: the process is gone, nothing lands."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.writes = 0
        self.dead = False
        self.after_write = None

    def read(self):
        return json.loads(self.path.read_text()) if self.path.exists() else None

    def write(self, record) -> None:
        if self.dead:
            raise Killed()
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(self.path)
        self.writes += 1
        if self.after_write is not None:
            self.after_write(record)


class Receiver:
    """Counts deliveries per key; its look-up is authoritative (a delivery is recorded before it answers)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.kill_at: str | None = None
        self.before_send = None
        self.lock = threading.Lock()

    def send(self, item, ctx):
        if self.before_send is not None:
            self.before_send(item["id"])
        if item["id"] == self.kill_at:
            raise Killed()
        with self.lock:  # one key per item here (no new generation is started): counted per item
            self.counts[ctx.item_id] = self.counts.get(ctx.item_id, 0) + 1
        return f"rcpt-{ctx.item_id}"

    def three_way(self, ctx):
        return f"rcpt-{ctx.item_id}" if ctx.item_id in self.counts else NOT_DELIVERED

    def duplicates(self) -> int:
        return sum(n - 1 for n in self.counts.values())

    def sent(self) -> int:
        return sum(self.counts.values())


def steps(receiver: Receiver, *, verify: bool = True) -> list[Step]:
    return [
        Step("validate", lambda item, ctx: True),
        Step("notify", receiver.send, side_effect=True, verify=receiver.three_way if verify else None),
    ]


def copy_files(src: Path, dst: Path) -> None:
    """The journal's file and its -wal and -shm, as a file-level backup copies them."""
    for suffix in ("", "-wal", "-shm"):
        part = Path(f"{src}{suffix}")
        if part.exists():
            shutil.copyfile(part, f"{dst}{suffix}")


def restore(backup: Path, db: Path) -> None:
    for suffix in ("", "-wal", "-shm"):
        Path(f"{db}{suffix}").unlink(missing_ok=True)
        if Path(f"{backup}{suffix}").exists():
            shutil.copyfile(f"{backup}{suffix}", f"{db}{suffix}")
    db.chmod(0o600)


def backup_api(src: Path, dst: Path) -> None:
    source, target = sqlite3.connect(src), sqlite3.connect(dst)
    try:
        source.backup(target)
    finally:
        source.close()
        target.close()


def first_run_with_a_backup(tmp_path: Path, how: str, receiver: Receiver, store: FileStore, concurrency: int) -> Path:
    """Run until item 151 (150 delivered), the journal backed up while item 81's mark was committed and its
    send not yet made; return the backup."""
    db, backup = tmp_path / "journal.db", tmp_path / "backup.db"
    copier: list[threading.Thread] = []

    def at_send(item_id: str) -> None:
        if item_id != "cust-081":
            return
        if how == "files":
            copy_files(db, backup)
        elif how == "backup_api":
            backup_api(db, backup)
        else:  # "while_running": the copy goes on beside the run, which does not wait for it
            thread = threading.Thread(target=copy_files, args=(db, backup))
            thread.start()
            copier.append(thread)

    receiver.before_send, receiver.kill_at = at_send, "cust-151"
    with StepJournal(db) as journal, pytest.raises(Killed):
        run_batch(journal, JOB, ITEMS, steps(receiver), high_water=store, concurrency=concurrency,
                  runner="first try")
    for thread in copier:
        thread.join()
    receiver.before_send = receiver.kill_at = None
    return backup


@pytest.mark.parametrize("how", ["files", "backup_api", "while_running"])
def test_a_restored_sqlite_journal_is_refused_then_verify_settles_it_with_nothing_sent_twice(tmp_path, how):
    receiver, store = Receiver(), FileStore(tmp_path / "mark.json")
    backup = first_run_with_a_backup(tmp_path, how, receiver, store, concurrency=1)
    delivered = dict(receiver.counts)
    assert len(delivered) >= 150 and receiver.duplicates() == 0
    db = tmp_path / "journal.db"
    restore(backup, db)
    with StepJournal(db) as journal:
        before = journal.marks(JOB)
        assert before < store.read()["marks"], "the backup must be behind the mark for this test to mean anything"

        with pytest.raises(JournalBehindError) as refused:
            run_batch(journal, JOB, ITEMS, steps(receiver), high_water=store)
        error = refused.value
        assert (error.journal_marks, error.stored_marks) == (before, store.read()["marks"])
        assert error.recorded_by == "first try" and error.recorded_at
        message = str(error)
        for words in (str(db), "restored", "on_journal_behind='verify'", "Nothing was sent"):
            assert words in message, message
        assert receiver.counts == delivered  # nothing sent
        assert journal.marks(JOB) == before  # the journal unchanged
        # Refused again on the next try: the stored mark is not moved by a refusal.
        with pytest.raises(JournalBehindError):
            run_batch(journal, JOB, ITEMS, steps(receiver), high_water=store)

        result = run_batch(journal, JOB, ITEMS, steps(receiver), high_water=store, on_journal_behind="verify")
        assert result.status == "completed"
        assert receiver.duplicates() == 0, f"{receiver.duplicates()} items sent twice"
        assert len(receiver.counts) == N  # none lost
        assert result.verified_steps >= len(delivered) - before  # what the journal forgot, found at the receiver
        # Re-based: the next run (refusing again) is not refused and sends nothing.
        assert store.read()["behind"] is None and store.read()["marks"] == journal.marks(JOB)
        again = run_batch(journal, JOB, ITEMS, steps(receiver), high_water=store)
        assert again.executed_steps == 0 and receiver.sent() == N


def test_without_a_mark_the_restored_journal_sends_again_blindly(tmp_path):
    """What the mark prevents: the same restore with no mark kept re-sends what the journal forgot."""
    receiver, store = Receiver(), FileStore(tmp_path / "mark.json")
    backup = first_run_with_a_backup(tmp_path, "files", receiver, store, concurrency=1)
    restore(backup, tmp_path / "journal.db")
    with StepJournal(tmp_path / "journal.db") as journal:
        run_batch(journal, JOB, ITEMS, [Step("validate", lambda i, c: True),
                                        Step("notify", receiver.send, side_effect=True)])
    assert receiver.duplicates() >= 60


def test_a_journal_behind_in_verify_mode_that_fails_again_stays_in_verify_mode(tmp_path):
    receiver, store = Receiver(), FileStore(tmp_path / "mark.json")
    backup = first_run_with_a_backup(tmp_path, "files", receiver, store, concurrency=4)
    db = tmp_path / "journal.db"
    restore(backup, db)
    with StepJournal(db) as journal:
        receiver.kill_at = "cust-170"  # dies again before it finished the batch
        with pytest.raises(Killed):
            run_batch(journal, JOB, ITEMS, steps(receiver), high_water=store, on_journal_behind="verify", concurrency=4)
        assert store.read()["behind"] is not None, "the mark must not be re-based by a run that did not finish"
        receiver.kill_at = None
        with pytest.raises(JournalBehindError):
            run_batch(journal, JOB, ITEMS, steps(receiver), high_water=store)
        run_batch(journal, JOB, ITEMS, steps(receiver), high_water=store, on_journal_behind="verify", concurrency=4)
    assert receiver.duplicates() == 0 and len(receiver.counts) == N


def _window(record: dict) -> set[bytes]:
    raw = base64.b64decode(record["window"])
    return {raw[i:i + 8] for i in range(0, len(raw), 8)}


def reboot(monkeypatch, tmp_path: Path) -> None:
    """The journal's host starts again (a crash): a new boot id."""
    from airflow_resumable.journal import sqlite as journal_sqlite

    boot = tmp_path / "boot_id"
    boot.write_text("after-the-crash\n")
    monkeypatch.setattr(journal_sqlite, "BOOT_ID", str(boot))


def run_killed_after_the_first_record(journal: StepJournal, receiver: Receiver, store: FileStore, *,
                                      verify: bool, at_record=None) -> list[dict]:
    """Run until the process dies: the first record lands (``at_record(record)`` is called then), no
    other does, and the run stops when it needs the next. Returns the records that landed."""
    landed: list[dict] = []

    def after_write(record: dict) -> None:
        landed.append(record)
        if at_record is not None:
            at_record(record)
        store.dead = True

    store.after_write = after_write
    with pytest.raises(Killed):
        run_batch(journal, JOB, ITEMS, steps(receiver, verify=verify), high_water=store)
    store.after_write, store.dead = None, False
    assert len(landed) == 1 and 0 < len(receiver.counts) < N
    return landed


def crash_with_the_journal_host(tmp_path: Path, receiver: Receiver, store: FileStore, monkeypatch, *,
                                verify: bool) -> set[str]:
    """The journal's host crashes while a window is open: the journal comes back as it was when the first
    record landed (the marks committed after it are gone), the runner's process is gone with it (no record
    lands after the first), and the host has a new boot. Returns the items the open window named."""
    db, snapshot = tmp_path / "journal.db", tmp_path / "snapshot.db"
    with StepJournal(db) as journal:
        landed = run_killed_after_the_first_record(journal, receiver, store, verify=verify,
                                                   at_record=lambda record: copy_files(db, snapshot))
    restore(snapshot, db)
    reboot(monkeypatch, tmp_path)
    record = store.read()
    assert record == landed[-1] and record["open"]
    window = {item["id"] for item in ITEMS if item_hash(item["id"]) in _window(record)}
    with StepJournal(db) as journal:
        assert journal.marks(JOB) >= record["marks"], "a host crash inside a window is not 'behind'"
        recorded = {r.item_id for r in journal.rows(JOB) if r.step == "notify"}
    forgotten = set(receiver.counts) - recorded
    # The case this is about: sends made that the journal no longer has, all of them in the window.
    assert forgotten and forgotten <= window, (forgotten, window)
    return window


def test_a_crash_of_the_journal_host_inside_a_window_verifies_the_window_before_sending(tmp_path, monkeypatch):
    receiver, store = Receiver(), FileStore(tmp_path / "mark.json")
    window = crash_with_the_journal_host(tmp_path, receiver, store, monkeypatch, verify=True)
    with StepJournal(tmp_path / "journal.db") as journal:
        result = run_batch(journal, JOB, ITEMS, steps(receiver), high_water=store)
        assert result.status == "completed" and result.verified_steps >= 1
        assert store.read()["open"] is False
    assert receiver.duplicates() == 0 and len(receiver.counts) == N
    assert len(window) < N  # windows cover a part of the batch ahead of the sends, not all of it


def test_without_verify_the_open_windows_items_the_journal_forgot_are_held_not_sent(tmp_path, monkeypatch):
    receiver, store = Receiver(), FileStore(tmp_path / "mark.json")
    window = crash_with_the_journal_host(tmp_path, receiver, store, monkeypatch, verify=False)
    with StepJournal(tmp_path / "journal.db") as journal:
        result = run_batch(journal, JOB, ITEMS, steps(receiver, verify=False), high_water=store)
        held = {h.item_id for h in result.held}
        assert held and held <= window
        for h in journal.held(JOB):
            assert h.reason == HeldReason.UNKNOWN_OUTCOME
        assert {r.status for r in journal.rows(JOB) if r.item_id in held and r.step == "notify"} == {Status.IN_FLIGHT}
        # The held rows keep them from being sent: the window is closed, the rest of the batch went on.
        assert store.read()["open"] is False
    assert receiver.duplicates() == 0
    assert set(receiver.counts) | held == {item["id"] for item in ITEMS}  # every other item delivered


def test_a_mark_is_written_per_window_not_per_send(tmp_path):
    """With a store as slow as Airflow's API server (~20 ms a write), a record covers many sends."""
    import time

    class SlowStore(FileStore):
        def write(self, record) -> None:
            time.sleep(0.02)
            super().write(record)

    receiver, store = Receiver(), SlowStore(tmp_path / "mark.json")
    items = [{"id": f"i{n}"} for n in range(1500)]
    with StepJournal(tmp_path / "journal.db") as journal:
        run_batch(journal, JOB, items, steps(receiver), high_water=store)
        assert journal.marks(JOB) == 1500
    assert store.writes <= 1500 // 10, store.writes
    record = store.read()
    assert record["open"] is False and record["marks"] == 1500 and record["window"] == ""
    assert len(json.dumps(record)) < 1024
    assert WINDOW_MAX * 8 * 4 // 3 + 1024 < 64 * 1024  # a full window fits a task state store value


def test_a_job_with_no_stored_mark_is_never_refused_and_marks_count_only_sends(journal_location, tmp_path):
    receiver, store = Receiver(), FileStore(tmp_path / "mark.json")
    with StepJournal(journal_location) as journal:
        result = run_batch(journal, JOB, ITEMS[:10], steps(receiver), high_water=store)
        assert result.status == "completed" and journal.marks(JOB) == 10  # one per send, none per local step
        run_batch(journal, JOB, ITEMS[:10], steps(receiver), high_water=store)
        assert journal.marks(JOB) == 10  # a finished job re-run marks nothing
        assert journal.marks("no-such-job") == 0


def test_on_journal_behind_must_be_a_known_value_and_the_journal_is_unchanged(tmp_path):
    with StepJournal(tmp_path / "journal.db") as journal:
        with pytest.raises(ValueError, match="on_journal_behind must be one of 'refuse', 'verify'"):
            run_batch(journal, JOB, ITEMS, steps(Receiver()), high_water=FileStore(tmp_path / "m.json"),
                      on_journal_behind="sometimes")
        assert not journal.has_job(JOB)
    assert not (tmp_path / "m.json").exists()


def test_a_try_killed_with_a_window_open_on_the_same_journal_has_nothing_to_verify(tmp_path):
    """The runner's process dies (no record lands after the first) but the journal is the one it wrote
    to, on the same boot: every mark it committed is there, so the window's items are neither asked
    about nor held - a step without verify sends the ones never sent, once."""
    receiver, store = Receiver(), FileStore(tmp_path / "mark.json")
    with StepJournal(tmp_path / "journal.db") as journal:
        run_killed_after_the_first_record(journal, receiver, store, verify=False)
        assert store.read()["open"] and store.read()["incarnation"] == journal.incarnation()
        result = run_batch(journal, JOB, ITEMS, steps(receiver, verify=False), high_water=store)
        assert (result.status, result.held, result.verified_steps) == ("completed", [], 0)
    assert receiver.duplicates() == 0 and len(receiver.counts) == N


def test_the_incarnation_changes_with_the_hosts_boot_not_when_the_journal_is_reopened(journal_location, tmp_path,
                                                                                       monkeypatch):
    with StepJournal(journal_location) as journal:
        first = journal.incarnation()
    with StepJournal(journal_location) as journal:
        assert journal.incarnation() == first
    if journal_location.startswith("postgresql://"):
        return  # a server restart or a promoted standby changes it (tests/airflow_layer/test_journal_behind.py)
    reboot(monkeypatch, tmp_path)
    with StepJournal(journal_location) as journal:
        assert journal.incarnation() != first


def test_items_of_a_lost_window_are_still_asked_about_after_the_next_try_is_killed(tmp_path, monkeypatch):
    """After a host crash the next try is killed too, on the new boot, before it got to every item of the
    lost window: the try after it (same boot, same journal) still treats those items as suspects."""
    receiver, store = Receiver(), FileStore(tmp_path / "mark.json")
    window = crash_with_the_journal_host(tmp_path, receiver, store, monkeypatch, verify=False)
    with StepJournal(tmp_path / "journal.db") as journal:
        run_killed_after_the_first_record(journal, receiver, store, verify=False)  # the second try
        carried = _window({"window": store.read()["suspects"]})
        assert store.read()["incarnation"] == journal.incarnation() and carried
        result = run_batch(journal, JOB, ITEMS, steps(receiver, verify=False), high_water=store)
        held = {h.item_id for h in result.held}
        assert held and held <= window and {item_hash(i) for i in held} <= carried
    assert receiver.duplicates() == 0
