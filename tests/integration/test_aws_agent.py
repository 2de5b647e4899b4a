"""The node agent on EC2 (moto's server, instances played by real sshd hosts: ``tests/support/moto_ec2.py``):
an agent per instance started over SSH; the agents reach each other only within the cluster's own
security group, and the control plane reaches the head's agent through a relay over its SSH connection."""

from __future__ import annotations

import time
from pathlib import Path

from aws_fixtures import backend, hosts, moto, net  # noqa: F401 (fixtures)
from moto_ec2 import FakeNetwork, MotoEC2
from sshd import SSHDCluster, needs_sshd, user_processes

from airflow_provider_sky.backends.aws.ec2 import cluster_groups
from airflow_provider_sky.backends.nodeagents import EXTRA_KEY, endpoint
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient

pytestmark = needs_sshd

N = 3
#: see tests/integration/test_ssh_agent.py
FAILFAST_MARGIN = 3.0


def _agents(hosts: SSHDCluster) -> list[int]:
    out = []
    for n in hosts.nodes:
        for pid in user_processes(n.user):
            try:
                if b"agent.py\0--node" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.append(pid)
            except OSError:
                continue
    return out


def test_agents_on_ec2_fail_fast_and_their_port_is_open_only_within_the_clusters_group(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    b = backend(moto.url, hosts)
    h = b.provision("agt", task_from_args(num_nodes=N, run="true"))
    try:
        where = endpoint(h.extra)
        assert where is not None and where[0] == h.nodes[0].extra["host"]
        assert len(_agents(hosts)) == N
        # the group: SSH from ssh_cidr, and from the group itself (the agents' port among them); nothing else
        ec2 = moto.client()
        (gid,) = cluster_groups(ec2, "agt", b.owner)
        perms = ec2.describe_security_groups(GroupIds=[gid])["SecurityGroups"][0]["IpPermissions"]
        own = [p for p in perms if p.get("UserIdGroupPairs")]
        assert [[g["GroupId"] for g in p["UserIdGroupPairs"]] for p in own] == [[gid]]
        assert all(p.get("FromPort") == 22 for p in perms if p.get("IpRanges")), perms
        # the control plane's way in: a relay on this machine over the head's SSH connection
        found = b.agent_endpoint(h)
        assert found is not None and found[0] == "127.0.0.1"
        assert found[2].decode() not in str(h.to_dict())

        run = f'if [ "$SKYPILOT_NODE_RANK" = "{N - 1}" ]; then sleep 2; exit 1; fi; sleep 10000'
        c = GangClient(b, h)
        c.launch(task_from_args(num_nodes=N, run=run), "ff")
        assert (c.agent_calls, c.node_calls) == (1, 0)
        time.sleep(2 + FAILFAST_MARGIN)  # nothing polls meanwhile
        status = c.peek("ff")
        assert (c.agent_calls, c.node_calls) == (2, 0)
        states = {r.rank: r.state.value for r in status.ranks}
        assert states == {0: "cancelled", 1: "cancelled", N - 1: "failed"}, status.ranks
        assert f"rank {N - 1} failed first" in status.by_rank(0).reason
    finally:
        b.terminate("agt")
        b.close()
    assert cluster_groups(moto.client(), "agt", b.owner) == []  # the group, with its rules, is gone
    net.power_off_gone()
    assert _agents(hosts) == []


def test_the_connections_own_groups_or_node_agent_off_keep_the_per_node_path(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    b = backend(moto.url, hosts, node_agent="false")
    assert not b.settings.node_agent
    h = b.provision("off", task_from_args(num_nodes=2, run="true"))
    try:
        assert EXTRA_KEY not in h.extra and _agents(hosts) == []
    finally:
        b.terminate("off")
        b.close()
