"""The jobs list of a user who may read some DAGs only: pages of readable jobs, each job once, at the
cost of a journal read per page of jobs passed over (it was one read per job once the page was one short
of full). The page's own function over a real SQLite journal; the auth manager's answers are given."""

from __future__ import annotations

import pytest

from airflow_resumable.journal import StepJournal
from airflow_resumable.plugins.auth import Viewer
from airflow_resumable.plugins.pager import Paging
from airflow_resumable.plugins.views import _visible_jobs
from tests.faces.test_ui_paging import fill


class SomeDags(Viewer):
    """A viewer who may read these DAGs only (as the auth manager would answer)."""

    def __init__(self, dags: set[str]) -> None:
        super().__init__("reader", user=None)
        self.dags = dags

    def on_all_dags(self, method: str) -> bool:
        return False

    def allowed(self, method, dag_ids):
        return {d for d in dag_ids if d in self.dags}


@pytest.mark.parametrize("limit", [1, 2, 3, 100])
def test_a_reader_of_some_dags_pages_through_their_jobs_in_a_read_per_page_passed_over(tmp_path, limit):
    path = tmp_path / "journal.sqlite3"
    others = [f"other/send/run-{n:04d}" for n in range(1000)]
    fill(path, others, range(1), dag_id="other")
    mine = [f"mine/send/run-{n}" for n in range(5)]
    for n, job_id in enumerate(mine):  # spread over the list: newest, among the others, oldest
        fill(path, [job_id], range(1), dag_id="mine", created_at=[2e9, 1.5e9, 1e9, 5e8, 1.0][n])
    with StepJournal(path) as journal:
        reads = []
        jobs = journal.jobs

        def counted(**kwargs):
            reads.append(kwargs["limit"])
            return jobs(**kwargs)

        journal.jobs = counted
        seen, cursor = [], None
        while True:
            page = _visible_jobs(journal, SomeDags({"mine"}), Paging(limit, cursor, ()), status=None, dag_id=None)
            seen += [j.job_id for j in page]
            assert len(page) <= limit
            if page.next_cursor is None:
                break
            cursor = page.next_cursor
    assert seen == mine  # each readable job once, newest first, none of the others
    pages = -(-len(mine) // limit) or 1
    assert len(reads) <= pages * 2 + len(others) // limit + 2, reads
