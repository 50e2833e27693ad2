"""The journal file itself - permissions, WAL, schema version and migration, refusal of
corrupt / foreign / newer / networked journals, prune, the append-only audit log, the read API and
input-change resolution."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import sqlite3
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from airflow_resumable import _fs
from airflow_resumable.exceptions import JobPrunedError, JournalCorruptError, JournalVersionError
from airflow_resumable.journal import (
    SCHEMA_VERSION,
    HeldReason,
    HeldStep,
    JournalError,
    JournalLocationError,
    Status,
    StepJournal,
)
from airflow_resumable.journal import sqlite as journal_sqlite
from airflow_resumable.journal.schema import SQLITE_MIGRATIONS
from airflow_resumable.runner import Step, StepContext, idempotency_key, run_batch
from tests.support import backends

pytestmark = pytest.mark.core

JOB = "journal/job"


def digest_of(item: Mapping[str, Any]) -> str:
    """The step digest, computed independently: SHA-256 of sorted-key, whitespace-free JSON."""
    return hashlib.sha256(json.dumps(item, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


class Receiver:
    def __init__(self) -> None:
        self.deliveries: list[tuple[str, str, str, str]] = []  # job, item, key, payload
        self.fail: set[str] = set()

    def count(self, item_id: str) -> int:
        return sum(1 for d in self.deliveries if d[1] == item_id)

    def has(self, key: str) -> str | None:
        for n, d in enumerate(self.deliveries):
            if d[2] == key:
                return f"rcpt-{n}"
        return None

    def steps(self, *, with_verify: bool = False) -> list[Step]:
        def validate(item: Mapping[str, Any], ctx: StepContext) -> bool:
            return True

        def transform(item: Mapping[str, Any], ctx: StepContext) -> dict[str, Any]:
            if item.get("break") == ctx.step:
                raise KeyError("boom")
            return {"payload": json.dumps(dict(item), sort_keys=True)}

        def notify(item: Mapping[str, Any], ctx: StepContext) -> str:
            if ctx.item_id in self.fail:
                self.fail.discard(ctx.item_id)
                raise TimeoutError()
            self.deliveries.append((ctx.job_id, ctx.item_id, ctx.idempotency_key, ctx.outputs["transform"]["payload"]))
            return f"rcpt-{len(self.deliveries) - 1}"

        verify = (lambda ctx: self.has(ctx.idempotency_key)) if with_verify else None
        return [Step("validate", validate), Step("transform", transform),
                Step("notify", notify, side_effect=True, verify=verify)]


def raw(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None, timeout=10, check_same_thread=False)


def snapshot(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = [r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return {t: sorted(conn.execute(f'SELECT * FROM "{t}"').fetchall(), key=repr) for t in tables}
    finally:
        conn.close()


@pytest.fixture
def path(tmp_path: Path) -> Path:
    """A SQLite journal file, for what only the file engine has (permissions, WAL, the file's schema)."""
    return tmp_path / "state" / "journal.sqlite3"


@pytest.fixture
def location(journal_location: str) -> str:
    """The journal of a contract test: a SQLite file, then a PostgreSQL database."""
    return journal_location


# -------------------------------------------------------------------------- file and connection


@pytest.fixture
def open_umask():
    old = os.umask(0)  # the most permissive umask: only the journal's own modes can protect it
    try:
        yield
    finally:
        os.umask(old)


def test_directory_0700_file_0600_and_sidecars_0600(path, open_umask):
    with StepJournal(path) as journal:
        run_batch(journal, JOB, [{"id": "a"}], Receiver().steps(), settle_in_task=False)
        assert mode_of(path.parent) == 0o700
        assert mode_of(path) == 0o600
        for suffix in ("-wal", "-shm"):
            sidecar = Path(str(path) + suffix)
            assert sidecar.exists(), f"{sidecar.name} should exist while the journal is open in WAL mode"
            assert mode_of(sidecar) == 0o600
        locks = Path(str(path) + ".locks")
        assert mode_of(locks) == 0o700
        with journal.open_job("held-open"):
            lock_files = list(locks.iterdir())
            assert len(lock_files) == 2 and [mode_of(p) for p in lock_files] == [0o600, 0o600]


def test_loose_permissions_of_an_existing_journal_are_tightened(path, open_umask):
    with StepJournal(path):
        pass
    os.chmod(path, 0o666)
    for suffix in ("-wal", "-shm"):
        Path(str(path) + suffix).touch(mode=0o666)
        os.chmod(str(path) + suffix, 0o666)
    with StepJournal(path):
        assert mode_of(path) == 0o600
        assert mode_of(Path(str(path) + "-wal")) == 0o600
        assert mode_of(Path(str(path) + "-shm")) == 0o600


def test_wal_mode_and_busy_timeout(path):
    with StepJournal(path, busy_timeout=2.5) as journal:
        conn = raw(path)
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"  # persistent: the file is WAL
        conn.close()
        assert journal.engine._connection.execute("PRAGMA busy_timeout").fetchone()[0] == 2500
        assert journal.engine._connection.execute("PRAGMA synchronous").fetchone()[0] == 1  # NORMAL
    with StepJournal(path) as journal:
        assert journal.engine._connection.execute("PRAGMA busy_timeout").fetchone()[0] == 30000


def test_a_second_journal_on_the_file_in_one_process_leaves_the_first_its_locks(path):
    """A task's journal stays open while this process opens the file again (the page's reader, the
    sensor) and closes it; then another process reads the journal and closes. That process must not
    take itself for the file's last user and delete the -wal file under the open journal: what the
    task writes next must reach every other process (and the disk), not an unlinked file."""
    with StepJournal(path, durability="normal") as journal:
        run_batch(journal, "first/job", [{"id": "a"}], Receiver().steps(), settle_in_task=False)
        StepJournal(path, readonly=True).close()
        read_elsewhere = ("import sys; from airflow_resumable.journal import StepJournal\n"
                          "with StepJournal(sys.argv[1], readonly=True) as j: print(j.job(sys.argv[2]))")
        subprocess.run([sys.executable, "-c", read_elsewhere, str(path), "first/job"], check=True)
        assert Path(str(path) + "-wal").exists()
        run_batch(journal, JOB, [{"id": "a"}, {"id": "b"}], Receiver().steps(), settle_in_task=False)
        seen = subprocess.run([sys.executable, "-c", read_elsewhere, str(path), JOB],
                              check=True, capture_output=True, text=True).stdout
        assert "items=2" in seen, seen


def test_busy_timeout_waits_for_another_writer(path):
    """Two tasks on one worker share the file: a write waits for the other writer, then goes on."""
    with StepJournal(path, busy_timeout=5) as journal:
        blocker = raw(path)
        blocker.execute("BEGIN IMMEDIATE")
        threading.Timer(0.3, lambda: blocker.execute("COMMIT")).start()
        started = time.monotonic()
        result = run_batch(journal, JOB, [{"id": "a"}], Receiver().steps(), settle_in_task=False)
        waited = time.monotonic() - started
        blocker.close()
        assert result.status == "completed"
        assert 0.25 <= waited < 4.5


def test_busy_timeout_expiry_is_a_clear_error_and_nothing_is_sent(path):
    receiver = Receiver()
    with StepJournal(path, busy_timeout=0.2) as journal:
        blocker = raw(path)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            with pytest.raises(JournalError, match="locked"):
                run_batch(journal, JOB, [{"id": "a"}], receiver.steps(), settle_in_task=False)
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
    assert receiver.deliveries == []


def test_schema_version(path):
    with StepJournal(path) as journal:
        assert SCHEMA_VERSION == 9
        conn = raw(path)
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        assert {"steps", "resolutions", "jobs", "meta"} <= tables
        journal_id = conn.execute("SELECT value FROM meta WHERE key = 'journal_id'").fetchone()[0]
        conn.close()
        assert journal.journal_id == journal_id and len(journal_id) == 32
    with StepJournal(path) as again:
        assert again.journal_id == journal_id  # stable across opens


# ------------------------------------------------------------------------------------- migration


def _version_1_journal(path: Path, item: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = raw(path)
    for statement in SQLITE_MIGRATIONS[1]:
        conn.execute(statement)
    conn.execute("PRAGMA user_version = 1")
    rows = [
        ("old/job", item["id"], "validate", 0, "SUCCEEDED", digest_of(item), None, "true", None, None, None, 1,
         1_600_000_000.0, 1_600_000_001.0),
        ("old/job", item["id"], "transform", 0, "SUCCEEDED", digest_of(item), None,
         json.dumps({"payload": json.dumps(dict(item), sort_keys=True)}), None, None, None, 1,
         1_600_000_002.0, 1_600_000_003.0),
        ("old/job", item["id"], "notify", 1, "SUCCEEDED", digest_of(item), "rcpt-old", '"rcpt-old"', None, None,
         None, 2, 1_600_000_004.0, 1_600_000_009.0),
        ("old/held", "h", "notify", 1, "FAILED", digest_of({"id": "h"}), None, None, "TimeoutError",
         "unknown_outcome", None, 1, 1_500_000_000.0, 1_500_000_000.0),
    ]
    conn.executemany("INSERT INTO steps VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)
    conn.execute(
        """INSERT INTO resolutions (job_id, item_id, step, decision, receipt, note, resolved_by, resolved_at,
                                    previous_status, previous_held_reason)
           VALUES ('old/job', ?, 'notify', 'delivered', 'rcpt-old', 'n', 'alice', 1600000005.0, 'FAILED',
                   'unknown_outcome')""",
        (item["id"],),
    )
    conn.close()


def test_forward_migration_from_version_1(path):
    item = {"id": "x", "amount": 5}
    _version_1_journal(path, item)
    before = snapshot(path)
    assert "jobs" not in before

    receiver = Receiver()
    with StepJournal(path) as journal:
        conn = raw(path)
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        conn.close()
        after = snapshot(path)
        # Every row as it was; version 5: generation 0 (the keys they were sent with) and not_sent 0;
        # version 6: every row at its first version.
        assert after["steps"] == [row + (0, 0, 1) for row in before["steps"]], "migration must keep every row"
        assert after["resolutions"] == before["resolutions"]
        # Version 4's finished_at: jobs journaled before count as finished when last updated. Version 7:
        # each job's counts (items, in flight, succeeded, failed, held, unresolved), counted once. Version 8:
        # no number and no compaction yet (job_no, compacted_at). Version 9: marks counted from then on (0).
        assert after["jobs"] == [
            ("old/held", 1_500_000_000.0, 1_500_000_000.0, None, None, 1_500_000_000.0, None, 1, 0, 0, 1, 1, 0,
             None, None, 0),
            ("old/job", 1_600_000_000.0, 1_600_000_009.0, None, None, 1_600_000_009.0, None, 1, 0, 3, 0, 0, 0,
             None, None, 0),
        ]
        backends.assert_counts_exact(path)
        assert len(journal.journal_id) == 32

        by_id = {j.job_id: j for j in journal.jobs()}
        assert set(by_id) == {"old/job", "old/held"}
        assert by_id["old/job"].settled and by_id["old/job"].counts["SUCCEEDED"] == 3
        assert not by_id["old/held"].settled
        assert journal.held() == [HeldStep("old/held", "h", "notify", HeldReason.UNKNOWN_OUTCOME)]
        assert [r.resolved_by for r in journal.resolutions("old/job")] == ["alice"]
        notify = {r.step: r for r in journal.rows("old/job", "x")}["notify"]
        assert (notify.receipt, notify.output, notify.attempts) == ("rcpt-old", "rcpt-old", 2)
        assert notify.updated_at == datetime.fromtimestamp(1_600_000_009.0, tz=timezone.utc)

        # The migrated history is live: the old job resumes (nothing re-sent), the held one stays held.
        result = run_batch(journal, "old/job", [item], receiver.steps(), settle_in_task=False)
        assert (result.executed_steps, result.skipped_steps, result.status) == (0, 3, "completed")
        held = run_batch(journal, "old/held", [{"id": "h"}], receiver.steps(), settle_in_task=False)
        assert held.held == [HeldStep("old/held", "h", "notify", HeldReason.UNKNOWN_OUTCOME)]
        assert receiver.deliveries == []
        backends.assert_counts_exact(path)
        settled = snapshot(path)
    # Opening the migrated journal again changes nothing.
    with StepJournal(path) as journal:
        assert snapshot(path) == settled
        assert journal.journal_id == after["meta"][0][1]


def test_a_journal_from_a_newer_version_is_refused_and_left_alone(path):
    with StepJournal(path) as journal:
        run_batch(journal, JOB, [{"id": "a"}], Receiver().steps(), settle_in_task=False)
    conn = raw(path)
    conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    conn.close()
    content = path.read_bytes()
    with pytest.raises(JournalVersionError) as info:
        StepJournal(path)
    message = str(info.value)
    assert isinstance(info.value, JournalError)
    assert f"version {SCHEMA_VERSION + 1}" in message and "newer" in message and str(path) in message
    assert path.read_bytes() == content
    conn = raw(path)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION + 1
    conn.close()


# ------------------------------------------------------------------------------- refused files


def _open_and_run(path: Path, receiver: Receiver) -> None:
    """What a task does: open the journal, run a batch."""
    with StepJournal(path) as journal:
        run_batch(journal, JOB, [{"id": i} for i in range(20)], receiver.steps(), settle_in_task=False)


@pytest.mark.parametrize(
    "garbage",
    [b"this is not a database at all " * 200, bytes(random.Random(1).randrange(256) for _ in range(8192)),
     b"SQLite format 3\x00" + b"\xff" * 4080],
    ids=["text", "random", "bad-header"],
)
def test_garbage_file_is_a_corrupt_journal_and_nothing_is_sent(path, garbage):
    path.parent.mkdir(mode=0o700)
    path.write_bytes(garbage)
    receiver = Receiver()
    with pytest.raises(JournalCorruptError) as info:
        _open_and_run(path, receiver)
    assert isinstance(info.value, JournalError)
    assert str(path) in str(info.value) and "Nothing was sent" in str(info.value)
    assert "Traceback" not in str(info.value)
    assert receiver.deliveries == []
    assert path.read_bytes() == garbage, "a corrupt journal is evidence: it must not be rewritten"


def test_journal_with_corrupt_pages_fails_before_anything_is_sent(path):
    items = [{"id": f"i{n}", "pad": "x" * 400} for n in range(300)]
    with StepJournal(path) as journal:
        run_batch(journal, JOB, items, Receiver().steps(), settle_in_task=False)
    data = bytearray(path.read_bytes())
    rng = random.Random(7)
    page = 4096
    assert len(data) > 10 * page
    for offset in range(page, len(data), page):  # keep page 1 (header + schema), wreck the rest
        data[offset:offset + page] = bytes(rng.randrange(256) for _ in range(page))
    path.write_bytes(bytes(data))

    receiver = Receiver()
    more = items + [{"id": f"new{n}"} for n in range(20)]
    with pytest.raises(JournalCorruptError, match="Nothing was sent"):
        with StepJournal(path) as journal:
            run_batch(journal, JOB, more, receiver.steps(), settle_in_task=False)
    assert receiver.deliveries == []


def test_a_sqlite_database_that_is_not_a_journal_is_refused(path):
    path.parent.mkdir(mode=0o700)
    conn = raw(path)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.execute("INSERT INTO customers (name) VALUES ('ada')")
    conn.close()
    receiver = Receiver()
    with pytest.raises(JournalError) as info:
        _open_and_run(path, receiver)
    assert "not a step journal" in str(info.value) and str(path) in str(info.value)
    assert receiver.deliveries == []
    conn = raw(path)
    assert conn.execute("SELECT * FROM customers").fetchall() == [(1, "ada")]
    assert {r[0] for r in conn.execute("SELECT name FROM sqlite_master")} == {"customers"}
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 0
    conn.close()



def test_a_refused_foreign_database_is_not_modified(path):
    path.parent.mkdir(mode=0o700)
    conn = raw(path)
    conn.execute("CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT)")
    conn.close()
    os.chmod(path, 0o640)
    content = path.read_bytes()
    with pytest.raises(JournalError):
        StepJournal(path)
    assert mode_of(path) == 0o640
    assert path.read_bytes() == content  # in particular still in rollback-journal mode, not WAL


# --------------------------------------------------------------------------- network filesystems


def _mountinfo(tmp_path: Path, mounts: list[tuple[Path | str, str, str]]) -> str:
    """A /proc/self/mountinfo with a local root plus the given (mount point, fs type, source)."""
    lines = ["22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw,errors=remount-ro"]
    for n, (point, fs_type, source) in enumerate(mounts):
        escaped = str(point).replace("\\", "\\134").replace(" ", "\\040")
        lines.append(f"{40 + n} 22 0:{50 + n} / {escaped} rw,relatime shared:{2 + n} - {fs_type} {source} rw")
    fake = tmp_path / "mountinfo"
    fake.write_text("\n".join(lines) + "\n")
    return str(fake)


@pytest.fixture
def mounts(tmp_path: Path) -> dict[str, Path]:
    base = Path(os.path.realpath(tmp_path))
    points = {name: base / name for name in ("nfs", "cifs", "sshfs", "local", "share space", "nfs-local")}
    for point in points.values():
        point.mkdir()
    (points["nfs"] / "inner").mkdir()
    points["nfs/inner"] = points["nfs"] / "inner"
    return points


@pytest.fixture
def fake_mountinfo(tmp_path: Path, mounts: dict[str, Path]) -> str:
    return _mountinfo(tmp_path, [
        (mounts["nfs"], "nfs4", "server:/export"),
        (mounts["cifs"], "cifs", "//server/share"),
        (mounts["sshfs"], "fuse.sshfs", "user@host:/srv"),
        (mounts["local"], "ext4", "/dev/sdb1"),
        (mounts["share space"], "smb3", "//server/other"),
        (mounts["nfs/inner"], "xfs", "/dev/sdc1"),  # a local disk mounted inside the NFS mount
    ])


@pytest.mark.parametrize(
    ("mount", "fs_type"),
    [("nfs", "nfs4"), ("cifs", "cifs"), ("sshfs", "fuse.sshfs"), ("share space", "smb3")],
)
def test_network_filesystems_are_detected(mounts, fake_mountinfo, mount, fs_type):
    target = mounts[mount] / "airflow" / "journal.sqlite3"  # not created yet, like a first run
    reason = _fs.network_location_reason(target, mountinfo=fake_mountinfo)
    assert reason is not None and fs_type in reason and "network" in reason
    assert _fs.filesystem_type(mounts[mount], fake_mountinfo) == fs_type


@pytest.mark.parametrize("mount", ["local", "nfs-local", "nfs/inner"])
def test_local_filesystems_are_allowed(mounts, fake_mountinfo, mount):
    # "nfs-local" shares a name prefix with the NFS mount but is not inside it; "nfs/inner" is a
    # local disk mounted inside the NFS mount (the longest mount point wins).
    assert _fs.network_location_reason(mounts[mount] / "journal.sqlite3", mountinfo=fake_mountinfo) is None


def test_no_mount_table_means_nothing_detected(tmp_path):
    assert _fs.network_location_reason(tmp_path / "j.sqlite3", mountinfo=str(tmp_path / "missing")) is None


@pytest.mark.parametrize("folder", ["Dropbox", "OneDrive - Contoso", "Google Drive", "iCloud Drive"])
def test_cloud_sync_folders_are_detected(tmp_path, mounts, fake_mountinfo, folder):
    target = mounts["local"] / "home" / folder / "airflow" / "journal.sqlite3"
    reason = _fs.network_location_reason(target, mountinfo=fake_mountinfo)
    assert reason is not None and "cloud-sync" in reason and folder.lower() in reason


def test_journal_on_a_network_filesystem_is_refused_unless_allowed(mounts, fake_mountinfo, monkeypatch):
    monkeypatch.setattr(journal_sqlite, "network_location_reason",
                        functools.partial(_fs.network_location_reason, mountinfo=fake_mountinfo))
    target = mounts["nfs"] / "airflow" / "journal.sqlite3"
    with pytest.raises(JournalLocationError) as info:
        StepJournal(target)
    message = str(info.value)
    assert isinstance(info.value, JournalError)
    assert str(target) in message and "nfs4" in message and "allow_network_filesystem" in message
    assert not target.parent.exists(), "a refused journal creates nothing"

    with pytest.raises(JournalLocationError, match="fuse.sshfs"):
        StepJournal(mounts["sshfs"] / "journal.sqlite3")
    with pytest.raises(JournalLocationError, match="cloud-sync"):
        StepJournal(mounts["local"] / "Dropbox" / "journal.sqlite3")
    with StepJournal(mounts["local"] / "journal.sqlite3"):
        pass

    receiver = Receiver()
    with StepJournal(target, allow_network_filesystem=True) as journal:
        assert run_batch(journal, JOB, [{"id": "a"}], receiver.steps(), settle_in_task=False).status == "completed"
    assert len(receiver.deliveries) == 1


def test_real_mount_table_dropbox_folder_is_refused(tmp_path):
    target = tmp_path / "Dropbox" / "journal.sqlite3"
    with pytest.raises(JournalLocationError, match="cloud-sync"):
        StepJournal(target)
    assert not target.parent.exists()
    with StepJournal(target, allow_network_filesystem=True):
        assert target.exists()


# ------------------------------------------------------------------------------------------ prune


def _age(location: str, job_id: str, days: float) -> None:
    backends.execute(location, "UPDATE jobs SET updated_at = updated_at - ? WHERE job_id = ?", (days * 86400, job_id))


def test_prune(location):
    receiver = Receiver()
    a = {"id": "a"}
    with StepJournal(location) as journal:
        for job in ("old/done", "new/done", "old/held", "old/failed-send", "old/changed", "old/local-failed",
                    "old/running"):
            run_batch(journal, job, [a], receiver.steps(), settle_in_task=False)
        # old/held: b's send failed, and the next run held it for a human.
        receiver.fail.add("b")
        with pytest.raises(TimeoutError):
            run_batch(journal, "old/held", [a, {"id": "b"}], receiver.steps(), settle_in_task=False)
        assert run_batch(journal, "old/held", [a, {"id": "b"}], receiver.steps(), settle_in_task=False).held == [
            HeldStep("old/held", "b", "notify", HeldReason.UNKNOWN_OUTCOME)]
        # old/failed-send: a send failed and no run has looked at it since (unresolved, not held).
        receiver.fail.add("c")
        with pytest.raises(TimeoutError):
            run_batch(journal, "old/failed-send", [a, {"id": "c"}], receiver.steps(), settle_in_task=False)
        # old/changed: held input_changed.
        assert run_batch(journal, "old/changed", [{"id": "a", "v": 9}], receiver.steps(), settle_in_task=False).held
        # old/local-failed: a local step failed.
        with pytest.raises(KeyError):
            run_batch(journal, "old/local-failed", [a, {"id": "d", "break": "transform"}], receiver.steps(),
                      settle_in_task=False)
        # old/in-flight: an IN_FLIGHT send left by a crashed runner (the runner's own API marks it).
        with journal.open_job("old/in-flight") as run:
            run.mark_in_flight("x", "notify", digest_of({"id": "x"}))
        old = ("old/done", "old/held", "old/failed-send", "old/changed", "old/local-failed", "old/running",
               "old/in-flight")
        for job in old:
            _age(location, job, 40)

        with pytest.raises(ValueError):
            journal.prune(timedelta(days=-1))
        with pytest.raises(ValueError):
            journal.prune(30)  # type: ignore[arg-type]
        assert journal.prune(timedelta(days=60)) == []

        kept = ("new/done",) + old[1:]
        before_rows = {j: journal.rows(j) for j in kept}
        with journal.open_job("old/running"):  # running right now: not pruned
            assert journal.prune(timedelta(days=30)) == ["old/done"]
        assert journal.rows("old/done") == []
        assert {j: journal.rows(j) for j in kept} == before_rows
        if journal.kind == "sqlite":
            assert not Path(journal.engine._lock_path("old/done")).exists()
        summaries = {j.job_id: j for j in journal.jobs()}
        assert summaries["old/done"].pruned_at is not None and summaries["old/done"].items == 0
        assert all(s.pruned_at is None for j, s in summaries.items() if j != "old/done")

        # Held / unresolved / changed / failed jobs are never pruned, however old.
        assert sorted(journal.prune(timedelta(0))) == ["new/done", "old/running"]
        remaining = {j.job_id for j in journal.jobs() if j.pruned_at is None}
        assert remaining == {"old/held", "old/failed-send", "old/changed", "old/local-failed", "old/in-flight"}
        assert {j: journal.rows(j) for j in remaining} == {j: before_rows[j] for j in remaining}
        assert {h.job_id for h in journal.held()} == {"old/held", "old/changed"}

        # Re-running a pruned job would re-send everything: refused, nothing sent.
        sent = len(receiver.deliveries)
        with pytest.raises(JobPrunedError) as info:
            run_batch(journal, "old/done", [a], receiver.steps(), settle_in_task=False)
        assert "old/done" in str(info.value) and "pruned" in str(info.value)
        assert len(receiver.deliveries) == sent
        assert journal.rows("old/done") == []

        # Once the held job is settled and has run to the end, it can be pruned too.
        journal.resolve("old/held", "b", "notify", delivered=False, resolved_by="oncall")
        done = run_batch(journal, "old/held", [a, {"id": "b"}], receiver.steps(), settle_in_task=False)
        assert done.status == "completed" and receiver.count("b") == 1
        assert journal.prune(timedelta(0)) == ["old/held"]
        assert journal.resolutions("old/held")[0].decision == "not_delivered"  # the audit log is kept
        with pytest.raises(JobPrunedError):
            run_batch(journal, "old/held", [a, {"id": "b"}], receiver.steps(), settle_in_task=False)
        assert receiver.count("b") == 1


def test_prune_keeps_unresolved_rows_ignoring_age(location):
    """A direct check of the rule: jobs with open rows survive prune(0) and an aged prune alike."""
    with StepJournal(location) as journal:
        with journal.open_job("crashed") as run:
            run.mark_in_flight("x", "notify", digest_of({"id": "x"}))
        _age(location, "crashed", 1000)
        assert journal.prune(timedelta(0)) == []
        assert journal.job("crashed").unresolved == 1
        assert [r.status for r in journal.rows("crashed")] == [Status.IN_FLIGHT]


def test_a_run_over_an_empty_batch_is_remembered(location):
    """The operator's wrong-worker guard asks has_job() on a retry: a job that ran here, even with
    nothing to do, has been seen by this journal."""
    with StepJournal(location) as journal:
        result = run_batch(journal, "empty/job", [], Receiver().steps(), settle_in_task=False)
        assert (result.status, result.items_total) == ("completed", 0)
        assert journal.has_job("empty/job")
        assert [j.job_id for j in journal.jobs()] == ["empty/job"]


# ------------------------------------------------------------------------------------ audit log


def test_resolution_audit_log_is_append_only(path):
    receiver = Receiver()
    receiver.fail.add("a")
    with StepJournal(path) as journal:
        with pytest.raises(TimeoutError):
            run_batch(journal, JOB, [{"id": "a"}], receiver.steps(), settle_in_task=False)
        journal.resolve(JOB, "a", "notify", delivered=False, resolved_by="alice", note="not there")
        before = snapshot(path)["resolutions"]
        assert len(before) == 1
        for conn in (raw(path), journal.engine._connection):
            with pytest.raises(sqlite3.DatabaseError, match="append-only"):
                conn.execute("UPDATE resolutions SET resolved_by = 'mallory'")
            with pytest.raises(sqlite3.DatabaseError, match="append-only"):
                conn.execute("DELETE FROM resolutions")
            with pytest.raises(sqlite3.DatabaseError, match="append-only"):
                conn.execute("DELETE FROM resolutions WHERE job_id = ?", (JOB,))
        assert snapshot(path)["resolutions"] == before
        assert [r.resolved_by for r in journal.resolutions(JOB)] == ["alice"]
        # Appending is what it is for.
        conn = raw(path)
        conn.execute("""INSERT INTO resolutions (job_id, item_id, step, decision, resolved_by, resolved_at)
                        VALUES ('j', 'i', 's', 'note', 'ops', 0)""")
        conn.close()
        assert len(snapshot(path)["resolutions"]) == 2



def test_audit_log_cannot_be_rewritten_with_insert_or_replace(path):
    receiver = Receiver()
    receiver.fail.add("a")
    with StepJournal(path) as journal:
        with pytest.raises(TimeoutError):
            run_batch(journal, JOB, [{"id": "a"}], receiver.steps(), settle_in_task=False)
        journal.resolve(JOB, "a", "notify", delivered=False, resolved_by="alice")
        conn = raw(path)
        try:
            conn.execute("""INSERT OR REPLACE INTO resolutions (id, job_id, item_id, step, decision, resolved_by,
                                                                resolved_at)
                            SELECT id, job_id, item_id, step, 'delivered', 'mallory', resolved_at FROM resolutions""")
        except sqlite3.DatabaseError:
            pass
        finally:
            conn.close()
        assert [(r.decision, r.resolved_by) for r in journal.resolutions(JOB)] == [("not_delivered", "alice")]


# ------------------------------------------------------------------------------------- read API


def test_read_api(location):
    receiver = Receiver()
    t0 = datetime.now(timezone.utc)
    with StepJournal(location) as journal:
        a, b, c_old, c_new = {"id": "a", "n": 1}, {"id": "b", "n": 2}, {"id": "c", "n": 3, "break": "transform"}, \
            {"id": "c", "n": 3}
        with pytest.raises(KeyError):  # a done; c's local transform fails
            run_batch(journal, JOB, [a, c_old], receiver.steps(), settle_in_task=False)
        receiver.fail.add("b")
        with pytest.raises(TimeoutError):  # b's send fails before the receiver accepts it
            run_batch(journal, JOB, [a, b], receiver.steps(), settle_in_task=False)
        items = [a, b, c_new]  # c's input changed since its rows were written
        second = run_batch(journal, JOB, items, receiver.steps(), settle_in_task=False)
        assert sorted(second.held, key=lambda h: h.item_id) == [
            HeldStep(JOB, "b", "notify", HeldReason.UNKNOWN_OUTCOME),
            HeldStep(JOB, "c", "validate", HeldReason.INPUT_CHANGED),
        ]
        run_batch(journal, "other/job", [{"id": "z"}], receiver.steps(), settle_in_task=False)
        with journal.open_job("crashed/job") as run:
            run.mark_in_flight("q", "notify", digest_of({"id": "q"}))

        # jobs(): newest first, per-status counts
        summaries = journal.jobs()
        assert [s.job_id for s in summaries] == ["crashed/job", "other/job", JOB]
        s = summaries[2]
        assert dict(s.counts) == {"IN_FLIGHT": 0, "SUCCEEDED": 6, "FAILED": 2}
        assert (s.items, s.held, s.unresolved, s.settled, s.pruned_at) == (3, 2, 0, False, None)
        assert t0 - timedelta(seconds=5) <= s.created_at <= s.updated_at <= datetime.now(timezone.utc)
        assert s.created_at.tzinfo is not None
        assert summaries[1].settled and dict(summaries[1].counts) == {"IN_FLIGHT": 0, "SUCCEEDED": 3, "FAILED": 0}
        crashed = summaries[0]
        assert (crashed.unresolved, crashed.held, crashed.settled) == (1, 0, False)
        assert dict(crashed.counts)["IN_FLIGHT"] == 1
        assert journal.job(JOB) == s and journal.job("missing") is None

        # rows(): every field the spec names
        rows = {(r.item_id, r.step): r for r in journal.rows(JOB)}
        assert len(rows) == 8 and all(r.job_id == JOB for r in rows.values())
        assert {k for k in rows} == {("a", "validate"), ("a", "transform"), ("a", "notify"), ("b", "validate"),
                                     ("b", "transform"), ("b", "notify"), ("c", "validate"), ("c", "transform")}
        a_notify = rows[("a", "notify")]
        assert (a_notify.status, a_notify.receipt, a_notify.output, a_notify.error_type, a_notify.held_reason,
                a_notify.attempts, a_notify.side_effect) == (Status.SUCCEEDED, "rcpt-0", "rcpt-0", None, None, 1, True)
        assert a_notify.digest == digest_of(items[0])
        assert rows[("a", "validate")].output is True and rows[("a", "validate")].receipt is None
        assert rows[("a", "transform")].output == {"payload": json.dumps(items[0], sort_keys=True)}
        b_notify = rows[("b", "notify")]
        assert (b_notify.status, b_notify.error_type, b_notify.held_reason, b_notify.receipt, b_notify.output,
                b_notify.attempts) == (Status.FAILED, "TimeoutError", HeldReason.UNKNOWN_OUTCOME, None, None, 1)
        c_transform = rows[("c", "transform")]
        assert (c_transform.status, c_transform.error_type, c_transform.attempts, c_transform.side_effect) == (
            Status.FAILED, "KeyError", 1, False)
        c_validate = rows[("c", "validate")]
        assert c_validate.held_reason == HeldReason.INPUT_CHANGED
        assert c_validate.digest == digest_of(c_old)
        assert c_validate.new_digest == digest_of(c_new)
        for r in rows.values():
            assert r.created_at <= r.updated_at and r.updated_at.tzinfo is not None
        assert [r.step for r in journal.rows(JOB, "a")] == ["validate", "transform", "notify"]
        assert journal.rows(JOB, "nope") == [] and journal.rows("nope") == []

        # held(): all jobs, or one
        assert journal.held() == journal.held(JOB) == [
            HeldStep(JOB, "b", "notify", HeldReason.UNKNOWN_OUTCOME),
            HeldStep(JOB, "c", "validate", HeldReason.INPUT_CHANGED),
        ]
        assert journal.held("other/job") == [] and journal.held("crashed/job") == []

        # resolutions(): the audit log, oldest first, with who / when / what / evidence / prior state
        receipt_b = receiver.has(idempotency_key(JOB, "b", "notify"))
        assert receipt_b is None  # failed before the receiver accepted it
        first = journal.resolve(JOB, "b", "notify", delivered=False, resolved_by="alice", note="checked logs")
        second_res = journal.resolve_input_change(JOB, "c", use_new_input=True, resolved_by="bob")
        audit = journal.resolutions(JOB)
        assert audit == [first, second_res]
        assert (audit[0].job_id, audit[0].item_id, audit[0].step, audit[0].decision, audit[0].receipt,
                audit[0].note, audit[0].resolved_by, audit[0].previous_status, audit[0].previous_held_reason) == (
            JOB, "b", "notify", "not_delivered", None, "checked logs", "alice", "FAILED", "unknown_outcome")
        assert (audit[1].item_id, audit[1].step, audit[1].decision, audit[1].resolved_by, audit[1].note,
                audit[1].previous_held_reason) == ("c", "validate", "use_new_input", "bob", "", "input_changed")
        assert audit[0].id < audit[1].id and audit[0].resolved_at <= audit[1].resolved_at
        assert journal.resolutions("other/job") == []

        third = run_batch(journal, JOB, items, receiver.steps(), settle_in_task=False)
        assert third.status == "completed" and journal.held() == []
        attempts = {(r.item_id, r.step): r.attempts for r in journal.rows(JOB)}
        # not_delivered keeps the row (and its key): the failed attempt, then the one send after it.
        assert attempts[("b", "notify")] == 2
        assert attempts[("c", "transform")] == 2  # use_new_input keeps the row and runs it again
        assert receiver.count("b") == 1 and receiver.count("c") == 1 and receiver.count("a") == 1


def test_digest_ignores_key_order_and_whitespace(location):
    receiver = Receiver()
    with StepJournal(location) as journal:
        run_batch(journal, JOB, [{"id": "a", "x": 1, "y": [1, 2]}], receiver.steps(), settle_in_task=False)
        again = run_batch(journal, JOB, [{"y": [1, 2], "x": 1, "id": "a"}], receiver.steps(), settle_in_task=False)
        assert (again.executed_steps, again.skipped_steps, again.held) == (0, 3, [])
        assert {r.digest for r in journal.rows(JOB)} == {digest_of({"id": "a", "x": 1, "y": [1, 2]})}
        changed = run_batch(journal, JOB, [{"id": "a", "x": 1, "y": [2, 1]}], receiver.steps(), settle_in_task=False)
        assert changed.held == [HeldStep(JOB, "a", "validate", HeldReason.INPUT_CHANGED)]
    assert receiver.count("a") == 1


# --------------------------------------------------------------------------------- input change


@pytest.mark.parametrize("use_new_input", [False, True])
def test_input_change_is_held_then_resolved(location, use_new_input):
    receiver = Receiver()
    old, new = {"id": "x", "amount": 100}, {"id": "x", "amount": 250}
    with StepJournal(location) as journal:
        run_batch(journal, JOB, [old, {"id": "y"}], receiver.steps(), settle_in_task=False)
        held = run_batch(journal, JOB, [new, {"id": "y"}], receiver.steps(), settle_in_task=False)
        assert held.held == [HeldStep(JOB, "x", "validate", HeldReason.INPUT_CHANGED)]
        assert (held.executed_steps, held.skipped_steps, held.items_completed) == (0, 3, 1)
        # Neither skipped nor re-sent, however often it is run.
        assert run_batch(journal, JOB, [new, {"id": "y"}], receiver.steps(), settle_in_task=False).held == held.held
        assert receiver.count("x") == 1
        record = journal.rows(JOB, "x")[0]
        assert (record.digest, record.new_digest) == (digest_of(old), digest_of(new))

        resolution = journal.resolve_input_change(JOB, "x", use_new_input=use_new_input, resolved_by="carol",
                                                  note="ticket 42")
        assert resolution.decision == ("use_new_input" if use_new_input else "keep_previous_input")
        assert journal.held(JOB) == []

        after = run_batch(journal, JOB, [new, {"id": "y"}], receiver.steps(), settle_in_task=False)
        assert after.status == "completed" and after.held == []
        if use_new_input:
            # Processed from scratch: every step ran again and the receiver got the new input.
            assert (after.executed_steps, after.skipped_steps) == (3, 3)
            assert [json.loads(d[3]) for d in receiver.deliveries if d[1] == "x"] == [old, new]
            # The rows are kept (a send's key may have reached a receiver); the send moved to generation
            # 1: the new content went out under a new key.
            rows = {r.step: r for r in journal.rows(JOB, "x")}
            assert {s: (r.attempts, r.generation) for s, r in rows.items()} == {
                "validate": (2, 0), "transform": (2, 0), "notify": (2, 1)}
            keys = [d[2] for d in receiver.deliveries if d[1] == "x"]
            assert keys == [idempotency_key(JOB, "x", "notify"), idempotency_key(JOB, "x", "notify", 1)]
        else:
            # The new input counts as already handled: nothing ran, nothing was sent.
            assert (after.executed_steps, after.skipped_steps) == (0, 6)
            assert [json.loads(d[3]) for d in receiver.deliveries if d[1] == "x"] == [old]
        assert {r.digest for r in journal.rows(JOB, "x")} == {digest_of(new)}
        assert all(r.status == Status.SUCCEEDED and r.held_reason is None for r in journal.rows(JOB, "x"))
        # Settled: a further run does nothing.
        final = run_batch(journal, JOB, [new, {"id": "y"}], receiver.steps(), settle_in_task=False)
        assert (final.executed_steps, final.skipped_steps) == (0, 6)
        assert receiver.count("x") == (2 if use_new_input else 1)


def test_input_going_back_releases_the_hold(location):
    receiver = Receiver()
    with StepJournal(location) as journal:
        run_batch(journal, JOB, [{"id": "x", "v": 1}], receiver.steps(), settle_in_task=False)
        assert run_batch(journal, JOB, [{"id": "x", "v": 2}], receiver.steps(), settle_in_task=False).held
        assert journal.held(JOB)
        back = run_batch(journal, JOB, [{"id": "x", "v": 1}], receiver.steps(), settle_in_task=False)
        assert (back.status, back.executed_steps, back.skipped_steps) == ("completed", 0, 3)
        assert journal.held(JOB) == [] and journal.rows(JOB, "x")[0].new_digest is None
    assert receiver.count("x") == 1


def test_keep_previous_input_keeps_an_unknown_outcome_hold(location):
    """An item whose send outcome is unknown AND whose input changed: adopting the input does not
    settle the send - it stays held until someone asks the receiver."""
    receiver = Receiver()
    receiver.fail.add("x")
    with StepJournal(location) as journal:
        with pytest.raises(TimeoutError):
            run_batch(journal, JOB, [{"id": "x", "v": 1}], receiver.steps(), settle_in_task=False)
        changed = run_batch(journal, JOB, [{"id": "x", "v": 2}], receiver.steps(), settle_in_task=False)
        assert changed.held == [HeldStep(JOB, "x", "validate", HeldReason.INPUT_CHANGED)]
        assert journal.held(JOB) == changed.held
        # The failed send is not held yet (no run has verified it) but it is unresolved.
        assert sorted((r.step, r.status) for r in journal.open_rows(JOB)) == [("notify", Status.FAILED),
                                                                           ("validate", Status.SUCCEEDED)]
        journal.resolve_input_change(JOB, "x", use_new_input=False, resolved_by="dan")
        assert journal.held(JOB) == []
        assert journal.job(JOB).unresolved == 1 and not journal.job(JOB).settled
        again = run_batch(journal, JOB, [{"id": "x", "v": 2}], receiver.steps(), settle_in_task=False)
        assert again.held == [HeldStep(JOB, "x", "notify", HeldReason.UNKNOWN_OUTCOME)]
        assert (again.executed_steps, again.skipped_steps) == (0, 2)
        assert receiver.deliveries == []


def test_progress_is_reported_at_the_end_and_when_a_step_fails(tmp_path):
    reports = []

    def notify(item, ctx):
        if item["id"] == 3:
            raise TimeoutError("the receiver did not answer")
        return f"r{item['id']}"

    steps = [Step("validate", lambda item, ctx: None), Step("notify", notify, side_effect=True)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        try:
            run_batch(journal, "progress/job", [{"id": i} for i in range(1, 6)], steps, on_progress=reports.append,
                      progress_interval=3600, settle_in_task=False)
        except TimeoutError:
            pass
        else:
            raise AssertionError("the send's error must propagate")
        # Items 1 and 2 done, item 3's local step ran, its send failed: how far this run got (2 of 5
        # items done, not the 5 read in).
        assert [(p.items_done, p.items_total, p.executed_steps, p.skipped_steps, p.held) for p in reports] == [
            (2, 5, 5, 0, 0)]
        run_batch(journal, "progress/job", [{"id": i} for i in (1, 2, 4, 5)], steps, on_progress=reports.append,
                  progress_interval=3600, settle_in_task=False)
    assert [(p.items_done, p.items_total, p.executed_steps, p.skipped_steps) for p in reports[1:]] == [(4, 4, 4, 4)]


def test_progress_is_reported_by_time_between_items_not_per_chunk(tmp_path):
    """20 slow sends in one chunk: reports come while the chunk runs, each with the items done so far."""
    reports = []

    def notify(item, ctx):
        time.sleep(0.03)
        return f"r{item['id']}"

    steps = [Step("notify", notify, side_effect=True)]
    with StepJournal(tmp_path / "journal.sqlite3") as journal:
        run_batch(journal, "progress/slow", [{"id": i} for i in range(20)], steps, on_progress=reports.append,
                  progress_interval=0.1, settle_in_task=False)
    *during, final = reports
    assert (final.items_done, final.items_total, final.executed_steps) == (20, 20, 20)
    assert len(during) >= 2, reports  # 20 x 30 ms against a 0.1 s interval: several, however loaded
    done = [p.items_done for p in during]
    assert done == sorted(done) and 0 < done[0] < 20, done  # before the chunk of 20 was through
