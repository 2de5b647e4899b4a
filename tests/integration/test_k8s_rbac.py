"""The RBAC docs/backends/kubernetes.md documents is exactly what the code calls, and a refusal is said in the API server's
words. The page's Role is ``role_rules()`` (from ``NEEDED_PERMISSIONS``, which the Test button checks);
a service account holding exactly that Role runs a gang (provision, a job, a replaced worker, teardown),
and the calls it makes are exactly those permissions; one without it is refused at create, nothing is
left, and the Test button names what is missing. Both reach the cluster through a kubeconfig given as
content (the ``kube_config`` extra), with a service-account token."""

from __future__ import annotations

from typing import Any

import pytest
from k8s_cluster import Image, K8sCluster

from airflow_provider_sky.backends.base import BackendError
from airflow_provider_sky.backends.kubernetes.backend import NEEDED_PERMISSIONS
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from integration.test_k8s_backend import _wait
from unit.test_k8s_rbac import _NAMESPACED, UNRESTRICTED, _backend, accounts  # noqa: F401  (shared with the unit half; fixtures among them)

#: calls outside the namespace, which every authenticated identity may make (the Test button's)


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
