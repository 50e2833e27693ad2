"""An HTTP proxy in front of a receiver that fails a share of the requests at random, seeded: half of the
failures answer 503 before anything is forwarded (the receiver never sees the request), the other half
forward the request and drop the connection once the receiver answered (it took it; the reply is lost).
Look-ups (GET) fail the same way as sends."""

from __future__ import annotations

import http.client
import random
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FaultProxy:
    def __init__(self, upstream_port: int, *, failure_rate: float, seed: int = 12) -> None:
        self.upstream_port = upstream_port
        self.failure_rate = failure_rate
        self.random = random.Random(seed)
        self.lock = threading.Lock()
        self.counts = {"forwarded": 0, "refused_503": 0, "reply_dropped": 0, "GET": 0, "POST": 0}
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with proxy.lock:
                    roll = proxy.random.random()
                    proxy.counts[self.command] += 1
                fault = None
                if roll < proxy.failure_rate / 2:
                    fault = "refused_503"
                elif roll < proxy.failure_rate:
                    fault = "reply_dropped"
                if fault == "refused_503":
                    with proxy.lock:
                        proxy.counts[fault] += 1
                    payload = b'{"error": "unavailable"}'
                    self.send_response(503)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.send_header("Connection", "close")
                    self.end_headers()
                    self.wfile.write(payload)
                    self.close_connection = True
                    return
                upstream = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                    upstream.request(self.command, self.path, body=body or None, headers=headers)
                    answer = upstream.getresponse()
                    data = answer.read()
                finally:
                    upstream.close()
                with proxy.lock:
                    proxy.counts[fault or "forwarded"] += 1
                if fault == "reply_dropped":  # the receiver took it; the client never hears back
                    self.close_connection = True
                    try:
                        self.connection.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    return
                self.send_response(answer.status)
                for key, value in answer.getheaders():
                    if key.lower() not in ("connection", "transfer-encoding", "content-length", "date", "server"):
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _handle  # noqa: N815

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
