"""`make demo` end to end: real Airflow, the HTTP receiver, counts read from the receiver's store."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.airflow_harness import REPO

pytestmark = pytest.mark.airflow


def test_demo_prints_the_articles_table_with_our_numbers():
    proc = subprocess.run([sys.executable, "-m", "demo"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = [" ".join(line.split()) for line in proc.stdout.splitlines()]
    before = lines.index("[fault before accept]")
    after = lines.index("[fault after accept]")
    assert lines[before + 1] == "steps executed on re-run 150 2nd run: 27; 3rd run after resolution: 1"
    assert lines[before + 2] == "steps skipped on re-run 0 2nd run: 122"
    assert lines[before + 3] == "duplicate sends (receiver's count) 40 0"
    assert lines[before + 4] == "items received 50 50"
    assert "then not_delivered -> sent once" in lines[before + 5]
    assert lines[after + 1] == "steps executed on re-run 150 2nd run: 27; 3rd run after resolution: 0"
    assert lines[after + 3] == "duplicate sends (receiver's count) 41 0"
    assert "then delivered -> marked done, not re-sent" in lines[after + 5]
