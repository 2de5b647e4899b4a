"""A new user's first steps on Kubernetes: ``docs/kubernetes-rbac.yaml`` applied to the real
test cluster makes everything the connection needs, ``python -m airflow_provider_sky.backends.kubernetes.account`` names
what is missing until it is all there, then writes the service account's kubeconfig, and a gang runs with
that kubeconfig."""

from __future__ import annotations

import copy
import secrets
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_cluster import Image, K8sCluster

from airflow_provider_sky.backends.kubernetes import account as kube_account
from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from integration.test_k8s_backend import _wait
from unit.test_k8s_first_steps import MANIFEST


def _documents(namespace: str) -> list[dict[str, Any]]:
    """The manifest's objects, in its order, with its namespace renamed (a test namespace of our own)."""
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    out = []
    for doc in copy.deepcopy(docs):
        meta = doc["metadata"]
        if doc["kind"] == "Namespace":
            meta["name"] = namespace
        else:
            meta["namespace"] = namespace
        for subject in doc.get("subjects", []):
            subject["namespace"] = namespace
        out.append(doc)
    return out


@pytest.fixture
def namespace(k8s: K8sCluster) -> Iterator[str]:
    name = f"sky-first-{secrets.token_hex(3)}"
    yield name
    api = k8s.api()
    try:
        api.delete_namespace(name, grace_period_seconds=0)
    except Exception:  # never created (a test that stopped early)
        pass
    finally:
        api.api_client.close()


def _apply(k8s: K8sCluster, docs: list[dict[str, Any]]) -> None:
    from kubernetes import utils

    api = k8s.api()
    try:
        for doc in docs:
            utils.create_from_dict(api.api_client, doc)
    finally:
        api.api_client.close()


def _command(
    k8s: K8sCluster, namespace: str, out: Path, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str]:
    argv = ["--namespace", namespace, "--output", str(out), "--kubeconfig", k8s.kubeconfig]
    if k8s.context:
        argv += ["--context", k8s.context]
    code = kube_account.main(argv)
    said = capsys.readouterr()
    return code, said.out + said.err


def test_the_manifest_and_the_command_give_a_kubeconfig_a_gang_runs_with(
    k8s: K8sCluster, k8s_image: Image, namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "sky-airflow.kubeconfig"
    docs = _documents(namespace)
    kinds = [d["kind"] for d in docs]
    assert kinds == ["Namespace", "ServiceAccount", "Secret", "Role", "RoleBinding"]

    code, said = _command(k8s, namespace, out, capsys)
    assert code == 1 and f"missing: namespace {namespace}" in said and "kubectl apply -f" in said, said
    assert not out.exists()

    _apply(k8s, docs[:4])  # everything but the binding
    code, said = _command(k8s, namespace, out, capsys)
    assert code == 1 and f"a RoleBinding of service account sky-airflow in namespace {namespace}" in said, (
        said
    )
    assert "service account" not in said.split("RoleBinding")[0], said  # the rest is there

    _apply(k8s, docs[4:])
    code, said = _command(k8s, namespace, out, capsys)
    assert code == 0 and "pods and exec allowed" in said, said
    assert "--conn-type skykubernetes" in said
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    token = yaml.safe_load(out.read_text())["users"][0]["user"]["token"]
    assert token and token not in said  # the token is in the file only

    b = KubernetesBackend.from_config(
        {
            "kube_config_path": str(out),
            "namespace": namespace,
            "image": k8s_image.name,
            "image_pull_policy": k8s_image.pull_policy,
            "provision_timeout": 120,
        }
    )
    try:
        spec = task_from_args(num_nodes=2, run='echo "rank $SKYPILOT_NODE_RANK"')
        c = GangClient(b, b.provision("first", spec))
        c.launch(spec, "job")
        assert [r.state for r in _wait(c, "job").status.ranks] == ["succeeded"] * 2
        assert b.terminate("first").removed
    finally:
        b.close()
