"""ResolveOperator: record a human's decision about a held step, from a DAG run's conf."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from airflow_resumable._airflow import journal_target
from airflow_resumable.journal import JournalError

if TYPE_CHECKING:
    from airflow.sdk import Context

DECISIONS = ("delivered", "not_delivered", "keep_previous_input", "use_new_input")
_STRING_FIELDS = ("job_id", "item_id", "step", "decision", "receipt", "note", "resolved_by")


class ResolutionRefused(ValueError):
    """The conf asked for something the journal refuses; the journal is unchanged."""


class ResolveOperator(BaseOperator):
    """Resolve one held step with the decision in the DAG run's conf (``params``).

    Conf: ``job_id``, ``item_id``, ``step``, ``decision`` (``delivered`` with ``receipt`` |
    ``not_delivered`` | ``keep_previous_input`` | ``use_new_input``), optional ``note``, and
    ``resolved_by`` when Airflow does not know the triggering user. The journal comes from the
    operator or the Airflow config, never from the conf.

    :param journal_conn_id: an Airflow Postgres connection holding a shared journal; default
        ``[resumable] journal_conn_id``. Wins over ``journal_path``.
    :param journal_path: the journal file; default ``[resumable] journal_path``.
    """

    def __init__(
        self, *, journal_conn_id: str | None = None, journal_path: str | os.PathLike[str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.journal_conn_id = journal_conn_id
        self.journal_path = journal_path

    def execute(self, context: Context) -> dict[str, Any]:
        conf = _conf(context)
        resolved_by = _triggering_user(context) or conf.get("resolved_by")
        if not resolved_by:
            raise ResolutionRefused("resolved_by is required: Airflow does not know who triggered this run")
        target = journal_target(conn_id=self.journal_conn_id, path=self.journal_path)
        if not target.exists():
            raise ResolutionRefused(f"there is no journal at {target.display} on this worker; nothing to resolve")
        with target.open() as journal:
            try:
                if conf["decision"] in ("delivered", "not_delivered"):
                    if not conf.get("step"):
                        raise ResolutionRefused("step is required for delivered / not_delivered")
                    resolution = journal.resolve(
                        conf["job_id"], conf["item_id"], conf["step"],
                        delivered=conf["decision"] == "delivered", receipt=conf.get("receipt") or None,
                        resolved_by=resolved_by, note=conf.get("note") or "",
                    )
                else:
                    resolution = journal.resolve_input_change(
                        conf["job_id"], conf["item_id"], use_new_input=conf["decision"] == "use_new_input",
                        resolved_by=resolved_by, note=conf.get("note") or "",
                    )
            except (JournalError, ValueError) as exc:
                raise ResolutionRefused(f"{exc} (the journal is unchanged)") from None
        self.log.info(
            "Resolved %s / %s / %s as %s by %s", resolution.job_id, resolution.item_id, resolution.step,
            resolution.decision, resolution.resolved_by,
        )
        return {"job_id": resolution.job_id, "item_id": resolution.item_id, "step": resolution.step,
                "decision": resolution.decision, "resolved_by": resolution.resolved_by,
                "resolved_at": resolution.resolved_at.isoformat(), "audit_id": resolution.id}


def _conf(context: Context) -> dict[str, Any]:
    raw: Mapping[str, Any] = dict(context.get("params") or {})
    dag_run = context.get("dag_run")
    run_conf = getattr(dag_run, "conf", None) or {}
    merged = {**raw, **run_conf}
    for name in _STRING_FIELDS:
        value = merged.get(name)
        if value is not None and not isinstance(value, str):
            raise ResolutionRefused(f"{name} must be a string, not {type(value).__name__}")
    for name in ("job_id", "item_id", "decision"):
        if not merged.get(name):
            raise ResolutionRefused(f"{name} is required in the conf")
    if merged["decision"] not in DECISIONS:
        raise ResolutionRefused(f"unknown decision {merged['decision']!r}; use one of {', '.join(DECISIONS)}")
    return merged


def _triggering_user(context: Context) -> str | None:
    dag_run = context.get("dag_run")
    for attribute in ("triggering_user_name",):
        value = getattr(dag_run, attribute, None)
        if isinstance(value, str) and value.strip():
            return value
    return None
