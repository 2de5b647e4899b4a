"""Credentials of a ``sky_aws`` connection through a linked ``aws`` connection, resolved by the Amazon
provider's session factory (``hooks/aws.py``): a role assumed through moto's STS, with moto enforcing IAM
so that the caller's own keys could not have made a single EC2 call."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from aws_fixtures import hosts, moto, net  # noqa: F401 (fixtures)
from moto_ec2 import IMAGE, REGION, FakeNetwork, MotoEC2, iter_instances, ours_left
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.spec import task_from_args

pytestmark = needs_sshd

ACCOUNT = "123456789012"  # moto's default account
ALL = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


def _user(iam: Any, name: str, policy: dict[str, Any]) -> tuple[str, str]:
    iam.create_user(UserName=name)
    iam.put_user_policy(UserName=name, PolicyName="p", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=name)["AccessKey"]
    return key["AccessKeyId"], key["SecretAccessKey"]


def _role(iam: Any, name: str, trusted: str, policy: dict[str, Any]) -> str:
    trust = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Principal": {"AWS": trusted}, "Action": "sts:AssumeRole"}],
    }
    arn = iam.create_role(RoleName=name, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
    iam.put_role_policy(RoleName=name, PolicyName="p", PolicyDocument=json.dumps(policy))
    return str(arn)


def test_role_arn_of_the_linked_aws_connection_is_assumed_through_sts(
    moto: MotoEC2,
    hosts: SSHDCluster,
    net: FakeNetwork,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``aws_default`` gives a caller's keys and a ``role_arn``, as the Amazon provider documents; the
    caller may only call sts:AssumeRole, the role may run EC2. The cluster's whole lifecycle works, so
    every EC2 call was the role's; the caller's keys alone are refused; a role that does not trust the
    caller is refused naming the cause. No secret is logged or in an error."""
    from airflow_provider_sky.hooks.sky import SkyAWSHook  # type: ignore[attr-defined]

    caplog.set_level(logging.DEBUG)
    iam = moto.client(service="iam")
    moto.keys = _user(iam, "admin", ALL)
    caller = _user(
        iam,
        "caller",
        {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole", "Resource": "*"}],
        },
    )
    ec2_all = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "ec2:*", "Resource": "*"}],
    }
    role = _role(iam, "sky-runner", f"arn:aws:iam::{ACCOUNT}:user/caller", ec2_all)
    untrusting = _role(iam, "not-yours", f"arn:aws:iam::{ACCOUNT}:user/admin", ec2_all)

    def connections(role_arn: str | None) -> None:
        extra: dict[str, Any] = {"region_name": REGION, "endpoint_url": moto.url}
        if role_arn:
            # the Amazon provider never sends AssumeRole to the global endpoint_url: STS gets its own
            extra.update(role_arn=role_arn, service_config={"sts": {"endpoint_url": moto.url}})
        aws = {"conn_type": "aws", "login": caller[0], "password": caller[1], "extra": extra}
        monkeypatch.setenv("AIRFLOW_CONN_AWS_ROLE", json.dumps(aws))
        sky = {
            "conn_type": "sky_aws",
            "extra": {"aws_conn_id": "aws_role", "private_key": hosts.client_key_text, "image_id": IMAGE},
        }
        monkeypatch.setenv("AIRFLOW_CONN_SKY_ROLE", json.dumps(sky))

    caplog.clear()  # botocore's DEBUG lines of the setup above hold the keys it was sent; not ours
    moto.enforce_iam(True)
    try:
        connections(role)
        hook = SkyAWSHook("sky_role")
        ok, message = hook.test_connection()
        assert ok, message
        spec = task_from_args(num_nodes=2, run="true")
        h = hook.get_backend().provision("role", spec, holder="d/r")
        assert len(h.nodes) == 2 and hook.client(h).backend is hook.get_backend()
        assert SkyAWSHook("sky_role").get_backend().find("role") is not None
        assert SkyAWSHook("sky_role").teardown("role", holder="d/r").removed
        assert ours_left(moto.client(), "role") == {}

        # the same keys without the role: EC2 refuses them (the test above could not pass on them)
        connections(None)
        ok, message = SkyAWSHook("sky_role").test_connection()
        assert not ok and "permission denied" in message, message
        # a role that does not trust the caller: refused at the AssumeRole, naming it
        connections(untrusting)
        ok, message = SkyAWSHook("sky_role").test_connection()
        assert not ok and "getting credentials from the aws connection" in message, message
        assert "permission denied (AccessDenied)" in message, message
    finally:
        moto.enforce_iam(False)
    assert len(list(iter_instances(moto.client()))) == 2
    for text in (caplog.text, message):
        assert caller[1] not in text and hosts.client_key_text not in text
