"""Hardening: what a hostile or unlucky environment did to the journal. One test (or a few)
per finding, named after it; each failed on the code before its fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from airflow_resumable.journal import JournalLocationError, StepJournal
from tests.faces.test_cli import cli
from tests.support.crash_child import EXIT_BUSY, ChildRun
from tests.support.receivers import DurableReceiver
from tests.support.scenario import held_job

JOB = "hardening/job-1"


# -- 1. two paths to one journal must meet at one lock ------------------------------------------------


@pytest.mark.parametrize("durability", ["full", "normal"])
@pytest.mark.parametrize("other_path", ["symlink", "dotdot", "symlinked_folder"])
def test_finding_1_two_paths_to_one_journal_share_the_job_lock(tmp_path, durability, other_path):
    real = tmp_path / "worker" / "journal.sqlite3"
    real.parent.mkdir()
    with StepJournal(real):
        pass
    if other_path == "symlink":
        alias = tmp_path / "link.sqlite3"
        alias.symlink_to(real)
    elif other_path == "dotdot":
        alias = tmp_path / "worker" / ".." / "worker" / "journal.sqlite3"
    else:
        (tmp_path / "folder-link").symlink_to(real.parent)
        alias = tmp_path / "folder-link" / "journal.sqlite3"
    receiver_path = tmp_path / "receiver.sqlite3"
    receiver = DurableReceiver(receiver_path)

    first = ChildRun(tmp_path, real, receiver_path, JOB, durability=durability, pause_at="local",
                     pause_item="item-013")
    first.wait_ready()
    sent = receiver.counts(JOB)
    code, summary, err = ChildRun(tmp_path, alias, receiver_path, JOB, durability=durability).finish(timeout=60)
    assert code == EXIT_BUSY, (code, summary, err)
    assert receiver.counts(JOB) == sent  # the second path sent nothing
    assert first.kill()
    # Through the other path the journal is the same file, with the same rows.
    with StepJournal(alias) as via_alias, StepJournal(real) as via_real:
        assert via_alias.location == via_real.location == str(real)
        assert via_alias.rows(JOB) == via_real.rows(JOB)


def test_finding_1_a_hard_linked_journal_is_refused(tmp_path):
    real = tmp_path / "journal.sqlite3"
    with StepJournal(real):
        pass
    os.link(real, tmp_path / "other-name.sqlite3")
    before = real.read_bytes()
    for path in (real, tmp_path / "other-name.sqlite3"):
        with pytest.raises(JournalLocationError, match="2 hard links; open it through one path"):
            StepJournal(path)
    assert real.read_bytes() == before
    assert not Path(str(real) + ".locks").exists() or not any(Path(str(real) + ".locks").iterdir())


def test_finding_1_cli_resolve_through_a_symlink_commits_and_says_so(tmp_path):

    real = tmp_path / "journal.sqlite3"
    held_job(real, JOB)
    alias = tmp_path / "alias.sqlite3"
    alias.symlink_to(real)
    done = cli(alias, "resolve", JOB, "a", "send", "--not-delivered", "--resolved-by", "me")
    assert done.returncode == 0, done.stderr
    with StepJournal(real) as journal:
        assert journal.held(JOB) == [] and [r.decision for r in journal.resolutions(JOB)] == ["not_delivered"]


# -- 8. the receipt-log fold trusts only its own job's well-formed lines -------------------------------


def test_finding_8_a_log_under_one_jobs_name_does_not_touch_another_job(tmp_path):
    from airflow_resumable.journal import Status
    from tests.core.test_receipt_log import insert, log_line, row

    path = tmp_path / "journal.sqlite3"
    with StepJournal(path) as journal:
        foreign_log = journal.engine.receipt_log("some/other/job").path  # named after another job...
    insert(path, row("in-flight", "IN_FLIGHT", "d1"))
    foreign_log.parent.mkdir(exist_ok=True)
    foreign_log.write_bytes(log_line("in-flight", "d1", "forged"))  # ...naming the victim's job inside
    with StepJournal(path) as journal:
        (victim,) = journal.rows("receipts/job")
    assert (victim.status, victim.receipt) == (Status.IN_FLIGHT, None)


@pytest.mark.parametrize("at", ['"yesterday"', "null", "true", "1e999", "[1]"])
def test_finding_8_a_line_with_a_bad_timestamp_is_not_folded_and_reads_keep_working(tmp_path, at):
    import json

    from airflow_resumable.journal import Status
    from tests.core.test_receipt_log import JOB as LOG_JOB
    from tests.core.test_receipt_log import insert, row

    path = tmp_path / "journal.sqlite3"
    with StepJournal(path) as journal:
        log = journal.engine.receipt_log(LOG_JOB).path
    insert(path, row("in-flight", "IN_FLIGHT", "d1"))
    log.parent.mkdir(exist_ok=True)
    line = json.dumps([LOG_JOB, "in-flight", "notify", "d1", '"r"', "r", 0])[:-2] + at + "]"
    log.write_bytes(line.encode() + b"\n")
    with StepJournal(path) as journal:
        (kept,) = journal.rows(LOG_JOB)  # rows() used to raise TypeError on a folded string timestamp
        assert kept.status == Status.IN_FLIGHT
        assert journal.jobs()[0].job_id == LOG_JOB


# -- 5. the wrong-worker guard must not fire on the right worker ---------------------------------------


@pytest.mark.airflow
def test_finding_5_a_try_that_failed_on_a_bad_item_does_not_block_the_retry_on_the_same_worker(airflow):
    from tests.airflow_layer.test_airflow_layer import ALL_ITEMS, arm, output, receiver

    arm(airflow, "batch", "bad_item")
    assert airflow.dags_test("guard_bad_item_once").returncode == 0, output(airflow)[-4000:]
    assert airflow.task_states("guard_bad_item_once") == {("send", -1): ("success", 2)}
    assert "InvalidItemError" in output(airflow) and "WrongWorkerError" not in output(airflow)
    counts = receiver(airflow).counts()
    assert sorted(counts) == ALL_ITEMS and set(counts.values()) == {1}


@pytest.mark.airflow
def test_finding_5_a_try_that_could_not_open_the_journal_does_not_block_the_retry(airflow):
    from tests.airflow_layer.test_airflow_layer import ALL_ITEMS, output, receiver

    airflow.journal.parent.parent.mkdir(parents=True, exist_ok=True)
    airflow.journal.parent.write_text("a file where the journal's folder should be")
    assert airflow.dags_test("guard_journal_unopenable_once").returncode == 0, output(airflow)[-4000:]
    assert airflow.task_states("guard_journal_unopenable_once") == {("send", -1): ("success", 2)}
    assert "cannot open the journal" in output(airflow)
    assert "WrongWorkerError" not in output(airflow)
    counts = receiver(airflow).counts()
    assert sorted(counts) == ALL_ITEMS and set(counts.values()) == {1}


# -- 7. the CLI: no terminal escapes, no spreadsheet formulas, no journal out of a typo, bugs are bugs ---


def journal_with_ids(path: Path, ids: list[str]) -> None:
    from airflow_resumable.runner import Step, run_batch

    with StepJournal(path) as journal:
        run_batch(journal, JOB, [{"id": i} for i in ids], [Step("send", lambda item, ctx: ctx.item_id, side_effect=True)],
                  settle_in_task=False)


def test_finding_7_show_never_prints_raw_escape_sequences(tmp_path):
    path = tmp_path / "journal.sqlite3"
    hostile = ["\x1b]0;pwned\x07\x1b[2J", "bidi-\u202eexe.txt", "line\nbreak", "zero\u200bwidth", "bell\x07"]
    journal_with_ids(path, hostile)
    for command in (["show", JOB], ["held", JOB], ["audit", JOB], ["jobs"]):
        out = cli(path, *command)
        assert out.returncode == 0, out.stderr
        assert not any(ch in out.stdout for ch in "\x1b\x07\u202e\u200b"), (command, out.stdout)
    shown = cli(path, "show", JOB).stdout
    assert "\\x1b]0;pwned\\x07\\x1b[2J" in shown and "bidi-\\u202eexe.txt" in shown and "line\\x0abreak" in shown
    assert len(shown.strip().splitlines()) == 1 + len(hostile)  # one line per row
    # --json stays exact (and escaped by JSON itself)
    rows = json.loads(cli(path, "--json", "show", JOB).stdout)
    assert sorted(r["item_id"] for r in rows) == sorted(hostile)


def test_finding_7_export_csv_quotes_cells_a_spreadsheet_would_run(tmp_path):
    import csv
    import io

    path = tmp_path / "journal.sqlite3"
    formulas = ["=HYPERLINK(\"http://x\")", "+1+1", "-2+3", "@SUM(A1)", "\tTAB", "plain"]
    journal_with_ids(path, formulas)
    out = cli(path, "export", JOB, "--format", "csv")
    assert out.returncode == 0, out.stderr
    cells = {row["item_id"]: row for row in csv.DictReader(io.StringIO(out.stdout))}
    assert set(cells) == {"'" + f for f in formulas[:-1]} | {"plain"}
    for row in cells.values():
        assert not any(str(v).startswith(("=", "+", "-", "@", "\t")) for v in row.values()), row


@pytest.mark.parametrize("command", [["prune", "--older-than", "30d"], ["held"], ["jobs"], ["show", JOB],
                                     ["resolve", JOB, "a", "send", "--not-delivered", "--resolved-by", "me"]])
def test_finding_7_no_command_creates_a_journal_from_a_typo(tmp_path, command):
    typo = tmp_path / "jounral.sqlite3"
    out = cli(typo, *command)
    assert out.returncode == 1 and "no journal at" in out.stderr, (out.returncode, out.stderr)
    assert list(tmp_path.iterdir()) == []


def test_finding_7_a_bug_is_not_reported_as_a_refusal(tmp_path, monkeypatch, capsys):
    from airflow_resumable.cli import command_line as cli_module

    path = tmp_path / "journal.sqlite3"
    journal_with_ids(path, ["a"])

    def broken(self, job_id=None, **paging):
        raise ValueError("an internal bug")

    monkeypatch.setattr(StepJournal, "held", broken)
    assert cli_module.main(["--journal", str(path), "held"]) == cli_module.EXIT_BUG
    err = capsys.readouterr().err
    assert "refused" not in err and "internal error" in err and "Traceback" in err


# -- 6. the UI: one URL per job, every listed job has a page, a page view writes nothing ---------------

LONG_JOB = "hardening_dag/send/" + "r" * 1500
PLAIN_JOB = "hardening_dag/send/run-1"
JSON_NAMED_JOB = PLAIN_JOB + ".json"
LOGGED_JOB = "hardening_dag/send/run-with-a-receipt-log"
HELD_JOB = "hardening_dag/send/run-with-held-items"


@pytest.fixture(scope="module")
def ui_server(airflow_template, tmp_path_factory):
    from airflow_resumable.runner import Step, run_batch
    from tests.core.test_receipt_log import log_line
    from tests.support import airflow_server

    tmp = tmp_path_factory.mktemp("ui-hardening")
    journal_path = tmp / "worker" / "journal.sqlite3"
    send = [Step("send", lambda item, ctx: f"rcpt-{ctx.job_id[-8:]}-{item['id']}", side_effect=True)]
    with StepJournal(journal_path) as journal:
        run_batch(journal, PLAIN_JOB, [{"id": "plain-item"}], send, settle_in_task=False)
        run_batch(journal, JSON_NAMED_JOB, [{"id": "json-named-item"}], send, settle_in_task=False)
        run_batch(journal, LONG_JOB, [{"id": "long-item"}], send, settle_in_task=False)
        # A dead runner's send: IN_FLIGHT in the journal, its receipt only in the receipt log.
        with journal.open_job(LOGGED_JOB) as run:
            run.mark_in_flight("in-flight", "notify", "d1")
            run.flush(durable=True)
        log = journal.engine.receipt_log(LOGGED_JOB).path
    held_job(journal_path, HELD_JOB, "held-1")
    held_job(journal_path, HELD_JOB, "held-2")
    log.write_bytes(log_line("in-flight", "d1", "rcpt-in-log").replace(b"receipts/job", LOGGED_JOB.encode()))
    srv = airflow_server.api_server(airflow_template, tmp, {"AIRFLOW__RESUMABLE__JOURNAL_PATH": str(journal_path)})
    srv.journal, srv.receipt_log = journal_path, log
    try:
        yield srv
    finally:
        srv.stop()


def _get(server, path: str, accept: str = "application/json"):
    from tests.support import airflow_server

    return airflow_server.get(server.url + "/resumable" + path, bearer=airflow_server.token(server.url, "admin"),
                              accept=accept)


@pytest.mark.airflow
def test_finding_6_a_job_id_ending_in_json_has_its_own_page_and_json(ui_server):
    from html import unescape
    from urllib.parse import quote

    status, _, page = _get(ui_server, f"/jobs/{quote(JSON_NAMED_JOB, safe='')}", accept="text/html")
    assert status == 200 and page.lstrip().startswith("<!doctype html>"), page[:300]
    assert JSON_NAMED_JOB in unescape(page.replace("<wbr>", ""))
    status, _, body = _get(ui_server, f"/api/jobs/{quote(JSON_NAMED_JOB, safe='')}")
    assert status == 200 and json.loads(body)["job"]["job_id"] == JSON_NAMED_JOB
    status, _, body = _get(ui_server, f"/api/jobs/{quote(PLAIN_JOB, safe='')}")
    assert status == 200 and json.loads(body)["job"]["job_id"] == PLAIN_JOB


@pytest.mark.airflow
def test_finding_6_every_listed_job_has_a_page_however_long_its_id(ui_server):
    from urllib.parse import quote

    status, _, body = _get(ui_server, "/jobs.json")
    listed = {j["job_id"] for j in json.loads(body)["jobs"]}
    assert LONG_JOB in listed
    for job_id in listed:
        status, _, page = _get(ui_server, f"/jobs/{quote(job_id, safe='')}", accept="text/html")
        assert status == 200, (len(job_id), status)
        status, _, body = _get(ui_server, f"/api/jobs/{quote(job_id, safe='')}")
        assert status == 200 and json.loads(body)["job"]["job_id"] == job_id


@pytest.mark.airflow
def test_finding_6_a_page_view_writes_nothing(ui_server):
    from urllib.parse import quote

    from tests.support.backends import snapshot

    before = snapshot(str(ui_server.journal))
    log_before = ui_server.receipt_log.read_bytes()
    for path in ("/", "/jobs.json", f"/jobs/{quote(LOGGED_JOB, safe='')}", f"/api/jobs/{quote(LOGGED_JOB, safe='')}"):
        accept = "application/json" if "json" in path or "/api/" in path else "text/html"
        status, _, _ = _get(ui_server, path, accept=accept)
        assert status == 200, path
    assert snapshot(str(ui_server.journal)) == before  # the dead runner's receipt was not folded by a reader
    assert ui_server.receipt_log.read_bytes() == log_before


# -- 4. a full disk is a full disk, not corruption; readers work on it ------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """A real 8 MiB filesystem (tmpfs), so that the disk really fills up. Needs root (CI runs as root)."""
    import subprocess

    mount = tmp_path / "small-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mount)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs as root and must be able to mount a tmpfs: {done.stderr}")
        pytest.skip(f"mounting a small tmpfs needs root: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave: int = 0) -> Path:
    """Fill ``disk`` to the last byte but ``leave``; returns the filler file (delete it to free the space)."""
    spare = disk / "spare"
    spare.write_bytes(b"\0" * leave)
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 4096, 512, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                continue
    finally:
        os.close(fd)
    spare.unlink()
    return filler


def test_finding_4_a_full_disk_is_reported_as_such_and_nothing_is_lost(small_disk):
    from airflow_resumable.exceptions import JournalCorruptError, JournalDiskFullError
    from airflow_resumable.journal import Status
    from airflow_resumable.runner import Step, run_batch

    path = small_disk / "journal.sqlite3"
    sent: list[str] = []
    steps = [Step("transform", lambda item, ctx: "x" * 1000),
             Step("send", lambda item, ctx: sent.append(ctx.item_id) or f"r-{ctx.item_id}", side_effect=True)]
    items = [{"id": f"item-{i:04d}"} for i in range(300)]
    with StepJournal(path) as journal:
        run_batch(journal, JOB, items[:10], steps, settle_in_task=False)
    filler = fill(small_disk, leave=256 * 1024)  # room for some of the batch, not all of it
    with pytest.raises(JournalDiskFullError) as caught, StepJournal(path) as journal:
        run_batch(journal, JOB, items, steps, settle_in_task=False)
    message = str(caught.value)
    assert "is full" in message and "Free space" in message and "restore it from a backup" not in message
    assert not isinstance(caught.value, JournalCorruptError)
    assert 10 < len(sent) < len(items)  # the full disk stopped the run part way

    filler.unlink()  # the operator frees space and retries
    with StepJournal(path) as journal:
        result = run_batch(journal, JOB, items, steps, settle_in_task=False)
        rows = journal.rows(JOB)
    assert result.status == "completed" or result.held
    delivered = {r.item_id for r in rows if r.step == "send" and r.status == Status.SUCCEEDED}
    # Nothing sent twice; every item sent once unless held for a human (an outcome the full disk hid).
    assert len(sent) == len(set(sent))
    assert delivered | {h.item_id for h in result.held} == {i["id"] for i in items}


def test_finding_4_reading_works_on_a_full_disk(small_disk):

    path = small_disk / "journal.sqlite3"
    held_job(path, JOB)
    with StepJournal(path) as journal:  # a dead runner's receipt log: a writer's open would fold it
        log = journal.engine.receipt_log(JOB).path
    log.write_bytes(b"")
    fill(small_disk)
    for command in (["held", JOB], ["show", JOB], ["jobs"], ["audit", JOB], ["export", JOB]):
        done = cli(path, *command)
        assert done.returncode == 0, (command, done.stderr)
    held = cli(path, "--json", "held", JOB)
    assert [h["item_id"] for h in json.loads(held.stdout)] == ["a"]


# -- 10. the demo receiver: a time on every delivery, room for a burst of connections -------------------


def test_finding_10_received_at_is_recorded_on_any_sqlite(tmp_path):
    import sqlite3
    import time

    from airflow_resumable.demo_receiver import ReceiverStore

    store = ReceiverStore(tmp_path / "receiver.sqlite3", dedupe=False)
    before = time.time()
    store.accept("k1", "item-1", "{}")
    after = time.time()
    conn = sqlite3.connect(tmp_path / "receiver.sqlite3")
    (received_at,) = conn.execute("SELECT received_at FROM deliveries").fetchone()
    (schema,) = conn.execute("SELECT sql FROM sqlite_master WHERE name = 'deliveries'").fetchone()
    assert received_at is not None and before <= received_at <= after
    assert "unixepoch" not in schema  # SQLite < 3.42 has no unixepoch('subsec'): the column stayed NULL


def test_finding_10_a_burst_of_connections_is_not_refused(tmp_path):
    import socket

    from airflow_resumable.demo_receiver import serve

    server = serve(0, tmp_path / "receiver.sqlite3")  # listening, not accepting yet: the backlog holds them
    try:
        port = server.server_address[1]
        sockets = []
        for _ in range(48):  # three times concurrency=16
            sock = socket.create_connection(("127.0.0.1", port), timeout=2)
            sockets.append(sock)
        for sock in sockets:
            sock.close()
    finally:
        server.server_close()


# -- 2. settling a held item needs the right to act on the job's DAG ------------------------------------


def _post(server, path: str, body, user: str | None = "admin", content_type: str = "application/json"):
    import urllib.error
    import urllib.request

    from tests.support import airflow_server

    headers = {"Content-Type": content_type, "Accept": "application/json"}
    if user:
        headers["Authorization"] = f"Bearer {airflow_server.token(server.url, user)}"
    data = json.dumps(body).encode() if content_type == "application/json" else body.encode()
    request = urllib.request.Request(server.url + "/resumable" + path, data=data, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")


@pytest.mark.airflow
def test_finding_2_a_user_who_may_only_read_the_dag_cannot_settle_its_items(ui_server):
    from urllib.parse import quote

    from tests.support import airflow_server
    from tests.support.backends import snapshot

    decision = {"job_id": HELD_JOB, "item_id": "held-1", "step": "send", "decision": "delivered", "receipt": "r-1"}
    before = snapshot(str(ui_server.journal))
    viewer = airflow_server.token(ui_server.url, "viewer")
    query = f"job_id={quote(HELD_JOB, safe='')}&item_id=held-1&step=send"
    status, _, page = airflow_server.get(ui_server.url + "/resumable/resolve?" + query, bearer=viewer,
                                         accept="text/html")
    assert status == 200 and 'id="not-allowed"' in page and "resolve-form" not in page  # reads, cannot act
    status, answer = _post(ui_server, "/api/resolve", decision, user="viewer")
    assert status == 403 and "edit permission on the job's DAG" in answer["detail"], answer
    assert _post(ui_server, "/api/resolve", decision, user=None)[0] in (401, 403)  # not signed in
    # A cross-site form cannot post it: only JSON is taken.
    form = "job_id=x&item_id=held-1&step=send&decision=not_delivered"
    assert _post(ui_server, "/api/resolve", form, content_type="application/x-www-form-urlencoded")[0] in (415, 422)
    assert snapshot(str(ui_server.journal)) == before


@pytest.mark.airflow
def test_finding_2_a_user_who_may_act_on_the_dag_settles_it_as_themself(ui_server):
    bad = {"job_id": HELD_JOB, "item_id": "held-2", "step": "send", "decision": "delivered"}  # no receipt
    status, answer = _post(ui_server, "/api/resolve", bad)
    assert status == 422 and "receipt" in answer["detail"], answer
    good = {**bad, "receipt": "rcpt-held-2", "note": "the receiver has it"}
    status, answer = _post(ui_server, "/api/resolve", good)
    assert status == 200 and (answer["decision"], answer["resolved_by"]) == ("delivered", "admin"), answer
    with StepJournal(ui_server.journal) as journal:
        (audit,) = [a for a in journal.resolutions(HELD_JOB) if a.item_id == "held-2"]
        assert (audit.resolved_by, audit.receipt, audit.note) == ("admin", "rcpt-held-2", "the receiver has it")
        assert [h.item_id for h in journal.held(HELD_JOB)] == ["held-1"]
    assert _post(ui_server, "/api/resolve", good)[0] == 404  # settled already: nothing to do


@pytest.mark.airflow
def test_the_job_page_settles_several_held_items_at_once_all_or_nothing(ui_server):
    """POST /api/resolve-many (the job page's form), as the signed-in user, all or nothing."""
    from tests.support.backends import snapshot

    job = "hardening_dag/send/run-with-three-held"
    for item in ("h-1", "h-2", "h-3"):
        held_job(ui_server.journal, job, item)
    before = snapshot(str(ui_server.journal))
    bad = {"job_id": job, "note": "checked", "decisions": [
        {"item_id": "h-1", "step": "send", "decision": "not_delivered"},
        {"item_id": "h-2", "step": "send", "decision": "delivered"}]}  # no receipt
    status, answer = _post(ui_server, "/api/resolve-many", bad)
    assert status == 422 and "entry 2" in answer["detail"] and "nothing was changed" in answer["detail"], answer
    assert _post(ui_server, "/api/resolve-many", {**bad, "decisions": bad["decisions"][:1]}, user="viewer")[0] == 403
    assert snapshot(str(ui_server.journal)) == before
    good = {**bad, "decisions": [bad["decisions"][0], {**bad["decisions"][1], "receipt": "rcpt-h-2"}]}
    status, answer = _post(ui_server, "/api/resolve-many", good)
    assert status == 200 and (answer["count"], answer["resolved_by"]) == (2, "admin"), answer
    with StepJournal(ui_server.journal) as journal:
        audit = {a.item_id: (a.decision, a.receipt, a.resolved_by, a.note) for a in journal.resolutions(job)}
        assert audit == {"h-1": ("not_delivered", None, "admin", "checked"), "h-2": ("delivered", "rcpt-h-2", "admin",
                                                                                      "checked")}
        assert [h.item_id for h in journal.held(job)] == ["h-3"]
    status, _, page = _get(ui_server, f"/jobs/{job.replace('/', '%2F')}", accept="text/html")
    assert status == 200 and 'id="bulk-form"' in page and 'data-item="h-3"' in page and 'data-item="h-1"' not in page


@pytest.mark.airflow
def test_finding_2_the_resolve_dag_settles_only_the_dags_it_is_given(airflow):
    """The worker-side path: a resolve DAG limited with job_dag_ids refuses other DAGs' jobs."""
    from tests.airflow_layer.test_airflow_layer import output

    held_job(airflow.journal, "other_team_dag/send/run-1", "x")
    conf = {"job_id": "other_team_dag/send/run-1", "item_id": "x", "step": "send", "decision": "not_delivered",
            "resolved_by": "someone"}
    assert airflow.dags_test("resolve_team_a", conf).returncode != 0
    assert "which this resolve DAG may not settle" in output(airflow)
    with StepJournal(airflow.journal) as journal:
        assert [h.item_id for h in journal.held("other_team_dag/send/run-1")] == ["x"]


# -- from the code review ------------------------------------------------------------------------------


def test_one_error_root_catches_every_error_the_provider_raises():
    import inspect

    import airflow_resumable.exceptions as exceptions
    from airflow_resumable.exceptions import JournalConfigError, ReceiverError, ResolutionRefused, ResumableError
    from airflow_resumable.operators.resumable_batch import HeldItemsError, WrongWorkerError
    from airflow_resumable.runner import InvalidItemError

    journal = [c for _, c in inspect.getmembers(exceptions, inspect.isclass) if issubclass(c, exceptions.JournalError)]
    others = [JournalConfigError, ReceiverError, ResolutionRefused, HeldItemsError, WrongWorkerError, InvalidItemError]
    assert len(journal) >= 10
    for error in journal + others:
        assert issubclass(error, ResumableError), error
    with pytest.raises(ResumableError):  # e.g. a bad item, caught by the root
        from airflow_resumable.runner import Step, run_batch

        with StepJournal(Path(__import__("tempfile").mkdtemp()) / "j.sqlite3") as journal_:
            run_batch(journal_, JOB, [{"id": None}], [Step("s", lambda item, ctx: 1)], settle_in_task=False)


# -- found under load: processes creating one journal at the same moment -------------


def test_a_journal_created_by_another_process_between_two_reads_is_not_foreign(tmp_path):
    """The suite under load caught it: a process read "schema version 0" just before another process
    committed the new journal's tables, then saw the tables, and took the new journal for a foreign
    database. Here the other process (a real one) creates the journal right after the first statement
    our open runs: the check must read version and tables in one snapshot."""
    import subprocess
    import sys

    from airflow_resumable.journal.sqlite import SqliteBackend

    path = tmp_path / "journal.sqlite3"
    create = [sys.executable, "-c", "import sys; from airflow_resumable.journal import StepJournal; "
              "StepJournal(sys.argv[1]).close()", str(path)]

    class OtherProcessCreatesItMeanwhile:
        def __init__(self, conn):
            self.conn, self.statements, self.last = conn, 0, None

        def execute(self, *args):
            self.statements += 1
            if self.statements == 2:  # between the open's first read of the file and its second
                self.last.close()  # (our read is over: no lock held while the other process writes)
                subprocess.run(create, check=True, timeout=120)
            self.last = self.conn.execute(*args)
            return self.last

        def __getattr__(self, name):
            return getattr(self.conn, name)

    class RacyEngine(SqliteBackend):
        @property
        def _connection(self):
            if not hasattr(self, "_racy"):
                self._racy = OtherProcessCreatesItMeanwhile(super()._connection)
            return self._racy

    journal = StepJournal.on(RacyEngine(path))
    try:
        assert journal.journal_id and journal.jobs() == []
    finally:
        journal.close()


def test_a_journal_folder_made_by_another_process_meanwhile_is_fine(tmp_path, monkeypatch):
    """Found under load: eight processes opening one new journal; one made the folder between another's
    "does it exist?" and its mkdir, which then failed with FileExistsError."""
    folder = tmp_path / "journal"
    real_mkdir = Path.mkdir

    def made_meanwhile(self, *args, **kwargs):
        if self == folder and not os.path.isdir(folder):
            os.mkdir(folder)  # the other process, after our "does it exist?" and before our mkdir
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", made_meanwhile)
    with StepJournal(folder / "journal.sqlite3") as journal:
        assert journal.jobs() == []
