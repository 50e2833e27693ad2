"""The "Resumable jobs" page, served by the plugin inside a real `airflow api-server`
(127.0.0.1, SimpleAuthManager), over a real journal written by real `run_batch` runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from html import unescape
from urllib.parse import parse_qs, quote, urlparse

import pytest

from airflow_resumable.journal import StepJournal
from airflow_resumable.runner import Step, idempotency_key, run_batch
from tests.support import airflow_server
from tests.support.airflow_harness import base_env

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.compat]

HELD_JOB = "article_hold/send/manual__2026-12-02T10:00:00+00:00"
DONE_JOB = "article_hold/send/manual__2026-12-01T10:00:00+00:00"
CHANGED_JOB = "customer_sync/push/scheduled__2026-12-02T00:00:00+00:00"
EVIL_ITEM = '<img src=x onerror="alert(1)">'
SECRET = "token=sk_live_do_not_show"


class LostReply(Exception):
    pass


def _write_journal(path) -> None:
    """Job 1: item-041's send fails once (the message holds a secret), then is held on the re-run.
    Job 2: completed. Job 3: two items whose input changed since they were journaled."""
    failed = set()

    def send(item, ctx):
        if item["id"] in ("item-041", EVIL_ITEM) and item["id"] not in failed:
            failed.add(item["id"])
            raise LostReply(SECRET)
        return f"rcpt-{item['id']}"

    steps = [Step("validate", lambda item, ctx: True), Step("notify_external", send, side_effect=True)]
    items = [{"id": f"item-{i:03d}"} for i in range(1, 51)] + [{"id": EVIL_ITEM}]
    with StepJournal(path) as journal:
        with pytest.raises(LostReply):
            run_batch(journal, HELD_JOB, items, steps, settle_in_task=False)
        with pytest.raises(LostReply):
            run_batch(journal, HELD_JOB, items, steps, settle_in_task=False)
        result = run_batch(journal, HELD_JOB, items, steps, settle_in_task=False)
        assert sorted(h.item_id for h in result.held) == sorted(["item-041", EVIL_ITEM])
        run_batch(journal, DONE_JOB, [{"id": "item-001"}], steps, settle_in_task=False)
        run_batch(journal, CHANGED_JOB, [{"id": "a", "v": 1}, {"id": "b", "v": 1}], steps, settle_in_task=False)
        changed = run_batch(journal, CHANGED_JOB, [{"id": "a", "v": 2}, {"id": "b", "v": 1}], steps, settle_in_task=False)
        assert [h.reason.value for h in changed.held] == ["input_changed"]


@pytest.fixture(scope="module")
def server(airflow_template, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ui")
    journal = tmp / "worker" / "journal.sqlite3"
    _write_journal(journal)
    # Times on the page follow Airflow's [core] default_timezone (JSON stays UTC).
    srv = airflow_server.api_server(airflow_template, tmp, {"AIRFLOW__RESUMABLE__JOURNAL_PATH": str(journal),
                                                            "AIRFLOW__CORE__DEFAULT_TIMEZONE": "Asia/Tokyo"})
    srv.journal = journal
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def admin(server) -> str:
    return airflow_server.token(server.url, "admin")


def pages(server) -> list[str]:
    base = server.url + "/resumable"
    return [
        base + "/",
        base + "/jobs.json",
        base + f"/jobs/{quote(HELD_JOB, safe='')}",
        base + f"/api/jobs/{quote(HELD_JOB, safe='')}",
        base + "/resolve?" + f"job_id={quote(HELD_JOB, safe='')}&item_id=item-041&step=notify_external",
    ]


def test_anonymous_and_forged_requests_are_refused_everywhere(server):
    for url in pages(server):
        for accept in ("application/json", "text/html"):
            status, _, body = airflow_server.get(url, accept=accept)
            assert status in (401, 403), (url, status)
            # Nothing from the journal (the login link only echoes the requested URL).
            assert "LostReply" not in body and "Held items" not in body and str(server.journal) not in body
        assert airflow_server.get(url, bearer="not-a-jwt")[0] in (401, 403)
        assert airflow_server.get(url, cookie="not-a-jwt")[0] in (401, 403)
    # The 401 page for a browser offers Airflow's login.
    status, _, body = airflow_server.get(pages(server)[0], accept="text/html")
    assert status == 401 and "Log in to Airflow" in body


def test_logged_in_user_sees_jobs_and_held_items(server, admin):
    status, headers, body = airflow_server.get(server.url + "/resumable/jobs.json", bearer=admin)
    assert status == 200, body
    data = json.loads(body)
    jobs = {j["job_id"]: j for j in data["jobs"]}
    assert set(jobs) == {HELD_JOB, DONE_JOB, CHANGED_JOB}
    assert (jobs[HELD_JOB]["status"], jobs[HELD_JOB]["held"], jobs[HELD_JOB]["items"]) == ("needs_review", 2, 51)
    assert jobs[HELD_JOB]["counts"]["SUCCEEDED"] == 100 and jobs[DONE_JOB]["status"] == "completed"
    held = {(h["job_id"], h["item_id"]): h for h in data["held"]}
    row = held[(HELD_JOB, "item-041")]
    assert (row["step"], row["held_reason"], row["status"], row["error_type"], row["attempts"]) == (
        "notify_external", "unknown_outcome", "FAILED", "LostReply", 1)
    assert held[(CHANGED_JOB, "a")]["held_reason"] == "input_changed" and data["held_total"] == 3
    assert SECRET not in body  # exception types only, never messages
    assert "frame-ancestors 'self'" in headers["content-security-policy"]


def test_jobs_page_lists_item_41_with_a_prefilled_resolve_link(server, admin):
    status, _, html = airflow_server.get(server.url + "/resumable/", bearer=admin, accept="text/html")
    assert status == 200
    assert "item-041" in html and "unknown outcome" in html and "LostReply" in html and SECRET not in html
    assert 'data-label="Items" class="num">51<' in html and "built-in method" not in html
    links = [unescape(h) for h in re.findall(r'href="([^"]*/resolve\?[^"]*)"', html)]
    query = {}
    for link in links:
        q = parse_qs(urlparse(link).query)
        if q["item_id"] == ["item-041"]:
            query = q
    assert query == {"job_id": [HELD_JOB], "item_id": ["item-041"], "step": ["notify_external"]}
    # Item ids are data: escaped, never markup.
    assert EVIL_ITEM not in html and "&lt;img src=x onerror=" in html


def test_resolve_form_is_prefilled_for_each_reason(server, admin):
    status, _, html = airflow_server.get(pages(server)[4], bearer=admin, accept="text/html")
    assert status == 200, html
    for name, value in (("job_id", HELD_JOB), ("item_id", "item-041"), ("step", "notify_external")):
        assert re.search(rf'name="{name}" value="{re.escape(value)}"', unescape(html)), name
    assert '<option value="delivered" selected>' in html and 'value="not_delivered"' in html
    assert "keep_previous_input" not in html.split("<select")[1].split("</select>")[0]
    assert idempotency_key(HELD_JOB, "item-041", "notify_external") in html
    assert 'data-endpoint="/resumable/api/resolve"' in html  # the API server checks the DAG permission
    assert re.search(r"held for <time datetime=\"[^\"]+\+00:00\" title=\"[-0-9]+ [:0-9]+ JST\">"
                     r"(\d+ \w+|a few seconds|less than a second)</time>", html), html
    url = server.url + "/resumable/resolve?" + f"job_id={quote(CHANGED_JOB, safe='')}&item_id=a&step=validate"
    status, _, html = airflow_server.get(url, bearer=admin, accept="text/html")
    assert status == 200 and '<option value="keep_previous_input" selected>' in html and "use_new_input" in html


def test_job_page_and_json_show_the_open_rows(server, admin):
    status, _, html = airflow_server.get(pages(server)[2], bearer=admin, accept="text/html")
    assert status == 200 and "item-041" in html and "needs review" in html
    # Airflow's default_timezone and how long ago; the UTC instant in the markup.
    assert re.search(r'<time datetime="[-0-9T:.]+\+00:00"[^>]*><span class="nowrap">[-0-9]+</span> '
                     r'<span class="nowrap">[:0-9]+ JST</span> <span class="nowrap muted">\(([^()]+ ago|just now)\)',
                     html), html
    assert "/dags/article_hold/runs/" in html  # the batch task in the Airflow UI, to Clear it
    status, _, body = airflow_server.get(pages(server)[3], bearer=admin)
    detail = json.loads(body)
    assert status == 200 and detail["job"]["job_id"] == HELD_JOB and detail["open_rows_total"] == 2
    assert detail["job"]["updated_at"].endswith("+00:00")
    assert {r["item_id"] for r in detail["open_rows"]} == {"item-041", EVIL_ITEM}
    # What to ask the receiver about, for each send.
    keys = {r["item_id"]: r["idempotency_key"] for r in detail["open_rows"]}
    assert keys["item-041"] == idempotency_key(HELD_JOB, "item-041", "notify_external")
    assert {(r["generation"], r["not_sent"]) for r in detail["open_rows"]} == {(0, False)}


def test_cookie_of_the_airflow_ui_authenticates_the_browser(server, admin):
    status, _, html = airflow_server.get(server.url + "/resumable/", cookie=admin, accept="text/html")
    assert status == 200 and "item-041" in html


def test_viewer_role_with_dag_read_gets_the_page(server):
    viewer = airflow_server.token(server.url, "viewer")
    assert airflow_server.get(server.url + "/resumable/jobs.json", bearer=viewer)[0] == 200


def test_unknown_job_or_step_is_a_short_404(server, admin):
    for url in (server.url + "/resumable/jobs/no-such-job", server.url + "/resumable/api/jobs/no-such-job",
                server.url + "/resumable/resolve?job_id=x&item_id=y&step=z",
                server.url + f"/resumable/resolve?job_id={quote(DONE_JOB, safe='')}&item_id=item-001&step=validate"):
        status, _, body = airflow_server.get(url, bearer=admin)
        assert status == 404 and len(body) < 200 and "Traceback" not in body, (url, body)
    status, _, html = airflow_server.get(server.url + "/resumable/jobs/nope", bearer=admin, accept="text/html")
    assert status == 404 and "unknown job" in html


def test_the_page_never_writes_the_journal(server, admin):
    before = server.journal.read_bytes()
    for url in pages(server):
        airflow_server.get(url, bearer=admin)
    assert server.journal.read_bytes() == before


def test_airflow_discovered_the_plugin_and_its_external_view(server, admin):
    status, _, body = airflow_server.get(server.url + "/api/v2/plugins", bearer=admin)
    assert status == 200, body
    (plugin,) = [p for p in json.loads(body)["plugins"] if p["name"] == "resumable_jobs"]
    assert [(a["name"], a["url_prefix"]) for a in plugin["fastapi_apps"]] == [("Resumable jobs", "/resumable")]
    (view,) = plugin["external_views"]
    assert (view["name"], view["url_route"], view["href"], view["destination"]) == (
        "Resumable jobs", "resumable-jobs", "resumable/", "nav")
    assert "airflow-provider-resumable" in plugin["source"]  # loaded through the entry point


PROVIDER_INFO_CHECK = """
from importlib import import_module
from importlib.metadata import entry_points
from airflow.providers_manager import ProvidersManager
from airflow_resumable.plugins import ResumableJobsPlugin

info = ProvidersManager().providers["airflow-provider-resumable"].data
(plugin,) = info["plugins"]
module, _, name = plugin["plugin-class"].rpartition(".")
assert getattr(import_module(module), name) is ResumableJobsPlugin and plugin["name"] == ResumableJobsPlugin.name
(entry,) = [e for e in entry_points(group="airflow.plugins") if e.name == "resumable_jobs"]
assert entry.load() is ResumableJobsPlugin
(link,) = info["extra-links"]
module, _, name = link.rpartition(".")
assert getattr(import_module(module), name)().name == "Resumable job"
print("ok")
"""


def test_provider_info_registers_the_plugin_and_the_extra_link(airflow_template):
    # In a subprocess with a test AIRFLOW_HOME: importing Airflow here would configure this process.
    proc = subprocess.run([sys.executable, "-c", PROVIDER_INFO_CHECK], env=base_env(airflow_template),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
