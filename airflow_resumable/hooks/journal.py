"""The step journal as an Airflow hook: what the operators, the sensor, the review and resolve tasks open.

A task names its journal by an Airflow connection (``journal_conn_id``) or a file on the worker
(``journal_path``); with neither, the ``[resumable]`` config decides (:class:`ResumableJournalHook` gives
the order). The connection may be

* a **Postgres** connection (``conn_type`` ``postgres``): a shared journal every worker reaches; its
  extra may name ``journal_schema``, ``claim_timeout`` and libpq's TLS and timeout options;
* a **SQLite** connection (``conn_type`` ``sqlite``, the file's path in ``host``, as Airflow's sqlite
  provider reads it): a journal on the worker's own disk.

The CLI and the page find the journal the same way without importing Airflow's hook machinery
(:mod:`airflow_resumable._location`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from airflow_resumable._location import JournalTarget, journal_target

if TYPE_CHECKING:
    from airflow_resumable.journal import StepJournal

__all__ = ["ResumableJournalHook"]


class ResumableJournalHook(BaseHook):
    """Opens the step journal a task's settings name.

    :param journal_conn_id: an Airflow connection holding the journal (Postgres: shared by every worker;
        SQLite: a file on the worker). Wins over ``journal_path``.
    :param journal_path: a SQLite file on the worker.
    :param journal_options: passed to :class:`~airflow_resumable.journal.StepJournal` (``durability``,
        ``allow_network_filesystem``, ...) over what the connection and the config say.

    Where the journal is, in this order: ``journal_conn_id``, ``journal_path``, the config's
    ``[resumable] journal_conn_id``, ``[resumable] journal_path``, else
    ``$AIRFLOW_HOME/resumable/journal.sqlite3``. Never anything from ``dag_run.conf`` or XCom: a run's conf
    must not choose where a worker writes.
    """

    conn_name_attr = "journal_conn_id"
    hook_name = "Resumable journal"

    def __init__(
        self,
        journal_conn_id: str | None = None,
        journal_path: str | os.PathLike[str] | None = None,
        **journal_options: Any,
    ) -> None:
        super().__init__()
        self.journal_conn_id = journal_conn_id
        self.journal_path = journal_path
        self.journal_options = journal_options

    @cached_property
    def target(self) -> JournalTarget:
        """Where the journal is; the connection is looked up once, on first use."""
        return journal_target(conn_id=self.journal_conn_id, path=self.journal_path)

    def get_conn(self) -> StepJournal:
        """The journal, open: a context manager; close it (``with hook.get_conn() as journal:``)."""
        journal: StepJournal = self.target.open(**self.journal_options)
        return journal

    def exists(self) -> bool:
        """Whether there is a journal to read (looking never creates a SQLite file)."""
        return self.target.exists()

    @contextlib.contextmanager
    def batch_journal(self, *, owner: str, recorded_id: str | None) -> Iterator[StepJournal]:
        """The journal of a task downstream of the batch task (sensor, review), refused if it is not there
        or is not the journal the batch task's summary recorded (``recorded_id``)."""
        if not self.exists():
            raise ValueError(f"{owner}: there is no journal at {self.target.display} on this worker")
        with self.get_conn() as journal:
            if recorded_id is not None and recorded_id != journal.journal_id:
                raise ValueError(
                    f"{owner}: the batch task ran on another journal than this task's ({journal.location}); "
                    "give this task the same journal_conn_id / journal_path as the batch task"
                )
            yield journal
