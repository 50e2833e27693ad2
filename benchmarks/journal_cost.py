"""What the journal costs: the same sends with and without it, measured in one run.

For each setting - concurrency 16 and 64 against the 4 ms receiver, 64 against a 50 ms one - the same
items go to the same receiver process (:mod:`benchmarks.concurrency`'s, real HTTP on 127.0.0.1) over
the same kind of keep-alive ``http.client`` connection, one per thread, from a thread pool of the same
size: once with no journal at all (a plain ``ThreadPoolExecutor`` running the item's steps, its key
worked out as the runner does), once through ``run_batch(..., concurrency=c)`` at full durability.
Each side runs twice, alternating, and the better run of each side is kept: a burst of other load on a
shared machine hits one repetition, not the figure. The ratio is with / without.

What each run costs the machine: the CPU seconds this process (all its threads), the receiver's
process and, on PostgreSQL, the database server's processes used per item, and how busy the
machine's cores were meanwhile (from ``/proc/stat``, other load included). When the sends without
the journal already keep the cores busy, the journal's extra CPU per item is what the ratio pays for.

Where the journal's time goes: one more run of the first setting under ``cProfile``, which profiles
the thread that calls ``run_batch`` - the one that prepares items, writes and commits every mark and
records every receipt - with how much of that thread's time was spent waiting (for sends to finish,
for a commit) rather than working, and its busiest functions.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from airflow_resumable.runner import Step, StepContext, idempotency_key, run_batch
from benchmarks import workload
from benchmarks.concurrency import _Client, _ReceiverProcess, fresh_journal

# (concurrency, the receiver's reply time in ms), each with its target: with / without the journal.
SETTINGS = ((16, 4.0), (64, 4.0), (64, 50.0))
TARGETS = {(16, 4.0): 0.9, (64, 4.0): 0.9, (64, 50.0): 0.97}
REPS = 2
TOP_FUNCTIONS = 8


_TICKS = os.sysconf("SC_CLK_TCK")


def _process_cpu(pid: int, *, with_children: bool = False) -> float:
    """CPU seconds (user + system) a process has used, from /proc; ``with_children``: plus its live
    children's and what its ended children used (a database server: the postmaster and its backends)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return 0.0  # a child that ended meanwhile: its time is in its parent's children's time
    fields = stat[stat.rindex(")") + 2:].split()
    seconds = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
    if with_children:
        seconds += (int(fields[13]) + int(fields[14])) / _TICKS  # cutime, cstime: children that ended
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            seconds += _process_cpu(int(child))
    return seconds


def _machine_ticks() -> tuple[int, int]:
    """(busy, total) clock ticks of every core since boot, from /proc/stat."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return sum(values) - idle, sum(values)


@dataclass
class _Cpu:
    """The CPU a timed run used: this process, the receiver's process, the database server's processes
    (a PostgreSQL journal), and the machine's busy share."""

    client: float
    receiver: float
    database: float
    busy_share: float

    @classmethod
    def around(cls, receiver_pid: int, database_pid: int | None, run: Any) -> tuple[float, _Cpu]:
        def database() -> float:
            return 0.0 if database_pid is None else _process_cpu(database_pid, with_children=True)

        client, receiver, db, (busy, total) = (time.process_time(), _process_cpu(receiver_pid), database(),
                                                _machine_ticks())
        seconds = run()
        busy_after, total_after = _machine_ticks()
        cpu = cls(time.process_time() - client, _process_cpu(receiver_pid) - receiver, database() - db,
                  (busy_after - busy) / max(1, total_after - total))
        return seconds, cpu

    def per_item_ms(self, n: int) -> dict[str, float]:
        return {"client": self.client / n * 1e3, "receiver": self.receiver / n * 1e3,
                "database": self.database / n * 1e3, "busy_share": self.busy_share}


def setting_name(concurrency: int, reply_ms: float) -> str:
    return f"{concurrency}@{reply_ms:g}ms"


def _local(item: Any, ctx: Any) -> None:
    return None  # the workload's validate and transform: nothing, on both sides


def _steps(client: _Client) -> list[Step]:
    return [Step("validate", _local), Step("transform", _local), Step("notify", client.send, side_effect=True)]


def _without_journal(client: _Client, job_id: str, n: int, concurrency: int) -> float:
    """Seconds for the items' steps on a plain thread pool: nothing recorded anywhere."""
    def one(item: dict[str, Any]) -> str:
        item_id = str(item["id"])
        _local(item, None)
        _local(item, None)
        ctx = StepContext(job_id, item_id, "notify", "", idempotency_key(job_id, item_id, "notify"))
        return client.send(item, ctx)

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="plain-send") as pool:
        receipts = list(pool.map(one, workload.items(n)))
    seconds = time.perf_counter() - start
    if len(receipts) != n:
        raise AssertionError(f"{job_id}: {len(receipts)} of {n} sends answered")
    return seconds


def _with_journal(client: _Client, journal_url: str | None, job_id: str, n: int, concurrency: int,
                  profile: cProfile.Profile | None = None) -> float:
    """Seconds for the same items through run_batch on a new full-durability journal."""
    schema = job_id.replace("-", "_").replace("@", "_").replace(".", "_")
    with fresh_journal(journal_url, schema) as journal:
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        try:
            result = run_batch(journal, job_id, workload.items(n), _steps(client), concurrency=concurrency)
        finally:
            if profile is not None:
                profile.disable()
        seconds = time.perf_counter() - start
    if result.executed_steps != 3 * n:
        raise AssertionError(f"{job_id}: {result.executed_steps} of {3 * n} steps executed")
    return seconds


def _where_the_time_goes(profile: cProfile.Profile, seconds: float) -> dict[str, Any]:
    """The journal thread's profile: its waiting share and busiest functions (own time)."""
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    def waiting_for_sends(name: str) -> bool:  # blocked until a send ends: the queue of ended sends, or a lock
        return ("acquire" in name and "lock" in name) or name == "<method 'get' of '_queue.SimpleQueue' objects>"

    waiting = sum(tottime for (_, _, name), (_, _, tottime, _, _) in stats.items() if waiting_for_sends(name))
    busiest = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)
    top = []
    for (path, line, name), (_, calls, tottime, _, _) in busiest:
        if waiting_for_sends(name):
            continue
        where = f"{Path(path).name}:{line}({name})" if path != "~" else name
        top.append({"function": where, "calls": calls, "seconds": tottime, "share": tottime / seconds})
        if len(top) == TOP_FUNCTIONS:
            break
    return {"seconds": seconds, "waiting_for_sends_share": waiting / seconds, "busiest": top}


def measure(n: int, journal_url: str | None = None, reps: int = REPS, database_pid: int | None = None) -> dict[str, Any]:
    """Each setting's items/s without and with the journal, their ratio, and the journal thread's profile."""
    settings: dict[str, Any] = {}
    profile_figures: dict[str, Any] | None = None
    for concurrency, reply_ms in SETTINGS:
        name = setting_name(concurrency, reply_ms)
        plain: list[float] = []
        journaled: list[float] = []
        cpu: dict[str, list[_Cpu]] = {"without": [], "with": []}
        with _ReceiverProcess(reply_ms / 1e3) as receiver:
            before = receiver.stats()
            for rep in range(reps):
                client = _Client(receiver.port)
                try:
                    seconds, used = _Cpu.around(receiver.proc.pid, database_pid, lambda: _without_journal(
                        client, f"plain-{name}-{rep}", n, concurrency))  # noqa: B023 - called at once
                    plain.append(seconds)
                    cpu["without"].append(used)
                finally:
                    client.close()
                client = _Client(receiver.port)
                try:
                    seconds, used = _Cpu.around(receiver.proc.pid, database_pid, lambda: _with_journal(
                        client, journal_url, f"cost-{name}-{rep}", n, concurrency))  # noqa: B023 - called at once
                    journaled.append(seconds)
                    cpu["with"].append(used)
                finally:
                    client.close()
            if profile_figures is None:  # the first setting, once more, profiled
                profile = cProfile.Profile()
                client = _Client(receiver.port)
                try:
                    seconds = _with_journal(client, journal_url, f"profiled-{name}", n, concurrency, profile)
                finally:
                    client.close()
                profile_figures = {"setting": name} | _where_the_time_goes(profile, seconds)
            after = receiver.stats()
        without, with_ = n / min(plain), n / min(journaled)
        settings[name] = {
            "concurrency": concurrency, "reply_ms": reply_ms, "items": n,
            "without_items_per_second": without, "with_items_per_second": with_, "ratio": with_ / without,
            "target": TARGETS[(concurrency, reply_ms)],
            "all_seconds": {"without": plain, "with": journaled},
            # Of each side's kept (fastest) run: CPU ms per item and the machine's busy share.
            "cpu_ms_per_item": {"without": cpu["without"][plain.index(min(plain))].per_item_ms(n),
                                "with": cpu["with"][journaled.index(min(journaled))].per_item_ms(n)},
            "duplicate_sends": after["duplicates"] - before["duplicates"],
        }
    return {"n": n, "durability": "full", "reps": reps, "settings": settings, "profile": profile_figures}


def measure_postgres(n: int, reps: int = REPS) -> dict[str, Any]:
    """:func:`measure` on a PostgreSQL journal in a throwaway cluster started (and destroyed) here."""
    from benchmarks import pg

    if (why := pg.unavailable()) is not None:
        return {"skipped": why}
    with pg.throwaway_server() as server:
        figures = measure(n, journal_url=server.new_database(), reps=reps, database_pid=server.pid())
        version = server.version()
    return {"engine": "postgresql", "postgres_version": version} | figures
