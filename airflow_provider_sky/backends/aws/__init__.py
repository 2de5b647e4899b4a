"""Gangs on AWS EC2: a tagged set of instances made with boto3, reached over SSH (see ``backend.py``).
Registered here; the backend (and boto3) is imported on first use, so the provider's metadata loads
without the ``aws`` extra."""

from __future__ import annotations

from typing import Any

from airflow_provider_sky.backends.registry import BackendInfo

_STR = {"type": ["string", "null"]}
_SECRET = {"type": ["string", "null"], "format": "password"}

BACKEND = BackendInfo(
    kind="aws",
    conn_type="skyaws",
    former_conn_types=("sky_aws",),
    hook_name="Sky AWS EC2 cluster",
    hook_class_name="SkyAWSHook",
    factory="airflow_provider_sky.backends.aws.backend:AWSBackend",
    default_conn_id="sky_aws_default",
    standard_fields=("login", "password"),
    relabeling={"login": "AWS access key id", "password": "AWS secret access key"},
    placeholders={"login": "empty: the aws connection's, else boto3's default chain"},
    conn_fields={
        "aws_conn_id": {
            "label": "Reuse an aws connection",
            "description": "Take credentials, region and endpoint URL from this standard aws connection "
            "(empty: aws_default, if it exists)",
            "schema": _STR,
        },
        "region_name": {"label": "Region", "description": "e.g. us-east-1", "schema": _STR},
        "endpoint_url": {
            "label": "EC2 endpoint URL",
            "description": "Only to point at another endpoint (a VPC endpoint, a test server)",
            "schema": _STR,
        },
        "zone": {"label": "Availability zone", "schema": _STR},
        "subnet_id": {"label": "Subnet", "description": "Default: the default VPC's subnets", "schema": _STR},
        "security_group_ids": {
            "label": "Security groups",
            "description": "Comma-separated ids; empty: one is made for the cluster and removed with it",
            "schema": _STR,
        },
        "ssh_cidr": {
            "label": "SSH allowed from (CIDR)",
            "description": "Who may reach port 22 of a security group made for the cluster",
            "schema": {"type": ["string", "null"], "default": "0.0.0.0/0"},
        },
        "key_name": {
            "label": "Key pair name",
            "description": "An existing key pair holding the private key's public half; empty: one is "
            "imported for the cluster from the private key and removed with it",
            "schema": _STR,
        },
        "private_key": {"label": "SSH private key (text)", "schema": _SECRET},
        "key_file": {"label": "SSH private key file", "description": "Path on the workers", "schema": _STR},
        "private_key_passphrase": {"label": "Key passphrase", "schema": _SECRET},
        "ssh_user": {"label": "SSH user", "schema": {"type": ["string", "null"], "default": "ubuntu"}},
        "image_id": {
            "label": "Image (AMI)",
            "description": "Unless the task gives image_id; default: the newest Ubuntu 22.04 Canonical publishes in the region",
            "schema": _STR,
        },
        "use_private_ips": {
            "label": "Connect to private IPs",
            "description": "Airflow reaches the nodes inside the VPC (no public IPs are used)",
            "schema": {"type": ["boolean", "null"], "default": False},
        },
        "owner": {
            "label": "Owner tag",
            "description": "Tags every resource; clusters are found and removed by it",
            "schema": {"type": ["string", "null"], "default": "airflow-provider-sky"},
        },
        "provision_timeout": {
            "label": "Provision timeout (s)",
            "description": "For every instance to run and answer SSH",
            "schema": {"type": ["number", "null"], "default": 600},
        },
        "poweroff_command": {
            "label": "Power-off command (idle_down)",
            "description": "What a node runs, as the SSH user, to power itself off when the cluster goes "
            "down idle; the instance is launched to terminate on shutdown. none: never (reap() ends them)",
            "schema": {"type": ["string", "null"], "default": "sudo -n shutdown -h now"},
        },
        "node_agent": {
            "label": "Node agents",
            "description": "Start a node agent on each instance when it has python3 (in the cluster's own "
            "security group): the gang's fail-fast and status then live on its head instance (off: every "
            "instance is polled and cancelled over SSH)",
            "schema": {"type": ["boolean", "null"], "default": True},
        },
        "host_key_policy": {
            "label": "Host key policy",
            "description": "pin (the key first seen at provision is pinned for the instance's life) or skip",
            "schema": {"type": "string", "enum": ["pin", "skip"], "default": "pin"},
        },
    },
    extra_aliases=("aws_session_token", "aws_access_key_id", "aws_secret_access_key", "ssh_port"),
    # the Amazon provider's credential resolution when installed (role_arn, profile_name, ...), else the
    # same fields read by backends.aws.config.merge_aws_connection
    linked_conn=("aws_conn_id", "airflow_provider_sky.hooks.aws:merge_aws_connection"),
    # as the Amazon provider's hooks: aws_default when aws_conn_id is empty (if it exists)
    linked_default="aws_default",
)


def __getattr__(name: str) -> Any:
    """``from airflow_provider_sky.backends.aws import AWSBackend`` without importing boto3 up front."""
    if name == "AWSBackend":
        from airflow_provider_sky.backends.aws import backend

        return backend.AWSBackend
    raise AttributeError(name)
