# ruff: noqa: F811 (the fixtures imported from aws_fixtures are parameters here)
"""resources.ports opened where a backend can open them: a rule in the EC2 cluster's own security group
(moto), removed with the group at teardown; a Kubernetes Service for the head pod, owned by it."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_sky.backends.aws.ec2 import resource_name
from airflow_provider_sky.runners import ssh
from airflow_provider_sky.spec import SpecError, task_from_args
from aws_fixtures import backend, hosts, moto, net  # noqa: F401 (fixtures)
from moto_ec2 import FakeNetwork, MotoEC2, ours_left
from sshd import SSHDCluster, needs_sshd


def _group(ec2: Any, name: str) -> dict[str, Any] | None:
    groups = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": [resource_name(name)]}])
    return (groups["SecurityGroups"] or [None])[0]


@needs_sshd
def test_ec2_ports_are_a_rule_of_the_clusters_group_gone_at_teardown(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    ec2 = moto.client()
    b = backend(moto.url, hosts)
    spec = task_from_args(num_nodes=2, run="true", resources={"ports": [8888, "10000-10010"]})
    b.provision("web", spec)
    try:
        group = _group(ec2, "web")
        assert group is not None
        opened = {
            (p["FromPort"], p["ToPort"]): [r["CidrIp"] for r in p["IpRanges"]]
            for p in group["IpPermissions"]
            if p.get("FromPort") not in (None, 22) and p["IpProtocol"] == "tcp"
        }
        assert opened == {(8888, 8888): ["0.0.0.0/0"], (10000, 10010): ["0.0.0.0/0"]}
    finally:
        b.terminate("web")
        ssh.close_all()
    assert _group(ec2, "web") is None
    assert not ours_left(ec2, "web")


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
