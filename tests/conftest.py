from __future__ import annotations

import ast
import os

import pytest

from tests.support import airflow_forkserver, cpu_report
from tests.support.airflow_harness import Airflow, migrated_template
from tests.support.postgres_server import ENV_URL, HOW_TO_ENABLE, PostgresCluster, create_database, server_bindir


@pytest.fixture(scope="session")
def airflow_template(tmp_path_factory):
    return migrated_template(tmp_path_factory.mktemp("airflow"))


@pytest.fixture
def airflow(airflow_template, tmp_path) -> Airflow:
    return Airflow.create(airflow_template, tmp_path)


# ----------------------------------------------------------------- the matrix cells (make test-matrix)

# A cell of the matrix runs the tests marked for it (pyproject.toml): `-m "core and not postgres_server"`
# on Pythons with no Airflow installed, `-m compat` on older Airflow. A module says which cells it is in
# with a `pytest.mark.core` / `pytest.mark.compat` of its own (its pytestmark, or one of its classes).
# When `-m` requires such a marker, a test module that does not carry it is not collected at all:
# importing it could only fail (it may import Airflow where none is installed) or cost time, since -m
# would deselect all of its tests anyway. Only an `and` of terms is read: with `or` or parentheses, and
# without -m (`make test`), every module is collected as usual.
CELL_MARKERS = ("core", "compat")


def required_cell_markers(markexpr: str) -> set[str]:
    """The cell markers a test must carry to match ``markexpr``: those it names, not after a ``not``."""
    words = markexpr.split()
    if "or" in words or "(" in markexpr or ")" in markexpr:
        return set()
    return {word for before, word in zip(["and", *words], words) if word in CELL_MARKERS and before != "not"}


def _marks(node: ast.AST) -> set[str]:
    """The names of the ``pytest.mark.<name>`` anywhere in ``node``."""
    return {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Attribute)
            and n.value.attr == "mark" and isinstance(n.value.value, ast.Name) and n.value.value.id == "pytest"}


def module_cells(source: str) -> set[str]:
    """The cell markers a test module's source gives: in its module-level pytestmark, or on a class of it
    (read, never imported)."""
    found: set[str] = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            found |= _marks(node.value)
        elif isinstance(node, ast.ClassDef):
            for decorator in node.decorator_list:
                found |= _marks(decorator)
    return found & set(CELL_MARKERS)


def pytest_ignore_collect(collection_path, config):
    if not (collection_path.name.startswith("test_") and collection_path.suffix == ".py"):
        return None
    required = required_cell_markers(config.getoption("markexpr") or "")
    if not required or required <= module_cells(collection_path.read_text(encoding="utf-8")):
        return None
    return True


# ----------------------------------------------------------------- both journal engines (SQLite, PostgreSQL)


class PostgresForTests:
    """The session's PostgreSQL: a throwaway cluster of our own, or the one RESUMABLE_TEST_POSTGRES_URL names."""

    def __init__(self) -> None:
        self.cluster: PostgresCluster | None = None
        self.admin_url = os.environ.get(ENV_URL) or None
        if self.admin_url is None:
            bindir = server_bindir()
            if bindir is not None:
                self.cluster = PostgresCluster(bindir)
                self.admin_url = self.cluster.url()

    @property
    def available(self) -> bool:
        return self.admin_url is not None

    def new_database(self) -> str:
        assert self.admin_url is not None
        return create_database(self.admin_url)


_POSTGRES: PostgresForTests | None = None


def _postgres() -> PostgresForTests:
    global _POSTGRES
    if _POSTGRES is None:
        _POSTGRES = PostgresForTests()
    return _POSTGRES


# The slowest modules, slowest first (from `--durations` on 2 cores). `make test` runs each module
# whole on one of several workers (pytest-xdist, --dist loadfile: a module's servers start once),
# handed out in collection order: one of these started last would run alone at the end. Every other
# module keeps its place after them.
SLOWEST_MODULES = (
    "test_airflow_layer.py",
    "test_properties.py",
    "test_celery_deployment.py",
    "test_celery_fleet.py",
    "test_hardening.py",
    "test_demo.py",
    "test_distribution.py",
    "test_browser.py",
    "test_crash_matrix.py",
    "test_shared_journal.py",
    "test_standalone_stop.py",
    "test_benchmarks.py",
)


# Modules whose tests share nothing wider than the session (no module-scoped server), and each of which
# would keep one worker busy for a third of the run: under --dist loadfile their tests are handed out
# one by one, so several workers share them. Every other module still runs whole on one worker.
SPREAD_MODULES = ("test_airflow_layer.py", "test_properties.py", "test_crash_matrix.py")


def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LoadFileSpreadingSome(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return nodeid if module.rsplit("/", 1)[-1] in SPREAD_MODULES else module

    return LoadFileSpreadingSome(config, log)


def needs_postgres_server(item) -> bool:
    """The test talks to a PostgreSQL server: the session's (its fixtures, or a "postgres" parameter of a
    fixture choosing the journal's engine) or a cluster of its own (a module marked so by hand)."""
    if item.get_closest_marker("postgres_server") or {"postgres", "postgres_url"} & set(item.fixturenames):
        return True
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(isinstance(v, str) and v == "postgres" for v in callspec.params.values())


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks given here
def pytest_collection_modifyitems(session, config, items):
    for item in items:
        if needs_postgres_server(item):
            item.add_marker("postgres_server")
    rank = {name: n for n, name in enumerate(SLOWEST_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's own order stays


def pytest_report_header(config):
    if os.environ.get(ENV_URL):
        return f"journal backends: SQLite and PostgreSQL ({ENV_URL})"
    if server_bindir() is None:
        return "!!! " + HOW_TO_ENABLE
    return "journal backends: SQLite and PostgreSQL (a throwaway cluster started by the tests)"


_CPU = cpu_report.ModuleCpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test's CPU (setup, call and teardown: a module's servers stop in its last test's) to its module."""
    started = cpu_report.started()
    yield
    _CPU.add(item.nodeid.split("::")[0], started)


def pytest_sessionfinish(session, exitstatus):
    extra = {}
    if _POSTGRES is not None and _POSTGRES.cluster is not None:
        server = _POSTGRES.cluster.postmaster_cpu()
        if server is not None:
            extra["(the session's PostgreSQL server)"] = server
        _POSTGRES.cluster.destroy()
    _CPU.write(extra)
    airflow_forkserver.stop()  # after the report: its end would count its forks' CPU again


@pytest.fixture(scope="module")
def mail_servers():
    """Real mail servers on 127.0.0.1 for a module's tests: an SMTP server filing into a Maildir, dovecot
    serving it over IMAP (tests/support/mail_servers.py). In CI they must be there; elsewhere their absence skips."""
    from tests.support.mail_servers import MailServers, missing

    problem = missing()
    if problem:
        if os.environ.get("CI"):
            pytest.fail("CI must run the e-mail tests. " + problem)
        pytest.skip(problem)
    servers = MailServers()
    yield servers
    servers.stop()


@pytest.fixture(scope="session")
def postgres() -> PostgresForTests:
    """The session's PostgreSQL. In CI it must be there (.ci/run installs it); elsewhere its absence skips."""
    pg = _postgres()
    if not pg.available:
        if os.environ.get("CI"):
            pytest.fail("CI must run the PostgreSQL tests, but no PostgreSQL server was found. " + HOW_TO_ENABLE)
        pytest.skip(HOW_TO_ENABLE)
    return pg


@pytest.fixture
def postgres_url(postgres) -> str:
    """A new, empty database of the session's PostgreSQL."""
    return postgres.new_database()


@pytest.fixture(params=["sqlite", "postgres"])
def journal_location(request, tmp_path) -> str:
    """Where this test's journal lives: a SQLite file, then a PostgreSQL database of its own."""
    if request.param == "sqlite":
        return str(tmp_path / "journal" / "journal.sqlite3")
    return request.getfixturevalue("postgres_url")
