"""CI's budget: run a command, add its wall time and CPU to a budget file, exit as it did.

    python3 .ci/timed.py BUDGET LABEL -- COMMAND...   one step (CPU: it and every child it waited for)
    python3 .ci/timed.py --report BUDGET              the table: each label's steps summed, and the total

Steps of one label that ran side by side (the matrix cells' installs) are summed, wall time too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict


def run(budget: str, label: str, command: list[str]) -> int:
    started = time.monotonic()
    child = subprocess.Popen(command)
    _, status, usage = os.wait4(child.pid, 0)
    with open(budget, "a") as out:
        out.write(json.dumps([label, time.monotonic() - started, usage.ru_utime, usage.ru_stime]) + "\n")
    return os.waitstatus_to_exitcode(status)


def report(budget: str) -> str:
    steps: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    with open(budget) as lines:
        for line in lines:
            label, *figures = json.loads(line)
            for i, value in enumerate(figures):
                steps[label][i] += value
    rows = [f"  {'step':<34} {'wall s':>8} {'user s':>8} {'sys s':>8}"]
    rows += [f"  {label:<34} {wall:8.0f} {user:8.0f} {system:8.0f}" for label, (wall, user, system) in steps.items()]
    return "\n".join(rows)


if __name__ == "__main__":
    if sys.argv[1] == "--report":
        print(report(sys.argv[2]))
        sys.exit(0)
    budget, label, separator, *command = sys.argv[1:]
    if separator != "--" or not command:
        sys.exit("usage: timed.py BUDGET LABEL -- COMMAND...")
    sys.exit(run(budget, label, command))
