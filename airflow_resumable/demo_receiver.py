"""A demo receiver: a real HTTP service on loopback with its own SQLite store.

It accepts notifications (``POST /notifications``), honours the ``Idempotency-Key`` header (switch
off with ``--no-dedupe`` to model receivers that do not), answers look-ups by key
(``GET /notifications/<key>``), counts deliveries per item (``GET /stats``) and injects faults on
request: fail *before* accepting, or accept and then fail the reply (*after accept*). With
``--reject-key-reuse`` a key that comes back with a different body is answered 422, as Stripe does,
instead of with the first delivery's receipt.

Run: ``python -m airflow_resumable.demo_receiver --port 8765 --db receiver.sqlite3
[--fault ITEM:before_accept|after_accept] [--no-dedupe | --reject-key-reuse]``. Faults can also be
armed over HTTP: ``POST /faults {"item_id": "item-041", "mode": "after_accept"}`` (each fires once).
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FAULT_MODES = ("before_accept", "after_accept")


class KeyReusedError(Exception):
    """An idempotency key came back with a body other than the one first delivered under it."""


class ReceiverStore:
    def __init__(self, path: Path, *, dedupe: bool = True, reject_key_reuse: bool = False) -> None:
        if reject_key_reuse and not dedupe:
            raise ValueError("reject_key_reuse needs dedupe: a receiver that ignores keys cannot compare bodies")
        self.path = Path(path)
        self.dedupe = dedupe
        self.reject_key_reuse = reject_key_reuse
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=FULL")  # a receipt we hand out is on disk
        self._conn.executescript(
            """CREATE TABLE IF NOT EXISTS deliveries (
                   seq INTEGER PRIMARY KEY AUTOINCREMENT, idempotency_key TEXT, item_id TEXT,
                   body TEXT, received_at REAL);
               CREATE INDEX IF NOT EXISTS deliveries_key ON deliveries (idempotency_key);
               CREATE TABLE IF NOT EXISTS faults (item_id TEXT PRIMARY KEY, mode TEXT NOT NULL);"""
        )

    def arm(self, item_id: str, mode: str) -> None:
        if mode not in FAULT_MODES:
            raise ValueError(f"fault mode must be one of {FAULT_MODES}")
        with self._lock:
            self._conn.execute("INSERT OR REPLACE INTO faults VALUES (?, ?)", (item_id, mode))

    def take_fault(self, item_id: str) -> str | None:
        """The armed fault for this item, disarmed as it fires (each fault fires once)."""
        with self._lock:
            row = self._conn.execute("SELECT mode FROM faults WHERE item_id = ?", (item_id,)).fetchone()
            if row:
                self._conn.execute("DELETE FROM faults WHERE item_id = ?", (item_id,))
            return row[0] if row else None

    def accept(self, key: str | None, item_id: str, body: str) -> tuple[str, bool]:
        """Record a delivery; returns (receipt, duplicate_suppressed). Raises KeyReusedError when the
        store rejects key reuse and the key was first delivered with another body."""
        with self._lock:
            if self.dedupe and key:
                found = self._conn.execute(
                    "SELECT seq, body FROM deliveries WHERE idempotency_key = ? ORDER BY seq LIMIT 1", (key,)
                ).fetchone()
                if found and self.reject_key_reuse and found[1] != body:
                    raise KeyReusedError(key)
                if found:
                    return f"rcpt-{found[0]}", True
            # The time comes from here, not from SQL: unixepoch('subsec') needs SQLite >= 3.42.
            cur = self._conn.execute(
                "INSERT INTO deliveries (idempotency_key, item_id, body, received_at) VALUES (?, ?, ?, ?)",
                (key, item_id, body, time.time()),
            )
            return f"rcpt-{cur.lastrowid}", False

    def lookup(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute(
                "SELECT seq FROM deliveries WHERE idempotency_key = ? ORDER BY seq LIMIT 1", (key,)
            ).fetchone()
        return None if row is None else f"rcpt-{row[0]}"

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._conn.execute("SELECT item_id, count(*) FROM deliveries GROUP BY item_id"))
        return {
            "deliveries": sum(counts.values()),
            "items": len(counts),
            "duplicates": sum(n - 1 for n in counts.values()),
            "per_item": counts,
        }


class _CutShort(Exception):
    """The sender went away before the whole request body arrived: nothing was delivered."""


class _NoLength(Exception):
    """A request without Content-Length (a chunked body): refused, nothing delivered."""


def make_handler(store: ReceiverStore, reply_seconds: float = 0.0) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # A reply's head and body are written apart: without this the client's delayed ACK holds each
        # reply back ~40 ms.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:  # quiet: the demo prints its own table
            pass

        def _json(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            if self.headers.get("Content-Length") is None:
                # A chunked body (no length) is not read here: it would be taken for an empty one, and an
                # empty delivery recorded under the key, whatever arrived.
                raise _NoLength
            length = int(self.headers.get("Content-Length") or 0)
            data = self.rfile.read(length)
            if len(data) < length:
                # http.client writes a request's head and body apart: a sender killed in between leaves
                # a head (with its key) and no body. That is no delivery, and must not be recorded as one.
                raise _CutShort
            return json.loads(data or b"{}")

        def do_POST(self) -> None:  # noqa: N802
            try:
                body = self._body()
            except _CutShort:
                self.close_connection = True  # nobody is left to answer
                return None
            except _NoLength:
                self.close_connection = True  # the body's bytes, if any, are still on the connection
                return self._json(411, {"error": "Content-Length required"})
            except ValueError:
                return self._json(400, {"error": "body must be JSON"})
            if self.path == "/faults":
                try:
                    store.arm(str(body["item_id"]), str(body["mode"]))
                except (KeyError, ValueError) as exc:
                    return self._json(400, {"error": type(exc).__name__})
                return self._json(200, {"armed": body["item_id"], "mode": body["mode"]})
            if self.path != "/notifications":
                return self._json(404, {"error": "not found"})
            item_id = str(body.get("item_id", ""))
            fault = store.take_fault(item_id)
            if fault == "before_accept":
                return self._json(503, {"error": "injected failure before accept"})
            try:
                receipt, duplicate = store.accept(self.headers.get("Idempotency-Key"), item_id, json.dumps(body))
            except KeyReusedError:
                return self._json(422, {"error": "idempotency key reused with a different body"})
            if reply_seconds:
                # The receiver's own work, after it recorded the delivery (its look-up is authoritative:
                # it knows of every request it holds) and before it answers.
                time.sleep(reply_seconds)
            if fault == "after_accept":
                # Accepted and stored, but the reply is lost: drop the connection without answering.
                self.close_connection = True
                self.connection.shutdown(2)
                return None
            return self._json(200, {"receipt": receipt, "duplicate": duplicate})

        def do_GET(self) -> None:  # noqa: N802
            if self.path == "/stats":
                return self._json(200, store.stats())
            if self.path == "/health":
                return self._json(200, {"ok": True})
            if self.path.startswith("/notifications/"):
                receipt = store.lookup(self.path.removeprefix("/notifications/"))
                if receipt is None:
                    return self._json(404, {"receipt": None})
                return self._json(200, {"receipt": receipt})
            return self._json(404, {"error": "not found"})

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The listen backlog: socketserver's default of 5 resets connections when a runner opens 16 at once.
    request_queue_size = 128


def serve(
    port: int, db: Path, *, dedupe: bool = True, host: str = "127.0.0.1", reject_key_reuse: bool = False,
    reply_ms: float = 0.0,
) -> ThreadingHTTPServer:
    store = ReceiverStore(db, dedupe=dedupe, reject_key_reuse=reject_key_reuse)
    server = _Server((host, port), make_handler(store, reply_ms / 1e3))
    server.store = store  # type: ignore[attr-defined]
    return server


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--db", type=Path, default=Path("receiver.sqlite3"))
    keys = parser.add_mutually_exclusive_group()
    keys.add_argument("--no-dedupe", action="store_true", help="ignore Idempotency-Key")
    keys.add_argument("--reject-key-reuse", action="store_true",
                      help="answer 422 when a key comes back with a different body (as Stripe does)")
    parser.add_argument("--fault", action="append", default=[], metavar="ITEM:MODE")
    parser.add_argument("--reply-ms", type=float, default=0.0, help="time each notification takes (default 0)")
    args = parser.parse_args(argv)
    if not 0 <= args.reply_ms <= 60_000:
        parser.error("--reply-ms must be from 0 to 60000")
    server = serve(args.port, args.db, dedupe=not args.no_dedupe, host=args.host,
                   reject_key_reuse=args.reject_key_reuse, reply_ms=args.reply_ms)
    for spec in args.fault:
        item_id, _, mode = spec.partition(":")
        server.store.arm(item_id, mode)  # type: ignore[attr-defined]
    print(f"demo receiver on http://{args.host}:{server.server_address[1]} (store {args.db})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
