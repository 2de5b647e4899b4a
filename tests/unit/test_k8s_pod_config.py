"""SkyPilot's ``config.kubernetes.pod_config`` and ``config.docker.run_options`` merged into every pod: the
merge itself, what the backend owns (refused before provisioning), and the pods on the real cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from k8s_cluster import Image, K8sCluster, connection_extras

from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
from airflow_provider_sky.backends.kubernetes.manifest import CLUSTER_LABEL, PodOptions, pod_manifest
from airflow_provider_sky.backends.registry import by_kind
from airflow_provider_sky.spec import SpecError, load_task_yaml, parse_task

OPTS = PodOptions(image="busybox:local", image_pull_policy="Never")

POD_CONFIG_YAML = """\
num_nodes: 2
run: echo "$TEAM_ENV"; ls /extra
config:
  kubernetes:
    pod_config:
      metadata:
        labels: {team: ml}
      spec:
        containers:
          - env: [{name: TEAM_ENV, value: from-pod-config}]
            volumeMounts: [{name: extra, mountPath: /extra}]
            securityContext:
              capabilities: {add: [IPC_LOCK]}
        volumes: [{name: extra, emptyDir: {}}]
        tolerations: [{key: example.com/dedicated, operator: Exists, effect: NoSchedule}]
  docker:
    run_options: [--shm-size=64m, --cap-add=SYS_PTRACE]
"""


def _spec(tmp_path: Path, text: str = POD_CONFIG_YAML) -> Any:
    path = tmp_path / "task.yaml"
    path.write_text(text)
    return load_task_yaml(path)


def test_pod_config_is_merged_as_skypilot_merges_it(tmp_path: Path) -> None:
    pod = pod_manifest("pc", 1, _spec(tmp_path), OPTS)
    assert pod["metadata"]["labels"]["team"] == "ml"
    assert pod["metadata"]["labels"][CLUSTER_LABEL] == "pc"  # ours kept beside it
    container = pod["spec"]["containers"][0]
    assert container["name"] == "node" and container["image"] == "busybox:local"  # merged into ours
    assert {"name": "TEAM_ENV", "value": "from-pod-config"} in container["env"]
    assert container["volumeMounts"] == [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "extra", "mountPath": "/extra"},
    ]
    assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK", "SYS_PTRACE"]
    # --shm-size sizes the backend's own /dev/shm volume (same name: merged, not a second one)
    assert pod["spec"]["volumes"] == [
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "64Mi"}},
        {"name": "extra", "emptyDir": {}},
    ]
    assert pod["spec"]["tolerations"] == [
        {"key": "example.com/dedicated", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert pod["spec"]["restartPolicy"] == "Never"
    # the spec round-trips through its dict form
    spec = _spec(tmp_path)
    assert parse_task(spec.to_dict()) == spec


@pytest.mark.parametrize(
    ("config", "field", "fragment"),
    [
        ({"gcp": {"managed_instance_group": {}}}, "config.gcp", "a cloud no backend here runs on"),
        (
            {"kubernetes": {"enable_docker": True}},
            "config.kubernetes.enable_docker",
            "Docker-in-Docker sidecar, or BuildKit with BUILD), which the kubernetes backend does not set up",
        ),
        (
            {"kubernetes": {"pod_config": "x"}},
            "config.kubernetes.pod_config",
            "must be a pod manifest mapping",
        ),
        ({"docker": {"run_options": ["--network=host"]}}, "config.docker.run_options", "'--network=host'"),
        ({"docker": {"run_options": ["--shm-size=lots"]}}, "config.docker.run_options", "takes a size"),
    ],
)
def test_config_that_cannot_apply_is_refused_by_name(
    config: dict[str, Any], field: str, fragment: str
) -> None:
    with pytest.raises(SpecError) as info:
        parse_task({"run": "true", "config": config})
    assert info.value.field == field
    assert fragment in info.value.message


def test_what_the_backend_owns_is_refused_before_provisioning(extras_offline: KubernetesBackend) -> None:
    spec = parse_task(
        {
            "run": "true",
            "config": {
                "kubernetes": {
                    "pod_config": {
                        "metadata": {"labels": {CLUSTER_LABEL: "other"}},
                        "spec": {"restartPolicy": "Always", "containers": [{"command": ["sleep", "1"]}]},
                    }
                }
            },
        }
    )
    problems = dict(extras_offline.spec_problems(spec))
    assert set(problems) == {
        f"config.kubernetes.pod_config.metadata.labels.{CLUSTER_LABEL}",
        "config.kubernetes.pod_config.spec.restartPolicy",
        "config.kubernetes.pod_config.spec.containers[0].command",
    }
    assert "node's entrypoint" in problems["config.kubernetes.pod_config.spec.containers[0].command"]


@pytest.fixture
def extras_offline() -> Iterator[KubernetesBackend]:
    """A backend whose settings are enough to check a spec (no API call is made)."""
    b = by_kind("kubernetes").make({"namespace": "default", "image": "busybox:local"})
    assert isinstance(b, KubernetesBackend)
    yield b
    b.close()


# -- on the real cluster ----------------------------------------------------------------------------------


@pytest.fixture
def backend(k8s: K8sCluster, k8s_image: Image) -> Iterator[KubernetesBackend]:
    b = by_kind("kubernetes").make(connection_extras(k8s, k8s_image))
    assert isinstance(b, KubernetesBackend)
    yield b
    b.close()
