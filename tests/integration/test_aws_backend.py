"""The AWS EC2 backend against moto's server (real HTTP, reached through the connection's endpoint URL).

moto boots nothing: the instances' SSH is the fake network of ``moto_ec2.FakeNetwork`` (each live moto
instance is one real sshd host of ``tests/support/sshd.py``); no test connects to a moto address.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
from aws_fixtures import backend, conn, hosts, moto, net  # noqa: F401 (fixtures)
from moto_ec2 import (
    IMAGE,
    REGION,
    FakeNetwork,
    Fault,
    FaultProxy,
    MotoEC2,
    iter_instances,
    measure_lifecycle,
    ours_left,
)
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.backends.aws.ec2 import resource_name
from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.runners import ssh
from airflow_provider_sky.spec import task_from_args

pytestmark = needs_sshd


def _tags(instance: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in instance.get("Tags") or ()}


def test_lifecycle_provision_find_reuse_stop_start_terminate(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    ec2 = moto.client()
    b = backend(moto.url, hosts)
    spec = task_from_args(num_nodes=4, run="true", resources={"cpus": "4+"})
    t0 = time.monotonic()
    h = b.provision("train", spec, holder="dag/run-a")
    took = time.monotonic() - t0
    instances = {i["InstanceId"]: i for i in iter_instances(ec2)}
    assert len(instances) == 4 and all(i["State"]["Name"] == "running" for i in instances.values())
    assert {i["InstanceType"] for i in instances.values()} == {"c6i.xlarge"}  # the cheapest with 4+ vCPUs
    roles = [_tags(instances[n.node_id])["sky-airflow:role"] for n in h.nodes]
    assert roles == ["head", "worker", "worker", "worker"]
    assert all(_tags(i)["sky-airflow:owner"] == "airflow-provider-sky" for i in instances.values())
    # SKYPILOT_NODE_IPS: private IPs, workers after the head sorted by IP
    workers = [n.ip for n in h.nodes[1:]]
    assert workers == sorted(workers, key=lambda ip: tuple(int(p) for p in ip.split(".")))
    assert [n.ip for n in h.nodes] == [instances[n.node_id]["PrivateIpAddress"] for n in h.nodes]
    assert h.cloud == "aws" and h.region == REGION
    # each node is its own machine (its own sshd host), and a command runs there
    homes = {b.runner(n).run_script('printf %s "$HOME"').text for n in h.nodes}
    assert len(homes) == 4
    # volumes and the security group are tagged too
    vols = ec2.describe_volumes(Filters=[{"Name": "tag:sky-airflow:cluster", "Values": ["train"]}])["Volumes"]
    assert len(vols) == 4
    assert ours_left(ec2, "train").keys() == {"instances", "security_groups", "key_pairs"}

    # found again by its tags, from a fresh backend (another worker)
    found = backend(moto.url, hosts).find("train")
    assert found is not None and [n.node_id for n in found.nodes] == [n.node_id for n in h.nodes]

    # reused by another run: the same instances, a second lease
    h2 = backend(moto.url, hosts).provision("train", spec, holder="dag/run-b")
    assert [n.node_id for n in h2.nodes] == [n.node_id for n in h.nodes]
    assert len(list(iter_instances(ec2))) == 4

    # stopped (by hand, in the console) and provisioned again: started, the head still rank 0
    ec2.stop_instances(InstanceIds=list(instances))
    ec2.get_waiter("instance_stopped").wait(InstanceIds=list(instances), WaiterConfig={"Delay": 1})
    assert backend(moto.url, hosts).find("train") is None  # not usable while stopped
    h3 = backend(moto.url, hosts).provision("train", spec, holder="dag/run-c")
    assert h3.nodes[0].node_id == h.nodes[0].node_id
    assert {n.node_id for n in h3.nodes} == set(instances)

    # run a's teardown keeps the cluster (b and c hold it); the last one removes everything of ours
    assert backend(moto.url, hosts).terminate("train", holder="dag/run-a").kept_for == (
        "dag/run-b",
        "dag/run-c",
    )
    assert backend(moto.url, hosts).terminate("train", holder="dag/run-b").kept_for == ("dag/run-c",)
    assert ours_left(ec2, "train")["instances"]
    down = backend(moto.url, hosts).terminate("train", holder="dag/run-c")
    assert down.removed and not down.unclean
    assert ours_left(ec2, "train") == {}
    assert all(i["State"]["Name"] == "terminated" for i in iter_instances(ec2))
    # idempotent: again, nothing to do
    assert backend(moto.url, hosts).terminate("train").removed is False
    print(f"provision of 4 on moto + sshd: {took:.2f}s")


def test_foreign_instances_survive_every_teardown(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    ec2 = moto.client()

    def foreign(tags: dict[str, str]) -> str:
        spec = (
            [{"ResourceType": "instance", "Tags": [{"Key": k, "Value": v} for k, v in tags.items()]}]
            if tags
            else []
        )
        kw: dict[str, Any] = {"TagSpecifications": spec} if spec else {}
        return str(
            ec2.run_instances(ImageId=IMAGE, MinCount=1, MaxCount=1, **kw)["Instances"][0]["InstanceId"]
        )

    theirs = [
        foreign({}),  # untagged
        foreign({"sky-airflow:cluster": "other", "sky-airflow:owner": "airflow-provider-sky"}),
        foreign(
            {"sky-airflow:cluster": "mine", "sky-airflow:owner": "someone-else"}
        ),  # same name, other owner
        foreign({"sky-airflow:cluster": "mine"}),  # our cluster tag but no owner tag
        foreign({"Name": "sky-mine-head", "sky-airflow:role": "head"}),
    ]
    b = backend(moto.url, hosts)
    h = b.provision("mine", task_from_args(num_nodes=2, run="true"), holder="d/r")
    assert not set(theirs) & {n.node_id for n in h.nodes}
    assert b.terminate("mine", holder="d/r").removed
    assert b.terminate("mine").removed is False
    assert b.terminate("other-never-made").removed is False
    states = {i["InstanceId"]: i["State"]["Name"] for i in iter_instances(ec2, InstanceIds=theirs)}
    assert states == dict.fromkeys(theirs, "running")
    assert ours_left(ec2, "mine") == {"instances": [theirs[2], theirs[3]]}  # tagged mine, not ours


@pytest.mark.parametrize(
    ("action", "code", "status", "cause"),
    [
        ("RunInstances", "InsufficientInstanceCapacity", 500, "insufficient capacity"),
        ("RunInstances", "VcpuLimitExceeded", 400, "quota"),
        ("CreateTags", "UnauthorizedOperation", 400, "permission denied"),  # after the instances exist
    ],
)
def test_a_failure_part_way_leaves_nothing_of_ours(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork, action: str, code: str, status: int, cause: str
) -> None:
    proxy = FaultProxy(moto.url)
    try:
        proxy.faults.append(Fault(action, code, f"the server says {code}", status))
        b = backend(proxy.url, hosts)
        with pytest.raises(BackendError) as err:
            b.provision("partial", task_from_args(num_nodes=3, run="true"), holder="d/r")
        text = str(err.value)
        assert f"{cause} ({code})" in text and "nothing of it is left" in text
        ec2 = moto.client()
        assert ours_left(ec2, "partial") == {}
        if action == "CreateTags":
            assert "3 instance(s) made" in text
            assert sorted(i["State"]["Name"] for i in iter_instances(ec2)) == ["terminated"] * 3
    finally:
        proxy.stop()


def test_an_instance_that_ends_while_starting_fails_the_provision_naming_it(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """EC2 ends an instance before it runs (capacity at boot, a spot reclaim): played by terminating one
    between the launch and the wait. The error names the instance and EC2's reason; nothing is left."""
    ec2 = moto.client()
    proxy = FaultProxy(moto.url)
    try:

        def end_one() -> None:
            ids = sorted(i["InstanceId"] for i in iter_instances(ec2))
            ec2.terminate_instances(InstanceIds=ids[:1])

        proxy.before["CreateTags"] = end_one  # the head's tag: after RunInstances, before the waiter
        with pytest.raises(BackendError) as err:
            backend(proxy.url, hosts).provision("ends", task_from_args(num_nodes=3, run="true"))
        text = str(err.value)
        assert "ended while starting (Client.UserInitiatedShutdown)" in text, text
        assert re.search(
            r"3 instance\(s\) made \((i-\w+, ){2}i-\w+\), terminated; nothing of it is left", text
        )
        assert ours_left(ec2, "ends") == {}
    finally:
        proxy.stop()


def test_ssh_that_never_answers_terminates_everything(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    ec2 = moto.client()
    b = backend(moto.url, hosts, provision_timeout=5)
    real = net.endpoint

    def second_is_dead(backend_: Any, inst: Any) -> Any:
        ids = sorted(i["InstanceId"] for i in iter_instances(ec2))
        if inst["InstanceId"] == ids[-1]:
            net.dead.add(inst["InstanceId"])
        return real(backend_, inst)

    net.endpoint = second_is_dead  # type: ignore[method-assign]
    t0 = time.monotonic()
    with pytest.raises(BackendError, match=r"SSH did not answer at [\d.]+:\d+ within provision_timeout=5s"):
        b.provision("nossh", task_from_args(num_nodes=2, run="true"))
    assert time.monotonic() - t0 < 60
    assert ours_left(ec2, "nossh") == {}


@pytest.mark.parametrize(
    ("resources", "field"),
    [
        ({"accelerators": "Z100:3"}, "resources.accelerators"),
        ({"accelerators": "A100:3"}, "resources.accelerators"),
        ({"instance_type": "m6i.large", "accelerators": "H100:8"}, "resources.instance_type"),
        ({"cpus": "3"}, "resources.cpus"),
        ({"region": "eu-west-1"}, "resources.region"),
    ],
)
def test_bad_input_is_refused_naming_the_field_before_anything_is_made(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork, resources: dict[str, Any], field: str
) -> None:
    proxy = FaultProxy(moto.url)
    try:
        b = backend(proxy.url, hosts)
        spec = task_from_args(num_nodes=2, run="true", resources=resources)
        assert [f for f, _ in b.fit(spec.resources, 2)] == [field]
        with pytest.raises(BackendError, match=field.replace(".", r"\.")):
            b.provision("bad", spec)
        assert [c for c in proxy.calls if not c.startswith("Describe")] == []
    finally:
        proxy.stop()


def test_instance_request_spot_disk_and_given_groups_and_key(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    ec2 = moto.client()
    vpc = ec2.describe_vpcs()["Vpcs"][0]["VpcId"]
    group = ec2.create_security_group(GroupName="mine", Description="x", VpcId=vpc)["GroupId"]
    pub = backend(moto.url, hosts).public_key()
    ec2.import_key_pair(KeyName="my-key", PublicKeyMaterial=pub.encode())
    b = backend(moto.url, hosts, security_group_ids=group, key_name="my-key")
    spec = task_from_args(
        num_nodes=2, run="true", resources={"accelerators": "A100:8", "use_spot": True, "disk_size": 512}
    )
    h = b.provision("gpu", spec)
    inst = list(iter_instances(ec2, InstanceIds=[n.node_id for n in h.nodes]))
    assert {i["InstanceType"] for i in inst} == {"p4d.24xlarge"}
    assert {i.get("InstanceLifecycle") for i in inst} == {"spot"}
    assert {i["KeyName"] for i in inst} == {"my-key"}
    # (moto lists a network interface's groups there, not in the instance's SecurityGroups)
    assert {g["GroupId"] for i in inst for g in i["NetworkInterfaces"][0]["Groups"]} == {group}
    vols = ec2.describe_volumes(
        Filters=[{"Name": "attachment.instance-id", "Values": [inst[0]["InstanceId"]]}]
    )
    assert [v["Size"] for v in vols["Volumes"]] == [512]
    # every rank is told the node's GPUs, also when the task names the instance type alone
    from airflow_provider_sky.watch.jobs import GangClient

    def gpus(handle: Any, task: Any) -> set[str]:
        launches = GangClient(b, handle).rank_launches(task, "j", "run")
        return {x.env["SKYPILOT_NUM_GPUS_PER_NODE"] for x in launches}

    assert gpus(h, spec) == {"8"}
    assert b.terminate("gpu").removed
    alone = task_from_args(num_nodes=2, run="true", resources={"instance_type": "g4dn.12xlarge"})
    assert gpus(b.provision("gpu2", alone), alone) == {"4"}
    assert b.terminate("gpu2").removed
    # what the connection gave is the user's: kept
    assert [g["GroupId"] for g in ec2.describe_security_groups(GroupIds=[group])["SecurityGroups"]] == [group]
    assert [k["KeyName"] for k in ec2.describe_key_pairs()["KeyPairs"]] == ["my-key"]


def test_the_runner_is_built_for_the_instance_address_user_and_key(moto: MotoEC2, hosts: SSHDCluster) -> None:
    """Without the fake network: the address a node is reached at, as a user gets it (nothing connects)."""
    moto.reset()
    ec2 = moto.client()
    inst = ec2.run_instances(ImageId=IMAGE, MinCount=1, MaxCount=1)["Instances"][0]
    for extra, host in (({}, inst["PublicIpAddress"]), ({"use_private_ips": True}, inst["PrivateIpAddress"])):
        b = backend(moto.url, hosts, ssh_user="ec2-user", **extra)
        node = b._node("c", inst, {"home": "/home/ec2-user", "extra": {"host_key": "ssh-ed25519 AAAAC3Nz"}})
        cfg = b.runner(node).config
        assert (cfg.host, cfg.port, cfg.user) == (host, 22, "ec2-user")
        assert cfg.private_key == hosts.client_key_text and cfg.key_file is None
        assert cfg.host_key_policy == "verify" and cfg.pinned_host_keys == ("ssh-ed25519 AAAAC3Nz",)
        assert node.ip == inst["PrivateIpAddress"] and node.root == "/home/ec2-user/.sky_airflow/c"


def test_example_dags_on_ec2_leave_nothing_after_a_failing_gang_or_a_failed_setup(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork, airflow_db: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``sky_default`` is a sky_aws connection on moto: the examples run unchanged under dag.test(), and
    every run's teardown leaves nothing of ours (instances, security groups, key pairs)."""
    import json

    from integration.test_dag_test import _run, _states

    extra = {k: v for k, v in conn(moto.url, hosts).items() if k not in ("login", "password")}
    monkeypatch.setenv(
        "AIRFLOW_CONN_SKY_DEFAULT",
        json.dumps({"conn_type": "sky_aws", "login": "testing", "password": "testing", "extra": extra}),
    )
    ec2 = moto.client()
    owner = [{"Name": "tag:sky-airflow:owner", "Values": ["airflow-provider-sky"]}]

    def nothing_of_ours_left() -> None:
        live = [i["InstanceId"] for i in iter_instances(ec2) if i["State"]["Name"] != "terminated"]
        assert live == []
        assert ec2.describe_security_groups(Filters=owner)["SecurityGroups"] == []
        assert ec2.describe_key_pairs(Filters=owner)["KeyPairs"] == []

    dr, tis = _run("sky_hello")
    assert str(dr.state) == "success" and set(_states(tis, "rank").values()) == {"success"}
    launched = list(iter_instances(ec2))
    assert len(launched) == 4
    nothing_of_ours_left()

    dr, tis = _run("sky_fail_fast")
    assert str(dr.state) == "failed" and tis[("down", -1)].state == "success"
    assert _states(tis, "rank")[2] == "failed"
    nothing_of_ours_left()

    dr, tis = _run("sky_failed_setup")
    assert str(dr.state) == "failed" and tis[("cluster", -1)].state == "failed"
    nothing_of_ours_left()  # the cluster task removes what it made when its setup fails
    assert len(list(iter_instances(ec2))) == 11  # clusters of 4, 4 and 3, all terminated


def test_the_lifecycle_makes_a_few_batched_calls_not_one_per_instance(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """A polite client: one RunInstances, one TerminateInstances, waiters polling all instances at once.
    The only call per instance is the host-key tag, once per provision."""
    config = conn(moto.url, hosts)
    two = measure_lifecycle(moto, config, 2, "calls2")
    four = measure_lifecycle(moto, config, 4, "calls4")
    for life in (two, four):
        assert (
            life.provision_calls.get("RunInstances") == 1
            and life.terminate_calls.get("TerminateInstances") == 1
        )
        assert life.provision_calls["CreateTags"] == 1 + life.n  # the head's role, each host key
        assert life.find_calls == {"DescribeInstances": 1}
    grown = {
        k: four.provision_calls[k] - v for k, v in two.provision_calls.items() if four.provision_calls[k] != v
    }
    assert grown == {"CreateTags": 2}
    assert four.terminate_calls == two.terminate_calls
    print(
        f"\nlifecycle on moto + sshd: N=4 provision {four.provision_s:.2f}s ({sum(four.provision_calls.values())} calls: "
        f"{four.provision_calls}), find {four.find_s:.2f}s, terminate {four.terminate_s:.2f}s "
        f"({four.terminate_calls}); N=2 {two.calls} calls, N=4 {four.calls} calls"
    )


def test_the_test_button_through_a_linked_aws_connection(
    moto: MotoEC2, hosts: SSHDCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As a user sets it up: ``aws_default`` (credentials, region, endpoint URL) reused by a sky_aws
    connection that adds the SSH key; the Test button reaches EC2 and loads the key, starting nothing."""
    import json

    from airflow_provider_sky.hooks.sky import SkyAWSHook  # type: ignore[attr-defined]

    moto.reset()
    aws = {
        "conn_type": "aws",
        "login": "testing",
        "password": "testing",
        "extra": {"region_name": REGION, "endpoint_url": moto.url},
    }
    monkeypatch.setenv("AIRFLOW_CONN_AWS_TEST", json.dumps(aws))
    sky = {"conn_type": "sky_aws", "extra": {"aws_conn_id": "aws_test", "private_key": hosts.client_key_text}}
    monkeypatch.setenv("AIRFLOW_CONN_SKY_T", json.dumps(sky))
    ok, message = SkyAWSHook("sky_t").test_connection()
    assert ok, message
    assert message.startswith(f"EC2 {REGION}: ") and "SSH key loads" in message
    assert list(iter_instances(moto.client())) == []
    # an endpoint nobody answers at: the button says so, naming the region
    aws["extra"] = {"region_name": REGION, "endpoint_url": "http://127.0.0.1:9"}
    monkeypatch.setenv("AIRFLOW_CONN_AWS_TEST", json.dumps(aws))
    ok, message = SkyAWSHook("sky_t").test_connection()
    assert not ok and f"reaching EC2 in {REGION}" in message
    # a key that does not load names the field, and no secret is in the message
    sky["extra"]["private_key"] = "not a key"
    aws["extra"]["endpoint_url"] = moto.url
    monkeypatch.setenv("AIRFLOW_CONN_AWS_TEST", json.dumps(aws))
    monkeypatch.setenv("AIRFLOW_CONN_SKY_T", json.dumps(sky))
    ok, message = SkyAWSHook("sky_t").test_connection()
    assert not ok and message.startswith("private_key: ") and "testing" not in message


def test_reap_terminates_a_cluster_gone_idle_and_nothing_else(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """After the nodes' idle_down removed the cluster's record, the instances would keep billing: reap
    finds the cluster by its tags and terminates it; a cluster in use and foreign instances stay."""
    ec2 = moto.client()
    b = backend(moto.url, hosts)
    spec = task_from_args(num_nodes=2, run="true")
    idle = b.provision("idle", spec, holder="d/r1")
    b.provision("busy", spec, holder="d/r2")
    foreign = ec2.run_instances(ImageId=IMAGE, MinCount=1, MaxCount=1)["Instances"][0]["InstanceId"]
    assert b.reap(min_age=3600) == []  # launched just now: could be a provision in progress
    assert b.reap(min_age=0) == []  # both hold their records
    # what the head's node keeper removes at idle_down
    (path,) = b.idle_down_paths(idle, 0)
    assert b.runner(idle.nodes[0]).run_script(f"rm {path}").returncode == 0
    # a provision of that name meanwhile adopts it (as it would a stopped cluster) once it is not new
    b2 = backend(moto.url, hosts, provision_timeout=4)
    time.sleep(4.1)
    again = b2.provision("idle", spec, holder="d/r3")
    assert [n.node_id for n in again.nodes] == [n.node_id for n in idle.nodes]
    assert b.runner(idle.nodes[0]).run_script(f"rm {path}").returncode == 0
    assert backend(moto.url, hosts).reap(min_age=0) == ["idle"]
    assert ours_left(ec2, "idle") == {}
    assert len(ours_left(ec2, "busy")["instances"]) == 2
    assert next(iter_instances(ec2, InstanceIds=[foreign]))["State"]["Name"] == "running"
    assert b.terminate("busy", holder="d/r2").removed


def test_leftovers_of_an_unfinished_teardown_hold_provisions_off_until_a_teardown_and_zone_is_honoured(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """The cluster's group name is the provisions' mutex, so a group a teardown could not delete holds
    the next provision off, naming it and the fix (another teardown deletes it); ``zone`` is honoured."""
    ec2 = moto.client()
    vpc = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"][0]["VpcId"]
    tags = [
        {"Key": "sky-airflow:cluster", "Value": "left"},
        {"Key": "sky-airflow:owner", "Value": "airflow-provider-sky"},
    ]
    ec2.create_security_group(
        GroupName=resource_name("left"),
        Description="left",
        VpcId=vpc,
        TagSpecifications=[{"ResourceType": "security-group", "Tags": tags}],
    )
    b = backend(moto.url, hosts, zone="us-east-1b")
    ec2.import_key_pair(
        KeyName=resource_name("left"),
        PublicKeyMaterial=b.public_key().encode(),
        TagSpecifications=[{"ResourceType": "key-pair", "Tags": tags}],
    )
    b.busy_wait = 1.0
    spec = task_from_args(num_nodes=2, run="true")
    with pytest.raises(BackendError, match=f"its security group {resource_name('left')} exists: another"):
        b.provision("left", spec)
    assert len(ours_left(ec2, "left")["security_groups"]) == 1  # not ours to delete while provisioning
    assert b.terminate("left").removed is False  # no instance, but the teardown deletes the leftovers
    assert ours_left(ec2, "left") == {}
    h = b.provision("left", spec)
    assert {n.extra["zone"] for n in h.nodes} == {"us-east-1b"} and h.zone == "us-east-1b"
    assert len(ours_left(ec2, "left")["security_groups"]) == 1
    assert b.terminate("left").removed
    assert ours_left(ec2, "left") == {}


def test_a_node_whose_instance_ends_mid_run_is_lost_with_ec2s_reason(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """A spot reclaim mid-run, played by terminating the instance in moto and killing its sshd host (the
    machine is gone): the rank is lost, its reason carries the instance's state and EC2's reason, and the
    gang is cancelled."""
    import asyncio

    from airflow_provider_sky.watch.jobs import GangClient
    from airflow_provider_sky.watch.loop import watch

    ec2 = moto.client()
    b = backend(moto.url, hosts)
    spec = task_from_args(num_nodes=2, run="sleep 10000", resources={"use_spot": True})
    h = b.provision("spot", spec)
    client = GangClient(b, h)
    client.launch(spec, "job")
    gone = h.nodes[1]
    index = net.host_of(gone.node_id)
    try:
        ec2.terminate_instances(InstanceIds=[gone.node_id])
        hosts.kill_node(index)

        async def until_done() -> Any:
            last = None
            async for poll in watch(client, "job", poll_interval=0.2, lost_after=2.0):
                last = poll
            return last

        poll = asyncio.run(asyncio.wait_for(until_done(), 60))
        lost = poll.status.by_rank(1)
        assert lost.state == "lost"
        assert f"instance {gone.node_id} is terminated (Client.UserInitiatedShutdown" in lost.reason
        assert poll.status.by_rank(0).state == "cancelled"
    finally:
        hosts.restart_node(index)
        ssh.close_all()
    assert b.terminate("spot").removed
    assert ours_left(ec2, "spot") == {}


def test_two_concurrent_provisions_of_one_cluster_make_one_set_of_instances(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """Two runs sharing a cluster_name start at once: one makes the instances, the other waits and joins
    (a second lease), never a second set of instances."""
    from concurrent.futures import ThreadPoolExecutor

    ec2 = moto.client()
    spec = task_from_args(num_nodes=2, run="true")

    def one(holder: str) -> Any:
        return backend(moto.url, hosts).provision("shared", spec, holder=holder)

    with ThreadPoolExecutor(2) as pool:
        a, b2 = pool.map(one, ["d/a", "d/b"])
    assert [n.node_id for n in a.nodes] == [n.node_id for n in b2.nodes]
    assert len(ours_left(ec2, "shared")["instances"]) == 2
    b = backend(moto.url, hosts)
    assert b.terminate("shared", holder="d/a").kept_for == ("d/b",)
    assert b.terminate("shared", holder="d/b").removed
    assert ours_left(ec2, "shared") == {}
