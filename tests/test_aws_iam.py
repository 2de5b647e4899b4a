# ruff: noqa: F811 (the fixtures imported from aws_fixtures are parameters here)
"""The IAM policy docs/backends/aws.md gives users, against the backend's real calls.

What moto (5.2.x) can check, and what it cannot: with auth enforced (``MotoEC2.enforce_iam``) it checks
each call's action against the caller's policies (Allow / Deny, wildcards), but for EC2 it evaluates
every statement against the resource ``*`` and with no condition keys of the request, so a statement's
``Resource`` and its ``Condition`` (the tag conditions) are never exercised. So: the policy is shown to
allow the whole lifecycle (actions), and its actions are shown to be exactly the ones the backend calls,
recorded on the wire; the conditions are checked for their shape only.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from airflow_provider_sky.backends.aws import iam
from airflow_provider_sky.backends.aws.ec2 import TAG_CREATED
from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.spec import task_from_args
from aws_fixtures import backend, hosts, moto, net  # noqa: F401 (fixtures)
from moto_ec2 import REGION, FakeNetwork, Fault, FaultProxy, MotoEC2, ours_left
from sshd import SSHDCluster, needs_sshd

pytestmark = needs_sshd


def _docs_policy() -> dict[str, Any]:
    """The IAM policy JSON the AWS backend's page (docs/backends/aws.md) gives users."""
    import json
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "backends" / "aws.md").read_text()
    after = text[text.index("**IAM permissions**") :]
    block = after[after.index("```json") + len("```json") : after.index("```", after.index("```json") + 7)]
    policy: dict[str, Any] = json.loads(block)
    return policy


def _users(moto: MotoEC2, policies: dict[str, dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """IAM users holding these policies, and an admin the tests' own client becomes; their keys."""
    import json

    iam = moto.client(service="iam")
    admin = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
    keys = {}
    for user, policy in {**policies, "admin": admin}.items():
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="p", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
    moto.keys = keys["admin"]
    return keys


def _root_size(ec2: Any, instance_id: str) -> int:
    vols = ec2.describe_volumes(Filters=[{"Name": "attachment.instance-id", "Values": [instance_id]}])
    return int(vols["Volumes"][0]["Size"])


def test_the_docs_iam_policy_allows_the_whole_lifecycle(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """moto enforcing IAM: a user holding exactly the docs' policy provisions, finds, replaces a node
    (the new instance gets the cluster's disk size, read from the old one's root volume), reaps and
    tears down a cluster and uses the Test button; a call the policy lacks would be AccessDenied. (moto
    checks the actions; it ignores Resource and Condition, so the tag conditions are not exercised.)"""
    keys = _users(moto, {"sky": _docs_policy()})
    moto.enforce_iam(True)
    try:
        b = backend(moto.url, hosts, login=keys["sky"][0], password=keys["sky"][1])
        assert b.test_connection().startswith(f"EC2 {REGION}")
        spec = task_from_args(num_nodes=2, run="true", resources={"disk_size": 512})
        h = b.provision("iam", spec, holder="d/r")
        assert backend(moto.url, hosts, login=keys["sky"][0], password=keys["sky"][1]).find("iam") is not None
        h2 = b.replace_nodes(h, [1])
        new = h2.nodes[1].node_id
        assert new != h.nodes[1].node_id and _root_size(moto.client(), new) == 512
        assert b.reap(min_age=0) == []
        assert b.terminate("iam", holder="d/r").removed
        assert ours_left(moto.client(), "iam") == {}
        # keys EC2 does not know: refused with the cause and the fix named, nothing made
        stranger = backend(moto.url, hosts, login="AKIANOBODY", password="wrong")
        with pytest.raises(BackendError) as err:
            stranger.provision("iam2", task_from_args(num_nodes=1, run="true"))
        print("\nunknown keys:", err.value)
        assert "credentials refused" in str(err.value) and "wrong" not in str(err.value)
        assert ours_left(moto.client(), "iam2") == {}
    finally:
        moto.enforce_iam(False)


def test_a_replacement_denied_the_root_volume_size_is_an_error_not_a_smaller_disk(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """A policy without ec2:DescribeVolumes: replacing a node cannot learn the cluster's disk size, so it
    fails naming the permission, before the lost instance is ended or a new one launched (never a new
    instance with the image's default disk)."""
    policy = _docs_policy()
    for st in policy["Statement"]:
        if isinstance(st["Action"], list):
            st["Action"] = [a for a in st["Action"] if a != "ec2:DescribeVolumes"]
    keys = _users(moto, {"sky": policy})
    moto.enforce_iam(True)
    try:
        b = backend(moto.url, hosts, login=keys["sky"][0], password=keys["sky"][1])
        h = b.provision("nodisk", task_from_args(num_nodes=2, run="true", resources={"disk_size": 512}))
        with pytest.raises(BackendError) as err:
            b.replace_nodes(h, [1])
        text = str(err.value)
        print("\nDescribeVolumes denied:", text)
        assert "root volume" in text and "permission denied" in text and "ec2:DescribeVolumes" in text
        assert sorted(ours_left(moto.client(), "nodisk")["instances"]) == sorted(n.node_id for n in h.nodes)
        assert b.terminate("nodisk").removed
    finally:
        moto.enforce_iam(False)


def test_the_docs_policy_is_the_one_made_from_the_backends_list_of_actions() -> None:
    """One list in code (``backends/aws/iam.py``) of the EC2 actions the backend calls; the docs'
    policy is the one made from it, for the default owner."""
    assert _docs_policy() == iam.policy()
    assert _actions(_docs_policy()) == iam.ACTIONS


def _actions(policy: dict[str, Any]) -> set[str]:
    out: set[str] = set()
    for st in policy["Statement"]:
        acts = st["Action"]
        out.update([acts] if isinstance(acts, str) else acts)
    return out


def test_the_docs_policy_names_exactly_the_actions_the_backend_calls(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """Every path of the backend (the Test button, provision with a disk (its image's root device) and the
    cluster's own group and key pair, find, reuse of a stopped cluster, a lost node's reason, replacing a
    node, reap with leftovers, teardown, a provision failing part way), each EC2 call recorded by a proxy
    in front of moto: the actions called are the list in code (``iam.ACTIONS``) and the policy's, no
    more and no fewer. And the policy's shape: one
    version, every statement Allow with Resource '*', conditions only on keys EC2 defines."""
    policy = _docs_policy()
    assert policy["Version"] == "2012-10-17"
    for st in policy["Statement"]:
        assert st["Effect"] == "Allow" and st["Resource"] == "*" and st["Sid"]
        assert all(a.startswith("ec2:") and "*" not in a for a in _actions({"Statement": [st]}))
        for op, keys in (st.get("Condition") or {}).items():
            assert op == "StringEquals"
            assert set(keys) <= {"ec2:CreateAction", "aws:ResourceTag/sky-airflow:owner"}, keys
    ec2 = moto.client()
    proxy = FaultProxy(moto.url)
    try:
        b = backend(proxy.url, hosts)
        b.test_connection()
        spec = task_from_args(num_nodes=2, run="true", resources={"disk_size": 64})
        h = b.provision("iam", spec, holder="d/r")
        assert backend(proxy.url, hosts).find("iam") is not None
        ids = [n.node_id for n in h.nodes]
        ec2.stop_instances(InstanceIds=ids)
        ec2.get_waiter("instance_stopped").wait(InstanceIds=ids, WaiterConfig={"Delay": 1})
        h = backend(proxy.url, hosts).provision("iam", spec, holder="d/r2")  # StartInstances
        assert b.lost_reason(h.nodes[1]) is None
        h = b.replace_nodes(h, [1])  # DescribeVolumes (the root disk's size), RunInstances
        assert b.reap(min_age=0) == []
        assert b.terminate("iam", holder=None).removed
        # a leftover group, deleted by reap; a provision failing after the launch undoes what it made
        vpc = ec2.describe_vpcs()["Vpcs"][0]["VpcId"]
        tags = [
            {"Key": "sky-airflow:cluster", "Value": "left"},
            {"Key": "sky-airflow:owner", "Value": "airflow-provider-sky"},
            {"Key": TAG_CREATED, "Value": str(int(time.time()) - 3600)},
        ]
        ec2.create_security_group(
            GroupName="sky-airflow-left",
            Description="x",
            VpcId=vpc,
            TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}],
        )
        b.reap(min_age=60)
        assert ours_left(ec2, "left") == {}
        proxy.faults.append(Fault("CreateTags", "UnauthorizedOperation", "no", after=0))
        with pytest.raises(BackendError):
            backend(proxy.url, hosts).provision("undo", task_from_args(num_nodes=1, run="true"))
        proxy.faults.clear()
        assert ours_left(ec2, "undo") == {}
    finally:
        proxy.stop()
    called = {f"ec2:{a}" for a in proxy.calls}
    print("\nEC2 actions called:", sorted(called))
    assert called == iam.ACTIONS, (
        f"called, not in the list: {sorted(called - iam.ACTIONS)}; "
        f"in the list, never called: {sorted(iam.ACTIONS - called)}"
    )
    assert _actions(policy) == iam.ACTIONS


def test_every_ec2_call_in_the_backends_code_is_in_the_list() -> None:
    """Also the calls of paths no test above walks: each ``ec2.<method>(`` of ``backends/aws`` (waiters
    and paginators by the operation they call) is an action of ``iam.ACTIONS``, and each action of the
    list is called somewhere."""
    import re
    from pathlib import Path

    import airflow_provider_sky.backends.aws as package

    waiters = {"instance_running": "describe_instances", "instance_terminated": "describe_instances"}
    found: dict[str, str] = {}
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        text = path.read_text()
        for method in re.findall(r"\bec2\.(\w+)\(", text):
            if method not in ("get_paginator", "get_waiter"):
                found.setdefault(method, path.name)
        for kind, op in re.findall(r"get_(paginator|waiter)\(\s*\"(\w+)\"", text):
            found.setdefault(waiters.get(op, "?" + op) if kind == "waiter" else op, path.name)
    actions = {"ec2:" + "".join(w.title() for w in m.split("_")): where for m, where in found.items()}
    assert set(actions) == iam.ACTIONS, (
        f"called, not in the list: {sorted(set(actions) - iam.ACTIONS)}; "
        f"listed, never called: {sorted(iam.ACTIONS - set(actions))}"
    )
