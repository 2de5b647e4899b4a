"""The unit tier's guard (``tests/unit/conftest.py``): a process or a network socket in a unit test fails it,
naming what it did, so a test that needs either cannot stay in the tier that runs without system tools."""

from __future__ import annotations

import asyncio
import socket
import subprocess
from types import SimpleNamespace
from typing import Any, cast

import pytest

from unit.conftest import NotAUnitTest, pytest_runtest_setup


def test_a_process_is_refused_naming_its_command() -> None:
    with pytest.raises(NotAUnitTest, match=r"started a process: \['true'\]"):
        subprocess.run(["true"], check=False)


def test_an_asyncio_subprocess_is_refused_too() -> None:
    async def spawn() -> None:
        await asyncio.create_subprocess_exec("true")

    with pytest.raises(NotAUnitTest, match="started a process"):
        asyncio.run(spawn())


def test_an_internet_socket_is_refused_and_a_unix_one_is_not() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(NotAUnitTest, match="bind"):
        s.bind(("127.0.0.1", 0))
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(NotAUnitTest, match="connect"):
        s.connect(("127.0.0.1", 9))
    a, b = socket.socketpair()
    a.close()
    b.close()


def test_a_unit_test_that_asks_for_the_cluster_is_refused_before_its_fixtures() -> None:
    """The cluster is a session fixture, set up before the function-scoped guard would see its processes."""
    item = cast(
        Any, SimpleNamespace(nodeid="tests/unit/test_x.py::test_y", fixturenames=["k8s_image", "k8s"])
    )
    with pytest.raises(NotAUnitTest, match=r"test_y asks for the Kubernetes test cluster \(fixture 'k8s'\)"):
        pytest_runtest_setup(item)
    pytest_runtest_setup(cast(Any, SimpleNamespace(nodeid="t", fixturenames=["tmp_path"])))
