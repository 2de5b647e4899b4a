"""Gangs on existing machines over SSH (see ``backend.py``). Registered here; the backend (and paramiko)
is imported on first use, so the provider's metadata loads without the ``ssh`` extra."""

from __future__ import annotations

from typing import Any

from airflow_provider_sky.backends.registry import BackendInfo

_STR = {"type": ["string", "null"]}

BACKEND = BackendInfo(
    kind="ssh",
    conn_type="skyssh",
    former_conn_types=("sky_ssh",),
    hook_name="Sky SSH cluster",
    hook_class_name="SkySSHHook",
    factory="airflow_provider_sky.backends.ssh.backend:SSHBackend",
    default_conn_id="sky_ssh_default",
    standard_fields=("host", "login", "password", "port"),
    relabeling={
        "host": "Hosts (head first, comma-separated)",
        "login": "User",
        "password": "Private key (text)",
    },
    placeholders={"host": "10.0.0.1, 10.0.0.2:2222, gpu-3", "port": "22"},
    conn_fields={
        "head": {"label": "Head host", "description": "Rank 0 (default: the first host)", "schema": _STR},
        "key_file": {"label": "Private key file", "description": "Path on the workers", "schema": _STR},
        "private_key_passphrase": {
            "label": "Key passphrase",
            "schema": {"type": ["string", "null"], "format": "password"},
        },
        "host_key_policy": {
            "label": "Host key policy",
            "description": "verify (known_hosts or pinned keys), accept-new (trust on first use), skip (warns)",
            "schema": {"type": "string", "enum": ["verify", "accept-new", "skip"], "default": "verify"},
        },
        "known_hosts": {"label": "known_hosts file", "schema": _STR},
        "pinned_host_keys": {
            "label": "Pinned host keys",
            "description": "One 'ssh-ed25519 AAAA...' line per key, or JSON {host: key}",
            "schema": {"type": ["string", "null"], "format": "multiline"},
        },
        "connect_timeout": {
            "label": "Connect timeout (s)",
            "schema": {"type": ["number", "null"], "default": 10},
        },
        "ready_timeout": {
            "label": "Readiness timeout (s)",
            "schema": {"type": ["number", "null"], "default": 30},
        },
        "max_parallel": {
            "label": "Most hosts contacted at once",
            "schema": {"type": ["integer", "null"], "default": 32, "minimum": 1},
        },
        "accelerators": {
            "label": "GPUs of the hosts",
            "description": "For hosts without nvidia-smi / rocm-smi: 'H100:8' for every host, or JSON "
            '{"10.0.0.1": "H100:8", "10.0.0.2": "A100:4"}; empty: found on each host at provision',
            "schema": {"type": ["string", "null"], "format": "multiline"},
        },
        "spare_hosts": {
            "label": "Spare hosts",
            "description": "Hosts kept aside, written like Hosts: one takes the rank of a host lost during a "
            "gang with retries",
            "schema": _STR,
        },
        "node_agent": {
            "label": "Node agents",
            "description": "Start a node agent on each host when it has python3: the gang's fail-fast and status "
            "then live on its head host (off: every host is polled and cancelled over SSH)",
            "schema": {"type": ["boolean", "null"], "default": True},
        },
        "ssh_conn_id": {
            "label": "Reuse an ssh connection",
            "description": "Take hosts, user and key from this standard ssh connection",
            "schema": _STR,
        },
    },
    extra_aliases=("hosts", "user", "private_key", "host_keys"),
    linked_conn=("ssh_conn_id", "airflow_provider_sky.backends.ssh.config:merge_ssh_connection"),
)


def __getattr__(name: str) -> Any:
    """``from airflow_provider_sky.backends.ssh import SSHBackend`` without importing paramiko up front."""
    if name in ("SSHBackend", "HostProbe"):
        from airflow_provider_sky.backends.ssh import backend

        return getattr(backend, name)
    raise AttributeError(name)
