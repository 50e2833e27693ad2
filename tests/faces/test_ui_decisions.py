"""Decisions on the "Resumable jobs" page are made against what was seen, by whoever may act on the
job's DAG, and bad text is refused with its reason.

A real `airflow api-server` on 127.0.0.1 per journal engine (a SQLite file; PostgreSQL through an
Airflow connection), real `run_batch` runs writing the journal, and an auth manager that grants some
users single DAGs (as FAB or Keycloak do per DAG): `reports_editor` may read and edit DAG `reports`
only, `payments_editor` DAG `payments` only; `admin` may do anything, `viewer` read every DAG.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
import shutil
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from html import unescape
from typing import Any
from urllib.parse import quote, urlencode

import pytest

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, StepContext, run_batch
from tests.support import airflow_server
from tests.support.airflow_harness import base_env
from tests.support.backends import snapshot

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

ROLES = {"admin": "admin", "viewer": "viewer", "reports_editor": "user", "payments_editor": "user"}
PASSWORDS = {**airflow_server.USERS, "reports_editor": "reports-password", "payments_editor": "payments-password"}
DAG_GRANTS = {"reports_editor": ["reports"], "payments_editor": ["payments"]}
GRANTS_ENV = "RESUMABLE_TEST_DAG_GRANTS"


# ------------------------------------------------------------------ an auth manager granting single DAGs


@functools.cache
def _dag_scoped_auth_manager() -> type:
    from airflow.api_fastapi.auth.managers.models.resource_details import DagDetails
    from airflow.api_fastapi.auth.managers.simple.simple_auth_manager import SimpleAuthManager

    grants: dict[str, list[str]] = json.loads(os.environ.get(GRANTS_ENV, "{}"))

    class DagScopedAuthManager(SimpleAuthManager):
        """SimpleAuthManager, except that the users named in $RESUMABLE_TEST_DAG_GRANTS may access only
        the DAGs listed for them: a question about all DAGs (no DAG id) is answered no for them."""

        def is_authorized_dag(self, *, method, user, access_entity=None, details=None):
            dags = grants.get(user.get_name())
            if dags is not None and (details is None or details.id not in dags):
                return False
            return super().is_authorized_dag(method=method, user=user, access_entity=access_entity, details=details)

        def get_authorized_dag_ids(self, *, user, method="GET", session=None):
            dags = grants.get(user.get_name())
            if dags is None:
                return super().get_authorized_dag_ids(user=user, method=method)
            return {d for d in dags if self.is_authorized_dag(method=method, user=user, details=DagDetails(id=d))}

    return DagScopedAuthManager


def __getattr__(name: str) -> Any:
    # The API server loads its auth manager by dotted name (tests.faces.test_ui_decisions.DagScopedAuthManager);
    # built on demand, so that this test process never imports Airflow's API code.
    if name == "DagScopedAuthManager":
        return _dag_scoped_auth_manager()
    raise AttributeError(name)


# ------------------------------------------------------------------------------ the page, per engine


@dataclass
class Page:
    server: airflow_server.Server
    journal: str  # a SQLite file or a PostgreSQL URL: what the runs write and snapshot() reads
    tokens: dict[str, str] = field(default_factory=dict)

    def token(self, user: str) -> str:
        if user not in self.tokens:
            body = json.dumps({"username": user, "password": PASSWORDS[user]}).encode()
            request = urllib.request.Request(self.server.url + "/auth/token", data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=airflow_server.CALL_TIMEOUT) as response:
                self.tokens[user] = json.loads(response.read())["access_token"]
        return self.tokens[user]

    def get(self, path: str, user: str = "admin", accept: str = "application/json") -> tuple[int, str]:
        status, _, body = airflow_server.get(self.server.url + "/resumable" + path, bearer=self.token(user),
                                             accept=accept)
        return status, body

    def json(self, path: str, user: str = "admin") -> Any:
        status, body = self.get(path, user)
        assert status == 200, (path, status, body)
        return json.loads(body)

    def post(self, path: str, body: Mapping[str, Any] | bytes, user: str = "admin") -> tuple[int, Any]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()  # json.dumps writes \ud800 as an escape
        request = urllib.request.Request(self.server.url + "/resumable" + path, data=data, method="POST", headers={
            "Authorization": f"Bearer {self.token(user)}", "Content-Type": "application/json",
            "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=airflow_server.CALL_TIMEOUT) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            text = exc.read().decode(errors="replace")
            try:
                return exc.code, json.loads(text)
            except ValueError:
                return exc.code, text


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def page(request, airflow_template, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"ui-decisions-{request.param}")
    if request.param == "sqlite":
        journal = str(tmp / "worker" / "journal.sqlite3")
        config = {"AIRFLOW__RESUMABLE__JOURNAL_PATH": journal}
    else:
        from tests.airflow_layer.test_airflow_shared_journal import CONN_ID, connection

        journal = request.getfixturevalue("postgres").new_database()
        config = {f"AIRFLOW_CONN_{CONN_ID.upper()}": connection(journal),
                  "AIRFLOW__RESUMABLE__JOURNAL_CONN_ID": CONN_ID}
    home = tmp / "airflow"
    shutil.copytree(airflow_template, home)
    port = airflow_server.free_port()
    env = airflow_server.server_env({**base_env(home), **config}, home, port)
    passwords = home / "passwords-by-dag.json"
    passwords.write_text(json.dumps(PASSWORDS))
    env.update({
        "AIRFLOW__CORE__AUTH_MANAGER": f"{__name__}.DagScopedAuthManager",
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": ",".join(f"{user}:{role}" for user, role in ROLES.items()),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(passwords),
        GRANTS_ENV: json.dumps(DAG_GRANTS),
    })
    server = airflow_server.start(["api-server", "--port", str(port), "--host", "127.0.0.1", "--workers", "1"],
                                  env, f"http://127.0.0.1:{port}", tmp / "api-server.log")
    try:
        yield Page(server, journal)
    finally:
        server.stop()


# ------------------------------------------------------------------------------------ the journal


def _lost_reply(item: Mapping[str, Any], ctx: StepContext) -> str:
    raise ConnectionError("the receiver's reply was lost")


SENDS = [Step("send", _lost_reply, side_effect=True)]


def _run_until_held(journal: StepJournal, job_id: str, item_ids: Sequence[str], dag_id: str | None) -> list[str]:
    # Each run loses one send's reply (and stops there); the next holds it and goes on to the next send.
    for _ in range(len(item_ids) + 1):
        try:
            result = run_batch(journal, job_id, [{"id": i} for i in item_ids], SENDS, dag_id=dag_id, settle_in_task=False)
        except ConnectionError:
            continue
        return sorted(h.item_id for h in result.held)
    raise AssertionError("the runs never went through the batch")


def held_job(location: str, job_id: str, item_ids: Sequence[str], *, dag_id: str | None) -> dict[str, str]:
    """A job (run by DAG ``dag_id``) whose sends of ``item_ids`` all lost their replies and are held.
    Returns each held step's version as the journal shows it."""
    with StepJournal(location) as journal:
        assert _run_until_held(journal, job_id, item_ids, dag_id) == sorted(item_ids)
        return {h.item_id: h.version for h in journal.held(job_id)}


def held_again(location: str, job_id: str, item_id: str, *, dag_id: str | None) -> str:
    """Someone else settles the send as not delivered, the next run re-sends it, its reply is lost
    again and a run holds it again: the same step, held for the same reason, after other events.
    Returns its version now."""
    with StepJournal(location) as journal:
        journal.resolve(job_id, item_id, "send", delivered=False, resolved_by="someone-else",
                        note="the receiver had no record")
        _run_until_held(journal, job_id, [item_id], dag_id)
        (now,) = [h for h in journal.held(job_id) if h.item_id == item_id]
        return now.version


def job_path(job_id: str) -> str:
    return quote(job_id, safe="")


def resolve_form(page: Page, job_id: str, item_id: str, user: str = "admin") -> str:
    status, html = page.get("/resolve?" + urlencode({"job_id": job_id, "item_id": item_id, "step": "send"}),
                            user, accept="text/html")
    assert status == 200, html
    return html


def shown_version(form_html: str) -> str:
    match = re.search(r'<input type="hidden" id="version" name="version" value="([^"]*)">', form_html)
    assert match, form_html
    return unescape(match.group(1))


# ---------------------------------------------------------------------------------- versions


def test_the_pages_json_and_forms_carry_each_held_steps_version(page):
    job = "payments/send/versions-shown"
    versions = held_job(page.journal, job, ["a", "b"], dag_id="payments")
    detail = page.json(f"/api/jobs/{job_path(job)}")
    assert detail["job"]["dag_id"] == "payments"
    assert {r["item_id"]: r["version"] for r in detail["open_rows"]} == versions
    listed = page.json("/jobs.json")
    assert {h["item_id"]: h["version"] for h in listed["held"] if h["job_id"] == job} == versions
    # The Resolve form keeps the version it showed; so does each row of "Resolve several".
    assert shown_version(resolve_form(page, job, "a")) == versions["a"]
    status, html = page.get(f"/jobs/{job_path(job)}", accept="text/html")
    assert status == 200
    for item, version in versions.items():
        assert f'data-item="{item}" data-step="send" data-version="{version}"' in html


def test_a_resolve_form_posted_after_its_step_changed_is_refused_with_409_and_changes_nothing(page):
    job = "payments/send/stale-form"
    held_job(page.journal, job, ["a"], dag_id="payments")
    seen = shown_version(resolve_form(page, job, "a"))
    # Meanwhile someone else settled it and a run held it again: it looks the same, it is not the same.
    now = held_again(page.journal, job, "a", dag_id="payments")
    assert now != seen
    before = snapshot(page.journal)
    decision = {"job_id": job, "item_id": "a", "step": "send", "decision": "delivered", "receipt": "rcpt-a",
                "note": "the receiver has it", "version": seen}
    status, answer = page.post("/api/resolve", decision)
    assert status == 409, answer
    assert "changed since it was looked at" in answer["detail"] and "nothing was changed" in answer["detail"].lower()
    assert snapshot(page.journal) == before
    # Looked at again, the same decision applies.
    status, answer = page.post("/api/resolve", {**decision, "version": shown_version(resolve_form(page, job, "a"))})
    assert status == 200 and answer["decision"] == "delivered", answer


def test_the_resolve_form_posts_an_items_id_with_line_breaks_as_it_is(page):
    """A text field's value drops an id's line breaks: the form posts the ids it shows from JSON."""
    job, item = "payments/send/line-breaks", "line\r\nbreak\n"
    versions = held_job(page.journal, job, [item], dag_id="payments")
    html = resolve_form(page, job, item)
    match = re.search(r"data-step-ids='([^']*)'", html)
    assert match, html
    ids = json.loads(unescape(match.group(1)))
    assert ids == {"job_id": job, "item_id": item, "step": "send"}
    status, answer = page.post("/api/resolve", {**ids, "decision": "delivered", "receipt": "rcpt-lines",
                                                "note": "", "version": shown_version(html)})
    assert status == 200 and answer["item_id"] == item and versions[item], answer


def test_resolve_several_with_one_stale_entry_applies_none(page):
    job = "payments/send/stale-several"
    held_job(page.journal, job, ["a", "b"], dag_id="payments")
    seen = {r["item_id"]: r["version"] for r in page.json(f"/api/jobs/{job_path(job)}")["open_rows"]}
    held_again(page.journal, job, "b", dag_id="payments")
    before = snapshot(page.journal)
    status, answer = page.post("/api/resolve-many", {"job_id": job, "note": "checked both", "decisions": [
        {"item_id": "a", "step": "send", "decision": "not_delivered", "version": seen["a"]},
        {"item_id": "b", "step": "send", "decision": "delivered", "receipt": "rcpt-b", "version": seen["b"]}]})
    assert status == 409 and answer["detail"].startswith("entry 2: "), answer
    assert snapshot(page.journal) == before  # entry 1 was not applied either


# ------------------------------------------------------------------------------- who may settle


def test_who_may_settle_is_decided_by_the_jobs_recorded_dag_not_its_id(page):
    job = "reports/send/run-by-payments"  # a custom job_id that starts with another DAG's id
    held_job(page.journal, job, ["a"], dag_id="payments")
    decision = {"job_id": job, "item_id": "a", "step": "send", "decision": "not_delivered"}
    before = snapshot(page.journal)

    # Edit permission on DAG "reports" only: the job is not theirs to see, nor to settle.
    assert job not in {j["job_id"] for j in page.json("/jobs.json", "reports_editor")["jobs"]}
    for path, accept in ((f"/api/jobs/{job_path(job)}", "application/json"), (f"/jobs/{job_path(job)}", "text/html"),
                         ("/resolve?" + urlencode({"job_id": job, "item_id": "a", "step": "send"}), "text/html")):
        assert page.get(path, "reports_editor", accept=accept)[0] == 404, path
    assert page.post("/api/resolve", decision, "reports_editor")[0] == 404
    assert page.post("/api/resolve-many", {"job_id": job, "decisions": [decision]}, "reports_editor")[0] == 404
    assert snapshot(page.journal) == before

    # Edit permission on DAG "payments", which ran it: seen and settled.
    assert job in {j["job_id"] for j in page.json("/jobs.json", "payments_editor")["jobs"]}
    status, html = page.get(f"/jobs/{job_path(job)}", "payments_editor", accept="text/html")
    assert status == 200 and 'id="bulk-form"' in html
    assert "/dags/reports/" not in html  # no link to a task of DAG "reports": the job is not one of its tasks
    assert 'id="resolve-form"' in resolve_form(page, job, "a", "payments_editor")
    status, answer = page.post("/api/resolve", decision, "payments_editor")
    assert status == 200 and answer["resolved_by"] == "payments_editor", answer


def test_a_job_with_no_recorded_dag_needs_the_permission_on_all_dags(page):
    job = "payments/send/written-outside-airflow"
    held_job(page.journal, job, ["a"], dag_id=None)
    decision = {"job_id": job, "item_id": "a", "step": "send", "decision": "not_delivered"}
    before = snapshot(page.journal)
    # One DAG's permission, even the DAG its id starts with, is not enough.
    assert job not in {j["job_id"] for j in page.json("/jobs.json", "payments_editor")["jobs"]}
    assert page.get(f"/api/jobs/{job_path(job)}", "payments_editor")[0] == 404
    assert page.post("/api/resolve", decision, "payments_editor")[0] == 404
    # Read on all DAGs shows it; settling it needs edit on all DAGs.
    assert job in {j["job_id"] for j in page.json("/jobs.json", "viewer")["jobs"]}
    status, answer = page.post("/api/resolve", decision, "viewer")
    assert status == 403 and "all DAGs" in answer["detail"], answer
    assert snapshot(page.journal) == before
    status, answer = page.post("/api/resolve", decision, "admin")
    assert status == 200 and answer["resolved_by"] == "admin", answer


# ---------------------------------------------------------------------------------- bad input


SURROGATE = "\ud800"


def test_bad_text_in_a_decision_is_refused_with_its_reason_and_changes_nothing(page):
    job = "payments/send/bad-text"
    version = held_job(page.journal, job, ["a"], dag_id="payments")["a"]
    one = {"job_id": job, "item_id": "a", "step": "send", "decision": "not_delivered", "version": version}
    several = {"job_id": job, "decisions": [{k: v for k, v in one.items() if k != "job_id"}]}
    before = snapshot(page.journal)
    refusals = [
        ("/api/resolve", {**one, "note": "checked " + SURROGATE}, "note contains a lone surrogate"),
        ("/api/resolve", {**one, "note": "checked\x00"}, "note contains a NUL character"),
        ("/api/resolve", {**one, "note": "é" * 2049}, "note is 4098 bytes; at most 4096"),
        ("/api/resolve", {**one, "decision": "delivered", "receipt": "r" * (64 * 1024 + 1)}, "at most 65536"),
        ("/api/resolve", {**one, "item_id": "a" + SURROGATE}, "item_id contains a lone surrogate"),
        ("/api/resolve", {**one, "item_id": "a\x00"}, "item_id contains a NUL character"),
        ("/api/resolve", {**one, "step": "s" * 1025}, "step is 1025 characters; at most 1024"),
        ("/api/resolve", {**one, "job_id": job + SURROGATE}, "job_id contains a lone surrogate"),
        ("/api/resolve", {**one, "job_id": job + "\x00"}, "job_id contains a NUL character"),
        ("/api/resolve", {**one, "version": SURROGATE}, "version contains a lone surrogate"),
        # Not a decision at all, with text no encoder takes: the refusal does not echo it back.
        ("/api/resolve", {"job_id": job, "item_id": SURROGATE}, "decision: Field required"),
        ("/api/resolve-many", {**several, "note": SURROGATE}, "note contains a lone surrogate"),
        ("/api/resolve-many", {**several, "decisions": [*several["decisions"], {"item_id": "b\x00", "step": "send",
                                                                               "decision": "not_delivered"}]},
         "entry 2: item_id contains a NUL character"),
        ("/api/resolve-many", {**several, "decisions": several["decisions"] * 501}, "at most 500"),
    ]
    for path, body, reason in refusals:
        status, answer = page.post(path, body)
        assert 400 <= status < 500 and isinstance(answer, dict), (reason, status, answer)
        assert reason in answer["detail"], (reason, answer)
    # A lone surrogate as raw bytes (not a \u escape) in the body.
    raw = json.dumps({**one, "note": SURROGATE}, ensure_ascii=False).encode("utf-8", "surrogatepass")
    status, answer = page.post("/api/resolve", raw)
    assert 400 <= status < 500 and "lone surrogate" in answer["detail"], (status, answer)
    assert snapshot(page.journal) == before


def test_an_id_in_a_url_that_can_name_nothing_is_an_unknown_job_on_either_engine(page):
    job = "payments/send/looked-up-by-url"
    held_job(page.journal, job, ["a"], dag_id="payments")
    # PostgreSQL cannot even be asked about a text with NUL in it: the page does not ask.
    for path in (f"/api/jobs/{job_path(job)}%00", f"/jobs/{job_path(job)}%00", "/api/jobs/%ED%A0%80",
                 "/resolve?" + urlencode({"job_id": job + "\x00", "item_id": "a", "step": "send"}),
                 "/resolve?" + urlencode({"job_id": job, "item_id": "a\x00", "step": "send"})):
        status, body = page.get(path)
        assert status == 404 and len(body) < 200, (path, status, body)


# ------------------------------------------------------------------------------------- paging


def _sent(item: Mapping[str, Any], ctx: StepContext) -> str:
    return f"rcpt-{item['id']}"


def test_a_viewer_of_one_dag_pages_through_its_jobs_alone_and_no_cursor_names_another_dags_job(page):
    made: dict[str, list[str]] = {"payments": [], "reports": []}
    with StepJournal(page.journal) as journal:
        for n in range(7):  # payments' jobs between two of reports' each time: pages of 3 read past them
            for dag in ("reports", "payments", "reports"):
                job = f"{dag}/send/paged-{n}-{len(made[dag])}"
                run_batch(journal, job, [{"id": "a"}], [Step("send", _sent, side_effect=True)], dag_id=dag,
                          settle_in_task=False)
                made[dag].append(job)

    def pages(query: dict[str, Any]) -> list[dict[str, Any]]:
        found, cursor = [], None
        for _ in range(100):
            data = page.json("/jobs.json?" + urlencode({**query, **({"cursor": cursor} if cursor else {})}),
                             "payments_editor")
            found.append(data)
            cursor = data["next"]
            if cursor is None:
                return found
            # The cursor is the journal's key of the page's last job: one the viewer may see.
            key = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
            assert not any(other in key for other in made["reports"]), key
        raise AssertionError("the jobs list never ended")

    listed = pages({"limit": 3})
    shown = [j for data in listed for j in data["jobs"]]
    assert {j["dag_id"] for j in shown} == {"payments"}
    assert len(shown) == len({j["job_id"] for j in shown}) and set(made["payments"]) <= {j["job_id"] for j in shown}
    assert all(len(data["jobs"]) == 3 for data in listed[:-1])  # full pages; only the last may be short
    assert {h["job_id"] for data in listed for h in data["held"]} <= {j["job_id"] for j in shown}
    # Filtered by their own DAG, the same jobs; by a DAG they may not read, none (and no cursor).
    assert [j["job_id"] for data in pages({"limit": 4, "dag_id": "payments"}) for j in data["jobs"]] == [
        j["job_id"] for j in shown]
    assert page.json("/jobs.json?dag_id=reports", "payments_editor") | {"journal_path": None, "hostname": None} == {
        "journal_path": None, "hostname": None, "jobs": [], "held": [], "held_total": 0, "limit": 100, "next": None}
