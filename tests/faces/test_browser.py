"""The Resumable jobs page end to end in a real browser: `airflow standalone` on 127.0.0.1 with this provider, the
article's DAG against the demo receiver (item 41 accepted, reply lost), headless Chromium logs in,
opens "Resumable jobs", follows "Resolve…" for item-041, triggers the resolve DAG, the batch task is
cleared, and the page shows the job completed. Screenshots at 1280 and 390 px are kept as artifacts
(RESUMABLE_TEST_ARTIFACTS, default test-artifacts/ in the repository)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from airflow_resumable.runner import idempotency_key
from demo.__main__ import Receiver
from tests.support import airflow_server
from tests.support.airflow_harness import REPO, base_env, migrated_template
from tests.support.airflow_server import api

pytestmark = [pytest.mark.airflow, pytest.mark.slow]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("RESUMABLE_TEST_ARTIFACTS") or REPO / "test-artifacts")
STEP = "notify_external"


def wait_for(what: str, check, timeout: float, server) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = check()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(2)
    raise AssertionError(f"timed out waiting for {what}:\n{server.tail()}")


def parked_for_input(server, dag_id: str, task_id: str, run_id: str) -> bool:
    """Airflow's scheduler has taken in the end of the worker that parked the task in awaiting_input.

    Answer a Required action only after that. The parked try and the resumed one share a try number,
    and this scheduler (3.3, LocalExecutor) cannot tell that worker's late "success" from the resumed
    try's: read once the response has queued the task again, it fails the task as "killed externally"
    (process_executor_events: the state is queued, executor.has_task() is false) and the retry asks
    the human again, for ever. Nothing in the metadata DB marks that event, only the scheduler's log."""
    finished = re.compile(rf"TaskInstance Finished: dag_id={re.escape(dag_id)}, task_id={re.escape(task_id)}, "
                          rf"run_id={re.escape(run_id)}, .*state=awaiting_input, executor=")
    return finished.search(server.log.read_text(errors="replace")) is not None


@pytest.fixture(scope="module")
def airflow_up(tmp_path_factory):
    if not os.path.exists(CHROMIUM):
        pytest.skip("no Chromium (apt-get install chromium); CI installs it")
    tmp = tmp_path_factory.mktemp("browser")
    home = migrated_template(tmp, [REPO / "dags" / "article_scenario.py", REPO / "dags" / "resolve_held_item.py"])
    receiver = Receiver(tmp / "receiver.sqlite3")  # real HTTP on 127.0.0.1, dedupe off: duplicates count
    port = airflow_server.free_port()
    env = airflow_server.server_env(base_env(home), home, port)
    env.update(
        AIRFLOW__RESUMABLE__JOURNAL_PATH=str(tmp / "worker" / "journal.sqlite3"),
        AIRFLOW_CONN_DEMO_RECEIVER=json.dumps({"conn_type": "http", "host": receiver.url}),
        # Other Airflows may run on this machine: no fixed ports.
        AIRFLOW__LOGGING__WORKER_LOG_SERVER_PORT=str(airflow_server.free_port()),
        AIRFLOW__LOGGING__TRIGGER_LOG_SERVER_PORT=str(airflow_server.free_port()),
        AIRFLOW__SCHEDULER__MIN_FILE_PROCESS_INTERVAL="5",
        AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL="5",
    )
    server = None
    try:
        server = airflow_server.start(["standalone"], env, f"http://127.0.0.1:{port}", tmp / "standalone.log",
                                      timeout=300)
        server.receiver = receiver
        server.journal = tmp / "worker" / "journal.sqlite3"
        yield server
    finally:
        if server is not None:
            server.stop()
        receiver.stop()


@contextlib.contextmanager
def signed_in_page(url: str, token: str):
    """A Chromium page at 1280 px, signed in to Airflow with ``token``."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            context.add_cookies([{"name": "_token", "value": token, "url": url}])
            yield context.new_page()
        finally:
            browser.close()


def shoot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def test_resolve_item_41_from_the_resumable_jobs_page(airflow_up):
    from playwright.sync_api import expect, sync_playwright

    server, receiver = airflow_up, airflow_up.receiver
    url = server.url
    admin = airflow_server.token(url, "admin")
    wait_for("the article DAG to be parsed", lambda: api(url + "/api/v2/dags/article_resumable", admin), 240, server)

    # The article's run: item 41 is accepted by the receiver but the reply is lost (try 1 fails);
    # try 2 resumes, cannot verify (this DAG has no verify), holds item 41, sends 42-50, fails.
    assert receiver.call("/faults", {"item_id": "item-041", "mode": "after_accept"})[0] == 200
    api(url + "/api/v2/dags/article_resumable", admin, "PATCH", {"is_paused": False})
    run_id = api(url + "/api/v2/dags/article_resumable/dagRuns", admin, "POST", {"logical_date": None})["dag_run_id"]
    run_url = f"{url}/api/v2/dags/article_resumable/dagRuns/{urllib.request.quote(run_id, safe='')}"
    wait_for("the batch run to end held", lambda: api(run_url, admin)["state"] == "failed", 300, server)
    job_id = f"article_resumable/send/{run_id}"
    links = api(f"{run_url}/taskInstances/send/links", admin)["extra_links"]
    assert links["Resumable job"].endswith("/resumable/jobs/" + urllib.request.quote(job_id, safe=""))

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(url + "/")
            page.locator("input[name=username]").fill("admin")
            page.locator("input[name=password]").fill(airflow_server.USERS["admin"])
            page.locator("button[type=submit]").click()
            page.get_by_role("link", name="Resumable jobs").first.click()
            frame = page.frame_locator('iframe[title="Resumable jobs"]')
            row = frame.locator("table.held tr", has_text="item-041")
            expect(row).to_contain_text("unknown outcome", timeout=60_000)
            expect(row).to_contain_text(job_id)
            shoot(page, "jobs-in-airflow-1280")
            page.set_viewport_size({"width": 390, "height": 844})
            shoot(page, "jobs-in-airflow-390")
            page.set_viewport_size({"width": 1280, "height": 900})

            # The receiver has item 41 (accepted, reply lost): its receipt is the evidence.
            status, found = receiver.call("/notifications/" + idempotency_key(job_id, "item-041", STEP))
            assert status == 200, found
            row.get_by_role("link", name="Resolve…").click()
            expect(frame.locator("#job_id")).to_have_value(job_id)
            expect(frame.locator("#item_id")).to_have_value("item-041")
            expect(frame.locator("#step")).to_have_value(STEP)
            expect(frame.locator("#decision")).to_have_value("delivered")
            frame.locator("#receipt").fill(found["receipt"])
            frame.locator("#note").fill("receiver has it (accepted, reply lost)")
            shoot(page, "resolve-in-airflow-1280")
            page.set_viewport_size({"width": 390, "height": 844})
            shoot(page, "resolve-in-airflow-390")
            page.set_viewport_size({"width": 1280, "height": 900})
            frame.locator("#resolve").click()  # the API server checks admin may act on the DAG, then records it
            expect(frame.locator("#resolved")).to_contain_text("Resolved as delivered by admin", timeout=60_000)
            # "open the batch task" shows Airflow's own task page in the top window, not nested in the frame.
            frame.locator("#outcome").get_by_role("link", name="open the batch task").click()
            expect(page).to_have_url(re.compile("^" + re.escape(f"{url}/dags/article_resumable/runs/") + ".*/tasks/send$"))
            expect(page.locator('iframe[title="Resumable jobs"]')).to_have_count(0)
            # The operator's name shows in more than one place of Airflow's task page (header, details,
            # and more as the page loads): any one of them visible will do (Playwright is strict otherwise).
            expect(page.get_by_text("ResumableBatchOperator", exact=True).first).to_be_visible(timeout=60_000)
            shoot(page, "batch-task-in-airflow-1280")
        finally:
            browser.close()

    # The on-call engineer clears the batch task (Airflow's REST API, as the UI's Clear does).
    api(url + "/api/v2/dags/article_resumable/clearTaskInstances", admin, "POST",
        {"dry_run": False, "task_ids": ["send"], "dag_run_id": run_id, "only_failed": False, "reset_dag_runs": True})
    wait_for("the cleared batch to succeed", lambda: api(run_url, admin)["state"] == "success", 300, server)

    with signed_in_page(url, admin) as page:
        page.goto(url + "/resumable/")
        job = page.locator("#jobs tr", has_text=job_id)
        expect(job).to_contain_text("completed")
        expect(page.locator("body")).to_contain_text("Nothing is held for a human.")
        shoot(page, "jobs-1280")
        page.set_viewport_size({"width": 390, "height": 844})
        shoot(page, "jobs-390")
        page.set_viewport_size({"width": 1280, "height": 900})
        job.get_by_role("link").first.click()
        expect(page.locator("#job-status")).to_have_text("completed")
        expect(page.locator("body")).to_contain_text("delivered")  # the resolution, in the audit table
        shoot(page, "job-1280")
        page.set_viewport_size({"width": 390, "height": 844})
        shoot(page, "job-390")

    stats = receiver.call("/stats")[1]
    assert stats["duplicates"] == 0 and stats["items"] == 50, stats
    xcom = f"{run_url}/taskInstances/send/xcomEntries/resumable_summary?deserialize=true&stringify=false"
    summary = api(xcom, admin)["value"]
    summary = json.loads(summary) if isinstance(summary, str) else summary
    assert (summary["status"], summary["executed_steps"]) == ("completed", 0)


def test_held_item_settled_in_airflows_required_actions(airflow_up):
    """The review task puts the held item before a human in Airflow's own
    "Required actions" (REST hitlDetails, and the page, screenshot); a response through the REST API
    settles it in the journal under the responder's name, and the downstream pass sends it once."""
    from playwright.sync_api import expect

    from airflow_resumable.journal import StepJournal
    from airflow_resumable.operators.review import APPLY

    server, receiver = airflow_up, airflow_up.receiver
    url = server.url
    admin = airflow_server.token(url, "admin")
    wait_for("the review DAG to be parsed", lambda: api(url + "/api/v2/dags/article_review", admin), 240, server)
    before = receiver.call("/stats")[1]["per_item"]
    # Item 41 is refused before the receiver accepts it (a 503): try 1 fails there; try 2 cannot tell
    # (no verify) and holds it; on_held="succeed" hands it to the review task.
    assert receiver.call("/faults", {"item_id": "item-041", "mode": "before_accept"})[0] == 200
    api(url + "/api/v2/dags/article_review", admin, "PATCH", {"is_paused": False})
    run_id = api(url + "/api/v2/dags/article_review/dagRuns", admin, "POST", {"logical_date": None})["dag_run_id"]
    run_url = f"{url}/api/v2/dags/article_review/dagRuns/{urllib.request.quote(run_id, safe='')}"
    job_id = f"article_review/send/{run_id}"
    hitl_url = f"{run_url}/taskInstances/review/-1/hitlDetails"

    def asked():
        try:
            return api(hitl_url, admin)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise
    detail = wait_for("the review's required action", asked, 300, server)
    key = idempotency_key(job_id, "item-041", STEP)
    assert detail["options"] == [APPLY, "Leave all held"] and detail["response_received"] is False
    assert "item-041" in detail["body"] and key in detail["body"] and "unknown_outcome" in detail["body"]
    assert detail["params"]["item_1"]["schema"]["enum"] == ["leave_held", "delivered", "not_delivered"]
    assert api(f"{run_url}/taskInstances/send", admin)["state"] == "success"

    with signed_in_page(url, admin) as page:
        page.goto(f"{url}/dags/article_review/runs/{urllib.request.quote(run_id, safe='')}/tasks/review/"
                  "required_actions")
        expect(page.get_by_text("Held items of the article's batch").first).to_be_visible(timeout=60_000)
        expect(page.get_by_text(key).first).to_be_visible(timeout=60_000)
        shoot(page, "required-action-1280")

    # The on-call engineer asks the receiver: no record of the key. Answer through the REST API, once
    # the task is parked and the scheduler has seen its worker end (see parked_for_input).
    assert receiver.call("/notifications/" + key)[0] == 404
    wait_for("the review to be parked awaiting input", lambda: api(f"{run_url}/taskInstances/review", admin)["state"]
             == "awaiting_input" and parked_for_input(server, "article_review", "review", run_id), 120, server)
    answer = api(hitl_url, admin, "PATCH", {"chosen_options": [APPLY], "params_input": {
        "item_1": "not_delivered", "receipt_1": "", "note": "receiver has no record"}})
    assert answer["chosen_options"] == [APPLY]
    wait_for("the run to finish", lambda: api(run_url, admin)["state"] in ("success", "failed"), 300, server)
    states = {ti["task_id"]: ti["state"] for ti in api(f"{run_url}/taskInstances", admin)["task_instances"]}
    assert states == {"send": "success", "review": "success", "second_pass": "success"}, (states, server.tail())
    review = api(f"{run_url}/taskInstances/review/xcomEntries/return_value?deserialize=true&stringify=false",
                 admin)["value"]
    review = json.loads(review) if isinstance(review, str) else review
    assert (review["applied"], review["held"], review["responded_by"]) == (1, 0, "admin")
    with StepJournal(server.journal) as journal:
        (audit,) = journal.resolutions(job_id)
        assert (audit.item_id, audit.step, audit.decision, audit.resolved_by, audit.note) == (
            "item-041", STEP, "not_delivered", "admin", "receiver has no record")
        assert journal.job(job_id).status == "completed"
    # Every item reached the receiver once more than before this run: item 41 once, by the second pass.
    after = receiver.call("/stats")[1]["per_item"]
    assert {item: after[item] - before.get(item, 0) for item in after} == {f"item-{i:03d}": 1 for i in range(1, 51)}


def test_several_held_items_settled_from_the_job_page(airflow_up):
    """The job page's "Resolve several" form settles the steps given a decision, in one
    all-or-nothing request, as the signed-in user; the one left alone stays held."""
    from playwright.sync_api import expect

    from airflow_resumable.journal import StepJournal
    from tests.support.scenario import held_job

    server = airflow_up
    job_id = "article_resumable/send/three-held"
    for item in ("item-a", "item-b", "item-c"):
        held_job(server.journal, job_id, item)
    admin = airflow_server.token(server.url, "admin")
    with signed_in_page(server.url, admin) as page:
        page.goto(f"{server.url}/resumable/jobs/{urllib.request.quote(job_id, safe='')}")
        form = page.locator("#bulk-form")
        row = {item: form.locator("tr.bulk-row", has_text=item) for item in ("item-a", "item-b", "item-c")}
        expect(row["item-a"]).to_contain_text(idempotency_key(job_id, "item-a", "send"))
        row["item-a"].locator("select").select_option("delivered")
        row["item-b"].locator("select").select_option("not_delivered")
        form.locator("#bulk-apply").click()  # item-a has no receipt yet: refused in the page, nothing sent
        expect(page.locator("#bulk-outcome")).to_contain_text("delivered needs the receiver's receipt")
        row["item-a"].locator("input.bulk-receipt").fill("rcpt-a-77")
        page.locator("#bulk-note").fill("checked the receiver's log")
        shoot(page, "resolve-several-1280")
        form.locator("#bulk-apply").click()
        expect(page.locator("#bulk-resolved")).to_contain_text("Resolved 2 held step(s) as admin", timeout=60_000)
    with StepJournal(server.journal) as journal:
        audit = {a.item_id: (a.decision, a.receipt, a.resolved_by) for a in journal.resolutions(job_id)}
        assert audit == {"item-a": ("delivered", "rcpt-a-77", "admin"), "item-b": ("not_delivered", None, "admin")}
        assert [h.item_id for h in journal.held(job_id)] == ["item-c"]


# Every element that could be cut off, and the right edge it must stay within: the window's, or that of
# the scrolling box a table sits in (a cell past it is hidden until scrolled to).
CUT_OFF = """() => {
  const width = document.documentElement.clientWidth, out = [];
  for (const el of document.querySelectorAll("td, th, a, button, .button, select, input, textarea, h1, h2")) {
    const box = el.getBoundingClientRect();
    if (!box.width && !box.height) continue;  // not shown (a narrow screen's table headers)
    const scroller = el.closest(".scroll");
    const edge = scroller ? Math.min(width, scroller.getBoundingClientRect().right) : width;
    if (box.right > edge + 0.5) {
      out.push(`${el.tagName}.${el.className} ends at ${Math.round(box.right)} > ${Math.round(edge)}: `
               + el.textContent.trim().slice(0, 40));
    }
  }
  const wide = document.documentElement.scrollWidth;
  if (wide > width) out.push(`the page scrolls sideways: ${wide} > ${width}`);
  return out;
}"""


def cut_off_in_airflow_frame(page, url: str, path: str) -> list[str]:
    """CUT_OFF of the page at `path`, shown in the "Resumable jobs" frame of Airflow's UI.

    Airflow's UI can mount the frame again while it settles (its own page then loads once more in
    it, destroying the page being measured, or replacing the frame): open `path` in whatever frame
    is mounted now and measure again, and only the page at `path`."""
    from playwright.sync_api import Error, expect

    inner = page.frame_locator('iframe[title="Resumable jobs"]')
    page.goto(url + "/plugin/resumable-jobs")
    expect(inner.locator("nav.crumbs")).to_be_visible(timeout=60_000)  # the frame's own page loaded
    for _ in range(10):
        page.wait_for_load_state("networkidle")
        frame = page.locator('iframe[title="Resumable jobs"]').element_handle().content_frame()
        try:
            if urllib.request.unquote(frame.url) != urllib.request.unquote(path):
                frame.goto(path)
            expect(inner.locator("table.held").first).to_be_visible(timeout=60_000)
            problems = frame.evaluate(CUT_OFF)
        except Error as error:
            if "context was destroyed" not in str(error) and "detached" not in str(error):
                raise
            time.sleep(1)  # the frame was mounted again under us: let the UI settle, then once more
            continue
        if urllib.request.unquote(frame.url) == urllib.request.unquote(path):
            return problems
    raise AssertionError(f"the frame did not stay at {path}")


def test_a_job_of_1000_held_items_pages_in_the_browser_and_nothing_is_cut_off(airflow_up):
    """Next links visit each of 1,000 held steps once (100 a page), Previous goes back, the jobs list
    filters by status and DAG with its form, and in Airflow's UI frame at 1280 and 390 px no cell or
    button reaches past the frame's (or its table box's) right edge."""
    from playwright.sync_api import expect

    from tests.faces.test_ui_paging import fill

    server = airflow_up
    job_id = "article_resumable/send/manual__2026-12-04T10:11:12.123456+00:00-thousand-held"
    held = [f"item-{i:07d}" for i in range(1000)]
    fill(server.journal, [job_id], range(1000), dag_id="article_resumable", held_every=1, step=STEP)
    fill(server.journal, ["paging_other/send/done"], range(3), dag_id="paging_other")
    admin = airflow_server.token(server.url, "admin")
    job_url = f"{server.url}/resumable/jobs/{urllib.request.quote(job_id, safe='')}"
    with signed_in_page(server.url, admin) as page:
        page.goto(job_url)
        seen, first_pages = [], []
        while True:
            rows = page.locator("table.held tbody tr")
            expect(rows.first).to_be_visible(timeout=60_000)
            items = rows.evaluate_all("rows => rows.map(r => r.dataset.item)")
            seen += items
            first_pages.append(items[0])
            following = page.locator("nav.pager a.next")
            if not following.count():
                break
            with page.expect_navigation(timeout=60_000):  # read the next page, never the one being left
                following.click()
        assert seen == held and len(first_pages) == 10  # every held step once, in order, 100 a page
        page.locator("nav.pager a.previous").click()
        expect(page.locator("table.held tbody tr").first).to_have_attribute("data-item", first_pages[-2])
        page.locator("nav.pager a.previous").click()
        expect(page.locator("table.held tbody tr").first).to_have_attribute("data-item", first_pages[-3])

        page.goto(server.url + "/resumable/")
        page.locator("#filter-status").select_option("needs_review")
        with page.expect_navigation(timeout=60_000):
            page.locator("#filter-apply").click()
        listed = page.locator("#jobs tbody tr")
        expect(listed.first).to_contain_text("needs review")
        assert set(listed.locator(".badge").all_inner_texts()) == {"needs review"}
        assert job_id in page.locator("#jobs").inner_text().replace("\n", "")
        page.locator("#filter-status").select_option("")
        page.locator("#filter-dag").fill("paging_other")
        with page.expect_navigation(timeout=60_000):
            page.locator("#filter-apply").click()
        expect(listed).to_have_count(1)
        expect(listed.first).to_contain_text("paging_other/send/done")

        # Inside Airflow's UI, as an on-call engineer sees it: the page in the "Resumable jobs" frame.
        for width, height in ((1280, 900), (390, 844)):
            page.set_viewport_size({"width": width, "height": height})
            for name, path in (("job", job_url), ("jobs", server.url + "/resumable/?status=needs_review")):
                assert cut_off_in_airflow_frame(page, server.url, path) == [], (width, name)
                shoot(page, f"paging-{name}-in-airflow-{width}")
