"""The embedded default backend: N nodes on this machine (see ``backend.py``). Registered here."""

from __future__ import annotations

from airflow_provider_sky.backends.local.backend import (
    LOCAL_MAX_NODES,
    TEARDOWN_CHUNK,
    LocalBackend,
    default_state_dir,
    node_ip,
)
from airflow_provider_sky.backends.registry import BackendInfo

__all__ = ["BACKEND", "LOCAL_MAX_NODES", "TEARDOWN_CHUNK", "LocalBackend", "default_state_dir", "node_ip"]

BACKEND = BackendInfo(
    kind="local",
    conn_type="skylocal",
    former_conn_types=("sky_local",),
    hook_name="Sky local cluster",
    hook_class_name="SkyHook",
    factory="airflow_provider_sky.backends.local.backend:LocalBackend",
    default_conn_id="sky_default",
    conn_fields={
        "state_dir": {
            "label": "State directory",
            "description": "Where local nodes live (default $AIRFLOW_HOME/sky)",
            "schema": {"type": ["string", "null"]},
        },
        "accelerators": {
            "label": "GPUs of this machine",
            "description": "e.g. H100:8; empty: found with nvidia-smi / rocm-smi",
            "schema": {"type": ["string", "null"]},
        },
        "node_agent": {
            "label": "Node agents",
            "description": "Start a node agent per local node (off by default: on one machine the rank "
            "wrappers already stop a failed gang's siblings with nothing polling)",
            "schema": {"type": ["boolean", "null"], "default": False},
        },
    },
)
