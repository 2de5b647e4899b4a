"""A ``sky_aws`` connection's linked ``aws`` connection, resolved by the Amazon provider when it is installed.

Why here and not in the backend: backends never import Airflow. With ``apache-airflow-providers-amazon``
installed, the linked connection is read by its ``AwsConnectionWrapper`` and the boto3 session is made by
its session factory (``AwsBaseHook``'s: ``role_arn`` and ``assume_role_method``/``assume_role_kwargs``,
``profile_name``, web identity, ``service_config``, ``[aws] session_factory``), so credentials behave as
for every other AWS task of the deployment. The backend only receives a function that makes that session,
called when it first needs EC2; no credential is copied into the settings, logged or written anywhere.
Without the Amazon provider, the same connection fields are read by
:func:`airflow_provider_sky.backends.aws.config.merge_aws_connection` (keys, token, region, endpoint).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from airflow_provider_sky.backends.aws.config import CREDENTIAL_FIELDS
from airflow_provider_sky.backends.aws.config import merge_aws_connection as merge_fields


def _session(wrapper: Any, region: str | None) -> Any:
    """A boto3 session from the Amazon provider's session factory (assumes the role, if any)."""
    from airflow.providers.amazon.aws.hooks.base_aws import SessionFactory

    return SessionFactory(conn=wrapper, region_name=region, config=wrapper.botocore_config).create_session()


def merge_aws_connection(config: Mapping[str, Any], aws_conn: Any) -> dict[str, Any]:
    """``config`` (a ``sky_aws`` connection's) completed from the linked ``aws`` connection.

    Credentials set on the ``sky_aws`` connection itself win, whole; otherwise they are the ``aws``
    connection's as the Amazon provider resolves them (a ``session_factory`` the backend calls). Region
    and endpoint: ours, else the ``aws`` connection's (its ``service_config`` for ``ec2`` first).
    """
    merged = merge_fields(config, aws_conn)
    try:
        from airflow.providers.amazon.aws.utils.connection_wrapper import AwsConnectionWrapper
    except ImportError:  # the Amazon provider is not installed: the fields alone
        return merged
    wrapper = AwsConnectionWrapper(conn=aws_conn)
    if not config.get("region_name") and wrapper.region_name:
        merged["region_name"] = wrapper.region_name
    endpoint = wrapper.get_service_endpoint_url("ec2")
    if not config.get("endpoint_url") and endpoint:
        merged["endpoint_url"] = endpoint
    if not any(config.get(k) not in (None, "") for k in CREDENTIAL_FIELDS):
        for key in CREDENTIAL_FIELDS:
            merged.pop(key, None)  # the session carries them (or a role's, refreshed as they expire)
        merged["session_factory"] = functools.partial(_session, wrapper)
    return merged


def for_another_process(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as plain data, for the job task's launch-side watcher (a process of its own, which gets
    its config on stdin, never on a command line or in a file): a ``session_factory`` becomes the
    credentials of the session it makes now. A role's credentials last an hour or more; the watcher
    calls EC2 only to name why a node was lost or to replace one, and otherwise talks SSH."""
    factory = config.get("session_factory")
    if not callable(factory):
        return dict(config)
    plain = {k: v for k, v in config.items() if k != "session_factory"}
    credentials = factory(config.get("region_name")).get_credentials()
    if credentials is None:  # boto3 found none (the backend's own calls would fail the same way)
        return plain
    frozen = credentials.get_frozen_credentials()
    plain.update(login=frozen.access_key, password=frozen.secret_key)
    if frozen.token:
        plain["aws_session_token"] = frozen.token
    return plain


def s3_access(aws_conn: Any | None) -> Any:
    """S3 for bucket ``file_mounts`` (``airflow_provider_sky.backends.storage.S3Access``): the ``aws`` connection's
    credentials, region and endpoint as :func:`merge_aws_connection` reads them (the Amazon provider's
    session factory when it is installed); without a connection, boto3's own chain (``AWS_*`` variables,
    ``~/.aws``, an instance role)."""
    import boto3
    from botocore.config import Config

    from airflow_provider_sky.backends.storage import S3Access

    merged = merge_aws_connection({}, aws_conn) if aws_conn is not None else {}
    region = merged.get("region_name")
    endpoint = merged.get("endpoint_url")
    factory = merged.get("session_factory")
    if callable(factory):
        session = factory(region)
    else:
        session = boto3.Session(
            aws_access_key_id=merged.get("login") or None,
            aws_secret_access_key=merged.get("password") or None,
            aws_session_token=merged.get("aws_session_token") or None,
            region_name=region,
        )
    region = region or session.region_name or "us-east-1"

    def client() -> Any:
        return session.client(
            "s3", region_name=region, endpoint_url=endpoint, config=Config(signature_version="s3v4")
        )

    def credentials() -> tuple[str, str, str | None]:
        found = session.get_credentials()
        if found is None:
            raise RuntimeError("no AWS credentials found for the bucket mount")
        frozen = found.get_frozen_credentials()
        return frozen.access_key, frozen.secret_key, frozen.token

    return S3Access(client=client, credentials=credentials, region=region, endpoint_url=endpoint)
