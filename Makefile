# One obvious way to run things. Every target builds its own virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
AIRFLOW_VERSION ?= 3.3.2
PY := $(VENV)/bin/python

.PHONY: test test-matrix demo demo-email bench bench-fleet lint clean

# The compatibility matrix (make test-matrix): the Airflow-layer, UI and metrics tests on the newest
# patch of every older Airflow minor this provider declares, and the core tests (no Airflow) on the
# oldest and newest Python it declares (the property test with 60 examples there, 300 in `make test`).
# `make test` is the newest Airflow on the default Python, every test.
#
# What the Python cells leave out, and why: a core test can fail on another Python only through what
# the interpreter and its standard library do - sqlite3, threads, signals, processes, the language. The
# tests marked postgres_server (tests/conftest.py marks every test that talks to a PostgreSQL server)
# check what the server does with the journal's SQL: the same SQL, sent through the same psycopg calls
# by the same code on every Python, which the SQLite half of each such test drives on these Pythons
# too. They run once, in `make test`; the cells run every other core test (the -m below).
AIRFLOW_MATRIX ?= 3.1.8 3.2.2
PYTHON_MATRIX ?= 3.10 3.13
# 3.2.2's own dependencies resolve to FastAPI/Pydantic releases that break its execution API; the
# official constraints file is out of reach here, so the installer picks what existed in May 2026.
INSTALL_ARGS_3.2.2 = --exclude-newer 2026-06-01T00:00:00Z
# Each cell selects its tests by marker (pyproject.toml): a test module carries `core` (runs with no
# Airflow installed: the Python cells) or `compat` (the Airflow-layer, UI and metrics tests: the Airflow
# cells), or both, as its pytestmark or on the one class of it a cell runs. tests/conftest.py does not
# even import a module that lacks the cell's marker. Every other module runs in `make test` only, listed
# here with the reason; tests/core/test_matrix_cells.py fails on a module that is neither (or both).
# - `make demo` and `make bench` end to end: they run in .venv, on the newest Airflow, only.
MAKE_TEST_ONLY = tests/deployments/test_demo.py tests/deployments/test_benchmarks.py
# - A real CeleryExecutor deployment: the celery provider, a Redis broker, PostgreSQL (the test extra).
MAKE_TEST_ONLY += tests/deployments/test_celery_deployment.py tests/deployments/test_celery_fleet.py
# - Builds the sdist and wheel (build, twine, uv: the test extra) and installs the wheel on its own.
MAKE_TEST_ONLY += tests/deployments/test_distribution.py
# - Parses docker-compose.yaml: its Airflow is the Docker image's, not the one installed here.
MAKE_TEST_ONLY += tests/deployments/test_docker_compose.py
# - A browser: Playwright (the test extra) drives Chromium through `airflow standalone`.
MAKE_TEST_ONLY += tests/faces/test_browser.py
# - Real mail servers: aiosmtpd and the IMAP provider (the test extra), Debian's dovecot. (The Airflow
#   cells run tests/outside_systems/test_smtp_receiver.py's TestWithoutServers, which needs none.)
MAKE_TEST_ONLY += tests/airflow_layer/test_email_airflow.py
# - mypy --strict of a DAG against this package's hints: mypy is the test extra's (not in the cells), and
#   the hints it reads are this package's, the same whatever Airflow is installed.
MAKE_TEST_ONLY += tests/airflow_layer/test_typing.py
# - A task's retry_policy, which Airflow 3.3 added: the older Airflow of the cells has none.
MAKE_TEST_ONLY += tests/airflow_layer/test_retry_policy.py
# - `airflow standalone` stops a running task: the task log asserted is 3.3's supervisor's (fails on 3.1.8).
MAKE_TEST_ONLY += tests/airflow_layer/test_standalone_stop.py
# - Every test talks to a PostgreSQL server (left out of the Python cells, see above), and the old
#   release's wheel is built from this repository's git history.
MAKE_TEST_ONLY += tests/engines/test_fleet_upgrade.py
# - A shared journal named by an Airflow connection from the environment (PostgreSQL): on 3.1.8 the CLI
#   and the API server do not find that connection and these fail (test_ui_decisions' SQLite half passes).
MAKE_TEST_ONLY += tests/airflow_layer/test_airflow_shared_journal.py tests/faces/test_ui_decisions.py
# - Core findings and Airflow ones in one module (finding 5's two fail on 3.1.8): no cell takes it whole.
MAKE_TEST_ONLY += tests/engines/test_hardening.py
# - SPEC §12 at full size: 2,000 items behind a real nginx limit (~20 s a run), four runner processes on a
#   PostgreSQL journal, a fault proxy, `airflow dags test`: once is enough (the cells run
#   tests/outside_systems/test_rate_limited_receiver.py and tests/core/test_settlement.py).
MAKE_TEST_ONLY += tests/outside_systems/test_paced_receiver.py
# - In no cell so far, for no reason of their own: they pass on Airflow 3.1.8 (the page's code without a
#   server, its cost in a 200,000-item journal, the HTTP receiver). Candidates for `compat`.
MAKE_TEST_ONLY += tests/faces/test_jobs_visible.py tests/faces/test_page_errors.py tests/faces/test_ui_paging.py
MAKE_TEST_ONLY += tests/outside_systems/test_http_receiver.py
# - In no cell so far, for no reason of its own: the CLI in a big journal, no Airflow; its tests that need
#   no PostgreSQL server pass on Python 3.13 with no Airflow installed. A candidate for `core`.
MAKE_TEST_ONLY += tests/faces/test_cli_paging.py

# A Python of that minor: pyenv's, else one on PATH.
python_for = $(firstword $(wildcard $(HOME)/.pyenv/versions/$(1).*/bin/python$(1)) $(shell command -v python$(1)))

# uv (from PyPI) builds every environment: it resolves and installs Airflow in seconds where pip took a
# minute of CPU. It uses the interpreters found here, never one it would download. --seed puts pip in
# each environment too: the tests build wheels and install an older release with it.
UV := .uv/bin/uv
export UV_PYTHON_DOWNLOADS := never
# Compiled at install, as pip does: where PYTHONDONTWRITEBYTECODE is set (it is on CI's machines), every
# Airflow process of the suite would otherwise compile Airflow again (5 s instead of 2 for each import).
export UV_COMPILE_BYTECODE := 1
# A step of CI's budget: with CI_BUDGET set (.ci/run sets it), the command's wall time and CPU are added to it.
timed = $(if $(CI_BUDGET),python3 .ci/timed.py $(CI_BUDGET) "$(1)" --,)

$(UV):
	$(PYTHON) -m venv .uv
	.uv/bin/python -m pip install --quiet "uv>=0.9"

$(VENV)/.installed: pyproject.toml Makefile | $(UV)
	$(call timed,install .venv) $(UV) venv --quiet --seed --allow-existing --python $(PYTHON) $(VENV)
	$(call timed,install .venv) $(UV) pip install --quiet --python $(PY) "apache-airflow==$(AIRFLOW_VERSION)" \
		-e ".[airflow,http,postgres,test]"
	touch $@

# The suite's modules run side by side (pytest-xdist): most tests wait on Airflow, servers and child
# processes more than they compute. A module runs whole on one worker (--dist loadfile), so the servers
# it starts once serve all its tests, except the three slowest, which start none: their tests are handed
# out one by one (tests/conftest.py, SPREAD_MODULES). The slowest modules are collected first, so none
# is left to run alone at the end. TEST_JOBS=0: one process.
TEST_JOBS ?= 4

test: $(VENV)/.installed  ## run the whole test suite
	$(call timed,make test: pytest) env RESUMABLE_CPU_LABEL=make-test \
		$(PY) -m pytest -n $(TEST_JOBS) --dist loadfile --no-loadscope-reorder

# The matrix builds its environments at once; an editable install writes the project's metadata into
# the source tree, so those steps take turns (the downloads and the rest of each install do not).
EDITABLE_LOCK = flock .editable-install.lock
CELL_TEST_TOOLS = "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6.100"
.PRECIOUS: .venv-airflow-%/.installed .venv-python-%/.installed

.venv-airflow-%/.installed: pyproject.toml Makefile | $(UV)
	$(call timed,install airflow $*) $(UV) venv --quiet --seed --allow-existing --python $(PYTHON) .venv-airflow-$*
	$(call timed,install airflow $*) $(EDITABLE_LOCK) $(UV) pip install --quiet --python .venv-airflow-$*/bin/python \
		$(INSTALL_ARGS_$*) "apache-airflow==$*" $(CELL_TEST_TOOLS) "statsd>=3.3" -e ".[airflow,http,postgres]"
	touch $@

.venv-python-%/.installed: pyproject.toml Makefile | $(UV)
	@test -n "$(call python_for,$*)" || { echo "no Python $* found (pyenv or PATH)"; exit 1; }
	$(call timed,install python $*) $(UV) venv --quiet --seed --allow-existing --python $(call python_for,$*) .venv-python-$*
	$(call timed,install python $*) $(EDITABLE_LOCK) $(UV) pip install --quiet --python .venv-python-$*/bin/python \
		$(CELL_TEST_TOOLS) -e ".[postgres]"
	touch $@

# The cells run side by side (each in its own virtual environment, its servers on free ports): they
# wait on Airflow, PostgreSQL and pip more than they compute. -O prints each cell's output whole when
# it ends, so a cell's log is never interleaved with another's; -k runs every cell even when one fails.
MATRIX_CELLS = $(addprefix cell-airflow-,$(AIRFLOW_MATRIX)) $(addprefix cell-python-,$(PYTHON_MATRIX))
MATRIX_JOBS ?= 4
# Two workers a cell, as `make test` does it (--dist loadfile, tests/conftest.py spreading the slowest
# modules), so no cell is left at the end with one long module on one worker.
CELL_JOBS ?= 2
CELL_PYTEST_ARGS = $(if $(filter 0,$(CELL_JOBS)),,-n $(CELL_JOBS) --dist loadfile --no-loadscope-reorder)

test-matrix:  ## the compatibility matrix, every cell at once
	@$(MAKE) --no-print-directory -k -O -j$(MATRIX_JOBS) $(MATRIX_CELLS) && echo "=== matrix: every cell passed ==="

# One cell alone while developing, e.g. `make cell-airflow-3.1.8` or `make cell-python-3.13`.
cell-airflow-%: .venv-airflow-%/.installed
	@echo "=== matrix cell: Airflow $*, Python $$(.venv-airflow-$*/bin/python -c 'import platform; print(platform.python_version())'): Airflow-layer, UI and metrics tests ==="
	$(call timed,cell airflow $*: pytest) env RESUMABLE_CPU_LABEL=cell-airflow-$* \
		.venv-airflow-$*/bin/python -m pytest -p no:cacheprovider -q $(CELL_PYTEST_ARGS) tests -m compat

cell-python-%: .venv-python-%/.installed
	@echo "=== matrix cell: Python $$(.venv-python-$*/bin/python -c 'import platform; print(platform.python_version())'), no Airflow: core tests ==="
	$(call timed,cell python $*: pytest) env RESUMABLE_PROPERTY_EXAMPLES=60 RESUMABLE_CPU_LABEL=cell-python-$* \
		.venv-python-$*/bin/python -m pytest -p no:cacheprovider -q $(CELL_PYTEST_ARGS) \
		tests -m "core and not postgres_server"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check airflow_resumable airflow_provider_resumable tests benchmarks dags demo
	$(VENV)/bin/mypy airflow_resumable/journal airflow_resumable/runner airflow_resumable/_fs.py airflow_resumable/exceptions.py

demo: $(VENV)/.installed  ## the article's experiment end to end through real Airflow
	$(PY) -m demo

demo-email: $(VENV)/.installed  ## the same for e-mail, against real mail servers (needs Debian's dovecot-imapd)
	$(PY) -m demo.email

# The bench extra (DBOS, for the peer figure) gets its own stamp so `make test` never needs it.
$(VENV)/.bench-installed: $(VENV)/.installed
	$(UV) pip install --quiet --python $(PY) -e ".[bench]"
	touch $@

bench: $(VENV)/.bench-installed  ## run every benchmark; prints figures, ratios and PASS/FAIL, updates README
	$(PY) -m benchmarks

# A million items over 16 mapped instances on a real CeleryExecutor, a worker SIGKILLed midway (needs
# redis-server and PostgreSQL's server binaries); writes benchmarks/fleet_results.json. ~30 min on 2 cores.
bench-fleet: $(VENV)/.installed  ## the fleet run: sharded batch, worker killed, exactly-once from the receiver
	$(PY) -m benchmarks.fleet

clean:
	rm -rf $(VENV) .uv .venv-airflow-* .venv-python-* .editable-install.lock .pytest_cache .mypy_cache .ruff_cache .hypothesis
