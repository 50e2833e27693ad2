"""An HTTP receiver's client built on Airflow's HttpHook: ``notify`` POSTs with an ``Idempotency-Key``
header, ``verify`` looks the key up on the receiver.

Needs the ``http`` extra (``apache-airflow-providers-http``). Use it as a pair::

    receiver = HttpReceiver(http_conn_id="receiver")
    ResumableBatchOperator(task_id="send", items=..., notify=receiver.notify, verify=receiver.verify)

Errors map to the runner's rules: a read timeout, a dropped connection or a 5xx reply raise, so the
step is recorded FAILED and its outcome is *unknown* - the next run verifies it by key, never re-sends.
Only a failure to open the connection - refused, the name did not resolve, the connect timed out - is
certain to have written no byte of the request: ``notify`` raises ``ReceiverUnreachable`` (a
``NotSentError``) for those, and the next run sends the item without verify or hold. A TLS handshake
failure, a proxy error or a reset on a reused connection stay unknown: they are not proof.

A refusal the receiver states is not an unknown outcome: a reply with a status in ``refusal_statuses``
(HTTP 429 unless configured otherwise) says it did not take the POST, so ``notify`` raises
``ReceiverRefused`` (a ``NotSentError``, carrying the ``Retry-After`` it named) and the item is sent again
with the same key, never looked up and never held. A 503 stays an unknown outcome unless the receiver is
configured to mean "not processed" by it.

Neither follows a redirect. For ``verify`` a 3xx, or a 2xx that names no receipt, is "cannot tell"
(``None``: the runner holds), never ``NOT_DELIVERED`` and never a receipt ``"None"``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Mapping
from email.utils import parsedate_to_datetime
from functools import cached_property
from typing import Any

import requests
from airflow.providers.http.hooks.http import HttpHook
from urllib3.exceptions import NewConnectionError

from airflow_resumable.exceptions import NotSentError, ReceiverError, ReceiverRefused, ReceiverUnreachable
from airflow_resumable.runner import NOT_DELIVERED, NotDelivered, StepContext

__all__ = ["HttpReceiver"]

# Our settings in the connection's extra. HttpHook sends every other extra field as a request header;
# a header set to None is dropped when requests merges the session's headers into the request's.
_NOT_HEADERS: dict[str, Any] = {"lookup_authoritative": None, "refusal_statuses": None}
# The receiver's "not now" (Too Many Requests): it did not take the request.
DEFAULT_REFUSAL_STATUSES = (429,)


def _retry_after(response: requests.Response) -> float | None:
    """The seconds a ``Retry-After`` header asks to wait (given in seconds or as an HTTP date); None when
    there is none or it cannot be read."""
    value = (response.headers.get("Retry-After") or "").strip()
    if not value:
        return None
    if value.isdigit():
        return float(value)
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT; one written without a zone is read as GMT too
        return None
    return max(0.0, when.timestamp() - time.time())


def _checked_statuses(value: Any, where: str) -> frozenset[int]:
    """Status codes a receiver refuses with, from a list of integers (or a comma-separated text in a
    connection's extra); ValueError saying what to write otherwise."""
    if isinstance(value, str):
        value = [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (bytes, Mapping)) or not isinstance(value, Collection):
        raise ValueError(f"{where} must be a list of HTTP status codes, e.g. [429, 503]")
    statuses = set()
    for status in value:
        try:
            number = int(status)
        except (TypeError, ValueError):
            raise ValueError(f"{where}: {str(status)[:20]!r} is not an HTTP status code") from None
        if isinstance(status, bool) or not 400 <= number <= 599 or str(number) != str(status).strip():
            raise ValueError(f"{where}: {str(status)[:20]!r} is not an error status (400-599); a refusal must be "
                             "the receiver saying it did not take the request")
        statuses.add(number)
    return frozenset(statuses)


def _never_written(exc: requests.exceptions.ConnectionError) -> bool:
    """Whether ``exc`` happened before any byte of the request was written: the connect timed out,
    or opening the connection failed (refused, unreachable, the name did not resolve). requests wraps
    the latter as ConnectionError(MaxRetryError(reason=NewConnectionError)); NameResolutionError is a
    NewConnectionError. A reused pooled connection that fails while sending is a ProtocolError."""
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return True
    cause = exc.args[0] if exc.args else None
    return isinstance(getattr(cause, "reason", None), NewConnectionError)


def _json_object(response: requests.Response) -> bool:
    try:
        return isinstance(response.json(), dict)
    except ValueError:
        return False


def _no_receipt_named(response: requests.Response, field: str) -> bool:
    """Whether the reply is a JSON object whose ``field`` is there and null: the look-up's "no such key"."""
    try:
        body = response.json()
    except ValueError:
        return False
    return isinstance(body, dict) and field in body and body[field] is None


def _receipt_in(response: requests.Response, field: str) -> str | None:
    """The receipt a 2xx reply names in ``field``, as text; None when it names none: the field is
    missing, null, false, empty or blank, or the body is not a JSON object (a login page, a 204, a
    list). Never the text "None". A string is kept as it is, any other value as its JSON text."""
    try:
        body = response.json()
    except ValueError:  # requests' JSONDecodeError is a ValueError; an empty body is one too
        return None
    receipt = body.get(field) if isinstance(body, dict) else None
    if receipt is None or receipt is False or receipt in ("", [], {}):
        return None
    text = receipt if isinstance(receipt, str) else json.dumps(receipt)
    return text if text.strip() else None


class HttpReceiver:
    """The steps that send to, and look up on, an HTTP receiver.

    Not to be confused with ``airflow.providers.http.notifications.HttpNotifier``, a callback notifier.

    :param http_conn_id: Airflow HTTP connection of the receiver.
    :param endpoint: path the notification is POSTed to.
    :param lookup_endpoint: path of the look-up by key; ``{key}`` is replaced by the idempotency key.
    :param payload: ``payload(item, ctx)`` -> JSON body; default: the item plus its id and step.
    :param receipt_field: field of the JSON reply holding the receipt.
    :param timeout: seconds for connect + read.
    :param lookup_authoritative: the receiver records a delivery before it answers it, so a 404 from
        the look-up whose JSON body names ``receipt_field`` as null means "never got it": ``verify`` then
        answers ``NOT_DELIVERED`` and the runner sends once now instead of holding (any other 404 - a
        wrong path, a proxy's page - is "cannot tell"). Default: the connection's extra ``lookup_authoritative``
        (``true``/``false``), else False - many receivers record asynchronously, and for them a 404
        only means "cannot tell".
    :param refusal_statuses: the statuses by which the receiver says it did not take the POST ("not now"):
        ``notify`` raises ``ReceiverRefused`` and the item is sent again with the same key, never looked up.
        Default: the connection's extra ``refusal_statuses`` (a list, or ``"429,503"``), else ``[429]``.
        Name a 503 only if the receiver answers it before taking the request (a rate limiter or a
        load balancer in front of it that never forwarded it).
    """

    def __init__(
        self,
        http_conn_id: str = "resumable_receiver",
        *,
        endpoint: str = "/notifications",
        lookup_endpoint: str = "/notifications/{key}",
        payload: Callable[[Mapping[str, Any], StepContext], Any] | None = None,
        receipt_field: str = "receipt",
        timeout: float = 10.0,
        lookup_authoritative: bool | None = None,
        refusal_statuses: Collection[int] | None = None,
    ) -> None:
        if lookup_authoritative is not None and not isinstance(lookup_authoritative, bool):
            raise ValueError("lookup_authoritative must be True, False or None (None: the connection's extra)")
        self._lookup_authoritative = lookup_authoritative
        self._refusal_statuses = None if refusal_statuses is None else _checked_statuses(refusal_statuses,
                                                                                           "refusal_statuses")
        self.http_conn_id = http_conn_id
        self.endpoint = endpoint
        self.lookup_endpoint = lookup_endpoint
        self.payload = payload
        self.receipt_field = receipt_field
        self.timeout = timeout

    @cached_property
    def _post(self) -> HttpHook:
        return HttpHook(method="POST", http_conn_id=self.http_conn_id)

    @cached_property
    def _get(self) -> HttpHook:
        return HttpHook(method="GET", http_conn_id=self.http_conn_id)

    def notify(self, item: Mapping[str, Any], ctx: StepContext) -> str:
        try:
            refusals = self.refusal_statuses
        except ValueError as exc:  # the connection's extra: a check before the request, nothing was sent
            raise NotSentError(str(exc)) from None
        body = self.payload(item, ctx) if self.payload else {"item_id": ctx.item_id, "step": ctx.step, "item": dict(item)}
        try:
            response = self._post.run(
                self.endpoint,
                json=body,
                headers={"Idempotency-Key": ctx.idempotency_key, "Content-Type": "application/json", **_NOT_HEADERS},
                # Never follow a redirect: the POST has been delivered by then, and a failure to reach
                # the redirect's target would look like "could not connect" - a blind re-send.
                extra_options={"timeout": self.timeout, "check_response": False, "allow_redirects": False},
            )
        except requests.exceptions.ConnectionError as exc:
            if _never_written(exc):
                raise ReceiverUnreachable(f"could not connect to the receiver ({type(exc).__name__})") from exc
            raise
        if response.status_code in refusals:  # its word that it did not take it: send again
            raise ReceiverRefused(response.status_code, retry_after=_retry_after(response))
        if response.status_code >= 300:  # a redirect or an error: the receiver may have it, unknown outcome
            raise ReceiverError(response.status_code)
        if response.status_code != 204 and not _json_object(response):
            # A 2xx page that is not the receiver's JSON (a proxy's or a portal's HTML) is no word from
            # the receiver at all: the POST may never have reached it. Unknown outcome: verify or hold.
            raise ReceiverError(response.status_code)
        # A 204, or the receiver's JSON without a receipt, is its word that it took the POST: the send
        # arrived. Raising would leave a delivered send as an unknown outcome, and recording "None" would
        # pass for the receiver's reference. So it is done, and its receipt says what we know - the
        # status, without the body (which may be large, or carry data we keep out of the journal). The
        # idempotency key stays the way to find it on the receiver.
        receipt = _receipt_in(response, self.receipt_field)
        return receipt if receipt is not None else f"HTTP {response.status_code}, no receipt in the reply"

    @cached_property
    def lookup_authoritative(self) -> bool:
        """Whether a 404 from the look-up means the receiver never got the key (see the class)."""
        if self._lookup_authoritative is not None:
            return self._lookup_authoritative
        value = self._get.get_connection(self.http_conn_id).extra_dejson.get("lookup_authoritative", False)
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            value = value.strip().lower() == "true"
        if not isinstance(value, bool):
            raise ValueError(f"connection {self.http_conn_id!r}: extra lookup_authoritative must be true or false")
        return value

    @cached_property
    def refusal_statuses(self) -> frozenset[int]:
        """The statuses by which the receiver refuses a send for now (see the class)."""
        if self._refusal_statuses is not None:
            return self._refusal_statuses
        value = self._post.get_connection(self.http_conn_id).extra_dejson.get("refusal_statuses")
        if value is None:
            return frozenset(DEFAULT_REFUSAL_STATUSES)
        return _checked_statuses(value, f"connection {self.http_conn_id!r}: extra refusal_statuses")

    def verify(self, ctx: StepContext) -> str | NotDelivered | None:
        response = self._get.run(
            self.lookup_endpoint.format(key=ctx.idempotency_key),
            headers=_NOT_HEADERS,
            # Never follow a redirect (whatever the connection's extra says; ours wins): the 404 of a
            # login page it leads to is not the receiver saying "never got it", and with an
            # authoritative look-up that would send the item again.
            extra_options={"timeout": self.timeout, "check_response": False, "allow_redirects": False},
        )
        if 300 <= response.status_code < 400:
            return None  # a redirect is no answer about the key: cannot tell, hold
        if response.status_code == 404:
            # Authoritative: never got it, send once now - but only the receiver's own answer about the key
            # (a JSON object naming the receipt field, with none): a 404 of a wrong path or a proxy's page
            # says nothing about the key. Otherwise: cannot tell, hold.
            return NOT_DELIVERED if self.lookup_authoritative and _no_receipt_named(response, self.receipt_field) else None
        if response.status_code >= 400:
            raise ReceiverError(response.status_code)  # the runner holds the step: unknown outcome
        # A 2xx without a receipt does not say what it found (a generic page, a 200 for anything):
        # cannot tell, hold - never a receipt "None".
        return _receipt_in(response, self.receipt_field)

