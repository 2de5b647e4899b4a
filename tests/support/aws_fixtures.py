"""The AWS tests' shared fixtures: moto's server (module-wide), 5 sshd hosts, the fake network, and the
``sky_aws`` connection config a test's backend is built from (as the hook hands it over)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from moto_ec2 import IMAGE, REGION, FakeNetwork, MotoEC2
from sshd import SSHDCluster

from airflow_provider_sky.backends.aws import AWSBackend
from airflow_provider_sky.runners import ssh


@pytest.fixture(scope="module")
def moto() -> Iterator[MotoEC2]:
    server = MotoEC2().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHDCluster]:
    with SSHDCluster(5, tmp_path_factory.mktemp("aws-sshd")) as c:
        yield c
        ssh.close_all()


@pytest.fixture
def net(moto: MotoEC2, hosts: SSHDCluster, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeNetwork]:
    moto.reset()
    network = FakeNetwork(hosts, moto)
    monkeypatch.setattr(AWSBackend, "endpoint", lambda self, inst: network.endpoint(self, inst))
    # the instances' agents reach their head where the fake network puts it (its sshd host's address)
    monkeypatch.setattr(AWSBackend, "agent_address", FakeNetwork.agent_address)
    yield network
    network.stop()
    ssh.close_all()
    network.power_off_gone()


def conn(moto_url: str, hosts: SSHDCluster, **extra: Any) -> dict[str, Any]:
    """A sky_aws connection's config, as the hook hands it to the backend."""
    config: dict[str, Any] = {
        "login": "testing",
        "password": "testing",
        "region_name": REGION,
        "endpoint_url": moto_url,
        "private_key": hosts.client_key_text,
        "image_id": IMAGE,
        "provision_timeout": 30,
    }
    config.update(extra)
    return {k: v for k, v in config.items() if v is not None}


def backend(moto_url: str, hosts: SSHDCluster, **extra: Any) -> AWSBackend:
    return AWSBackend.from_config(conn(moto_url, hosts, **extra))
