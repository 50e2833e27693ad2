# One obvious way to run things. Every target builds its own virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
AIRFLOW_VERSION ?= 3.3.2
PY := $(VENV)/bin/python

.PHONY: test test-matrix demo bench lint clean

# The compatibility matrix (make test-matrix): the Airflow-layer, UI and metrics tests on the newest
# patch of every older Airflow minor this provider declares, and the core tests (no Airflow) on the
# oldest and newest Python it declares (the property test with 60 examples there, 300 in `make test`).
# `make test` is the newest Airflow on the default Python.
AIRFLOW_MATRIX ?= 3.1.8 3.2.2
PYTHON_MATRIX ?= 3.10 3.13
# 3.2.2's own dependencies resolve to FastAPI/Pydantic releases that break its execution API; the
# official constraints file is out of reach here, so pip (>= 26) picks what existed in May 2026.
PIP_ARGS_3.2.2 = --uploaded-prior-to 2026-06-01T00:00:00Z
AIRFLOW_LAYER_TESTS = tests/test_airflow_layer.py tests/test_ui_plugin.py tests/test_metrics_and_link.py \
	tests/test_sensor_journal.py tests/test_review_operator.py
CORE_TESTS = tests/test_article_scenario.py tests/test_bad_input.py tests/test_cli.py tests/test_crash_matrix.py \
	tests/test_decide.py tests/test_durability.py tests/test_job_lock.py tests/test_journal.py \
	tests/test_postgres_failures.py tests/test_postgres_journal.py tests/test_properties.py \
	tests/test_receipt_log.py tests/test_secrets.py tests/test_shared_journal.py tests/test_three_way_verify.py \
	tests/test_bulk_resolution.py tests/test_generations.py tests/test_stop.py tests/test_versions.py tests/test_decision_input.py tests/test_stale_decisions.py \
	tests/test_fleet_scale.py
# A Python of that minor: pyenv's, else one on PATH.
python_for = $(firstword $(wildcard $(HOME)/.pyenv/versions/$(1).*/bin/python$(1)) $(shell command -v python$(1)))

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "apache-airflow==$(AIRFLOW_VERSION)" -e ".[airflow,http,postgres,test]"
	touch $@

test: $(VENV)/.installed  ## run the whole test suite
	$(PY) -m pytest

.venv-airflow-%/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv .venv-airflow-$*
	.venv-airflow-$*/bin/python -m pip install --quiet --upgrade "pip>=26"
	.venv-airflow-$*/bin/python -m pip install --quiet $(PIP_ARGS_$*) "apache-airflow==$*" \
		-e ".[airflow,http,postgres]" "pytest>=8" "hypothesis>=6.100" "statsd>=3.3"
	touch $@

.venv-python-%/.installed: pyproject.toml Makefile
	@test -n "$(call python_for,$*)" || { echo "no Python $* found (pyenv or PATH)"; exit 1; }
	$(call python_for,$*) -m venv .venv-python-$*
	.venv-python-$*/bin/python -m pip install --quiet --upgrade pip
	.venv-python-$*/bin/python -m pip install --quiet -e ".[postgres]" "pytest>=8" "hypothesis>=6.100"
	touch $@

test-matrix: $(foreach v,$(AIRFLOW_MATRIX),.venv-airflow-$(v)/.installed) $(foreach v,$(PYTHON_MATRIX),.venv-python-$(v)/.installed)  ## the compatibility matrix
	@set -e; for v in $(AIRFLOW_MATRIX); do \
	  echo "=== matrix cell: Airflow $$v, Python $$(.venv-airflow-$$v/bin/python -c 'import platform; print(platform.python_version())'): Airflow-layer, UI and metrics tests ==="; \
	  .venv-airflow-$$v/bin/python -m pytest -p no:cacheprovider -q $(AIRFLOW_LAYER_TESTS); \
	done; \
	for v in $(PYTHON_MATRIX); do \
	  echo "=== matrix cell: Python $$(.venv-python-$$v/bin/python -c 'import platform; print(platform.python_version())'), no Airflow: core tests ==="; \
	  RESUMABLE_PROPERTY_EXAMPLES=60 .venv-python-$$v/bin/python -m pytest -p no:cacheprovider -q $(CORE_TESTS); \
	done; \
	echo "=== matrix: every cell passed ==="

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check airflow_resumable airflow_provider_resumable tests benchmarks dags demo
	$(VENV)/bin/mypy airflow_resumable/journal airflow_resumable/runner.py airflow_resumable/_fs.py airflow_resumable/errors.py

demo: $(VENV)/.installed  ## the article's experiment end to end through real Airflow
	$(PY) -m demo

# The bench extra (DBOS, for the peer figure) gets its own stamp so `make test` never needs it.
$(VENV)/.bench-installed: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[bench]"
	touch $@

bench: $(VENV)/.bench-installed  ## run every benchmark; prints figures, ratios and PASS/FAIL, updates README
	$(PY) -m benchmarks

clean:
	rm -rf $(VENV) .venv-airflow-* .venv-python-* .pytest_cache .mypy_cache .ruff_cache .hypothesis
