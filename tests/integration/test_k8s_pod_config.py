"""SkyPilot's ``config.kubernetes.pod_config`` and ``config.docker.run_options`` merged into every pod: the
merge itself, what the backend owns (refused before provisioning), and the pods on the real cluster."""

from __future__ import annotations

from pathlib import Path

from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
from airflow_provider_sky.backends.kubernetes.manifest import CLUSTER_LABEL
from unit.test_k8s_pod_config import _spec, backend  # noqa: F401  (shared with the unit half)

# -- on the real cluster ----------------------------------------------------------------------------------


def test_pod_config_is_on_every_pod_of_the_real_cluster(backend: KubernetesBackend, tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    handle = backend.provision("podcfg", spec)
    try:
        pods = backend.core.list_namespaced_pod(
            backend.namespace, label_selector=f"{CLUSTER_LABEL}=podcfg"
        ).items
        assert len(pods) == 2
        for pod in pods:
            assert pod.metadata.labels["team"] == "ml"
            c = pod.spec.containers[0]
            assert [(e.name, e.value) for e in c.env or [] if e.name == "TEAM_ENV"] == [
                ("TEAM_ENV", "from-pod-config")
            ]
            assert c.security_context.capabilities.add == ["IPC_LOCK", "SYS_PTRACE"]
            assert any(t.key == "example.com/dedicated" for t in pod.spec.tolerations)
            shm = next(v for v in pod.spec.volumes if v.name == "dshm")
            assert shm.empty_dir.size_limit == "64Mi"
        # what the ranks see: the env var and the extra volume
        for node in handle.nodes:
            res = backend.runner(node).run_script('echo "$TEAM_ENV"; test -d /extra && echo extra')
            assert res.returncode == 0 and res.stdout.split() == [b"from-pod-config", b"extra"], res
    finally:
        backend.terminate("podcfg")
