# One obvious way to run things. Every target builds its own virtual environment on first use.
PYTHON ?= python3
VENV ?= .venv
AIRFLOW_VERSION ?= 3.3.2
PY := $(VENV)/bin/python

.PHONY: test demo bench lint clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "apache-airflow==$(AIRFLOW_VERSION)" -e ".[airflow,http,postgres,test]"
	touch $@

test: $(VENV)/.installed  ## run the whole test suite
	$(PY) -m pytest

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check airflow_resumable tests benchmarks dags
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
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
