"""airflow-provider-sky: run multi-node gangs (SkyPilot-style) from Airflow, failing fast."""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_STR = {"type": ["string", "null"]}
#: the ``sky_ssh`` connection's own fields (stored in extra); host/login/port/password are the standard ones
SSH_CONN_FIELDS: dict[str, Any] = {
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
    "ssh_conn_id": {
        "label": "Reuse an ssh connection",
        "description": "Take hosts, user and key from this standard ssh connection",
        "schema": _STR,
    },
}


def get_provider_info() -> dict[str, Any]:
    """What ``airflow providers list`` and the connection UI read (entry point ``apache_airflow_provider``)."""
    return {
        "package-name": "airflow-provider-sky",
        "name": "Sky (multi-node gangs)",
        "description": "Run multi-node jobs (gangs) that fail fast: local, SSH, Kubernetes and AWS backends.",
        "versions": [__version__],
        "operators": [
            {
                "integration-name": "Sky",
                "python-modules": [
                    "airflow_provider_sky.operators.cluster",
                    "airflow_provider_sky.operators.job",
                    "airflow_provider_sky.operators.rank",
                    "airflow_provider_sky.operators.down",
                ],
            }
        ],
        "sensors": [{"integration-name": "Sky", "python-modules": ["airflow_provider_sky.sensors.gang"]}],
        "triggers": [{"integration-name": "Sky", "python-modules": ["airflow_provider_sky.triggers.gang"]}],
        "hooks": [{"integration-name": "Sky", "python-modules": ["airflow_provider_sky.hooks.sky"]}],
        "integrations": [
            {"integration-name": "Sky", "external-doc-url": "https://docs.skypilot.co/", "tags": ["software"]}
        ],
        "connection-types": [
            {
                "hook-class-name": "airflow_provider_sky.hooks.sky.SkyHook",
                "connection-type": "sky_local",
                "hook-name": "Sky local cluster",
                "ui-field-behaviour": {
                    "hidden-fields": ["host", "schema", "login", "password", "port"],
                    "relabeling": {},
                    "placeholders": {},
                },
                "conn-fields": {
                    "state_dir": {
                        "label": "State directory",
                        "description": "Where local nodes live (default $AIRFLOW_HOME/sky)",
                        "schema": {"type": ["string", "null"]},
                    }
                },
            },
            {
                "hook-class-name": "airflow_provider_sky.hooks.sky.SkySSHHook",
                "connection-type": "sky_ssh",
                "hook-name": "Sky SSH cluster",
                "ui-field-behaviour": {
                    "hidden-fields": ["schema"],
                    "relabeling": {
                        "host": "Hosts (head first, comma-separated)",
                        "login": "User",
                        "password": "Private key (text)",
                    },
                    "placeholders": {"host": "10.0.0.1, 10.0.0.2:2222, gpu-3", "port": "22"},
                },
                "conn-fields": SSH_CONN_FIELDS,
            },
        ],
    }
