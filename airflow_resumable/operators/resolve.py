"""ResolveOperator: record a human's decision about a held step, from a DAG run's conf."""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping, Sequence
from functools import cached_property
from typing import TYPE_CHECKING, Any

import pendulum
from airflow.sdk import DAG, BaseOperator, Param

from airflow_resumable._location import RESOLVE_DAG_ID
from airflow_resumable.exceptions import ResolutionRefused, StaleDecisionError
from airflow_resumable.hooks.journal import ResumableJournalHook
from airflow_resumable.journal import DECISIONS, JournalError, StepJournal
from airflow_resumable.journal.records import (
    ENTRY_FIELDS,
    MAX_DECISIONS,
    MAX_ID_LENGTH,
    MAX_JOB_ID_LENGTH,
    MAX_NOTE_BYTES,
    MAX_PERSON_LENGTH,
    MAX_RECEIPT_BYTES,
)

if TYPE_CHECKING:
    from airflow.sdk import Context

__all__ = ["ResolveOperator", "resolve_held_item_dag"]
_STRING_FIELDS = ("job_id", "item_id", "step", "decision", "receipt", "note", "version", "resolved_by")


class ResolveOperator(BaseOperator):
    """Resolve one held step with the decision in the DAG run's conf (``params``).

    Conf: ``job_id``, ``item_id``, ``step``, ``decision`` (``delivered`` with ``receipt`` |
    ``not_delivered`` | ``keep_previous_input`` | ``use_new_input``), optional ``note``, optional
    ``version`` (the held step's version as ``held`` / ``show`` or the Resumable jobs page showed it: if
    the step changed since, the decision is refused and nothing changes; without it the decision
    applies to the step as it is now), and ``resolved_by`` when Airflow does not know the triggering
    user. Or ``resolutions``: a list of such decisions (without ``resolved_by``, each with its own
    ``version``), settled all or nothing in one transaction, each with its own audit row; returns
    ``{"resolved": [...], "count": n}``. The journal comes from the operator or the Airflow config,
    never from the conf. A refused conf fails the task naming the entry; the journal is unchanged.

    :param journal_conn_id: an Airflow Postgres connection holding a shared journal; default
        ``[resumable] journal_conn_id``. Wins over ``journal_path``.
    :param journal_path: the journal file; default ``[resumable] journal_path``.
    :param job_dag_ids: settle only jobs of these DAGs (the DAG a job's first run recorded, not the
        start of its id; a job with no recorded DAG is refused too); others are refused, the journal
        unchanged. A worker cannot ask Airflow whether the user who triggered
        this run may act on the job's DAG, so a copy of the resolve DAG per team, each with its own
        ``access_control`` and ``job_dag_ids``, is how to authorise per DAG on this path. Default: any
        job (then restrict who may trigger the resolve DAG). The UI page's form checks the job's DAG
        permission itself.
    """

    def __init__(
        self, *, journal_conn_id: str | None = None, journal_path: str | os.PathLike[str] | None = None,
        job_dag_ids: Collection[str] | None = None, **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if isinstance(job_dag_ids, str):
            raise ValueError(f"{self.task_id}: job_dag_ids is a list of DAG ids, not one string")
        self.job_dag_ids = None if job_dag_ids is None else frozenset(job_dag_ids)
        self.journal_conn_id = journal_conn_id
        self.journal_path = journal_path

    @cached_property
    def hook(self) -> ResumableJournalHook:
        """The journal whose held items this task settles: its own settings, then the Airflow config."""
        return ResumableJournalHook(self.journal_conn_id, self.journal_path)

    def execute(self, context: Context) -> dict[str, Any]:
        conf = _conf(context)
        resolved_by = _triggering_user(context) or conf.get("resolved_by")
        if not resolved_by:
            raise ResolutionRefused("resolved_by is required: Airflow does not know who triggered this run")
        entries = conf["resolutions"] or [{k: conf.get(k) for k in ENTRY_FIELDS}]
        if not self.hook.exists():
            raise ResolutionRefused(f"there is no journal at {self.hook.target.display} on this worker; nothing to resolve")
        with self.hook.get_conn() as journal:
            if self.job_dag_ids is not None:
                self._check_job_dags(journal, entries, numbered=bool(conf["resolutions"]))
            try:
                resolutions = journal.apply_decisions(entries, resolved_by=resolved_by)
            except StaleDecisionError as exc:  # it names the step, says nothing changed and what to do
                raise ResolutionRefused(str(exc)) from None
            except (JournalError, ValueError) as exc:
                raise ResolutionRefused(f"{exc} (the journal is unchanged)") from None
        done = []
        for r in resolutions:
            self.log.info("Resolved %s / %s / %s as %s by %s", r.job_id, r.item_id, r.step, r.decision, r.resolved_by)
            done.append(r.as_json())
        if not conf["resolutions"]:
            return done[0]
        self.log.info("%d held step(s) settled in one transaction", len(done))
        return {"resolved": done, "count": len(done)}


    def _check_job_dags(self, journal: StepJournal, entries: Sequence[Any], *, numbered: bool) -> None:
        """Refuse entries of jobs whose recorded DAG (its first run's, never its id's first part) is not
        one of ``job_dag_ids``; a job with no recorded DAG is settled only by a resolve DAG for any job."""
        assert self.job_dag_ids is not None
        allowed = ", ".join(sorted(self.job_dag_ids)) or "none"
        for n, entry in enumerate(entries, 1):
            job_id = entry.get("job_id") if isinstance(entry, Mapping) else None
            job = journal.job(job_id) if isinstance(job_id, str) and job_id and "\x00" not in job_id else None
            if job is None:
                continue  # the journal refuses the entry, naming it
            if job.dag_id not in self.job_dag_ids:
                where = f"entry {n}: " if numbered else ""
                owner = (f"belongs to DAG {job.dag_id!r}" if job.dag_id is not None else
                         "has no recorded DAG (written outside Airflow or by an older release)")
                raise ResolutionRefused(
                    f"{where}job {job_id!r} {owner}, which this resolve DAG may not settle "
                    f"(job_dag_ids: {allowed}); the journal is unchanged"
                )


_CONF_ONLY_FIELDS = frozenset({"resolved_by", "resolutions"})


def _conf(context: Context) -> dict[str, Any]:
    raw: Mapping[str, Any] = dict(context.get("params") or {})
    dag_run = context.get("dag_run")
    run_conf = getattr(dag_run, "conf", None) or {}
    # A field this DAG does not know would be dropped without a word: a decision's version given as
    # "expected_version" (the CLI's and the Python API's name) would make a decision on what was seen
    # an unconditional one.
    unknown = sorted(str(k) for k in run_conf if k not in ENTRY_FIELDS | _CONF_ONLY_FIELDS | set(raw))
    if unknown:
        shown = ", ".join(repr(name[:40]) for name in unknown[:5])
        raise ResolutionRefused(f"unknown field(s) in the conf: {shown}; use {', '.join(sorted(ENTRY_FIELDS))}, "
                                "resolved_by or resolutions (the version a person saw is 'version')")
    merged = {**raw, **run_conf}
    for name in _STRING_FIELDS:
        value = merged.get(name)
        if value is not None and not isinstance(value, str):
            raise ResolutionRefused(f"{name} must be a string, not {type(value).__name__}")
    resolutions = merged.get("resolutions") or []
    if not isinstance(resolutions, list):
        raise ResolutionRefused("resolutions must be a list of decisions (each with job_id, item_id, step, "
                                "decision, receipt, note)")
    merged["resolutions"] = resolutions
    if resolutions:
        single = [name for name in sorted(ENTRY_FIELDS) if merged.get(name)]
        if single:
            raise ResolutionRefused(f"give either resolutions (a list) or one decision, not both ({', '.join(single)} "
                                    "given too)")
        return merged
    for name in ("job_id", "item_id", "decision"):
        if not merged.get(name):
            raise ResolutionRefused(f"{name} is required in the conf (or a list in resolutions)")
    if merged["decision"] not in DECISIONS:
        raise ResolutionRefused(f"unknown decision {merged['decision']!r}; use one of {', '.join(DECISIONS)}")
    return merged


def _triggering_user(context: Context) -> str | None:
    # Who triggered the run (Airflow records it from the UI, the REST API and the CLI).
    value = getattr(context.get("dag_run"), "triggering_user_name", None)
    return value if isinstance(value, str) and value.strip() else None


def resolve_held_item_dag(
    dag_id: str = RESOLVE_DAG_ID, *, journal_conn_id: str | None = None,
    journal_path: str | os.PathLike[str] | None = None, job_dag_ids: Collection[str] | None = None,
    **dag_kwargs: Any,
) -> DAG:
    """The resolve DAG: one :class:`ResolveOperator` whose run form asks for the decision.

    Put ``dag = resolve_held_item_dag()`` in a file of your DAGs folder (the provider's example DAGs
    hold the same, loaded when ``[core] load_examples`` is on). A team's own copy, limited to its DAGs
    and with its own permissions::

        dag = resolve_held_item_dag("resolve_team_a", job_dag_ids=["billing"], access_control={...})

    ``dag_kwargs`` go to the DAG (``access_control``, ``tags``, ``default_args``, ...).
    """
    settings: dict[str, Any] = {
        "description": "Record a human decision about a held step of a resumable batch",
        "schedule": None,
        "start_date": pendulum.datetime(2026, 1, 1, tz="UTC"),
        "catchup": False,
        "max_active_runs": 1,
        "tags": ["resumable"],
        "params": _resolve_params(),
        "doc_md": "Settle a step that a resumable batch held for a human, after checking the receiver's "
                  "records; then Clear the batch task: it resumes.",
    }
    settings.update(dag_kwargs)
    with DAG(dag_id=dag_id, **settings) as dag:
        ResolveOperator(task_id="resolve", journal_conn_id=journal_conn_id, journal_path=journal_path,
                        job_dag_ids=job_dag_ids)
    return dag


def _resolve_params() -> dict[str, Param]:
    # The form's limits are the journal's (it refuses past them, on every surface, with the same
    # message); a length counts characters, at most the journal's count of UTF-8 bytes.
    return {
        "job_id": Param("", type="string", maxLength=MAX_JOB_ID_LENGTH,
                        description="The job, as shown in the batch task's summary or failure message."),
        "item_id": Param("", type="string", maxLength=MAX_ID_LENGTH, description="The held item's id."),
        "step": Param("", type="string", maxLength=MAX_ID_LENGTH,
                      description="The held step (required for delivered / not_delivered)."),
        "decision": Param("", type="string", enum=["", *DECISIONS],
                          description="delivered: the receiver has it (give its receipt); not_delivered: "
                          "the receiver confirmed it never arrived (it is sent once on the next run); "
                          "keep_previous_input / use_new_input: for an input_changed hold."),
        "receipt": Param("", type="string", maxLength=MAX_RECEIPT_BYTES,
                         description="The receiver's receipt / reference (required for delivered)."),
        "note": Param("", type="string", maxLength=MAX_NOTE_BYTES, description="Why; what you checked."),
        "version": Param("", type="string",
                         description="The version you saw in held/show/the page; if the step changed since, the "
                         "decision is refused (nothing changes: look again). Empty: decide on the step as it is now."),
        "resolved_by": Param("", type="string", maxLength=MAX_PERSON_LENGTH,
                             description="Who decides (used when Airflow does not know the triggering user)."),
        "resolutions": Param([], type="array", maxItems=MAX_DECISIONS, items={"type": "object"},
                             description="Several decisions at once, instead of the fields above: a list of "
                             "{job_id, item_id, step, decision, receipt, note, version}. All or nothing: one refused "
                             "entry (a step that changed since its version was seen, too) changes nothing."),
    }
