"""Never touch what is not ours, never leave what is: the AWS backend against moto's server when a
reply is lost, a record cannot be written, a run adopts a cluster the reaper is about to end, and two
names differ only in case.

moto boots nothing: the instances' SSH is the fake network of ``moto_ec2.FakeNetwork`` (each live moto
instance is one real sshd host), so the cluster record lives on a real host, read and written over SSH.
"""

from __future__ import annotations

from typing import Any

import pytest
from aws_fixtures import backend, hosts, moto, net  # noqa: F401 (fixtures)
from moto_ec2 import (
    FakeNetwork,
    Fault,
    FaultProxy,
    MotoEC2,
    case_blind_group_names,
    iter_instances,
    ours_left,
)
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.backends.base import BackendError, add_lease
from airflow_provider_sky.backends.headrecord import HeadRecords
from airflow_provider_sky.spec import task_from_args

pytestmark = needs_sshd


def _given_group_and_key(moto: MotoEC2, hosts: SSHDCluster) -> dict[str, str]:
    """The least-privilege option of docs/backends/aws.md: the connection names its own group and key pair, so the
    provision makes neither (and holds no mutex of its own)."""
    ec2 = moto.client()
    vpc = ec2.describe_vpcs()["Vpcs"][0]["VpcId"]
    group = ec2.create_security_group(GroupName="given", Description="x", VpcId=vpc)["GroupId"]
    ec2.import_key_pair(KeyName="given-key", PublicKeyMaterial=backend(moto.url, hosts).public_key().encode())
    return {"security_group_ids": group, "key_name": "given-key"}


def _live(ec2: Any, name: str) -> list[str]:
    return sorted(ours_left(ec2, name).get("instances", []))


# -- a RunInstances whose reply is lost ---------------------------------------------------------------


def test_a_lost_launch_reply_leaves_no_instance_and_the_error_says_what_was_terminated(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """EC2 makes the instances but the reply never comes back (the connection drops after moto carried
    the call out, on botocore's every retry): the provision fails, the instances of that launch are
    found by its client token and our tags and terminated, and the error names them. Also when the
    connection gives its own group and key pair (no mutex: the case that used to leak)."""
    given = _given_group_and_key(moto, hosts)
    ec2 = moto.client()
    proxy = FaultProxy(moto.url)
    try:
        proxy.faults.append(Fault("RunInstances", "", "", status=0, reach=True))
        with pytest.raises(BackendError) as err:
            backend(proxy.url, hosts, **given).provision("lost", task_from_args(num_nodes=2, run="true"))
        text = str(err.value)
        print("\nlost reply:", text)
        made = [i["InstanceId"] for i in iter_instances(ec2)]
        assert len(made) == 2  # botocore retried with the same client token: one set, as on EC2
        assert _live(ec2, "lost") == []
        assert (
            f"2 instance(s) made ({', '.join(sorted(made))}), 2 of them found by the launch's client token"
            in text
        )
        assert text.endswith("terminated; nothing of it is left"), text
    finally:
        proxy.stop()


def test_a_lost_launch_reply_whose_look_up_fails_says_so_and_never_claims_nothing_is_left(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    given = _given_group_and_key(moto, hosts)
    ec2 = moto.client()
    proxy = FaultProxy(moto.url)
    try:
        proxy.faults.append(Fault("RunInstances", "", "", status=0, reach=True))
        # the first DescribeInstances (is there a cluster of that name?) passes; the look-up is refused
        proxy.faults.append(Fault("DescribeInstances", "UnauthorizedOperation", "not you", after=1))
        with pytest.raises(BackendError) as err:
            backend(proxy.url, hosts, **given).provision("blind", task_from_args(num_nodes=2, run="true"))
        text = str(err.value)
        print("\nlook-up failed:", text)
        assert "looking up the instances of the launch (client token sky-" in text
        assert "permission denied (UnauthorizedOperation)" in text
        assert "instances of it may be left, tagged sky-airflow:cluster=blind" in text
        assert "nothing of it is left" not in text
        assert len(_live(ec2, "blind")) == 2  # as said: left, tagged (a teardown finds them)
    finally:
        proxy.stop()
    assert backend(moto.url, hosts, **given).terminate("blind").removed
    assert _live(ec2, "blind") == []


def test_an_undo_whose_termination_is_refused_names_the_instances_left(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """The launch worked, tagging the head was refused, and so was terminating: the error names the
    instances made and that terminating them failed, never that nothing is left."""
    given = _given_group_and_key(moto, hosts)
    ec2 = moto.client()
    proxy = FaultProxy(moto.url)
    try:
        proxy.faults.append(Fault("CreateTags", "UnauthorizedOperation", "no tags"))
        proxy.faults.append(Fault("TerminateInstances", "UnauthorizedOperation", "no terminate"))
        with pytest.raises(BackendError) as err:
            backend(proxy.url, hosts, **given).provision("stuck", task_from_args(num_nodes=2, run="true"))
        text = str(err.value)
        live = _live(ec2, "stuck")
        assert len(live) == 2
        assert f"2 instance(s) made ({', '.join(live)}); terminating them failed: " in text
        assert "permission denied (UnauthorizedOperation): no terminate" in text
        assert "nothing of it is left" not in text
    finally:
        proxy.stop()
    assert backend(moto.url, hosts, **given).terminate("stuck").removed


def test_a_replacement_whose_launch_reply_is_lost_leaves_no_instance(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """Replacing a lost worker: the new instance's RunInstances reply is lost. The instance EC2 made is
    found by the launch's client token and terminated, and the error says so; the cluster keeps its
    other instances."""
    ec2 = moto.client()
    proxy = FaultProxy(moto.url)
    try:
        b = backend(proxy.url, hosts)
        h = b.provision("swap", task_from_args(num_nodes=2, run="true"), holder="d/r")
        proxy.faults.append(Fault("RunInstances", "", "", status=0, reach=True))
        with pytest.raises(BackendError) as err:
            b.replace_nodes(h, [1])
        text = str(err.value)
        print("\nreplacement, lost reply:", text)
        assert "1 instance(s) made (i-" in text and "found by the launch's client token" in text
        assert "terminated; nothing of it is left" in text
        assert _live(ec2, "swap") == [h.nodes[0].node_id]  # the lost one ended, the new one too
    finally:
        proxy.stop()
    assert backend(moto.url, hosts).terminate("swap", holder="d/r").removed


# -- a teardown that cannot write the record ----------------------------------------------------------


def test_a_teardown_that_cannot_write_the_record_terminates_nothing_and_says_so(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """Two runs hold the cluster; run a's teardown reads the record (b's lease in it) but cannot write it
    back (the head's records directory made read-only: a full disk, a lock held past its wait). Nothing
    is terminated and the error says so, naming the holders; once the head can write again the leases
    are honoured as usual."""
    ec2 = moto.client()
    b = backend(moto.url, hosts)
    spec = task_from_args(num_nodes=2, run="true")
    h = b.provision("held", spec, holder="d/a")
    b.provision("held", spec, holder="d/b")
    head = b.runner(h.nodes[0])
    assert head.run_script("chmod a-w ~/.sky_airflow/.clusters").returncode == 0
    try:
        with pytest.raises(BackendError) as err:
            backend(moto.url, hosts).terminate("held", holder="d/a")
        text = str(err.value)
        print("\nrecord not written:", text)
        assert text.startswith("cluster 'held' kept, nothing terminated: its record on the head was read")
        assert "(held by d/a, d/b) but could not be updated" in text
        assert len(_live(ec2, "held")) == 2
    finally:
        assert head.run_script("chmod u+w ~/.sky_airflow/.clusters").returncode == 0
    assert backend(moto.url, hosts).terminate("held", holder="d/a").kept_for == ("d/b",)
    assert backend(moto.url, hosts).terminate("held", holder="d/b").removed
    assert ours_left(ec2, "held") == {}


def test_the_reaper_spares_a_cluster_a_run_adopts_after_it_looked(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reaper reads no record on an idle cluster's head; right then a run adopts the cluster (writes
    a record with its lease). The reaper ends a cluster only if, under the record's lock, there is still
    no record: this one is kept, with the run's lease."""
    ec2 = moto.client()
    b = backend(moto.url, hosts)
    h = b.provision("adopted", task_from_args(num_nodes=2, run="true"), holder="d/old")
    (path,) = b.idle_down_paths(h, 0)
    assert b.runner(h.nodes[0]).run_script(f"rm {path}").returncode == 0  # gone idle (idle_down)
    real_read, real_update = HeadRecords.read, HeadRecords.update
    looked: list[str] = []

    def read(self: HeadRecords, name: str) -> str | None:
        text = real_read(self, name)
        if name == "adopted" and not looked:
            looked.append(name)  # the reaper's look; a run adopts the cluster right after it
            real_update(self, name, lambda rec: (add_lease({**h.to_dict(), "leases": {}}, "d/new"), None))
        return text

    monkeypatch.setattr(HeadRecords, "read", read)
    assert b.reap(min_age=0) == []
    assert looked == ["adopted"]
    assert len(_live(ec2, "adopted")) == 2
    record = b.records("adopted", h.nodes[0]).load("adopted")
    assert record is not None and list(record["leases"]) == ["d/new"] and not record.get("down")
    monkeypatch.undo()
    assert backend(moto.url, hosts).terminate("adopted", holder="d/new").removed
    assert ours_left(ec2, "adopted") == {}


# -- one name, one identity ---------------------------------------------------------------------------


def test_names_that_differ_only_in_case_are_two_clusters_and_a_teardown_touches_only_its_own(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    """``train`` and ``Train`` are two valid, distinct cluster names. EC2 compares security group names
    without case (played by the proxy: moto compares exactly), so a group named after the cluster alone
    would make the second one wait for the first. Each gets its own group and key pair, found by its
    exact name, and a teardown of one leaves the other whole."""
    ec2 = moto.client()
    proxy = FaultProxy(moto.url)
    try:
        proxy.answer["CreateSecurityGroup"] = case_blind_group_names(moto)
        b = backend(proxy.url, hosts)
        b.busy_wait = 2.0
        spec = task_from_args(num_nodes=2, run="true")
        lower = b.provision("train", spec, holder="d/r")
        upper = b.provision("Train", spec, holder="d/r")
        assert not {n.node_id for n in lower.nodes} & {n.node_id for n in upper.nodes}
        kept = ours_left(ec2, "train")
        assert len(kept["instances"]) == 2
        own = [
            ec2.describe_security_groups(Filters=[{"Name": "tag:sky-airflow:cluster", "Values": [n]}])
            for n in ("train", "Train")
        ]
        names = [g["GroupName"].lower() for o in own for g in o["SecurityGroups"]]
        assert len(names) == len(set(names)) == 2
        assert b.terminate("Train", holder="d/r").removed
        assert ours_left(ec2, "Train") == {}
        assert ours_left(ec2, "train") == kept
        assert backend(proxy.url, hosts).find("train") is not None
        assert b.terminate("train", holder="d/r").removed
        assert ours_left(ec2, "train") == {}
    finally:
        proxy.stop()
