"""Every detail of the pods a Kubernetes cluster is made of, and the connection's settings: no cluster
needed (the real-cluster tests are in test_k8s_backend.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from airflow.sdk import Connection

from airflow_provider_sky.backends import BackendError
from airflow_provider_sky.backends.kubernetes.config import merge_kubernetes_connection, parse_kube_config
from airflow_provider_sky.backends.kubernetes.manifest import (
    CLUSTER_LABEL,
    ENTRYPOINT,
    ROLE_LABEL,
    PodOptions,
    dns_name,
    head_name,
    pod_manifest,
    pod_names,
)
from airflow_provider_sky.backends.kubernetes.pods import pod_state
from airflow_provider_sky.spec import task_from_args

OPTS = PodOptions(image="busybox:local", image_pull_policy="Never")


def manifest(index: int = 0, opts: PodOptions = OPTS, cluster: str = "train", **task: Any) -> dict[str, Any]:
    task.setdefault("num_nodes", 4)
    return pod_manifest(cluster, index, task_from_args(run="true", **task), opts)


def anti(m: dict[str, Any]) -> dict[str, Any]:
    return m["spec"].get("affinity", {}).get("podAntiAffinity", {})


# -- names and labels -------------------------------------------------------------------------------------


def test_pods_are_named_head_and_workers_and_labelled_with_cluster_and_role() -> None:
    assert pod_names("train", 3) == ["train-head", "train-worker1", "train-worker2"]
    head, worker = manifest(0), manifest(2)
    assert head["metadata"]["name"] == "train-head" and worker["metadata"]["name"] == "train-worker2"
    assert head["metadata"]["labels"] == {CLUSTER_LABEL: "train", ROLE_LABEL: "head"}
    assert worker["metadata"]["labels"][ROLE_LABEL] == "worker"
    assert head["metadata"]["annotations"]["sky.airflow/cluster-name"] == "train"


@pytest.mark.parametrize("name", ["My_Cluster.v2", "x" * 80, "UPPER", "a--b_", "sky-" + "9" * 70])
def test_names_are_dns_1123_and_distinct(name: str) -> None:
    for pod in pod_names(name, 1000):
        assert len(pod) <= 63 and pod == dns_name(pod), pod
        assert pod[0].isalnum() and pod[-1].isalnum()
    assert dns_name(name) != dns_name(name + "x")
    assert head_name(name) == pod_names(name, 7)[0]  # found from the name alone, whatever the size


def test_user_labels_are_kept_but_never_replace_ours() -> None:
    m = manifest(0, resources={"labels": {"team": "ml", CLUSTER_LABEL: "other"}})
    assert m["metadata"]["labels"]["team"] == "ml" and m["metadata"]["labels"][CLUSTER_LABEL] == "train"


# -- the pod ------------------------------------------------------------------------------------------------


def test_the_pod_idles_never_restarts_and_has_a_memory_backed_shm() -> None:
    m = manifest()
    spec = m["spec"]
    assert spec["restartPolicy"] == "Never"
    (c,) = spec["containers"]
    assert c["command"] == ENTRYPOINT and "trap 'exit 0' TERM" in ENTRYPOINT[2]
    assert c["image"] == "busybox:local" and c["imagePullPolicy"] == "Never"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in spec["volumes"]


def test_image_id_in_skypilot_docker_form_wins_over_the_connection_image() -> None:
    m = manifest(resources={"image_id": "docker:python:3.12-slim"})
    assert m["spec"]["containers"][0]["image"] == "python:3.12-slim"


@pytest.mark.parametrize(
    ("cpus", "memory", "requests", "limits"),
    [
        ("4", "8", {"cpu": "4", "memory": "8Gi"}, {"cpu": "4", "memory": "8Gi"}),
        ("4+", "8+", {"cpu": "4", "memory": "8Gi"}, None),
        ("0.5", None, {"cpu": "0.5"}, {"cpu": "0.5"}),
        ("2+", "16", {"cpu": "2", "memory": "16Gi"}, {"memory": "16Gi"}),
    ],
)
def test_cpus_and_memory_become_requests_and_exact_ones_limits(
    cpus: str, memory: str | None, requests: dict[str, str], limits: dict[str, str] | None
) -> None:
    res = {"cpus": cpus} | ({"memory": memory} if memory else {})
    got = manifest(resources=res)["spec"]["containers"][0]["resources"]
    assert got["requests"] == requests and got.get("limits") == limits


def test_no_resources_asked_means_no_resources_block() -> None:
    assert "resources" not in manifest()["spec"]["containers"][0]


# -- GPUs -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("acc", "whole"), [("V100:0.5", "1"), ("A100:8", "8"), ("T4", "1"), ("H100:1.5", "2")]
)
def test_gpus_are_whole_units_with_selector_and_toleration_while_the_request_shows_as_written(
    acc: str, whole: str
) -> None:
    m = manifest(resources={"accelerators": acc})
    c = m["spec"]["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == whole
    assert c["resources"]["requests"]["nvidia.com/gpu"] == whole
    name = acc.split(":")[0]
    assert m["spec"]["nodeSelector"] == {"skypilot.co/accelerator": name.lower()}
    assert m["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    shown = m["metadata"]["annotations"]["sky.airflow/accelerators"]
    assert shown == (acc if ":" in acc else f"{acc}:1")


def test_gpu_resource_and_label_come_from_the_connection() -> None:
    opts = PodOptions(image="i", gpu_resource="amd.com/gpu", accelerator_label="nvidia.com/gpu.product")
    m = manifest(resources={"accelerators": "MI300:2"}, opts=opts)
    assert m["spec"]["containers"][0]["resources"]["limits"] == {"amd.com/gpu": "2"}
    assert m["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "mi300"}
    assert m["spec"]["tolerations"][0]["key"] == "amd.com/gpu"


# -- spreading ---------------------------------------------------------------------------------------------


def test_soft_anti_affinity_by_default_on_hostname_for_the_cluster() -> None:
    (pref,) = anti(manifest())["preferredDuringSchedulingIgnoredDuringExecution"]
    assert pref["weight"] == 100
    term = pref["podAffinityTerm"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"] == {"matchLabels": {CLUSTER_LABEL: "train"}}


def test_hard_anti_affinity_requires_and_off_adds_nothing() -> None:
    hard = anti(manifest(opts=PodOptions(image="i", anti_affinity="hard")))
    assert list(hard) == ["requiredDuringSchedulingIgnoredDuringExecution"]
    assert "affinity" not in manifest(opts=PodOptions(image="i", anti_affinity="off"))["spec"]


def test_a_single_node_gets_no_anti_affinity() -> None:
    assert "affinity" not in manifest(num_nodes=1)["spec"]


def test_anti_affinity_merges_with_the_users_affinity_without_changing_it() -> None:
    user = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": []}},
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 5, "podAffinityTerm": {"x": 1}}]
        },
    }
    before = json.dumps(user, sort_keys=True)
    m = manifest(opts=PodOptions(image="i", affinity=user))
    aff = m["spec"]["affinity"]
    assert aff["nodeAffinity"] == user["nodeAffinity"]
    weights = [t["weight"] for t in aff["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]]
    assert weights == [5, 100]
    assert json.dumps(user, sort_keys=True) == before


def test_service_account_is_set_when_given() -> None:
    assert (
        manifest(opts=PodOptions(image="i", service_account="trainer"))["spec"]["serviceAccountName"]
        == "trainer"
    )
    assert "serviceAccountName" not in manifest()["spec"]


def test_no_service_account_token_in_the_pods_unless_the_connection_names_an_account() -> None:
    """Every rank's code can read a mounted token: none unless the task is meant to talk to the API."""
    for index in (0, 1):
        assert manifest(index)["spec"]["automountServiceAccountToken"] is False
    given = manifest(opts=PodOptions(image="i", service_account="trainer"))["spec"]
    assert given["serviceAccountName"] == "trainer" and "automountServiceAccountToken" not in given


# -- the connection ------------------------------------------------------------------------------------------


KUBECONFIG = {"apiVersion": "v1", "clusters": [{"name": "c", "cluster": {"server": "https://x"}}]}


@pytest.mark.parametrize(
    ("extra", "source"),
    [
        ({}, "default"),
        ({"in_cluster": True}, "in_cluster"),
        ({"in_cluster": "false"}, "default"),
        ({"kube_config": json.dumps(KUBECONFIG)}, "content"),
        ({"kube_config": KUBECONFIG}, "content"),
        ({"kube_config_path": "/k"}, "path"),
    ],
)
def test_exactly_one_credentials_source(extra: dict[str, Any], source: str) -> None:
    assert parse_kube_config(extra).source == source


@pytest.mark.parametrize(
    "extra",
    [
        {"in_cluster": True, "kube_config_path": "/k"},
        {"kube_config": json.dumps(KUBECONFIG), "kube_config_path": "/k"},
        {"in_cluster": "true", "kube_config": json.dumps(KUBECONFIG)},
    ],
)
def test_two_credentials_sources_are_an_error_naming_both(extra: dict[str, Any]) -> None:
    with pytest.raises(BackendError, match="two sources of cluster credentials"):
        parse_kube_config(extra)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"anti_affinity": "sometimes"}, "anti_affinity"),
        ({"image_pull_policy": "never"}, "image_pull_policy"),
        ({"namespace": "Bad_NS"}, "namespace"),
        ({"provision_timeout": "soon"}, "provision_timeout"),
        ({"kube_config": "just text"}, "kube_config"),
    ],
)
def test_bad_settings_name_the_field(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(BackendError, match=f"^{field}:"):
        parse_kube_config(extra)


def test_a_reused_cncf_connection_gives_what_ours_leaves_empty() -> None:
    theirs = Connection(
        conn_id="k",
        conn_type="kubernetes",
        extra=json.dumps(
            {"extra__kubernetes__namespace": "ml", "cluster_context": "prod", "kube_config_path": "/t"}
        ),
    )
    s = parse_kube_config(merge_kubernetes_connection({"kubernetes_conn_id": "k", "image": "img"}, theirs))
    assert (s.namespace, s.context, s.kube_config_path, s.pods.image) == ("ml", "prod", "/t", "img")
    # our own credentials are taken whole: theirs (path, context) are not mixed in
    ours = merge_kubernetes_connection(
        {"kubernetes_conn_id": "k", "in_cluster": True, "namespace": "x"}, theirs
    )
    s = parse_kube_config(ours)
    assert (s.source, s.context, s.namespace) == ("in_cluster", None, "x")


# -- what a pod's status says ------------------------------------------------------------------------------


def _pod(phase: str = "Pending", **status: Any) -> Any:
    from kubernetes import client

    return client.V1Pod(
        metadata=client.V1ObjectMeta(name="p"),
        spec=client.V1PodSpec(containers=[client.V1Container(name="node", image="img:1")]),
        status=client.V1PodStatus(phase=phase, **status),
    )


def test_pending_reasons_read_from_the_pod() -> None:
    from kubernetes import client

    unsched = _pod(
        conditions=[
            client.V1PodCondition(
                type="PodScheduled",
                status="False",
                reason="Unschedulable",
                message="0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
            )
        ]
    )
    s = pod_state(unsched)
    assert s.unschedulable and not s.fatal and "2 Insufficient nvidia.com/gpu" in s.reason
    waiting = client.V1ContainerState(
        waiting=client.V1ContainerStateWaiting(reason="ErrImageNeverPull", message="m")
    )
    bad = _pod(
        container_statuses=[
            client.V1ContainerStatus(
                name="node", image="img:1", image_id="", ready=False, restart_count=0, state=waiting
            )
        ]
    )
    s = pod_state(bad)
    assert s.fatal and "ErrImageNeverPull for image 'img:1'" in s.reason
    running = _pod("Running", pod_ip="10.0.0.3")
    assert pod_state(running).running and pod_state(running).ip == "10.0.0.3"


@pytest.mark.parametrize("value", ["ml team", "x" * 64, "-ml", "ml/team"])
def test_a_label_value_kubernetes_refuses_is_named_before_any_pod(value: str) -> None:
    """No API call: the check runs on the spec, with the task's other problems, before provisioning."""
    from airflow_provider_sky.backends.base import choose_resources
    from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
    from airflow_provider_sky.spec import SpecError

    b = KubernetesBackend(parse_kube_config({}))
    spec = task_from_args(run="true", resources={"labels": {"team": value, "ok": "ml.team_1"}})
    with pytest.raises(SpecError) as err:
        choose_resources(b, spec)
    assert err.value.field == "resources.labels.team" and "a pod label" in err.value.message
    choose_resources(b, task_from_args(run="true", resources={"labels": {"team": "ml.team_1", "e": ""}}))


def test_a_label_name_kubernetes_refuses_is_named_before_any_pod() -> None:
    """An EC2 tag key such as 'Cost Center' is a fine label elsewhere; a pod label cannot have it."""
    from airflow_provider_sky.backends.base import choose_resources
    from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
    from airflow_provider_sky.spec import SpecError

    spec = task_from_args(run="true", resources={"labels": {"Cost Center": "ml"}})
    with pytest.raises(SpecError) as err:
        choose_resources(KubernetesBackend(parse_kube_config({})), spec)
    assert (
        err.value.field == "resources.labels.Cost Center" and "whose name is at most 63" in err.value.message
    )


@pytest.mark.parametrize(
    ("given", "on"),
    [({}, True), ({"node_agent": ""}, True), ({"node_agent": "false"}, False), ({"node_agent": True}, True)],
)
def test_node_agents_are_on_unless_the_connection_turns_them_off(given: dict[str, Any], on: bool) -> None:
    assert parse_kube_config(given).node_agent is on


def test_the_entrypoint_becomes_the_agent_only_once_its_run_script_exists() -> None:
    """The pod's process idles (exit 0 on SIGTERM) until the provisioning exec wrote ``run.sh`` and woke
    it; then it execs it: the agent is pid 1."""
    script = ENTRYPOINT[2]
    assert "trap 'exit 0' TERM INT" in script and "trap : USR1" in script
    assert '[ -f "$a" ] && exec /bin/sh "$a"' in script and "/.sky_agent/run.sh" in script
