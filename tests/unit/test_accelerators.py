"""GPUs: names as SkyPilot gives them, what nvidia-smi / rocm-smi print, and the local backend
splitting this machine's GPUs among the nodes, each its own CUDA_VISIBLE_DEVICES.

This machine has no GPU: the local-backend tests put the FAKE nvidia-smi / rocm-smi of ``tests/fakes`` on
PATH with a GPU list (``gpus.local_gpus``); everything else (detection, provisioning, ranks, setup) is real.
"""

from __future__ import annotations

import pytest

from airflow_provider_sky.backends.base import choose_resources
from airflow_provider_sky.node.accelerators import (
    GpuDevice,
    canonical_name,
    declared_inventory,
    pack,
    parse_declared,
    parse_detect_output,
    parse_nvidia_smi,
    parse_rocm_smi,
    same_name,
)
from airflow_provider_sky.spec import task_from_args

# ------------------------------------------------------------------------------------------- names


@pytest.mark.parametrize(
    ("raw", "memory", "name"),
    [
        ("NVIDIA A100-SXM4-80GB", 81920, "A100-80GB"),
        ("NVIDIA A100 80GB PCIe", None, "A100-80GB"),
        ("NVIDIA A100-SXM4-40GB", 40960, "A100"),
        ("NVIDIA A100-PCIE-40GB", None, "A100"),
        ("Tesla V100-SXM2-16GB", 16384, "V100"),
        ("Tesla V100-SXM2-32GB", 32768, "V100-32GB"),
        ("NVIDIA H100 80GB HBM3", 81559, "H100"),
        ("NVIDIA H100 PCIe", 81559, "H100"),
        ("NVIDIA H200", 143771, "H200"),
        ("NVIDIA GH200 480GB", 97871, "GH200"),
        ("NVIDIA B200", 183359, "B200"),
        ("NVIDIA L40S", 46068, "L40S"),
        ("NVIDIA L40", 46068, "L40"),
        ("NVIDIA L4", 23034, "L4"),
        ("NVIDIA A10G", 23028, "A10G"),
        ("NVIDIA A10", 23028, "A10"),
        ("Tesla T4", 15360, "T4"),
        ("Tesla K80", 11441, "K80"),
        ("NVIDIA RTX A6000", 49140, "RTXA6000"),
        ("NVIDIA GeForce RTX 4090", 24564, "RTX4090"),
        ("AMD Instinct MI300X OAM", 196592, "MI300X"),
        ("AMD Instinct MI250X", 65536, "MI250X"),
        ("H100", None, "H100"),  # a declared name is canonical already
        ("a100-80gb", None, "A100-80GB"),
    ],
)
def test_tool_names_become_skypilot_names(raw: str, memory: int | None, name: str) -> None:
    assert canonical_name(raw, memory) == name


def test_names_compare_case_insensitively_and_exactly() -> None:
    assert same_name("a100-80gb", "A100-80GB")
    assert same_name("h100", "H100")
    assert not same_name("A100", "A100-80GB")  # as in SkyPilot: another accelerator
    assert not same_name("A10", "A100")


# ------------------------------------------------------------------------------------------- tool output


def test_nvidia_smi_csv_with_or_without_header_and_units() -> None:
    text = "index, name, memory.total [MiB]\n0, NVIDIA A100-SXM4-80GB, 81920 MiB\n1, Tesla T4, 15360 MiB\n"
    assert parse_nvidia_smi(text) == [
        GpuDevice(0, "A100-80GB", "NVIDIA A100-SXM4-80GB", 81920),
        GpuDevice(1, "T4", "Tesla T4", 15360),
    ]
    assert parse_nvidia_smi("0, NVIDIA H100 80GB HBM3, 81559\n")[0].name == "H100"


def test_rocm_smi_product_and_memory_lines() -> None:
    text = (
        "GPU[0]\t\t: Card Series: \t\tAMD Instinct MI300X OAM\n"
        "GPU[0]\t\t: Card Vendor: \t\tAdvanced Micro Devices, Inc. [AMD/ATI]\n"
        "GPU[1]\t\t: Card series: \t\tAMD Instinct MI300X OAM\n"
        "GPU[0]\t\t: VRAM Total Memory (B): 206141652992\n"
    )
    devices = parse_rocm_smi(text)
    assert [(d.index, d.name, d.memory_mib) for d in devices] == [(0, "MI300X", 196592), (1, "MI300X", None)]


def test_detect_output_says_why_there_is_no_gpu() -> None:
    assert parse_detect_output("@end\n").note == "neither nvidia-smi nor rocm-smi is installed"
    failed = parse_detect_output(
        "@nvidia\nNVIDIA-SMI has failed because it couldn't communicate\n@failed 9\n@end\n"
    )
    assert failed.devices == () and failed.note.startswith(
        "nvidia-smi failed with exit code 9: NVIDIA-SMI has"
    )
    assert failed.describe().startswith("no GPUs (nvidia-smi failed")
    none = parse_detect_output("@nvidia\nNo devices were found\n@failed 6\n@rocm\n@end\n")
    assert "nvidia-smi failed with exit code 6: No devices were found" in none.note
    assert "rocm-smi lists none" in none.note


def test_declared_gpus() -> None:
    inv = parse_declared("A100:2, T4", "accelerators")
    assert [(d.index, d.name) for d in inv.devices] == [(0, "A100"), (1, "A100"), (2, "T4")]
    assert inv.source == "declared"
    assert parse_declared("", "accelerators").describe() == "no GPUs (declared without GPUs)"
    with pytest.raises(ValueError, match="cannot read 'H100:x'"):
        parse_declared("H100:x", "accelerators")
    per_host = declared_inventory(
        '{"10.0.0.1": "H100:8", "*": "T4:1"}', "accelerators", ("10.0.0.1", "10.0.0.2")
    )
    assert per_host["10.0.0.1"].describe() == "8x H100 (declared)" and "*" in per_host
    assert declared_inventory({"H100": 8}, "accelerators")["*"].describe() == "8x H100 (declared)"
    with pytest.raises(ValueError, match="'10.0.0.9' is not one of the hosts"):
        declared_inventory('{"10.0.0.9": "H100:8"}', "accelerators", ("10.0.0.1",))


@pytest.mark.parametrize(
    ("free", "count", "nodes", "per_node"),
    [
        (range(8), 4, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (range(8), 8, 1, [list(range(8))]),
        (range(8), 1.5, 3, [[0, 1], [2, 3], [4, 5]]),  # a fraction above one rounds up
        (range(2), 0.5, 4, [[0], [0], [1], [1]]),  # below one, nodes share a device as Ray shares it
        (range(1), 0.25, 4, [[0], [0], [0], [0]]),
        ([3, 5, 6], 1, 3, [[3], [5], [6]]),
    ],
)
def test_pack_gives_each_node_its_own_devices(
    free: range, count: float, nodes: int, per_node: list[list[int]]
) -> None:
    assert pack(list(free), count, nodes).per_node == per_node


def test_pack_says_what_is_short() -> None:
    assert pack(range(8), 4, 3).problem == "needs 12 (3 node(s) x 4), 8 free"
    assert pack(range(1), 0.5, 4).problem == "needs 2 (4 node(s) x 0.5, 2 per device), 1 free"


# ------------------------------------------------------------------------------------------- the local backend


def test_kubernetes_gets_the_same_choice_through_the_shared_code() -> None:
    """The Kubernetes backend is handed the chosen alternative only, so its manifests are those of a task
    that asked for it alone (no cluster needed: the choice is by capability there; the scheduler places)."""
    from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
    from airflow_provider_sky.backends.kubernetes.manifest import pod_manifest
    from airflow_provider_sky.backends.registry import conn_types

    b = KubernetesBackend.from_config({"namespace": "ns", "image": "busybox"})
    spec = task_from_args(
        num_nodes=2,
        run="true",
        resources={
            "any_of": [{"infra": "aws", "accelerators": "H100:8"}, {"infra": "k8s", "accelerators": "A100:8"}]
        },
    )
    choice = choose_resources(b, spec, "k", conn_types())
    assert (choice.index, str(choice.resources.accelerators)) == (1, "A100:8")
    assert "#1 (H100:8, cloud aws): the kubernetes backend cannot run on cloud 'aws'" in choice.note()
    chosen = spec.with_resources(choice.resources)
    alone = task_from_args(num_nodes=2, run="true", resources={"infra": "k8s", "accelerators": "A100:8"})
    assert pod_manifest("k", 1, chosen, b.settings.pods) == pod_manifest("k", 1, alone, b.settings.pods)
    assert pod_manifest("k", 0, chosen, b.settings.pods)["spec"]["containers"][0]["resources"]["limits"] == {
        "nvidia.com/gpu": "8"
    }
