"""A task ``retry_policy`` (Airflow 3.3 or newer) that waits as long as the receiver asked.

A receiver that refuses a send for now says how long to wait (HTTP ``Retry-After``); the error that
fails the try carries it (:class:`~airflow_resumable.exceptions.ReceiverRefused`'s ``retry_after``).
Airflow's own ``RetryRule`` retries after a fixed delay; this policy retries after the receiver's::

    from airflow_resumable.retry_policy import RetryAfterPolicy

    ResumableBatchOperator(task_id="send", items=..., notify=receiver.notify, verify=receiver.verify,
                           retries=5, retry_delay=timedelta(minutes=5), retry_policy=RetryAfterPolicy())

A try that failed for any other reason retries as the task says (``retry_delay``), or as the
``fallback`` policy decides. The policy never adds tries: ``retries`` still bounds them.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from airflow_resumable._compat import airflow_version

if airflow_version() < (3, 3):
    raise ImportError(
        f"airflow_resumable.retry_policy needs Airflow 3.3 or newer (a task's retry_policy); this is Airflow "
        f"{'.'.join(map(str, airflow_version()))}: use retry_delay instead"
    )

from airflow.sdk import RetryDecision, RetryPolicy  # noqa: E402 - after the version check

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["RetryAfterPolicy"]


def _retry_after(exception: BaseException) -> float | None:
    """The ``retry_after`` seconds the error (or one it was raised from) carries, if any."""
    seen: set[int] = set()
    error: BaseException | None = exception
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        value = getattr(error, "retry_after", None)
        if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0:
            return float(value)
        error = error.__cause__ or error.__context__
    return None


class RetryAfterPolicy(RetryPolicy):
    """Retry after the wait the receiver asked for (its ``Retry-After``), kept between two bounds.

    :param min_delay: the shortest wait before the next try, even if the receiver asked for none.
    :param max_delay: the longest: a receiver asking for hours does not park the task that long.
    :param fallback: the policy for a try that failed without a ``Retry-After`` (default: the task's
        ``retry_delay``).
    """

    def __init__(
        self,
        *,
        min_delay: timedelta = timedelta(seconds=1),
        max_delay: timedelta = timedelta(minutes=30),
        fallback: RetryPolicy | None = None,
    ) -> None:
        for name, value in (("min_delay", min_delay), ("max_delay", max_delay)):
            if not isinstance(value, timedelta) or value < timedelta(0):
                raise ValueError(f"RetryAfterPolicy: {name} must be a timedelta of 0 or more, not {value!r}")
        if min_delay > max_delay:
            raise ValueError(f"RetryAfterPolicy: min_delay ({min_delay}) is longer than max_delay ({max_delay})")
        if fallback is not None and not isinstance(fallback, RetryPolicy):
            raise ValueError(f"RetryAfterPolicy: fallback must be a RetryPolicy, not {type(fallback).__name__}")
        self.min_delay, self.max_delay, self.fallback = min_delay, max_delay, fallback

    def evaluate(
        self, exception: BaseException, try_number: int, max_tries: int, context: Context | None = None,
    ) -> RetryDecision:
        seconds = _retry_after(exception)
        if seconds is None:
            if self.fallback is not None:
                return self.fallback.evaluate(exception, try_number, max_tries, context)
            return RetryDecision.default()
        delay = min(max(timedelta(seconds=seconds), self.min_delay), self.max_delay)
        return RetryDecision.retry(
            delay=delay,
            reason=f"the receiver asked to wait {seconds:g} s (Retry-After); next try in {delay.total_seconds():g} s",
        )
