"""Test-only: Airflow's own processes join the AWS tests' fake network (``moto_ec2.FakeNetwork``).

Put on ``PYTHONPATH`` of a test stack's services together with ``SKY_TEST_FAKE_EC2_NET`` (the file
``FakeNetwork.share`` wrote); nothing else sets either. When ``airflow_provider_sky.backends.aws.backend``
is first imported in such a process, its two address hooks are replaced exactly as the in-process
tests' ``net`` fixture (``tests/support/aws_fixtures.py``) does: ``AWSBackend.endpoint`` by the shared
fake network's, and ``AWSBackend.agent_address`` (where the instances' agents reach their head) by the
head's sshd host address. The product has no test
hook of its own.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path
from typing import Any

_TARGET = "airflow_provider_sky.backends.aws.backend"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "support"))  # moto_ec2, sshd
            from moto_ec2 import FakeNetwork

            network = FakeNetwork.joined(Path(os.environ["SKY_TEST_FAKE_EC2_NET"]))
            module.AWSBackend.endpoint = lambda self, inst: network.endpoint(self, inst)
            module.AWSBackend.agent_address = FakeNetwork.agent_address

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("SKY_TEST_FAKE_EC2_NET"):
    sys.meta_path.insert(0, _PatchOnImport())
