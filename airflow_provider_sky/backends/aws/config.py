"""A ``sky_aws`` connection read into settings: one plain function, no boto3, tested as a matrix.

Credentials follow the Amazon provider's ``aws`` connection: login / password are the access key id and
secret (or the extras ``aws_access_key_id`` / ``aws_secret_access_key``), ``aws_session_token``,
``region_name`` and ``endpoint_url`` are extras. None given: boto3's default chain (environment, instance
profile). Secrets stay in memory and out of ``repr``; nothing is written to disk.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.ssh.config import name_value, number, one_of

DEFAULT_OWNER = "airflow-provider-sky"
DEFAULT_USER = "ubuntu"
DEFAULT_PROVISION_TIMEOUT = 600.0
HOST_KEY_POLICIES = ("pin", "skip")
#: what a node runs to power itself off when the cluster goes down idle (Ubuntu's and Amazon Linux's
#: default user may sudo without a password); the instance is launched to terminate on shutdown
DEFAULT_POWEROFF = "sudo -n shutdown -h now"
#: the fields that carry credentials (taken whole from one connection)
CREDENTIAL_FIELDS = ("login", "password", "aws_access_key_id", "aws_secret_access_key", "aws_session_token")


@dataclass(frozen=True)
class AWSSettings:
    """What an AWS backend is built from."""

    region: str | None = None
    endpoint_url: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)
    zone: str | None = None
    subnet_id: str | None = None
    security_group_ids: tuple[str, ...] = ()
    ssh_cidr: str = "0.0.0.0/0"
    key_name: str | None = None
    private_key: str | None = field(default=None, repr=False)
    key_file: str | None = None
    passphrase: str | None = field(default=None, repr=False)
    ssh_user: str = DEFAULT_USER
    ssh_port: int = 22
    image_id: str | None = None
    use_private_ips: bool = False
    owner: str = DEFAULT_OWNER
    provision_timeout: float = DEFAULT_PROVISION_TIMEOUT
    host_key_policy: str = "pin"
    #: run by a node at idle_down to power itself off ('': nodes never power off; reap() ends them)
    poweroff_command: str = DEFAULT_POWEROFF
    #: a node agent per instance (``backends/nodeagents.py``) when the cluster has its own security group
    node_agent: bool = True
    #: ``(region) -> boto3 session``: the linked aws connection's session as the Amazon provider makes it
    #: (``hooks/aws.py``: role_arn, profile_name, ...); None: the keys above, else boto3's default chain
    session_factory: Callable[[str | None], Any] | None = field(default=None, repr=False, compare=False)


def _flag(config: Mapping[str, Any], key: str) -> bool:
    value = config.get(key)
    if isinstance(value, str):
        low = value.strip().lower()
        if low not in ("1", "true", "yes", "on", "0", "false", "no", "off", ""):
            raise BackendError(f"{key}: {value!r} is not true or false")
        return low in ("1", "true", "yes", "on")
    return bool(value)


def _ids(raw: Any, key: str, prefix: str) -> tuple[str, ...]:
    items = raw.split(",") if isinstance(raw, str) else list(raw or ())
    out = tuple(str(i).strip() for i in items if str(i).strip())
    for item in out:
        name_value(item, key)
        if not item.startswith(prefix):
            raise BackendError(f"{key}: {item!r} is not an id ({prefix}...); give ids, comma-separated")
    return out


def _poweroff(value: Any) -> str:
    text = str(value or DEFAULT_POWEROFF).strip()
    if "\n" in text or "\x00" in text:
        raise BackendError("poweroff_command: one line, e.g. 'sudo -n shutdown -h now' (or 'none')")
    return "" if text.lower() == "none" else text


def parse_aws_config(config: Mapping[str, Any]) -> AWSSettings:
    """Settings from a ``sky_aws`` connection (a linked ``aws`` connection already merged in)."""
    key_id = one_of(config, "login", "aws_access_key_id", what="access key id")
    secret = one_of(config, "password", "aws_secret_access_key", what="secret access key")
    if bool(key_id) != bool(secret):
        given, missing = ("login", "password") if key_id else ("password", "login")
        raise BackendError(
            f"{missing}: the connection gives the {'access key id' if key_id else 'secret'} ({given}) "
            f"but not the {'secret access key' if key_id else 'access key id'}; give both, or neither "
            "(boto3's default chain: environment, instance profile)"
        )
    private_key = config.get("private_key") or None
    key_file = config.get("key_file") or None
    if private_key and key_file:
        raise BackendError("private_key and key_file: both are given; keep one")
    if not private_key and not key_file:
        raise BackendError(
            "private_key: the connection has no SSH private key (private_key text or key_file); the "
            "instances are reached over SSH with it (its public half is imported as the cluster's key "
            "pair unless key_name names one)"
        )
    policy = str(config.get("host_key_policy") or "pin")
    if policy not in HOST_KEY_POLICIES:
        raise BackendError(f"host_key_policy: {policy!r} is not one of pin (default), skip")
    cidr = str(config.get("ssh_cidr") or "0.0.0.0/0")
    try:
        ipaddress.ip_network(cidr)
    except ValueError:
        raise BackendError(f"ssh_cidr: {cidr!r} is not a CIDR block (e.g. 203.0.113.0/24)") from None
    owner = name_value(config.get("owner"), "owner") or DEFAULT_OWNER
    if len(owner) > 256:
        raise BackendError("owner: at most 256 characters (an EC2 tag value)")
    subnet = name_value(config.get("subnet_id"), "subnet_id")
    if subnet and not str(subnet).startswith("subnet-"):
        raise BackendError(f"subnet_id: {subnet!r} is not a subnet id (subnet-...)")
    return AWSSettings(
        region=name_value(config.get("region_name"), "region_name"),
        endpoint_url=name_value(config.get("endpoint_url"), "endpoint_url"),
        access_key_id=key_id or None,
        secret_access_key=secret or None,
        session_token=config.get("aws_session_token") or None,
        zone=name_value(config.get("zone"), "zone"),
        subnet_id=subnet,
        security_group_ids=_ids(config.get("security_group_ids"), "security_group_ids", "sg-"),
        ssh_cidr=cidr,
        key_name=name_value(config.get("key_name"), "key_name"),
        private_key=private_key,
        key_file=key_file,
        passphrase=config.get("private_key_passphrase") or None,
        ssh_user=name_value(config.get("ssh_user"), "ssh_user") or DEFAULT_USER,
        ssh_port=number(config, "ssh_port", 22, int),
        image_id=name_value(config.get("image_id"), "image_id"),
        use_private_ips=_flag(config, "use_private_ips"),
        owner=owner,
        provision_timeout=number(config, "provision_timeout", DEFAULT_PROVISION_TIMEOUT, float),
        host_key_policy=policy,
        poweroff_command=_poweroff(config.get("poweroff_command")),
        node_agent=config.get("node_agent") in (None, "") or _flag(config, "node_agent"),
        session_factory=config.get("session_factory"),
    )


def merge_aws_connection(config: Mapping[str, Any], aws_conn: Any) -> dict[str, Any]:
    """Fill what a ``sky_aws`` connection leaves empty from a standard ``aws`` connection, read as the
    Amazon provider reads it: login / password (or the extras ``aws_access_key_id`` /
    ``aws_secret_access_key``), ``aws_session_token``, ``region_name``, ``endpoint_url`` (also its older
    ``host`` field). The credentials are taken whole from one of the two connections, never a key id from
    one and a secret from the other."""
    extra = dict(aws_conn.extra_dejson)
    theirs: dict[str, Any] = {
        "region_name": extra.get("region_name"),
        "endpoint_url": extra.get("endpoint_url") or getattr(aws_conn, "host", None),
    }
    if not any(config.get(k) not in (None, "") for k in CREDENTIAL_FIELDS):
        theirs.update(
            login=aws_conn.login or extra.get("aws_access_key_id"),
            password=aws_conn.password or extra.get("aws_secret_access_key"),
            aws_session_token=extra.get("aws_session_token"),
        )
    merged = {k: v for k, v in theirs.items() if v not in (None, "")}
    merged.update({k: v for k, v in config.items() if v not in (None, "")})
    return merged
