"""Run node scripts over SSH with paramiko, sharing one connection per host across the process.

One job per module:

- :mod:`.errors`: what can go wrong (HostUnreachable, HostKeyMismatch, AuthFailed, ...),
- :mod:`.config`: :class:`SSHNodeConfig`, how to reach one node, and the host-key policies,
- :mod:`.hostkeys`: known_hosts parsing, host patterns, pinned keys, :func:`verify_host_key`,
- :mod:`.keys`: loading the client's private key,
- :mod:`.transport`: one handshake (connect, key exchange, host-key check, login) under the bounds,
- :mod:`.pool`: the process-wide connection pool, its idle sweeper and the runner's thread pool,
- :mod:`.probe`: :func:`wait_for_ssh`, waiting for a node's SSH banner,
- :mod:`.runner`: :class:`SSHRunner`, sessions, stdin/stdout pumping and stopping abandoned calls,
- :mod:`.sftp`: copying files and trees to a node.

Tunables (``IDLE_TTL``, ``KILL_GRACE``, ``MAX_CONCURRENT_HANDSHAKES``, ...) live in, and are read by, the
module that uses them: change them there, not here. No Airflow import: runners sit below the Airflow layer.
"""

from __future__ import annotations

from airflow_provider_sky.runners.ssh.config import HostKeyPolicy, SSHNodeConfig
from airflow_provider_sky.runners.ssh.errors import (
    AuthFailed,
    CallAbandoned,
    CommandTimeout,
    HostKeyError,
    HostKeyMismatch,
    HostUnreachable,
    UnknownHostKey,
)
from airflow_provider_sky.runners.ssh.hostkeys import verify_host_key
from airflow_provider_sky.runners.ssh.pool import PoolInfo, close_all, pool_info
from airflow_provider_sky.runners.ssh.probe import wait_for_ssh
from airflow_provider_sky.runners.ssh.runner import SSHRunner

__all__ = [
    "AuthFailed",
    "CallAbandoned",
    "CommandTimeout",
    "HostKeyError",
    "HostKeyMismatch",
    "HostKeyPolicy",
    "HostUnreachable",
    "PoolInfo",
    "SSHNodeConfig",
    "SSHRunner",
    "UnknownHostKey",
    "close_all",
    "pool_info",
    "verify_host_key",
    "wait_for_ssh",
]
