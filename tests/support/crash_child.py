"""A runner process for the crash and lock tests: runs one job, optionally pausing at a boundary.

Run as ``python tests/support/crash_child.py --journal J --receiver R --job JOB [options]``. The parent test
SIGKILLs it while it is paused (or at a random moment). With ``--pause-at BOUNDARY --pause-item ID``
the child writes ``--marker`` when it reaches that boundary for that item, then blocks until
``--release`` exists (forever if not given), so the parent knows exactly where the kill lands:

* ``local``        - inside the local step ``transform``
* ``before_send``  - after the IN_FLIGHT mark was committed, before ``receiver.deliver``
* ``after_accept`` - after ``receiver.deliver`` accepted it, before the step returns the reply
* ``after_reply``  - after the step returned its receipt, before ``JobRun.mark_succeeded`` runs

Without ``--pause-at`` the child writes ``--marker`` just before ``run_batch`` starts.

With ``--http-receiver URL`` the sends go to the demo receiver over HTTP instead of the durable
receiver file (``--receiver`` is then not needed), and ``--only ID`` (repeatable) runs the batch with
those items alone: the stale-decision tests change one held row from another process.

Exit codes: 0 completed, 3 needs_review (something held), 4 JobBusyError, 5 the run stopped on an
HTTP send that failed (its outcome unknown: an error status or a lost reply); anything else is a crash
the tests treat as a failure. The last stdout line is a JSON summary of the run.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: this file is tests/support/crash_child.py

from airflow_resumable.journal import JobBusyError, JobRun, StepJournal  # noqa: E402
from airflow_resumable.runner import NOT_DELIVERED, Step, run_batch  # noqa: E402
from tests.support.receivers import DurableReceiver  # noqa: E402

BOUNDARIES = ("local", "before_send", "after_accept", "after_reply")
EXIT_COMPLETED, EXIT_NEEDS_REVIEW, EXIT_BUSY, EXIT_SEND_FAILED = 0, 3, 4, 5


class ReceiverFailed(Exception):
    """The HTTP receiver answered an error status: to the runner, the send's outcome is unknown."""


class ReceiverReplyLost(Exception):
    """The connection broke before the receiver's reply arrived: it may have the delivery or not."""


class HttpReceiverClient:
    """The demo receiver (``airflow_resumable.demo_receiver``) over HTTP, with the durable receiver's
    ``deliver`` / ``lookup`` so the same steps send to either."""

    def __init__(self, url: str, timeout: float = 30.0) -> None:
        self.url, self.timeout = url.rstrip("/"), timeout

    def _call(self, request: urllib.request.Request) -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def deliver(self, job_id: str, item_id: str, step: str, key: str, payload: str = "") -> str:
        body = json.dumps({"job_id": job_id, "item_id": item_id, "step": step, "payload": payload}).encode()
        request = urllib.request.Request(self.url + "/notifications", data=body, method="POST",
                                         headers={"Idempotency-Key": key, "Content-Type": "application/json"})
        try:
            status, reply = self._call(request)
        except (OSError, http.client.HTTPException):
            raise ReceiverReplyLost() from None
        if status >= 400:
            raise ReceiverFailed(status)
        return str(reply["receipt"])

    def lookup(self, key: str) -> str | None:
        """The receipt under ``key``, None when the receiver has no record of it (it answers 404);
        any other answer raises (the runner takes that as "cannot tell")."""
        status, reply = self._call(urllib.request.Request(f"{self.url}/notifications/{key}"))
        if status == 404:
            return None
        if status != 200:
            raise ReceiverFailed(status)
        return str(reply["receipt"])


def items(n: int) -> list[dict]:
    return [{"id": f"item-{i:03d}", "amount": i * 100} for i in range(1, n + 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--journal", required=True)
    parser.add_argument("--receiver", help="the durable receiver's file (needed unless --http-receiver)")
    parser.add_argument("--http-receiver", metavar="URL", help="send to the demo receiver at URL instead")
    parser.add_argument("--only", action="append", default=[], metavar="ID",
                        help="run the batch with this item alone (repeatable); default: all of --items")
    parser.add_argument("--job", required=True)
    parser.add_argument("--also-job", action="append", default=[],
                        help="run this job too, at the same time, on a thread with a journal connection of its own")
    parser.add_argument("--items", type=int, default=30)
    parser.add_argument("--durability", choices=("full", "normal"), default="full")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--pause-at", choices=BOUNDARIES)
    parser.add_argument("--pause-item")
    parser.add_argument("--marker")
    parser.add_argument("--release")
    parser.add_argument("--verify", choices=("none", "three_way"), default="none",
                        help="three_way: the receiver's look-up answers the receipt or NOT_DELIVERED (it is "
                             "authoritative: deliveries are committed before the receipt is returned)")
    parser.add_argument("--step-ms", type=float, nargs=2, default=(0.0, 0.0),
                        metavar=("MIN", "MAX"), help="each step sleeps uniformly this many ms")
    args = parser.parse_args(argv)
    if not args.receiver and not args.http_receiver:
        parser.error("--receiver or --http-receiver is required")

    def signal_ready(text: str) -> None:
        if args.marker:
            tmp = args.marker + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, args.marker)  # the parent never sees a half-written marker
        print(text, flush=True)

    def pause(boundary: str, item_id: str) -> None:
        if args.pause_at != boundary or item_id != args.pause_item:
            return
        signal_ready(f"PAUSED {boundary} {item_id} pid={os.getpid()}")
        while not (args.release and os.path.exists(args.release)):
            time.sleep(0.01)

    low, high = args.step_ms

    def work() -> None:
        if high > 0:
            time.sleep(random.uniform(low, high) / 1000.0)

    receiver = HttpReceiverClient(args.http_receiver) if args.http_receiver else DurableReceiver(Path(args.receiver))
    batch = [item for item in items(args.items) if not args.only or item["id"] in args.only]

    def validate(item, ctx):
        work()
        return {"ok": item["amount"] >= 0}

    def transform(item, ctx):
        work()
        pause("local", ctx.item_id)
        assert ctx.outputs["validate"] == {"ok": True}
        return {"cents": item["amount"] * 100}

    def notify_external(item, ctx):
        work()  # the request's latency: IN_FLIGHT is committed, the receiver has nothing yet
        pause("before_send", ctx.item_id)
        receipt = receiver.deliver(ctx.job_id, ctx.item_id, ctx.step, ctx.idempotency_key,
                                   str(ctx.outputs["transform"]["cents"]))
        pause("after_accept", ctx.item_id)
        work()  # the reply's latency: the receiver has it, the journal does not know yet
        return receipt

    real_mark_succeeded = JobRun.mark_succeeded

    def mark_succeeded(self, item_id, step, digest, *a, **kw):
        if kw.get("side_effect"):
            pause("after_reply", item_id)
        return real_mark_succeeded(self, item_id, step, digest, *a, **kw)

    JobRun.mark_succeeded = mark_succeeded  # type: ignore[method-assign]

    def verify(ctx):
        return receiver.lookup(ctx.idempotency_key) or NOT_DELIVERED

    steps = [
        Step("validate", validate),
        Step("transform", transform),
        Step("notify_external", notify_external, side_effect=True,
             verify=verify if args.verify == "three_way" else None),
    ]

    def run_job(journal: StepJournal, job: str) -> dict:
        started = time.monotonic()
        try:
            result = run_batch(journal, job, batch, steps, concurrency=args.concurrency,
                               runner=f"crash_child:{os.getpid()}", settle_in_task=False)
        except JobBusyError as exc:
            return {"busy": True, "elapsed": time.monotonic() - started, "message": str(exc)}
        except (ReceiverFailed, ReceiverReplyLost) as exc:  # only with --http-receiver
            return {"busy": False, "send_failed": type(exc).__name__}
        return {
            "busy": False,
            "status": result.status,
            "executed": result.executed_steps,
            "skipped": result.skipped_steps,
            "held": [[h.item_id, h.step, h.reason.value] for h in result.held],
            "items_total": result.items_total,
            "items_completed": result.items_completed,
            "verified": result.verified_steps,
            "resent": result.resent_steps,
        }

    others: dict[str, dict] = {}

    def run_other(job: str) -> None:
        try:
            with StepJournal(args.journal, durability=args.durability) as journal:
                others[job] = run_job(journal, job)
        except BaseException as exc:  # reported in the summary; the process exits non-zero
            others[job] = {"error": type(exc).__name__, "message": str(exc)}

    threads = [threading.Thread(target=run_other, args=(job,)) for job in args.also_job]
    # The journal is open (and migrated) before the parent hears "STARTED": its kill delays count
    # from the moment the run is about to start.
    with StepJournal(args.journal, durability=args.durability) as journal:
        if not args.pause_at:
            signal_ready(f"STARTED pid={os.getpid()}")
        for thread in threads:
            thread.start()
        summary = run_job(journal, args.job)
        for thread in threads:
            thread.join()
    if others:
        summary["also"] = others
    print(json.dumps(summary), flush=True)
    if summary["busy"]:
        return EXIT_BUSY
    if "send_failed" in summary:
        return EXIT_SEND_FAILED
    if any("error" in other for other in others.values()):
        return 1
    everything = [summary, *others.values()]
    return EXIT_COMPLETED if all(s.get("status") == "completed" for s in everything) else EXIT_NEEDS_REVIEW


# ------------------------------------------------------------------------- the parent's side


class ChildRun:
    """One child process, as the tests start it (``sys.executable`` running this file)."""

    def __init__(
        self, tmp: Path, journal: Path | str, receiver: Path | None, job: str, *, durability: str = "full",
        pause_at: str | None = None, pause_item: str | None = None, release: Path | None = None,
        step_ms: tuple[float, float] = (0.0, 0.0), n_items: int = 30, concurrency: int = 1,
        also_jobs: tuple[str, ...] = (), verify: str = "none", http_receiver: str | None = None,
        only: tuple[str, ...] = (),
    ) -> None:
        import subprocess
        import uuid

        self.marker = Path(tmp) / f"marker-{uuid.uuid4().hex}"
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "--journal", str(journal), "--job", job,
            "--durability", durability, "--items", str(n_items),
            "--marker", str(self.marker), "--step-ms", str(step_ms[0]), str(step_ms[1]),
            "--concurrency", str(concurrency), "--verify", verify,
        ]
        if receiver is not None:
            cmd += ["--receiver", str(receiver)]
        if http_receiver:
            cmd += ["--http-receiver", http_receiver]
        for item_id in only:
            cmd += ["--only", item_id]
        if pause_at:
            cmd += ["--pause-at", pause_at, "--pause-item", str(pause_item)]
        if release:
            cmd += ["--release", str(release)]
        for other in also_jobs:
            cmd += ["--also-job", other]
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float = 30.0) -> str:
        """Wait for the marker; returns its text. Fails if the child exits or hangs before it."""
        deadline = time.monotonic() + timeout
        while not self.marker.exists():
            # The marker is looked at again after the exit is seen: a child with nothing left to do
            # writes it and exits between this loop's two checks.
            if self.proc.poll() is not None and not self.marker.exists():
                out, err = self.proc.communicate()
                raise AssertionError(f"child exited {self.proc.returncode} before its marker:\n{out}\n{err}")
            if time.monotonic() > deadline:
                self.proc.kill()
                raise AssertionError("child never reached its marker")
            time.sleep(0.002)
        return self.marker.read_text()

    def kill(self) -> bool:
        """SIGKILL the child; True if it was killed, False if it had already exited by itself."""
        import signal

        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc.communicate()
        if self.proc.returncode == -signal.SIGKILL:
            return True
        assert self.proc.returncode in (EXIT_COMPLETED, EXIT_NEEDS_REVIEW), (
            f"child ended with {self.proc.returncode} before the kill"
        )
        return False

    def finish(self, timeout: float = 60.0) -> tuple[int, dict, str]:
        """Wait for the child to exit by itself: (exit code, its JSON summary, its stderr)."""
        out, err = self.proc.communicate(timeout=timeout)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        summary = json.loads(lines[-1]) if lines else {}
        return self.proc.returncode, summary, err


if __name__ == "__main__":
    sys.exit(main())
