"""The unit tier: no process, no network, no root. A unit test that starts a process, forks, or opens or
binds an internet socket fails here, naming what it did: it belongs in ``tests/integration``. So does one
that asks for the Kubernetes test cluster (the ``k8s`` fixture): a session fixture is set up before the
function-scoped guard, so the cluster would otherwise start, unseen, inside the tier meant to need nothing."""

from __future__ import annotations

import os
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest


class NotAUnitTest(RuntimeError):
    """What a unit test may not do; the test goes to ``tests/integration`` instead."""


def _no_process(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
    raise NotAUnitTest(f"a unit test started a process: {args!r}")


def _no_fork() -> int:
    raise NotAUnitTest("a unit test forked")


def _guard(method: Any, what: str) -> Any:
    def guarded(self: socket.socket, address: Any) -> Any:
        if self.family in (socket.AF_INET, socket.AF_INET6):
            raise NotAUnitTest(f"a unit test tried to {what} {address!r}")
        return method(self, address)

    return guarded


#: the fixture of the Kubernetes test cluster (tests/support/k8s_cluster.py), which every cluster fixture needs
CLUSTER_FIXTURE = "k8s"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Refuse a unit test that needs the cluster before any of its fixtures is set up."""
    if CLUSTER_FIXTURE in getattr(item, "fixturenames", ()):
        raise NotAUnitTest(
            f"{item.nodeid} asks for the Kubernetes test cluster (fixture {CLUSTER_FIXTURE!r})"
        )


@pytest.fixture(autouse=True)
def _unit_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _no_process)
    monkeypatch.setattr(os, "fork", _no_fork)
    monkeypatch.setattr(socket.socket, "connect", _guard(socket.socket.connect, "connect to"))
    monkeypatch.setattr(socket.socket, "connect_ex", _guard(socket.socket.connect_ex, "connect to"))
    monkeypatch.setattr(socket.socket, "bind", _guard(socket.socket.bind, "bind"))
    yield
