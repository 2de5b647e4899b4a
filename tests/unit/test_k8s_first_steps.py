"""A new user's first steps on Kubernetes: ``docs/kubernetes-rbac.yaml`` applied to the real
test cluster makes everything the connection needs, ``python -m airflow_provider_sky.backends.kubernetes.account`` names
what is missing until it is all there, then writes the service account's kubeconfig, and a gang runs with
that kubeconfig."""

from __future__ import annotations

from pathlib import Path

import yaml

from airflow_provider_sky.backends.kubernetes.backend import NEEDED_PERMISSIONS, OPTIONAL_PERMISSIONS

MANIFEST = Path(__file__).resolve().parents[2] / "docs" / "kubernetes-rbac.yaml"


def test_the_manifest_grants_exactly_what_the_provider_checks() -> None:
    """Its Role and the permissions the Test button checks (``NEEDED_PERMISSIONS``) are one list."""
    role = next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d["kind"] == "Role")
    granted = set()
    for rule in role["rules"]:
        assert rule["apiGroups"] == [""], rule
        for resource in rule["resources"]:
            name, _, sub = resource.partition("/")
            granted |= {(verb, name, sub or None) for verb in rule["verbs"]}
    assert granted == set(NEEDED_PERMISSIONS) | set(OPTIONAL_PERMISSIONS)
