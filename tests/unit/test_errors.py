"""One exception hierarchy: every error the provider raises on purpose is a SkyError, whatever module it
is imported from, so ``except SkyError`` catches them all and old imports keep working."""

from __future__ import annotations

import ast
import importlib
import inspect
import pickle
import pkgutil
import sys
from pathlib import Path

import pytest

import airflow_provider_sky
from airflow_provider_sky import errors
from airflow_provider_sky.errors import SkyError

#: exceptions that never leave the module that raises them (control flow, caught and turned into a
#: SkyError or a retry), and the test stack's own error: not part of the hierarchy
INTERNAL = {
    "airflow_provider_sky.runners.ssh.pool.Retired",  # the pool was closed: the caller rejoins it
    "airflow_provider_sky.backends.aws.ec2.Duplicate",  # an idempotent create found its own instance
    "airflow_provider_sky.backends.aws.catalog.NoInstanceType",  # becomes a fit() problem
    "airflow_provider_sky.agent.node.ProtocolError",  # drops a connection; the client raises AgentError
    "devstack.stack.StackError",  # the test and demo stack, not the product
}

#: where each error was importable from before the hierarchy (module, name)
OLD_PLACES = [
    ("airflow_provider_sky.spec", "SpecError"),
    ("airflow_provider_sky.spec.common", "SpecError"),
    ("airflow_provider_sky.backends.base", "BackendError"),
    ("airflow_provider_sky.backends.base", "ClusterBusy"),
    ("airflow_provider_sky.backends.registry", "ConnectionConfigError"),
    ("airflow_provider_sky.runners.base", "RunnerError"),
    ("airflow_provider_sky.runners.ssh", "AuthFailed"),
    ("airflow_provider_sky.runners.ssh", "CallAbandoned"),
    ("airflow_provider_sky.runners.ssh", "CommandTimeout"),
    ("airflow_provider_sky.runners.ssh", "HostKeyError"),
    ("airflow_provider_sky.runners.ssh", "HostKeyMismatch"),
    ("airflow_provider_sky.runners.ssh", "HostUnreachable"),
    ("airflow_provider_sky.runners.ssh", "UnknownHostKey"),
    ("airflow_provider_sky.runners.ssh.errors", "AuthFailed"),
    ("airflow_provider_sky.runners.ssh.errors", "CallAbandoned"),
    ("airflow_provider_sky.runners.ssh.errors", "CommandTimeout"),
    ("airflow_provider_sky.runners.ssh.errors", "HostKeyError"),
    ("airflow_provider_sky.runners.ssh.errors", "HostKeyMismatch"),
    ("airflow_provider_sky.runners.ssh.errors", "HostUnreachable"),
    ("airflow_provider_sky.runners.ssh.errors", "UnknownHostKey"),
    ("airflow_provider_sky.watch.jobs", "LaunchError"),
    ("airflow_provider_sky.watch.setup_stage", "SetupFailed"),
    ("airflow_provider_sky.watch.bridge", "BridgeError"),
    ("airflow_provider_sky.watch.result", "ResultError"),
    ("airflow_provider_sky.node.runtime", "StatusParseError"),
    ("airflow_provider_sky.backends.kubernetes.account", "AccountError"),
    ("airflow_provider_sky.agent.client", "AgentError"),
    ("airflow_provider_sky.agent.client", "AgentUnreachable"),
]


def _package_exceptions() -> list[type[BaseException]]:
    """Every public exception class defined anywhere in the package."""
    found: dict[str, type[BaseException]] = {}
    for mod in pkgutil.walk_packages(airflow_provider_sky.__path__, "airflow_provider_sky."):
        # a __main__ runs its program; the node scripts' folder holds the mask filter, a program sent to nodes
        if mod.name.endswith("__main__") or mod.name.startswith("airflow_provider_sky.node.scripts."):
            continue
        module = importlib.import_module(mod.name)
        for name, obj in vars(module).items():
            if (
                inspect.isclass(obj)
                and issubclass(obj, BaseException)
                and obj.__module__.startswith("airflow_provider_sky.")
                and not name.startswith("_")
                and not obj.__name__.startswith("_")
            ):
                found[f"{obj.__module__}.{obj.__qualname__}"] = obj
    return list(found.values())


def test_every_public_error_is_a_sky_error() -> None:
    classes = _package_exceptions()
    assert len(classes) > 20  # the walk found the package's modules
    outside = sorted(
        f"{c.__module__}.{c.__qualname__}"
        for c in classes
        if not issubclass(c, SkyError) and f"{c.__module__}.{c.__qualname__}" not in INTERNAL
    )
    assert outside == [], "subclass SkyError in airflow_provider_sky/errors.py (or list it in INTERNAL)"
    assert {
        f"{c.__module__}.{c.__qualname__}" for c in classes if c.__module__ == "airflow_provider_sky.errors"
    } == {f"airflow_provider_sky.errors.{n}" for n in errors.__all__}


@pytest.mark.parametrize(("module", "name"), OLD_PLACES, ids=[f"{m}.{n}" for m, n in OLD_PLACES])
def test_old_import_places_give_the_same_class(module: str, name: str) -> None:
    cls = getattr(importlib.import_module(module), name)
    assert cls is getattr(errors, name)
    assert issubclass(cls, SkyError)


def test_builtin_bases_are_kept() -> None:
    """``except ValueError`` around a spec parse (and the like) still catches what it caught."""
    assert issubclass(errors.SpecError, ValueError)
    assert issubclass(errors.ConnectionConfigError, ValueError)
    assert issubclass(errors.ConnectionConfigError, errors.BackendError)
    assert issubclass(errors.StatusParseError, ValueError)
    assert issubclass(errors.AccountError, RuntimeError)
    assert issubclass(errors.HostKeyMismatch, errors.RunnerError)


def test_messages_and_pickling_unchanged() -> None:
    err = errors.SpecError("num_nodes", "must be >= 1; set num_nodes: 1 or more")
    assert str(err) == "num_nodes: must be >= 1; set num_nodes: 1 or more"
    back = pickle.loads(pickle.dumps(err))
    assert (type(back), back.field, back.message) == (errors.SpecError, err.field, err.message)
    assert str(errors.RunnerError("10.0.0.1", "connection refused")) == "10.0.0.1: connection refused"


def test_errors_module_imports_only_the_standard_library() -> None:
    """Backends and runners import it, and they never import Airflow (nor anything above them)."""
    tree = ast.parse(Path(errors.__file__).read_text())
    imported = {
        (node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    assert {m.split(".")[0] for m in imported} <= set(sys.stdlib_module_names) | {"__future__"}
