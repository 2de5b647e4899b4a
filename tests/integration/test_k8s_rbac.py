"""The RBAC docs/backends/kubernetes.md documents is exactly what the code calls, and a refusal is said in the API server's
words. The page's Role is ``role_rules()`` (from ``NEEDED_PERMISSIONS``, which the Test button checks);
a service account holding exactly that Role runs a gang (provision, a job, a replaced worker, teardown),
and the calls it makes are exactly those permissions; one without it is refused at create, nothing is
left, and the Test button names what is missing. Both reach the cluster through a kubeconfig given as
content (the ``kube_config`` extra), with a service-account token."""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s_cluster import Image, K8sCluster, wait_for

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.kubernetes.backend import NEEDED_PERMISSIONS, KubernetesBackend, role_rules
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from integration.test_k8s_backend import _wait

#: calls outside the namespace, which every authenticated identity may make (the Test button's)
UNRESTRICTED = {("GET", "/version/"), ("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews")}
_NAMESPACED = re.compile(
    r"^/api/v1/namespaces/\{namespace\}/(?P<resource>[a-z]+)(/\{name\}(/(?P<sub>[a-z]+))?)?$"
)


def _token_kubeconfig(k8s: K8sCluster, account: str) -> dict[str, Any]:
    """A kubeconfig (as content) that authenticates as ``account`` with its token."""
    api = k8s.api()
    try:
        sa = wait_for(
            lambda: (s := api.read_namespaced_service_account(account, k8s.namespace)).secrets and s,
            60,
            f"the token of service account {account}",
        )
        secret = api.read_namespaced_secret(sa.secrets[0].name, k8s.namespace)
        token = base64.b64decode(secret.data["token"]).decode()
    finally:
        api.api_client.close()
    admin = yaml.safe_load(Path(k8s.kubeconfig).read_text())
    ctx = next(c for c in admin["contexts"] if c["name"] == (k8s.context or admin["current-context"]))
    cluster = next(c for c in admin["clusters"] if c["name"] == ctx["context"]["cluster"])["cluster"]
    if "certificate-authority" in cluster:
        ca = Path(cluster.pop("certificate-authority")).read_bytes()
        cluster["certificate-authority-data"] = base64.b64encode(ca).decode()
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "c", "cluster": cluster}],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": "c", "user": account}}],
        "current-context": "sa",
    }


@pytest.fixture(scope="module")
def accounts(k8s: K8sCluster) -> Iterator[dict[str, dict[str, Any]]]:
    """``allowed`` has exactly the docs' Role in the test namespace; ``denied`` has nothing."""
    from kubernetes import client

    api = k8s.api()
    rbac = client.RbacAuthorizationV1Api(api.api_client)
    ns = k8s.namespace
    for name in ("sky-allowed", "sky-denied"):
        api.create_namespaced_service_account(ns, {"metadata": {"name": name}})
    rbac.create_namespaced_role(ns, {"metadata": {"name": "sky-gangs"}, "rules": role_rules()})
    rbac.create_namespaced_role_binding(
        ns,
        {
            "metadata": {"name": "sky-gangs"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "sky-gangs"},
            "subjects": [{"kind": "ServiceAccount", "name": "sky-allowed", "namespace": ns}],
        },
    )
    yield {name: _token_kubeconfig(k8s, f"sky-{name}") for name in ("allowed", "denied")}
    api.api_client.close()  # the namespace (deleted at the session's end) takes the accounts and roles


def _backend(k8s: K8sCluster, image: Image, kubeconfig: dict[str, Any]) -> KubernetesBackend:
    return KubernetesBackend.from_config(
        {
            "kube_config": json.dumps(kubeconfig),
            "namespace": k8s.namespace,
            "image": image.name,
            "image_pull_policy": image.pull_policy,
            "provision_timeout": 120,
        }
    )


def test_a_role_that_may_not_list_nodes_still_has_a_gpu_typo_refused(
    k8s: K8sCluster, k8s_image: Image, accounts: dict[str, dict[str, Any]]
) -> None:
    """Without leave to list nodes their labels cannot be read: a likely typo of a known GPU name is
    still refused before any pod, and a name the catalog does not know (a custom label) is let through."""
    from airflow_provider_sky.backends.base import choose_resources
    from airflow_provider_sky.spec import SpecError

    b = _backend(k8s, k8s_image, accounts["allowed"])
    with pytest.raises(SpecError, match="A1000 is not a GPU name SkyPilot knows; did you mean A100"):
        choose_resources(b, task_from_args(num_nodes=1, run="true", resources={"accelerators": "A1000:8"}))
    custom = task_from_args(num_nodes=1, run="true", resources={"accelerators": "MyCustomGpu:1"})
    assert choose_resources(b, custom).resources.accelerators is not None
    b.close()


def _permissions(calls: list[tuple[str, str, dict[str, Any]]]) -> set[tuple[str, str, str | None]]:
    """The (verb, resource, subresource) RBAC checks for each recorded call. An exec is a websocket
    upgrade of a GET: authorized as get, and as create too on servers that check upgrades so (1.35+)."""
    out: set[tuple[str, str, str | None]] = set()
    for method, path, query in calls:
        m = _NAMESPACED.match(path)
        if m is None:
            assert (method, path) in UNRESTRICTED, (method, path)
            continue
        resource, sub, named = m["resource"], m["sub"], "{name}" in path
        if sub == "exec":
            out |= {("get", resource, sub), ("create", resource, sub)}
            continue
        verb = {"POST": "create", "DELETE": "delete" if named else "deletecollection"}.get(method)
        if method == "GET":
            verb = "get" if named else ("watch" if query.get("watch") else "list")
        out.add((verb or method.lower(), resource, sub))
    return out


@pytest.fixture
def api_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, dict[str, Any]]]:
    """Every request the kubernetes client builds (REST and exec alike), as (method, path, query)."""
    from kubernetes.client import ApiClient

    calls: list[tuple[str, str, dict[str, Any]]] = []
    serialize = ApiClient.param_serialize

    def recording(self: Any, method: str, resource_path: str, *args: Any, **kwargs: Any) -> Any:
        query = kwargs.get("query_params") or (args[1] if len(args) > 1 else None) or []
        calls.append((method, resource_path, dict(query)))
        return serialize(self, method, resource_path, *args, **kwargs)

    monkeypatch.setattr(ApiClient, "param_serialize", recording)
    return calls


def test_exactly_the_documented_role_runs_a_gang_and_is_all_it_calls(
    k8s: K8sCluster,
    k8s_image: Image,
    accounts: dict[str, dict[str, Any]],
    api_calls: list[tuple[str, str, dict[str, Any]]],
) -> None:
    b = _backend(k8s, k8s_image, accounts["allowed"])
    try:
        assert "pods and exec allowed" in b.test_connection()
        spec = task_from_args(num_nodes=2, run='echo "rank $SKYPILOT_NODE_RANK"')
        h = b.provision("rbac", spec)
        c = GangClient(b, h)
        c.launch(spec, "job")
        assert [r.state for r in _wait(c, "job").status.ranks] == ["succeeded"] * 2
        replaced = b.replace_nodes(h, [1])  # as after a lost worker: copied from a pod of the cluster
        assert replaced.nodes[1].extra["pod"] == "rbac-worker2"
        assert b.terminate("rbac").removed
    finally:
        b.terminate("rbac", holder=None)
        b.close()
    assert _permissions(api_calls) == set(NEEDED_PERMISSIONS)


def test_no_role_is_refused_at_create_in_the_api_servers_words(
    k8s: K8sCluster, k8s_image: Image, accounts: dict[str, dict[str, Any]]
) -> None:
    b = _backend(k8s, k8s_image, accounts["denied"])
    with pytest.raises(
        BackendError,
        match=r"may not create pods, get pods, list pods, delete pods, create pods/exec, get pods/exec;",
    ):
        b.test_connection()
    with pytest.raises(
        BackendError, match=r"forbidden.*system:serviceaccount:.*sky-denied.*cannot (create|list)"
    ):
        b.provision("norbac", task_from_args(num_nodes=2, run="true"))
    api = k8s.api()
    try:
        assert api.list_namespaced_pod(k8s.namespace, label_selector="sky.airflow/cluster=norbac").items == []
    finally:
        api.api_client.close()
