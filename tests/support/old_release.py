"""The previous release as a fleet still runs it: its wheel, built from its commit in this repository's
history, installed into a virtual environment of its own (outside the checkout, nothing imported from
it), and a worker script that runs a batch with that release's core API against a shared journal.

The worker sends through :class:`tests.support.receivers.DurableReceiver` (loaded from its file, so the old
interpreter imports nothing else of this checkout): old and new workers deliver to one receiver,
which counts every delivery per idempotency key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # this file is tests/support/<name>.py
RECEIVERS = Path(__file__).resolve().with_name("receivers.py")

RELEASE = "0.2.0"
# The last commit of 0.2.0 (journal schema 5); the next one began 0.3.0's schema 6. No tags are kept.
COMMIT = "6d453860a6db9d1148716a4e979f2785d3093549"
RELEASE_SCHEMA_VERSION = 5

WORKER = r'''
"""One worker of the previous release: run the batch, print what happened as one JSON line."""
import importlib.util, json, pathlib, sys, threading, time

import airflow_resumable
from airflow_resumable.journal import JournalVersionError, StepJournal
from airflow_resumable.runner import BatchStopped, Step, run_batch

args = json.loads(sys.argv[1])
spec = importlib.util.spec_from_file_location("receivers", args["receivers"])
receivers = importlib.util.module_from_spec(spec)
spec.loader.exec_module(receivers)
receiver = receivers.DurableReceiver(pathlib.Path(args["receiver"]))
stop = threading.Event()
sent = 0


def wait_for(go: pathlib.Path) -> None:
    deadline = time.monotonic() + 60
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{go} never appeared")
        time.sleep(0.01)


def render(item, ctx):
    return "Hello " + item["id"]


def send(item, ctx):
    global sent
    receipt = receiver.deliver(ctx.job_id, ctx.item_id, ctx.step, ctx.idempotency_key)
    sent += 1
    if sent == args["pause_after"]:  # mid-run: the test looks at the fleet while this send is under way
        pathlib.Path(args["paused"]).touch()
        wait_for(pathlib.Path(args["go_on"]))
    if sent == args["stop_after"]:  # a deploy stops this worker: no send starts after this one
        stop.set()
    return receipt


report = {"version": airflow_resumable.__version__, "package": airflow_resumable.__file__}
try:
    with StepJournal(args["url"]) as journal:
        steps = [Step("render", render), Step("send", send, side_effect=True)]
        result = run_batch(journal, args["job"], args["items"], steps, stop=stop)
    report.update(outcome=result.status, executed=result.executed_steps, skipped=result.skipped_steps)
except BatchStopped:
    report.update(outcome="stopped")
except JournalVersionError as exc:
    report.update(outcome="refused", message=str(exc))
report["sent"] = sent
print(json.dumps(report))
'''


@dataclass(frozen=True)
class WorkerReport:
    """What one worker of the previous release did: ``outcome`` is the batch's status, ``stopped``
    (its stop was set part way) or ``refused`` (the journal was refused: ``message``)."""

    version: str
    package: str
    outcome: str
    sent: int
    executed: int | None = None
    skipped: int | None = None
    message: str | None = None


@dataclass(frozen=True)
class OldWorker:
    """A worker of the previous release running in its own process (see :meth:`OldRelease.start`)."""

    process: subprocess.Popen[str]
    paused: Path
    go_on: Path

    def wait_until_paused(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.paused.exists():
            if self.process.poll() is not None:
                raise AssertionError(f"the old worker ended before its pause: {self.process.communicate()}")
            if time.monotonic() > deadline:
                raise AssertionError("the old worker never reached its pause")
            time.sleep(0.01)

    def go_on_and_finish(self, timeout: float = 60) -> WorkerReport:
        self.go_on.touch()
        return self.finish(timeout)

    def finish(self, timeout: float = 60) -> WorkerReport:
        out, err = self.process.communicate(timeout=timeout)
        assert self.process.returncode == 0, err[-3000:]
        return WorkerReport(**json.loads(out.strip().splitlines()[-1]))

    def __enter__(self) -> OldWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        # A test that failed part way leaves no worker of ours behind (one paused would wait a minute).
        if self.process.poll() is None:
            self.process.kill()
            self.process.communicate()


@dataclass(frozen=True)
class OldRelease:
    """The previous release, installed: ``python`` runs it, ``venv`` is where it lives."""

    version: str
    venv: Path
    python: Path
    worker_script: Path
    build_seconds: float  # git archive + wheel + virtual environment

    def start(self, url: str, job: str, receiver: Path, *, items: list[dict[str, str]], stop_after: int | None = None,
              pause_after: int | None = None) -> OldWorker:
        """Start a worker of this release on ``job`` over ``items``, sending to ``receiver``: it stops
        itself after ``stop_after`` sends, and waits after ``pause_after`` sends until told to go on."""
        control = self.venv.parent / "control"
        control.mkdir(exist_ok=True)
        tag = f"{os.getpid()}-{time.monotonic_ns()}"
        paused, go_on = control / f"paused-{tag}", control / f"go-{tag}"
        args = {"url": url, "job": job, "receiver": str(receiver), "receivers": str(RECEIVERS), "items": items,
                "stop_after": stop_after, "pause_after": pause_after, "paused": str(paused), "go_on": str(go_on)}
        # -I: isolated, so neither PYTHONPATH nor the current directory can bring this checkout's package in.
        process = subprocess.Popen([str(self.python), "-I", str(self.worker_script), json.dumps(args)],
                                   cwd=self.venv.parent, env=_clean_env(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        return OldWorker(process, paused, go_on)

    def run(self, url: str, job: str, receiver: Path, *, items: list[dict[str, str]],
            stop_after: int | None = None) -> WorkerReport:
        """Run a worker of this release to its end (see :meth:`start`)."""
        with self.start(url, job, receiver, items=items, stop_after=stop_after) as worker:
            return worker.finish()


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "AIRFLOW"))}


def _run(*args: str | Path, timeout: float = 600) -> None:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(map(str, args))}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"


def has_commit() -> bool:
    """Whether this checkout's git history holds the previous release (not a shallow clone or a tarball)."""
    found = subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{COMMIT}^{{commit}}"], capture_output=True)
    return found.returncode == 0


def build(workdir: Path) -> OldRelease:
    """Build the previous release's wheel from its commit and install it (with its PostgreSQL extra, no
    Airflow: only the core API is used) into a virtual environment under ``workdir``.

    Works offline but for the package index: setuptools for the isolated build, psycopg and pendulum.
    """
    started = time.monotonic()
    source, dist, venv = workdir / "source", workdir / "dist", workdir / "venv"
    source.mkdir()
    archive = workdir / "source.tar"
    _run("git", "-C", REPO, "archive", "--format=tar", "--output", archive, COMMIT)
    _run("tar", "-xf", archive, "-C", source)
    _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", dist, source)
    (wheel,) = dist.glob(f"airflow_provider_resumable-{RELEASE}-*.whl")
    # No pip inside the environment (ensurepip costs seconds): this interpreter's pip installs into it.
    _run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    _run(sys.executable, "-m", "pip", "--python", python, "install", "--quiet", f"{wheel}[postgres]")
    worker_script = workdir / "old_worker.py"
    worker_script.write_text(WORKER)
    return OldRelease(RELEASE, venv, python, worker_script, time.monotonic() - started)
