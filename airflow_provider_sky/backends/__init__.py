"""Backends by name. Imported lazily, so a missing optional dependency only matters when used."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_provider_sky.backends.base import Backend, BackendError, ClusterHandle, Node, Teardown

__all__ = ["Backend", "BackendError", "ClusterHandle", "Node", "Teardown", "make_backend", "BACKEND_KINDS"]

BACKEND_KINDS = ("local", "ssh")


def make_backend(kind: str, config: Mapping[str, Any]) -> Backend:
    """Build a backend of ``kind`` from a plain config dict (a connection's fields and extras)."""
    if kind == "local":
        from airflow_provider_sky.backends.local import LocalBackend

        return LocalBackend.from_config(config)
    if kind == "ssh":
        from airflow_provider_sky.backends.ssh import SSHBackend  # type: ignore[import-not-found,unused-ignore]

        return SSHBackend.from_config(config)
    raise BackendError(f"unknown backend {kind!r}: use one of {', '.join(BACKEND_KINDS)}")
