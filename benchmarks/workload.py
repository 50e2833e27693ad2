"""The batch every cost benchmark runs: items, the three steps, and the bare loop subtracted from both sides."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from airflow_resumable.runner import Step

STEP_NAMES = ("validate", "transform", "notify")


def items(n: int) -> Iterator[dict[str, Any]]:
    """A generator, never a list: the runners must stream (and both sides pay the same to build items)."""
    for i in range(n):
        yield {"id": i, "payload": "x" * 32}


def _validate(item: Mapping[str, Any], ctx: object) -> None:
    return None


def _transform(item: Mapping[str, Any], ctx: object) -> None:
    return None


def _notify(item: Mapping[str, Any], ctx: object) -> str:
    return "receipt"  # a side effect's result is its receipt


def steps() -> list[Step]:
    """validate and transform (local no-ops) and notify (a side effect returning a receipt), no work."""
    return [
        Step("validate", _validate),
        Step("transform", _transform),
        Step("notify", _notify, side_effect=True),
    ]


def timed(run: Callable[[], object]) -> float:
    """Seconds ``run()`` takes. Collects first, so one side does not pay for the other side's garbage."""
    gc.collect()
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def bare_seconds(n: int) -> float:
    """The same items through the same step functions with no journal at all."""
    step_fns = [s.fn for s in steps()]

    def loop() -> None:
        for item in items(n):
            for fn in step_fns:
                fn(item, None)  # type: ignore[arg-type]

    return timed(loop)


def median_of(reps: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(max(1, reps)))
