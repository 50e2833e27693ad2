"""No test module falls out of every cell of `make test-matrix` unnoticed.

A cell runs the modules marked for it (``core``: no Airflow installed, the Python cells; ``compat``: the
Airflow cells), as a module-level ``pytestmark`` or on a class. A module with neither mark runs in
`make test` only, and the Makefile says so and why: it lists it in ``MAKE_TEST_ONLY``. Everything here
is read from the texts of the Makefile and the modules; no test module is imported.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import CELL_MARKERS, module_cells, required_cell_markers

pytestmark = pytest.mark.core

REPO = Path(__file__).resolve().parents[2]
MAKEFILE = (REPO / "Makefile").read_text()
TEST_MODULES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py"))
WHAT_TO_DO = ("mark it for a cell (pytestmark = pytest.mark.core: it runs with no Airflow installed; or compat: "
              "the Airflow cells), or list it in the Makefile's MAKE_TEST_ONLY with the reason it runs in `make test` only")


def make_test_only(makefile: str) -> list[str]:
    """The paths the Makefile's MAKE_TEST_ONLY names (its ``=`` and ``+=`` lines)."""
    paths: list[str] = []
    for line in makefile.replace("\\\n", " ").splitlines():
        match = re.match(r"MAKE_TEST_ONLY\s*[:+]?=(.*)", line)
        if match:
            paths += match.group(1).split("#")[0].split()
    return paths


def cells_of(module: str) -> set[str]:
    return module_cells((REPO / module).read_text(encoding="utf-8"))


def test_every_test_module_is_in_a_cell_or_listed_as_run_by_make_test_only():
    listed = set(make_test_only(MAKEFILE))
    assert listed, "no MAKE_TEST_ONLY in the Makefile"
    nowhere = [module for module in TEST_MODULES if not cells_of(module) and module not in listed]
    assert not nowhere, f"in no cell of make test-matrix and not listed as make-test-only: {nowhere}; {WHAT_TO_DO}"


def test_every_module_listed_as_make_test_only_exists_and_is_in_no_cell():
    listed = make_test_only(MAKEFILE)
    assert not [path for path in listed if listed.count(path) > 1], "listed twice in MAKE_TEST_ONLY"
    missing = [path for path in listed if path not in TEST_MODULES]
    assert not missing, f"MAKE_TEST_ONLY names what is no test module: {missing}"
    marked = {path: sorted(cells_of(path)) for path in listed if cells_of(path)}
    assert not marked, f"listed as make-test-only, yet marked for a cell: {marked}; one or the other"


def test_the_cells_select_by_their_markers():
    """The cells' pytest commands name no files: a module is in a cell by its marker alone."""
    makefile = MAKEFILE.replace("\\\n", " ")
    python_cell = makefile.split("\ncell-python-%:", 1)[1].split("\n\n", 1)[0]
    airflow_cell = makefile.split("\ncell-airflow-%:", 1)[1].split("\n\n", 1)[0]
    assert re.search(r' -m pytest [^\n]*\stests -m "core and not postgres_server"(\s|$)', python_cell), python_cell
    assert re.search(r" -m pytest [^\n]*\stests -m compat(\s|$)", airflow_cell), airflow_cell


REQUIRED = [  # -m expression, the cell markers a module's text must mention to be collected
    ("", set()),
    ("core", {"core"}),
    ("core and not postgres_server", {"core"}),
    ("compat", {"compat"}),
    ("core and compat", {"core", "compat"}),
    ("not core", set()),  # every module may hold tests without the marker
    ("slow and not compat", set()),
    ("core or compat", set()),  # an `or`: collect everything, -m decides
    ("(core)", set()),
    ("airflow", set()),
    ("score", set()),
]


@pytest.mark.parametrize(("markexpr", "required"), REQUIRED, ids=[expr or "no -m" for expr, _ in REQUIRED])
def test_a_cell_marker_is_required_only_where_the_expression_cannot_match_without_it(markexpr, required):
    assert required_cell_markers(markexpr) == required


def test_the_cell_markers_are_declared_in_pyproject():
    pyproject = (REPO / "pyproject.toml").read_text()
    for marker in CELL_MARKERS:
        assert re.search(rf'^\s*"{marker}: ', pyproject, re.M), marker
