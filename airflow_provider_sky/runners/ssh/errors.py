"""What can go wrong reaching a node over SSH, as :class:`RunnerError` subclasses callers can tell apart.

Defined in :mod:`airflow_provider_sky.errors` with every other error; these are the same classes.
"""

from __future__ import annotations

from airflow_provider_sky.errors import AuthFailed as AuthFailed
from airflow_provider_sky.errors import CallAbandoned as CallAbandoned
from airflow_provider_sky.errors import CommandTimeout as CommandTimeout
from airflow_provider_sky.errors import HostKeyError as HostKeyError
from airflow_provider_sky.errors import HostKeyMismatch as HostKeyMismatch
from airflow_provider_sky.errors import HostUnreachable as HostUnreachable
from airflow_provider_sky.errors import UnknownHostKey as UnknownHostKey
