"""``idle_down`` on EC2 without Airflow: the node keeper powers its machine off and EC2 terminates it.

Real: the launch parameter (``InstanceInitiatedShutdownBehavior=terminate``, read back from moto), the
keeper and the power-off command run on real sshd hosts, leftovers found and removed by their tags.
Faked (``FakeNetwork.power_button``): moto boots no machine, so the power-off is a file the command
writes and the fake plays EC2's part through moto's API, applying the instance's shutdown behaviour.
"""

from __future__ import annotations

import time

import pytest
from aws_fixtures import backend, hosts, moto, net  # noqa: F401 (fixtures)
from moto_ec2 import FakeNetwork, MotoEC2, iter_instances, ours_left
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.backends.aws.ec2 import TAG_CREATED, resource_name
from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient

pytestmark = needs_sshd


def test_idle_nodes_power_off_and_ec2_terminates_them_then_leftovers_go(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    ec2 = moto.client()
    command = net.power_button()
    b = backend(moto.url, hosts, poweroff_command=command)
    spec = task_from_args(num_nodes=2, run="true")
    h = b.provision("idle", spec, holder="d/r")
    ids = sorted(n.node_id for n in h.nodes)
    for iid in ids:
        attr = ec2.describe_instance_attribute(InstanceId=iid, Attribute="instanceInitiatedShutdownBehavior")
        assert attr["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    GangClient(b, h).launch(spec, "job", idle_down=2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and {
        i["State"]["Name"] for i in iter_instances(ec2, InstanceIds=ids)
    } != {"terminated"}:
        time.sleep(0.5)
    assert sorted(net.powered_off) == [(iid, "terminate") for iid in ids]
    assert {i["State"]["Name"] for i in iter_instances(ec2, InstanceIds=ids)} == {"terminated"}
    # nothing runs or bills; the cluster's security group and key pair are left (nothing deleted them)
    assert set(ours_left(ec2, "idle")) == {"security_groups", "key_pairs"}
    assert b.reap(min_age=3600) == [] and set(ours_left(ec2, "idle")) == {"security_groups", "key_pairs"}
    assert b.reap(min_age=0) == []  # no instance to terminate; the leftovers, old enough, are deleted
    assert ours_left(ec2, "idle") == {}
    # the name is free again: a fresh cluster
    h2 = b.provision("idle", spec, holder="d/r2")
    assert not set(ids) & {n.node_id for n in h2.nodes}
    assert b.terminate("idle", holder="d/r2").removed and ours_left(ec2, "idle") == {}


def test_a_provision_deletes_an_old_leftover_group_and_waits_for_a_young_one(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """The group's name is the provisions' mutex for the seconds before the launch: one made long ago
    with no instance of its cluster is a leftover (deleted, the provision goes on); a young one may be
    a concurrent provision's (waited for, then an error naming it)."""
    ec2 = moto.client()
    vpc = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]

    def leftover(name: str, created: float) -> None:
        tags = [
            {"Key": "sky-airflow:cluster", "Value": name},
            {"Key": "sky-airflow:owner", "Value": "airflow-provider-sky"},
            {"Key": TAG_CREATED, "Value": str(int(created))},
        ]
        ec2.create_security_group(
            GroupName=resource_name(name),
            Description="left",
            VpcId=vpc,
            TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}],
        )

    b = backend(moto.url, hosts)
    b.busy_wait = 1.0
    spec = task_from_args(num_nodes=1, run="true")
    leftover("young", time.time())
    with pytest.raises(BackendError, match=f"its security group {resource_name('young')} exists"):
        b.provision("young", spec)
    assert len(ours_left(ec2, "young")["security_groups"]) == 1
    leftover("old", time.time() - 3600)
    old = ours_left(ec2, "old")["security_groups"]
    h = b.provision("old", spec)
    assert len(h.nodes) == 1 and ours_left(ec2, "old")["security_groups"] != old
    assert b.terminate("old").removed and ours_left(ec2, "old") == {}
    assert b.terminate("young").removed is False and ours_left(ec2, "young") == {}
