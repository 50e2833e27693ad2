"""One import path per public name: the public modules export exactly the names pinned here, a name is
exported by one of them (or, where the journal's and the runner's faces carry it too, by the ones listed
in SECOND_PATHS), no module re-exports what another defines, and no module stands in for another.

Read from the sources (no import), so it runs where Airflow is not installed; that each name imports is
checked too (the core's here, the Airflow layer's in tests/airflow_layer/test_public_api_airflow.py)."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.core, pytest.mark.compat]

PACKAGE = Path(__file__).resolve().parents[2] / "airflow_resumable"

# The public modules and the names each exports (its __all__). A new public name is added here.
PUBLIC_API = {
    "airflow_resumable": {"__version__"},
    "airflow_resumable.exceptions": {
        "ArchiveError", "BatchStopped", "DecisionInputError", "DurationError", "InvalidItemError",
        "InvalidStepOutputError", "JobBusyError", "JobPrunedError", "JournalBehindError", "JournalConfigError",
        "JournalConnectionError", "JournalCorruptError", "JournalDiskFullError", "JournalError", "JournalLocationError",
        "JournalVersionError", "MailNotSent", "MailOutcomeUnknown", "NotHeldError", "NotSentError",
        "OutcomeUnknownError", "PageError", "ReceiverError", "ReceiverRefused", "ReceiverUnavailableError",
        "ReceiverUnreachable", "ResolutionError",
        "ResolutionRefused", "ResumableError",
        "StaleDecisionError",
    },
    "airflow_resumable.journal": {
        "DECISIONS", "DECISIONS_BY_REASON", "HeldReason", "HeldStep", "JOB_STATUSES", "JobRun", "JobSummary",
        "Page", "Resolution", "SCHEMA_VERSION", "Status", "StepJournal", "StepRecord", "StepState",
        "is_postgres_url", "migrate",
        "JobBusyError", "JournalError", "JournalLocationError", "NotHeldError",
    },
    "airflow_resumable.runner": {
        "NOT_DELIVERED", "Action", "BatchProgress", "BatchResult", "MarkStore", "NotDelivered", "Settlement", "Step",
        "StepContext", "StepFn", "VerifyFn", "canonical_digest", "decide", "idempotency_key", "run_batch", "verify_held",
        "BatchStopped", "HeldStep", "InvalidItemError", "NotSentError",
    },
    "airflow_resumable.cli": {"main"},
    "airflow_resumable.hooks.journal": {"ResumableJournalHook"},
    "airflow_resumable.operators.resumable_batch": {
        "HeldItemsError", "HeldItemsNeedAHumanError", "ResumableBatchOperator", "WrongWorkerError",
    },
    "airflow_resumable.operators.resolve": {"ResolveOperator", "resolve_held_item_dag"},
    "airflow_resumable.operators.review": {"APPLY", "LEAVE", "LEAVE_HELD", "ReviewHeldItemsOperator"},
    "airflow_resumable.sensors.held_items": {"HeldItemSensor"},
    "airflow_resumable.triggers.held_items": {"HeldItemTrigger"},
    "airflow_resumable.receivers.http": {"HttpReceiver"},
    "airflow_resumable.receivers.smtp": {"InvalidMessage", "MailRejected", "SmtpReceiver"},
    "airflow_resumable.retry_policy": {"RetryAfterPolicy"},
}

# The names a package's face exports besides their home, because the journal's and the runner's
# contracts name them there: what a caller of the journal catches, and what a step raises or a run holds.
SECOND_PATHS = {
    "airflow_resumable.journal": {"JobBusyError", "JournalError", "JournalLocationError", "NotHeldError"},
    "airflow_resumable.runner": {"BatchStopped", "HeldStep", "InvalidItemError", "NotSentError"},
}

CORE_MODULES = ("airflow_resumable", "airflow_resumable.exceptions", "airflow_resumable.journal",
                "airflow_resumable.runner", "airflow_resumable.cli")


class Module:
    """A module of the package, read from its source."""

    def __init__(self, path: Path) -> None:
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = relative.parts[:-1] if relative.name == "__init__" else relative.parts
        self.name = ".".join(parts)
        self.is_package = relative.name == "__init__"
        self.tree = ast.parse(path.read_text(), str(path))
        self.all: list[str] | None = None
        self.defined: set[str] = set()
        self.imported: dict[str, str] = {}  # name -> the module it is imported from
        for node in self.tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.defined.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names = [n for t in targets for n in (t.elts if isinstance(t, ast.Tuple) else [t])]
                for target in names:
                    if isinstance(target, ast.Name):
                        self.defined.add(target.id)
                        if target.id == "__all__":
                            self.all = list(ast.literal_eval(node.value))  # type: ignore[arg-type]
            elif isinstance(node, ast.ImportFrom) and node.module:
                for alias in node.names:
                    self.imported[alias.asname or alias.name] = node.module

    def swaps_itself(self) -> bool:
        """Whether it puts another module in its own place in sys.modules (an alias module)."""
        return any(isinstance(n, ast.Subscript) and ast.unparse(n.value) == "sys.modules"
                   and isinstance(n.ctx, ast.Store) for n in ast.walk(self.tree))


MODULES = {m.name: m for m in (Module(p) for p in sorted(PACKAGE.rglob("*.py")))}


def test_each_public_module_exports_exactly_its_pinned_names():
    for name, names in PUBLIC_API.items():
        module = MODULES[name]
        assert module.all is not None, f"{name} has no __all__"
        assert set(module.all) == names, (
            f"{name}.__all__ differs from the pinned surface: added {sorted(set(module.all) - names)}, "
            f"removed {sorted(names - set(module.all))}; a public name has one path (update PUBLIC_API on purpose)"
        )


def test_no_public_name_has_a_second_path():
    """A package's parts may list what they define (a face imports it from them); among the public
    modules, each name is exported once."""
    paths: dict[str, list[str]] = {}
    for name in PUBLIC_API:
        for exported in MODULES[name].all or ():
            if exported != "__version__" and exported not in SECOND_PATHS.get(name, ()):
                paths.setdefault(exported, []).append(name)
    doubles = {name: where for name, where in paths.items() if len(where) > 1}
    assert not doubles, f"names exported by more than one module: {doubles}"


def test_a_module_exports_what_it_defines_or_what_its_own_parts_define():
    """No re-export lists: a name in __all__ is defined in the module, or (a package's face) in one of
    its own parts, or is one of SECOND_PATHS."""
    for name, module in MODULES.items():
        for exported in module.all or ():
            if exported in module.defined or exported in SECOND_PATHS.get(name, ()):
                continue
            source = module.imported.get(exported)
            assert source is not None, f"{name}.__all__ names {exported!r}, which it neither defines nor imports"
            assert module.is_package and source.startswith(name + "."), (
                f"{name} re-exports {exported!r} from {source}: import it from there")


def test_no_module_stands_in_for_another():
    assert not [name for name, module in MODULES.items() if module.swaps_itself()]


def test_the_modules_kept_only_for_old_names_are_gone():
    gone = ("airflow_resumable._airflow", "airflow_resumable.errors", "airflow_resumable.notifiers",
            "airflow_resumable.journal.errors", "airflow_resumable.plugins.ui")
    assert not [name for name in gone if name in MODULES]
    assert "HttpNotifier" not in MODULES["airflow_resumable.receivers.http"].defined


def test_the_core_names_import_from_their_paths():
    for name in CORE_MODULES:
        module = importlib.import_module(name)
        missing = [exported for exported in PUBLIC_API[name] if not hasattr(module, exported)]
        assert not missing, f"{name} lacks {missing}"


def test_a_second_path_is_the_same_object_as_the_first():
    exceptions = importlib.import_module("airflow_resumable.exceptions")
    journal = importlib.import_module("airflow_resumable.journal")
    for face, names in SECOND_PATHS.items():
        module = importlib.import_module(face)
        for name in names:
            home = exceptions if hasattr(exceptions, name) else journal
            assert getattr(module, name) is getattr(home, name), f"{face}.{name}"


def test_every_error_is_under_the_one_root():
    from airflow_resumable.exceptions import NotSentError, OutcomeUnknownError, ResumableError

    exceptions = importlib.import_module("airflow_resumable.exceptions")
    for name in PUBLIC_API["airflow_resumable.exceptions"]:
        assert issubclass(getattr(exceptions, name), ResumableError), name
    # A send's error says which of the two it is: sent again unasked, or asked about first.
    from airflow_resumable.exceptions import (
        MailNotSent,
        MailOutcomeUnknown,
        ReceiverError,
        ReceiverRefused,
        ReceiverUnreachable,
    )

    assert all(issubclass(e, NotSentError) for e in (ReceiverUnreachable, ReceiverRefused, MailNotSent))
    assert issubclass(ReceiverError, OutcomeUnknownError) and issubclass(MailOutcomeUnknown, OutcomeUnknownError)
    assert not issubclass(OutcomeUnknownError, NotSentError) and not issubclass(NotSentError, OutcomeUnknownError)


def test_the_core_imports_nothing_from_airflow():
    # A fresh interpreter: this one may have Airflow loaded by other tests.
    code = (f"import sys; [__import__(m) for m in {CORE_MODULES!r}]; import airflow_resumable._location; "
            "print(sorted(m for m in sys.modules if m == 'airflow' or m.startswith('airflow.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_errors_are_built_with_their_fields():
    from airflow_resumable.exceptions import JobBusyError, MailNotSent, ReceiverError

    busy = JobBusyError("job 'a' is already running", holder="pid 7 on w1", runner="task")
    assert (busy.holder, busy.runner, str(busy)) == ("pid 7 on w1", "task", "job 'a' is already running")
    assert JobBusyError("busy").holder == "holder unknown"
    assert ReceiverError(503).status == 503
    not_sent = MailNotSent("DATA", "ConnectionResetError")
    assert (not_sent.stage, not_sent.cause) == ("DATA", "ConnectionResetError")


@pytest.mark.parametrize("mutation", ["second path", "re-export"])
def test_the_checks_above_catch_a_name_gaining_a_second_path(tmp_path, monkeypatch, mutation):
    """The rules fail on a package like ours with one more path: a face exporting a name from another
    package, or a part re-exporting a name another part defines."""
    runner = MODULES["airflow_resumable.runner"]
    changed = Module.__new__(Module)
    changed.__dict__.update(runner.__dict__)
    if mutation == "second path":
        changed.all = [*runner.all, "JobPrunedError"]
        changed.imported = {**runner.imported, "JobPrunedError": "airflow_resumable.exceptions"}
    else:
        changed.all = [*runner.all, "StepJournal"]
        changed.imported = {**runner.imported, "StepJournal": "airflow_resumable.journal"}
    monkeypatch.setitem(MODULES, "airflow_resumable.runner", changed)
    for check in (test_a_module_exports_what_it_defines_or_what_its_own_parts_define,
                  test_each_public_module_exports_exactly_its_pinned_names, test_no_public_name_has_a_second_path):
        with pytest.raises(AssertionError):
            check()
