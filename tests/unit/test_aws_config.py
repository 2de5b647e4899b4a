"""The ``sky_aws`` connection as a matrix (fields × extras × a linked ``aws`` connection → settings), and the
instance-type catalog: milliseconds, no server."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from airflow.sdk import Connection

from airflow_provider_sky.backends import BackendError
from airflow_provider_sky.backends.aws.catalog import NoInstanceType, choose
from airflow_provider_sky.backends.aws.config import merge_aws_connection, parse_aws_config
from airflow_provider_sky.backends.registry import ConnectionConfigError, by_conn_type
from airflow_provider_sky.hooks.sky import connection_config
from airflow_provider_sky.spec import task_from_args

KEY = "-----BEGIN OPENSSH PRIVATE KEY-----\nabc\n-----END OPENSSH PRIVATE KEY-----"


def settings(extra: dict[str, Any] | None = None, **fields: Any) -> Any:
    extra = {"private_key": KEY, **(extra or {})}
    c = Connection(conn_id="c", conn_type="sky_aws", extra=json.dumps(extra), **fields)
    return parse_aws_config(connection_config(by_conn_type("sky_aws", "c"), c, "c"))


def aws_conn(extra: dict[str, Any] | None = None, **fields: Any) -> Connection:
    return Connection(conn_id="aws_default", conn_type="aws", extra=json.dumps(extra or {}), **fields)


def test_credentials_come_from_login_password_or_the_amazon_extras() -> None:
    s = settings(login="AKIA1", password="s3cret", extra={"region_name": "eu-west-1"})
    assert (s.access_key_id, s.secret_access_key, s.region) == ("AKIA1", "s3cret", "eu-west-1")
    s = settings(extra={"aws_access_key_id": "AKIA2", "aws_secret_access_key": "x", "aws_session_token": "t"})
    assert (s.access_key_id, s.secret_access_key, s.session_token) == ("AKIA2", "x", "t")
    none = settings()
    assert (none.access_key_id, none.secret_access_key) == (None, None)  # boto3's default chain
    assert "s3cret" not in repr(settings(login="AKIA1", password="s3cret")) and KEY not in repr(s)


@pytest.mark.parametrize(
    ("fields", "extra", "message"),
    [
        ({"login": "AKIA1"}, {}, "password: the connection gives the access key id"),
        ({"password": "x"}, {}, "login: the connection gives the secret"),
        (
            {"login": "A"},
            {"aws_access_key_id": "B", "aws_secret_access_key": "x"},
            "login and aws_access_key_id",
        ),
        ({}, {"private_key": None}, "private_key: the connection has no SSH private key"),
        ({}, {"key_file": "/k"}, "private_key and key_file: both are given"),
        ({}, {"security_group_ids": "sg-1, default"}, "security_group_ids: 'default' is not an id"),
        ({}, {"subnet_id": "10.0.0.0/24"}, "subnet_id: '10.0.0.0/24' is not a subnet id"),
        ({}, {"ssh_cidr": "everyone"}, "ssh_cidr: 'everyone' is not a CIDR block"),
        ({}, {"host_key_policy": "verify"}, "host_key_policy: 'verify' is not one of pin"),
        ({}, {"use_private_ips": "maybe"}, "use_private_ips: 'maybe' is not true or false"),
        ({}, {"provision_timeout": "soon"}, "provision_timeout: 'soon' is not a number"),
    ],
)
def test_a_wrong_setting_is_an_error_naming_it(
    fields: dict[str, Any], extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(BackendError, match=message):
        settings(extra, **fields)


def test_an_unknown_extra_gets_did_you_mean() -> None:
    with pytest.raises(ConnectionConfigError, match="unknown extra 'region'; did you mean 'region_name'"):
        settings({"region": "us-east-1"})


def test_defaults() -> None:
    s = settings()
    assert (s.ssh_user, s.ssh_port, s.use_private_ips, s.owner, s.host_key_policy, s.ssh_cidr) == (
        "ubuntu",
        22,
        False,
        "airflow-provider-sky",
        "pin",
        "0.0.0.0/0",
    )
    assert settings({"security_group_ids": "sg-1,sg-2", "use_private_ips": "true"}).security_group_ids == (
        "sg-1",
        "sg-2",
    )


def test_a_linked_aws_connection_gives_credentials_whole_region_and_endpoint() -> None:
    theirs = aws_conn(
        {"region_name": "us-west-2", "endpoint_url": "http://vpce", "aws_session_token": "tok"},
        login="THEIRS",
        password="theirs-secret",
    )
    s = parse_aws_config(merge_aws_connection({"aws_conn_id": "aws_default", "private_key": KEY}, theirs))
    assert (s.access_key_id, s.secret_access_key, s.session_token) == ("THEIRS", "theirs-secret", "tok")
    assert (s.region, s.endpoint_url) == ("us-west-2", "http://vpce")
    # ours win, and our key id is never paired with their secret
    ours = {
        "aws_conn_id": "aws_default",
        "private_key": KEY,
        "login": "OURS",
        "password": "ours",
        "region_name": "eu-central-1",
    }
    s = parse_aws_config(merge_aws_connection(ours, theirs))
    assert (s.access_key_id, s.secret_access_key, s.session_token, s.region) == (
        "OURS",
        "ours",
        None,
        "eu-central-1",
    )
    with pytest.raises(BackendError, match="password: the connection gives the access key id"):
        parse_aws_config(merge_aws_connection({"private_key": KEY, "login": "OURS"}, theirs))
    # their older host field as the endpoint, their extras as the credentials
    old = aws_conn({"aws_access_key_id": "K", "aws_secret_access_key": "S"}, host="http://old-endpoint")
    s = parse_aws_config(merge_aws_connection({"private_key": KEY}, old))
    assert (s.access_key_id, s.secret_access_key, s.endpoint_url) == ("K", "S", "http://old-endpoint")


@pytest.mark.parametrize(
    ("resources", "instance_type"),
    [
        ({}, "m6i.xlarge"),  # SkyPilot's default: 4+ vCPUs, 16+ GiB
        ({"cpus": "4+"}, "c6i.xlarge"),
        ({"cpus": 8}, "c6i.2xlarge"),
        ({"memory": "64+"}, "r6i.2xlarge"),
        ({"cpus": "2", "memory": "8"}, "t3.large"),
        ({"accelerators": "A100:8"}, "p4d.24xlarge"),
        ({"accelerators": "a100-80gb:8"}, "p4de.24xlarge"),
        ({"accelerators": "H100:8"}, "p5.48xlarge"),
        ({"accelerators": "T4"}, "g4dn.xlarge"),
        ({"accelerators": "V100:4"}, "p3.8xlarge"),
        ({"accelerators": "V100:0.5"}, "p3.2xlarge"),  # a fraction takes a whole GPU
        ({"accelerators": "T4", "cpus": "8+"}, "g4dn.2xlarge"),
        ({"instance_type": "x9.weird"}, "x9.weird"),  # taken on trust
        ({"instance_type": "p4d.24xlarge", "accelerators": "A100:8"}, "p4d.24xlarge"),
    ],
)
def test_the_catalog_picks_the_cheapest_type_that_fits(resources: dict[str, Any], instance_type: str) -> None:
    assert choose(task_from_args(run="true", resources=resources).resources).name == instance_type


def test_nothing_fits_names_the_field_and_the_gpu_types() -> None:
    with pytest.raises(NoInstanceType) as err:
        choose(task_from_args(run="true", resources={"accelerators": "A100:3"}).resources)
    assert err.value.field == "resources.accelerators" and "A100:8" in err.value.message
    with pytest.raises(NoInstanceType, match="resources.cpus: no instance type .* cpus 3"):
        choose(task_from_args(run="true", resources={"cpus": 3}).resources)


def test_with_the_amazon_provider_the_linked_connection_gives_a_session_not_keys() -> None:
    """hooks/aws.py: credentials of the linked aws connection stay in the Amazon provider's session
    factory (role_arn, profile_name, ...); ours, when the sky_aws connection sets any, win whole."""
    from airflow_provider_sky.hooks.aws import merge_aws_connection as merge

    theirs = aws_conn(
        {
            "region_name": "us-west-2",
            "role_arn": "arn:aws:iam::123456789012:role/r",
            "service_config": {"ec2": {"endpoint_url": "http://ec2-vpce"}},
        },
        login="THEIRS",
        password="theirs-secret",
    )
    s = parse_aws_config(merge({"aws_conn_id": "aws_default", "private_key": KEY}, theirs))
    assert s.session_factory is not None and (s.access_key_id, s.secret_access_key) == (None, None)
    assert (s.region, s.endpoint_url) == ("us-west-2", "http://ec2-vpce")
    assert "theirs-secret" not in repr(s)
    ours = {"aws_conn_id": "aws_default", "private_key": KEY, "login": "OURS", "password": "ours"}
    s = parse_aws_config(merge(ours, theirs))
    assert s.session_factory is None and (s.access_key_id, s.region) == ("OURS", "us-west-2")


def test_without_aws_conn_id_aws_default_is_used_when_it_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the Amazon provider's hooks: an empty aws_conn_id means aws_default, and none is no error."""
    from airflow_provider_sky.hooks.sky import SkyAWSHook  # type: ignore[attr-defined]

    monkeypatch.setenv(
        "AIRFLOW_CONN_SKY_NOLINK", json.dumps({"conn_type": "sky_aws", "extra": {"private_key": KEY}})
    )
    monkeypatch.delenv("AIRFLOW_CONN_AWS_DEFAULT", raising=False)
    kind, config = SkyAWSHook("sky_nolink").backend_config()
    assert kind == "aws" and "region_name" not in config and "session_factory" not in config
    aws = {"conn_type": "aws", "login": "K", "password": "S", "extra": {"region_name": "ap-south-1"}}
    monkeypatch.setenv("AIRFLOW_CONN_AWS_DEFAULT", json.dumps(aws))
    kind, config = SkyAWSHook("sky_nolink").backend_config()
    s = parse_aws_config(config)
    assert s.region == "ap-south-1" and s.session_factory is not None
    # a named aws connection that does not exist is an error, as before
    sky = {"conn_type": "sky_aws", "extra": {"private_key": KEY, "aws_conn_id": "aws_missing"}}
    monkeypatch.setenv("AIRFLOW_CONN_SKY_NOLINK", json.dumps(sky))
    with pytest.raises(Exception, match="aws_missing"):
        SkyAWSHook("sky_nolink").backend_config()


def test_backends_of_one_connection_share_one_client_and_other_keys_get_their_own() -> None:
    """A backend is made per task, trigger and poll; its client is built once per process and keys
    (EC2's service model alone is 0.2-0.35 s of CPU), never shared across keys, regions or endpoints,
    and a session from the Amazon provider (it may assume a role) is asked for a client every time."""
    from airflow_provider_sky.backends.aws import AWSBackend

    fields = {"region_name": "eu-west-1", "endpoint_url": "http://127.0.0.1:9"}
    extra = {**fields, "aws_access_key_id": "K", "aws_secret_access_key": "S"}
    first, second = (AWSBackend(settings(extra)) for _ in range(2))
    assert first.ec2 is second.ec2
    assert first.ec2.meta.region_name == "eu-west-1" and first.ec2.meta.endpoint_url == "http://127.0.0.1:9"
    for other in (
        {"aws_secret_access_key": "S2"},
        {"aws_session_token": "T"},
        {"region_name": "eu-west-2"},
        {"endpoint_url": "http://127.0.0.1:10"},
    ):
        assert AWSBackend(settings({**extra, **other})).ec2 is not first.ec2, other
    made: list[str | None] = []

    def session_factory(region: str | None) -> Any:
        import boto3

        made.append(region)
        return boto3.session.Session(aws_access_key_id="K", aws_secret_access_key="S")

    linked = dataclasses.replace(settings(extra), session_factory=session_factory)
    assert AWSBackend(linked).ec2 is not AWSBackend(linked).ec2 and made == ["eu-west-1"] * 2
