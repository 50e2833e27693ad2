"""Settling a "not now" in the task (SPEC §12): what a failed send means, how long to wait, and the pace
of the sends to one receiver.

A failed send is one of three kinds (:func:`kind_of`):

* **refused** - a :class:`~airflow_resumable.exceptions.NotSentError` (the receiver's stated refusal,
  HTTP 429, or nothing written): sent again with the same key after a wait - the receiver's
  ``Retry-After`` when it gave one, else exponential backoff with jitter.
* **unknown** - an :class:`~airflow_resumable.exceptions.OutcomeUnknownError` or an ``OSError`` (a
  timeout, a reset, a 5xx): after a backoff the receiver is asked (``verify``); a step declared
  ``idempotent`` is sent again with the same key instead.
* **final** - anything else (a permanent refusal such as an ``AirflowFailException``, a bug in the
  step, a step output the journal cannot keep): the item fails and the run stops, as without settlement.

:class:`Pace` decides when the next send to a receiver may start: at most ``max_sends_per_second``
when the step names a rate; otherwise it learns the rate the receiver accepts. A first refusal next to
sends that went through sets the rate to 0.9 of what the receiver took (over the last second, or since
the first send if sooner); the rate then grows about sevenfold a second until the next refusal, which
sets it between what was taken and half the rate reached. From then on a refusal lowers it to 0.9 of
what was taken (at most once a second, never below half), and it grows by 1 % a second while sends go
through (additive increase, multiplicative decrease, after a slow start); it does not grow while a
refusal's lesson is pending. A ``Retry-After`` pauses every send to that receiver until then; when the
pause and the learned rate disagree, the pause wins: no send starts before it ends, and the learned
rate applies after it. The failure streak counts rounds of failures with no success in between: from
the second round every send to the receiver waits a backoff, and past ``max_attempts`` rounds the run
stops.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from airflow_resumable.exceptions import InvalidStepOutputError, NotSentError, OutcomeUnknownError

__all__ = ["Settlement"]

REFUSED, UNKNOWN, FINAL = "refused", "unknown", "final"


@dataclass(frozen=True)
class Settlement:
    """How a run settles refused and failed sends in the task (``run_batch(settle_in_task=...)``).

    :param max_attempts: sends and look-ups one step of one item gets in a run (the first send
        included). An item that runs out is left for the next try; the others go on. Also the number of
        failure rounds in a row (no send to the receiver going through) after which the run stops.
    :param first_backoff: seconds before the second attempt when the receiver named no wait; doubled
        for each further attempt, with jitter (a wait is between half and all of it).
    :param max_backoff: the longest backoff, in seconds.
    :param max_wait: the longest ``Retry-After`` the run waits for; a receiver asking for more stops the
        run at once with the wait in its error, for Airflow's retry to wait instead of a worker slot.
    """

    max_attempts: int = 6
    first_backoff: float = 0.5
    max_backoff: float = 30.0
    max_wait: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.max_attempts, bool) or not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"max_attempts must be a whole number of at least 1, not {self.max_attempts!r}")
        for name in ("first_backoff", "max_backoff", "max_wait"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a number of seconds (0 or more), not {value!r}")

    def backoff(self, attempt: int) -> float:
        """The wait after the ``attempt``-th failed attempt: exponential, capped, with jitter."""
        ceiling = min(self.max_backoff, self.first_backoff * 2.0 ** min(attempt - 1, 60))
        return ceiling * random.uniform(0.5, 1.0)  # noqa: S311 - jitter, not a secret


def checked_settlement(value: object) -> Settlement | None:
    """``run_batch``'s ``settle_in_task`` as a :class:`Settlement` (None: off), or ValueError."""
    if value is True:
        return Settlement()
    if value is False:
        return None
    if isinstance(value, Settlement):
        return value
    raise ValueError(f"settle_in_task must be True, False or a Settlement(...), not {value!r}")


def _permanent(exc: BaseException) -> bool:
    # The runner imports nothing from Airflow: a permanent refusal is known by its base's name.
    return any(cls.__name__ == "AirflowFailException" for cls in type(exc).__mro__)


def kind_of(exc: BaseException) -> str:
    """What a send's error means for settlement in the task: REFUSED, UNKNOWN or FINAL."""
    if not isinstance(exc, Exception) or isinstance(exc, InvalidStepOutputError) or _permanent(exc):
        return FINAL
    if isinstance(exc, NotSentError):
        return REFUSED
    if isinstance(exc, OutcomeUnknownError | OSError):
        return UNKNOWN
    return FINAL


def retry_after_of(exc: BaseException) -> float | None:
    """The seconds the receiver asked to wait, as the error carries them (``retry_after``), or None."""
    value = getattr(exc, "retry_after", None)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        return None
    return float(value)


def check_rate(value: object, where: str) -> float | None:
    """A ``max_sends_per_second`` if usable (None: not set), else ValueError naming ``where``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"{where}: max_sends_per_second must be a positive number, not {value!r}")
    return float(value)


def check_limit_key(value: object, where: str) -> str | None:
    """A ``limit_key`` if usable (None: not shared), else ValueError naming ``where``."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip() or len(value) > 200 or "\x00" in value:
        raise ValueError(f"{where}: limit_key must be non-empty text of at most 200 characters, not {value!r}")
    return value


class SharedPace(Protocol):
    """A pace kept with other runs through the journal (:class:`~airflow_resumable.journal.pace.JournalPace`):
    reserves blocks of send slots and pauses every run's sends."""

    def reserve(self, count: int, interval: float) -> float:
        """Reserve ``count`` slots ``interval`` apart; the seconds from now until the first."""
        ...

    def pause(self, seconds: float) -> None:
        """No run sends under this key for ``seconds`` from now."""
        ...


class Pace:
    """When the next send to one receiver may start, and how that receiver is doing.

    Reserved and told of outcomes by the run's main thread; worker threads only read ``paused_until``.
    """

    # On a refusal, the learned rate drops to this share of what the receiver accepted over the last second.
    DECREASE = 0.9
    # While sends go through, the learned rate grows by this share of itself each second; after the
    # first refusal by FIRST_GROWTH (about sevenfold a second) until the next one, then by INCREASE.
    INCREASE = 0.01
    FIRST_GROWTH = 2.0
    # Sends that went through in the last second before a refusal teaches a first rate.
    MIN_EVIDENCE = 5
    # A refusal's lesson is taken this long after it, and at most once in LESSON_EVERY seconds.
    LESSON_DELAY = 0.25
    LESSON_EVERY = 1.0

    def __init__(self, rate: float | None, *, adaptive: bool, shared: SharedPace | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.adaptive = adaptive and rate is None
        self.learned: float | None = None
        self.shared = shared
        self.clock = clock
        self.next_at = 0.0
        self.paused_until = 0.0
        self.last_retry_after: float | None = None
        self._accepted: deque[float] = deque()
        self._last_decrease = -math.inf
        self.slow_start = True  # until a second refusal: the first guess grows fast
        self._first_accepted = math.inf
        self._lesson: float | None = None  # when a refusal whose lesson is still to be taken came back
        self._block: list[float] = []  # slots reserved on the shared pace, not yet used
        self.streak = 0  # rounds of failures with no success in between
        self._round_started = -math.inf
        self.lock = threading.Lock()

    @property
    def interval(self) -> float | None:
        rate = self.rate or self.learned
        return None if rate is None else 1.0 / rate

    def reserve(self, horizon: float = math.inf) -> float | None:
        """The moment (``clock`` time) the next send may start, taken for it; None if that is more than
        ``horizon`` seconds away (nothing is taken then)."""
        with self.lock:
            if self._lesson is not None:
                self._learn()
            now = self.clock()
            start = max(now, self.paused_until)
            interval = self.interval
            if interval is not None:
                if self.shared is not None and self.rate is not None:
                    return self._reserve_shared(now, start, horizon)
                start = max(start, self.next_at)
            if start > now + horizon:
                return None
            if interval is not None:
                self.next_at = start + interval
            return start

    def _reserve_shared(self, now: float, start: float, horizon: float) -> float | None:
        assert self.shared is not None and self.rate is not None
        self._block = [slot for slot in self._block if slot >= now - 0.05]  # a slot long past is gone
        if not self._block:
            # About a tenth of a second of sends per reservation: a commit per ~0.1 s, not per send.
            count = max(1, min(256, int(self.rate * 0.1)))
            interval = 1.0 / self.rate
            first = now + self.shared.reserve(count, interval)
            self._block = [first + n * interval for n in range(count)]
        slot = max(self._block[0], start)
        if slot > now + horizon:
            return None
        self._block.pop(0)
        return slot

    def next_free(self) -> float:
        """The earliest moment a reservation could succeed (``clock`` time)."""
        with self.lock:
            start = max(self.clock(), self.paused_until)
            if self._block:
                return max(start, self._block[0])
            return max(start, self.next_at) if self.interval is not None and self.shared is None else start

    def went_through(self, ended: float) -> None:
        """A send (or look-up) to this receiver went through."""
        with self.lock:
            self.streak = 0
            if self.adaptive:
                self._first_accepted = min(self._first_accepted, ended)
                self._accepted.append(ended)
                self._learn()
                if self.learned is not None and self._lesson is None:  # no growth while a refusal is weighed
                    # One send at rate r per 1/r seconds: the rate grows by this share of itself a second.
                    self.learned += self.FIRST_GROWTH if self.slow_start else self.INCREASE

    def failed(self, started: float, ended: float, *, refused: bool, retry_after: float | None,
               settlement: Settlement) -> int:
        """A send (or look-up) to this receiver failed; returns the failure streak (rounds in a row)."""
        with self.lock:
            # A new round is a failure of a send that started after the last round was recorded here: sends
            # already on their way then (a busy runner records failures late) could not wait for it.
            now = self.clock()
            if started >= self._round_started:
                self.streak += 1
                self._round_started = now
            if retry_after is not None:
                self.last_retry_after = retry_after
                self._pause_until(ended + retry_after)
            elif self.streak >= 2:  # the receiver keeps failing: every send to it waits, not just this one
                self._pause_until(max(ended, now) + settlement.backoff(self.streak - 1))
            if (refused and self.adaptive and self._lesson is None
                    and ended - self._last_decrease >= self.LESSON_EVERY):
                # The sends that went through beside it are told of a little later (a refusal comes back
                # faster than a send the receiver takes): the lesson waits for them.
                self._lesson = ended
            self._learn()
            return self.streak

    def _learn(self) -> None:
        """Take the lesson of a refusal once the sends that went through beside it are known. A first one
        teaches a rate only next to MIN_EVIDENCE of them: an odd refusal at a slow rate says nothing."""
        now = self.clock()
        refused_at = self._lesson
        if refused_at is None:
            while self._accepted and self._accepted[0] < now - 1.0:
                self._accepted.popleft()
            return
        if now < refused_at + self.LESSON_DELAY:
            return
        self._lesson = None
        while self._accepted and self._accepted[0] < refused_at - 1.0:
            self._accepted.popleft()
        taken = sum(1 for moment in self._accepted if moment <= refused_at + self.LESSON_DELAY)
        if self.learned is None and taken < self.MIN_EVIDENCE:
            return
        self._last_decrease = refused_at
        # What the receiver took in about a second (over the time since the first send, if shorter).
        window = min(1.0, max(self.LESSON_DELAY, refused_at + self.LESSON_DELAY - self._first_accepted))
        estimate = max(1.0, self.DECREASE * taken / window)
        if self.learned is None:
            self.learned = estimate  # a first guess: from here it grows fast until the next refusal
        elif self.slow_start:
            # It grew past the limit fast: the limit lies between what was taken (a rate still rising) and
            # half the rate reached.
            self.learned = max(estimate, (estimate + 0.5 * self.learned) / 2)
            self.slow_start = False
        else:
            self.learned = max(0.5 * self.learned, min(self.DECREASE * self.learned, estimate))

    def _pause_until(self, moment: float) -> None:
        if moment > self.paused_until:
            if self.shared is not None:
                self.shared.pause(moment - self.clock())
            self.paused_until = moment

    def paused(self) -> float:
        """Seconds until the receiver's pause ends (0: not paused)."""
        return max(0.0, self.paused_until - self.clock())
