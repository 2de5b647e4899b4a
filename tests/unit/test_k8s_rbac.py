"""The Role docs/backends/kubernetes.md documents is ``role_rules()`` (from ``NEEDED_PERMISSIONS``, which
the Test button checks), nothing more or less. That this Role runs a gang and is all the code calls is tested
on the cluster, in ``tests/integration/test_k8s_rbac.py``."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from airflow_provider_sky.backends.kubernetes.backend import role_rules

K8S_DOCS = Path(__file__).resolve().parents[2] / "docs" / "backends" / "kubernetes.md"


def test_the_docs_role_is_the_permissions_the_code_needs() -> None:
    """The docs' Role YAML and its list in words are ``role_rules()``, nothing more or less."""
    text = K8S_DOCS.read_text()
    section = text[text.index("**RBAC**") :]
    block = re.search(r"```yaml\n(.*?)```", section, re.S)
    assert block is not None
    assert yaml.safe_load(block.group(1)) == {"rules": role_rules()}
    words = "; ".join(f"`{r['resources'][0]}`: {', '.join(r['verbs'])}" for r in role_rules())
    assert words in " ".join(section.split()), words
