"""Backends by name, from the registry (``backends/registry.py``): one package per backend, imported
lazily, so a missing optional dependency only matters when that backend is used."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from airflow_provider_sky.backends.base import Backend, BackendError, ClusterHandle, Node, Teardown
from airflow_provider_sky.backends.registry import by_kind, kinds

__all__ = ["Backend", "BackendError", "ClusterHandle", "Node", "Teardown", "kinds", "make_backend"]


def make_backend(kind: str, config: Mapping[str, Any]) -> Backend:
    """Build a backend of ``kind`` from a plain config dict (a connection's fields and extras)."""
    return by_kind(kind).make(config)
