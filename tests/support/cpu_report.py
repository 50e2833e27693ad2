"""Where the suite's CPU goes: per test module, the user and system time of the pytest process and of
every child it waited for (Airflow processes, servers a module starts and stops), and its wall time.

Loaded by tests/conftest.py. When ``RESUMABLE_CPU_REPORT`` names a folder, each pytest process (every
xdist worker) writes ``<label>-<worker>.json`` there at the end (``RESUMABLE_CPU_LABEL``: which run,
e.g. ``make-test`` or ``cell-python-3.13``), plus the session's PostgreSQL server (a daemon nobody
waits for: its postmaster's own and its children's time, read from /proc). ``python -m tests.support.cpu_report
FOLDER`` prints the table `.ci/run` ends with. A module runs whole on one worker (``--dist loadfile``),
so its figures are its own; a module split over several workers is summed.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections import defaultdict
from pathlib import Path

ENV_FOLDER, ENV_LABEL = "RESUMABLE_CPU_REPORT", "RESUMABLE_CPU_LABEL"


_FOREIGN = [0.0, 0.0]


def count_foreign(user: float, system: float) -> None:
    """Count CPU spent for this process by processes it does not wait for itself (forks of the Airflow
    fork server, tests/support/airflow_forkserver.py: their parent waits for them and reports it)."""
    _FOREIGN[0] += user
    _FOREIGN[1] += system


def cpu_now() -> tuple[float, float]:
    """(user, system) seconds of this process, of the children it has waited for, and counted for it."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + children.ru_utime + _FOREIGN[0], me.ru_stime + children.ru_stime + _FOREIGN[1]


class ModuleCpu:
    """Per-module (user, system, wall) of one pytest process."""

    def __init__(self) -> None:
        self.modules: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])

    def add(self, module: str, started: tuple[float, float, float]) -> None:
        user, system = cpu_now()
        figures = self.modules[module]
        figures[0] += user - started[0]
        figures[1] += system - started[1]
        figures[2] += time.monotonic() - started[2]

    def write(self, extra: dict[str, list[float]]) -> None:
        folder = os.environ.get(ENV_FOLDER)
        if not folder:
            return
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        label = os.environ.get(ENV_LABEL, "pytest")
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{label}-{worker}.json").write_text(json.dumps({**self.modules, **extra}))


def started() -> tuple[float, float, float]:
    return (*cpu_now(), time.monotonic())


def process_tree_cpu(pid: int) -> list[float] | None:
    """(user, system, 0) of process ``pid`` and the children it waited for, from /proc; None if gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    utime, stime, cutime, cstime = (int(fields[i]) / tick for i in (11, 12, 13, 14))
    return [utime + cutime, stime + cstime, 0.0]


def table(folder: Path) -> str:
    """Every report in ``folder`` as one table per label, heaviest module first."""
    runs: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
    for report in sorted(folder.glob("*.json")):
        label = report.stem.rsplit("-", 1)[0]
        for module, figures in json.loads(report.read_text()).items():
            for i, value in enumerate(figures):
                runs[label][module][i] += value
    lines = []
    for label, modules in runs.items():
        total = [sum(f[i] for f in modules.values()) for i in range(3)]
        lines.append(f"CPU by module, {label}: {total[0] + total[1]:.0f} s CPU ({total[0]:.0f} user + "
                     f"{total[1]:.0f} system); wall summed over workers {total[2]:.0f} s")
        lines.append(f"  {'module':<58} {'user':>7} {'system':>7} {'cpu':>7} {'wall':>7}")
        for module, (user, system, wall) in sorted(modules.items(), key=lambda kv: -(kv[1][0] + kv[1][1])):
            lines.append(f"  {module:<58} {user:7.1f} {system:7.1f} {user + system:7.1f} {wall:7.1f}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(Path(sys.argv[1])))
