"""A throwaway PostgreSQL cluster for the PostgreSQL sections, started and destroyed inside their child process.

The cluster is the tests' own (:mod:`tests.support.postgres_server`: initdb in a temporary folder, a free
port on 127.0.0.1, trust authentication, the server's defaults otherwise, so ``fsync`` and
``synchronous_commit`` are on). As root the server runs as the ``postgres`` OS user. Without
PostgreSQL's server binaries or psycopg, a section reports itself skipped with the reason.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator

SKIPPED_NO_SERVER = (
    "no PostgreSQL server binaries found (initdb, pg_ctl); install them (Debian: apt-get install postgresql)"
)
SKIPPED_NO_PSYCOPG = "psycopg is not installed (pip install -e '.[postgres]')"


def unavailable() -> str | None:
    """Why the PostgreSQL sections cannot run here, or None."""
    if importlib.util.find_spec("psycopg") is None:
        return SKIPPED_NO_PSYCOPG
    from tests.support.postgres_server import server_bindir

    return SKIPPED_NO_SERVER if server_bindir() is None else None


class Server:
    """The running cluster: ``new_database()`` gives the URL of a new empty database, ``url(name)`` any."""

    def __init__(self, cluster: object) -> None:
        self._cluster = cluster

    def url(self, dbname: str = "postgres") -> str:
        return self._cluster.url(dbname)  # type: ignore[attr-defined, no-any-return]

    def new_database(self) -> str:
        return self._cluster.new_database()  # type: ignore[attr-defined, no-any-return]

    def pid(self) -> int:
        """The server's main process (its postmaster): every session's backend is a child of it."""
        return int((self._cluster.data / "postmaster.pid").read_text().split()[0])  # type: ignore[attr-defined]

    def version(self) -> str:
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as conn:
            return str(conn.execute("SHOW server_version").fetchone()[0])  # type: ignore[index]


@contextlib.contextmanager
def throwaway_server() -> Iterator[Server]:
    """A cluster of its own for one section; destroyed (stopped, its folder removed) on the way out."""
    from tests.support.postgres_server import PostgresCluster, server_bindir

    bindir = server_bindir()
    if bindir is None:
        raise RuntimeError(SKIPPED_NO_SERVER)
    cluster = PostgresCluster(bindir)
    try:
        yield Server(cluster)
    finally:
        cluster.destroy()
