"""A real rate limiter in front of a receiver: Debian's nginx (``nginx-light``) started by a test on a
free port with a configuration of its own, and stopped after.

``limit_req`` refuses what comes faster than ``rate`` per second beyond ``burst`` with a 429 and
``Retry-After`` (the refused requests never reach the receiver); the access log records every request's
method, path, status and time, so a test counts what reached nginx, what it answered and how fast.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from tests.support.postgres_server import free_port, wait_until

HOW_TO_INSTALL = "install Debian's nginx-light (apt-get install nginx-light; .ci/install-system does)"


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


CONFIG = """\
daemon off;
master_process off;
worker_processes 1;
{user}
pid {home}/nginx.pid;
error_log {home}/error.log warn;
events {{ worker_connections 512; }}
http {{
    log_format counted '$request_method $uri $status $msec';
    access_log {home}/access.log counted;
    client_body_temp_path {home}/body;
    proxy_temp_path {home}/proxy;
    fastcgi_temp_path {home}/fastcgi;
    uwsgi_temp_path {home}/uwsgi;
    scgi_temp_path {home}/scgi;
    limit_req_zone $binary_remote_addr zone=receiver:1m rate={rate}r/s;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            limit_req zone=receiver burst={burst} nodelay;
            limit_req_status 429;
            error_page 429 = @refused;
            proxy_pass http://127.0.0.1:{upstream};
        }}
        location @refused {{
            add_header Retry-After {retry_after} always;
            default_type application/json;
            return 429 '{{"error": "rate limited"}}';
        }}
    }}
}}
"""


class RateLimiter:
    """nginx on 127.0.0.1 in front of ``upstream_port``, limiting requests to ``rate`` per second."""

    def __init__(self, home: Path, upstream_port: int, *, rate: int, burst: int, retry_after: int = 1) -> None:
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError(f"no nginx: {HOW_TO_INSTALL}")
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        user = "user root;" if os.geteuid() == 0 else ""  # as root, nginx would switch to nobody
        (self.home / "nginx.conf").write_text(CONFIG.format(
            user=user, home=self.home, rate=rate, burst=burst, port=self.port, upstream=upstream_port,
            retry_after=retry_after))
        self.proc = subprocess.Popen([binary, "-p", str(self.home), "-c", str(self.home / "nginx.conf")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if not wait_until(self._answers, timeout=30) or self.proc.poll() is not None:
            self.stop()
            raise RuntimeError(f"nginx did not start: {(self.home / 'error.log').read_text()[-2000:]}")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            return True  # exited: reported by the caller's check below
        try:
            urllib.request.urlopen(f"{self.url}/stats", timeout=2).close()
        except urllib.error.HTTPError:
            return True  # nginx answered (the upstream's or its own error)
        except OSError:
            return False
        return True

    def requests(self) -> list[tuple[str, str, int]]:
        """Every request nginx got: (method, path, status), in order."""
        log = self.home / "access.log"
        if not log.exists():
            return []
        return [(method, path, status) for method, path, status, _ in self.timed_requests()]

    def timed_requests(self) -> list[tuple[str, str, int, float]]:
        """Every request nginx got: (method, path, status, epoch seconds when it answered), in order."""
        log = self.home / "access.log"
        if not log.exists():
            return []
        lines = [line.split() for line in log.read_text().splitlines() if line.strip()]
        return [(method, path, int(status), float(msec)) for method, path, status, msec in lines]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGQUIT)  # graceful: the access log is written out
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stderr is not None:
            self.proc.stderr.close()
