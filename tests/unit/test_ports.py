# ruff: noqa: F811 (the fixtures imported from aws_fixtures are parameters here)
"""resources.ports opened where a backend can open them: a rule in the EC2 cluster's own security group
(moto), removed with the group at teardown; a Kubernetes Service for the head pod, owned by it."""

from __future__ import annotations

import pytest
from aws_fixtures import backend, hosts, moto, net  # noqa: F401 (fixtures)
from moto_ec2 import MotoEC2
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.spec import SpecError, task_from_args


@needs_sshd
def test_ec2_ports_with_the_connections_own_groups_are_refused_before_provisioning(
    moto: MotoEC2, hosts: SSHDCluster
) -> None:
    b = backend(moto.url, hosts, security_group_ids="sg-12345678")
    spec = task_from_args(run="true", resources={"ports": 8888})
    problems = dict(b.spec_problems(spec))
    assert "open the ports in those groups yourself" in problems["resources.ports"]
    with pytest.raises(SpecError):
        from airflow_provider_sky.backends.base import choose_resources

        choose_resources(b, spec)


# -- Kubernetes: a Service for the head pod ----------------------------------------------------------------
