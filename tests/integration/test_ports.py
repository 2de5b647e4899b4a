"""resources.ports opened where a backend can open them: a rule in the EC2 cluster's own security group
(moto), removed with the group at teardown; a Kubernetes Service for the head pod, owned by it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from aws_fixtures import backend, hosts, moto, net  # noqa: F401 (fixtures)
from k8s_cluster import Image, K8sCluster, connection_extras
from moto_ec2 import FakeNetwork, MotoEC2, ours_left
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.backends.aws.ec2 import resource_name
from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
from airflow_provider_sky.backends.kubernetes.manifest import CLUSTER_LABEL, ROLE_LABEL
from airflow_provider_sky.backends.registry import by_kind
from airflow_provider_sky.runners import ssh
from airflow_provider_sky.spec import task_from_args


def _group(ec2: Any, name: str) -> dict[str, Any] | None:
    groups = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": [resource_name(name)]}])
    return (groups["SecurityGroups"] or [None])[0]


@needs_sshd
def test_ec2_ports_are_a_rule_of_the_clusters_group_gone_at_teardown(
    moto: MotoEC2, hosts: SSHDCluster, net: FakeNetwork
) -> None:
    ec2 = moto.client()
    b = backend(moto.url, hosts)
    spec = task_from_args(num_nodes=2, run="true", resources={"ports": [8888, "10000-10010"]})
    b.provision("web", spec)
    try:
        group = _group(ec2, "web")
        assert group is not None
        opened = {
            (p["FromPort"], p["ToPort"]): [r["CidrIp"] for r in p["IpRanges"]]
            for p in group["IpPermissions"]
            if p.get("FromPort") not in (None, 22) and p["IpProtocol"] == "tcp"
        }
        assert opened == {(8888, 8888): ["0.0.0.0/0"], (10000, 10010): ["0.0.0.0/0"]}
    finally:
        b.terminate("web")
        ssh.close_all()
    assert _group(ec2, "web") is None
    assert not ours_left(ec2, "web")


# -- Kubernetes: a Service for the head pod ----------------------------------------------------------------


@pytest.fixture
def k8s_backend(k8s: K8sCluster, k8s_image: Image) -> Iterator[KubernetesBackend]:
    b = by_kind("kubernetes").make(connection_extras(k8s, k8s_image))
    assert isinstance(b, KubernetesBackend)
    yield b
    b.close()


def _endpoint_ips(b: KubernetesBackend, name: str) -> list[str]:
    ep = b.core.read_namespaced_endpoints(name, b.namespace)
    return [a.ip for s in ep.subsets or [] for a in s.addresses or []]


def test_k8s_ports_are_a_service_of_the_head_pod_deleted_with_it(k8s_backend: KubernetesBackend) -> None:
    """The Service selects the head pod (its Endpoints: the head's IP), is owned by it, and goes with it.
    The test cluster runs no kube-proxy (the Service's virtual IP routes nowhere here) and no route
    between its two machines' pod networks: the port is reached at the Service's endpoint from a pod on
    the head's machine (a worker there, else the head itself)."""
    b = k8s_backend
    spec = task_from_args(num_nodes=3, run="true", resources={"ports": [8080, "9000-9001"]})
    handle = b.provision("svc", spec)
    try:
        head = handle.nodes[0]
        svc = b.core.read_namespaced_service("svc-head", b.namespace)
        assert [(p.port, p.target_port) for p in svc.spec.ports] == [(8080, 8080), (9000, 9000), (9001, 9001)]
        assert svc.spec.selector[ROLE_LABEL] == "head"
        pod = b.core.read_namespaced_pod(head.node_id, b.namespace)
        assert [(o.kind, o.uid) for o in svc.metadata.owner_references] == [("Pod", pod.metadata.uid)]
        assert handle.extra["service"] == f"svc-head.{b.namespace}.svc" and handle.extra["ports"] == [
            8080,
            9000,
            9001,
        ]
        deadline = time.monotonic() + 30  # the endpoints controller fills them within seconds
        while _endpoint_ips(b, "svc-head") != [head.ip] and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _endpoint_ips(b, "svc-head") == [head.ip]
        # a server on the head's port answers a worker at that endpoint
        serve = "mkdir -p /tmp/www && echo served > /tmp/www/index.html && httpd -p 8080 -h /tmp/www"
        assert b.runner(head).run_script(serve).returncode == 0
        peers = [n for n in handle.nodes[1:] if n.extra["k8s_node"] == head.extra["k8s_node"]] or [head]
        res = b.runner(peers[0]).run_script(f"wget -qO- http://{head.ip}:8080/index.html")
        assert res.returncode == 0 and res.stdout == b"served\n", res
    finally:
        b.terminate("svc")
    deadline = time.monotonic() + 60  # the garbage collector deletes what the head pod owned
    while time.monotonic() < deadline:
        if not b.core.list_namespaced_service(b.namespace, label_selector=f"{CLUSTER_LABEL}=svc").items:
            break
        time.sleep(0.5)
    assert not b.core.list_namespaced_service(b.namespace, label_selector=f"{CLUSTER_LABEL}=svc").items
