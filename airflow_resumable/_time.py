"""Times and durations the way Airflow shows and reads them, with pendulum (an Airflow dependency).

* The CLI's tables and the "Resumable jobs" page show times in Airflow's ``[core] default_timezone``
  (``utc`` unless configured; ``system`` is the host's zone), with a relative part: "3 hours ago".
  Machine-readable output (``--json``, the page's JSON) stays ISO 8601 in UTC.
* ``prune --older-than`` takes ``30d`` / ``12h`` / ``90m`` / ``45s`` / ``2w`` or an ISO 8601 duration
  (``P30D``, ``PT12H``); months and years are refused, having no fixed length.

The journal stores UTC; nothing here changes what is stored.
"""

from __future__ import annotations

import os
import re
from datetime import datetime, timedelta
from functools import cache

import pendulum
from pendulum.tz.timezone import FixedTimezone, Timezone

from airflow_resumable.exceptions import DurationError

_UNITS = {"s": "seconds", "m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
DURATION_HELP = "e.g. 30d, 12h, 90m, 2w, or ISO 8601 such as P30D or PT12H"


def parse_duration(text: str) -> timedelta:
    """``30d`` or ``P30D`` as a duration; :class:`DurationError` with the accepted forms otherwise."""
    value = text.strip()
    short = re.fullmatch(r"(\d{1,9})\s*([smhdw])", value)
    if short:
        return pendulum.duration(**{_UNITS[short.group(2)]: int(short.group(1))})
    if not value.upper().startswith("P"):
        raise DurationError(f"invalid duration {text!r}: use {DURATION_HELP}")
    try:
        parsed = pendulum.parse(value.upper())
    except (ValueError, OverflowError):  # pendulum's ParserError is a ValueError
        raise DurationError(f"invalid duration {text!r}: use {DURATION_HELP}") from None
    if not isinstance(parsed, pendulum.Duration):
        raise DurationError(f"invalid duration {text!r}: use {DURATION_HELP}")
    if parsed.years or parsed.months:
        raise DurationError(f"invalid duration {text!r}: months and years have no fixed length; "
                            "give days (e.g. P30D or 30d)")
    return parsed


@cache
def display_timezone() -> Timezone | FixedTimezone:
    """Airflow's ``[core] default_timezone`` (the environment, else airflow.cfg when Airflow is installed)."""
    name = os.environ.get("AIRFLOW__CORE__DEFAULT_TIMEZONE")
    if not name:
        try:
            from airflow_resumable._compat import conf

            name = conf().get("core", "default_timezone", fallback="utc")
        except ImportError:  # the core on its own: no Airflow config to read
            name = "utc"
    name = (name or "utc").strip()
    if name.lower() == "system":
        return pendulum.local_timezone()
    try:
        return pendulum.timezone("UTC" if name.lower() == "utc" else name)
    except ValueError:  # Airflow refuses to start with such a zone; here we fall back rather than fail a listing
        return pendulum.timezone("UTC")


def local(value: datetime) -> pendulum.DateTime:
    """``value`` (aware; naive is taken as UTC, as the journal stores it) in the display timezone."""
    if value.tzinfo is None:
        value = value.replace(tzinfo=pendulum.UTC)
    return pendulum.instance(value).in_timezone(display_timezone())


def when(value: datetime, now: datetime | None = None) -> str:
    """``2026-12-03 19:20:31 CET (3 hours ago)``."""
    moment = local(value)
    return f"{moment.format('YYYY-MM-DD HH:mm:ss zz')} ({ago(value, now)})"


def ago(value: datetime, now: datetime | None = None) -> str:
    """``3 hours ago`` (``just now`` under a second)."""
    moment, reference, span = _span(value, now)
    if span is None:
        return "just now"
    return span + (" ago" if moment <= reference else " from now")


def age(value: datetime, now: datetime | None = None) -> str:
    """How long since ``value``, for "held for 3 hours"."""
    return _span(value, now)[2] or "less than a second"


def _span(value: datetime, now: datetime | None) -> tuple[pendulum.DateTime, pendulum.DateTime, str | None]:
    """``value`` and ``now`` (default: this moment) in the display timezone, and the time between them
    in words ("3 hours"), or None under a second."""
    moment, reference = local(value), local(now) if now is not None else pendulum.now(display_timezone())
    if abs((reference - moment).total_seconds()) < 1:
        return moment, reference, None
    return moment, reference, moment.diff_for_humans(reference, absolute=True)
