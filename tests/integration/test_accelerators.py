"""GPUs: names as SkyPilot gives them, what nvidia-smi / rocm-smi print, and the local backend
splitting this machine's GPUs among the nodes, each its own CUDA_VISIBLE_DEVICES.

This machine has no GPU: the local-backend tests put the FAKE nvidia-smi / rocm-smi of ``tests/fakes`` on
PATH with a GPU list (``gpus.local_gpus``); everything else (detection, provisioning, ranks, setup) is real.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from envdump import DUMP, parse
from gangs import wait_done
from gpus import A100_40, H100, MI300X, T4, local_gpus, no_gpu_tools

from airflow_provider_sky.backends.base import BackendError, choose_resources
from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.node.accelerators import (
    DETECT_SCRIPT,
    detect_local,
)
from airflow_provider_sky.spec import SpecError, TaskSpec, task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from airflow_provider_sky.watch.setup_stage import run_setup

# ------------------------------------------------------------------------------------------- names


# ------------------------------------------------------------------------------------------- tool output


def test_detection_runs_the_tools_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    local_gpus(monkeypatch, tmp_path, [A100_40, A100_40, T4])
    inv = detect_local()
    assert inv.source == "nvidia-smi"
    assert [(d.index, d.name) for d in inv.devices] == [(0, "A100"), (1, "A100"), (2, "T4")]
    assert inv.describe() == "2x A100, 1x T4 (nvidia-smi)"
    local_gpus(monkeypatch, tmp_path / "amd", [], rocm=[MI300X] * 2)
    amd = detect_local()
    assert (amd.source, amd.describe()) == ("rocm-smi", "2x MI300X (rocm-smi)")
    no_gpu_tools(monkeypatch)
    assert detect_local().note == "neither nvidia-smi nor rocm-smi is installed"
    assert "nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader,nounits" in DETECT_SCRIPT


# ------------------------------------------------------------------------------------------- the local backend


def _run(b: LocalBackend, name: str, spec: TaskSpec) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Provision (with the shared choice), run setup and run; every rank's setup env and run env."""
    choice = choose_resources(b, spec, name)
    handle = b.provision(name, spec.with_resources(choice.resources))
    client = GangClient(b, handle)
    lines: dict[int, list[str]] = {}
    try:
        run_setup(client, spec, "setup", on_log=lambda rank, line: lines.setdefault(rank, []).append(line))
        client.launch(spec, "job")
        poll = wait_done(client)
        assert poll.status.succeeded, poll.status.failure_message()
        runs = [parse(client.poll("job").chunks[r][1].decode()) for r in range(len(handle.nodes))]
    finally:
        client.close()
    setups = [parse("\n".join(lines[r])) for r in range(len(handle.nodes))] if spec.setup else []
    return setups, runs


def test_two_nodes_on_an_8_gpu_machine_each_get_their_own_4(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_gpus(monkeypatch, tmp_path, [H100] * 8)
    b = LocalBackend(sky_home)
    spec = task_from_args(num_nodes=2, run=DUMP, setup=DUMP, resources={"accelerators": "H100:4"})
    setups, runs = _run(b, "split", spec)
    assert [r["CUDA_VISIBLE_DEVICES"] for r in runs] == ["0,1,2,3", "4,5,6,7"]
    assert [r["SKYPILOT_NUM_GPUS_PER_NODE"] for r in runs] == ["4", "4"]
    assert [s["SKYPILOT_SETUP_NUM_GPUS_PER_NODE"] for s in setups] == ["4", "4"]
    assert [s["CUDA_VISIBLE_DEVICES"] for s in setups] == ["0,1,2,3", "4,5,6,7"]
    assert [r["SKYPILOT_NODE_RANK"] for r in runs] == ["0", "1"]
    assert b.terminate("split").removed


def test_too_few_gpus_or_the_wrong_type_fail_before_anything_is_made(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_gpus(monkeypatch, tmp_path, [H100] * 8)
    b = LocalBackend(sky_home)
    with pytest.raises(SpecError) as info:
        choose_resources(b, task_from_args(num_nodes=3, run="true", resources={"accelerators": "H100:4"}))
    assert info.value.field == "resources.accelerators"
    assert (
        "3 node(s) x H100:4 needs 12 (3 node(s) x 4), 8 free H100 on this machine (8x H100 (nvidia-smi))"
        in str(info.value)
    )
    with pytest.raises(SpecError) as info:
        choose_resources(b, task_from_args(num_nodes=1, run="true", resources={"accelerators": "A100:1"}))
    assert "this machine has 8x H100 (nvidia-smi); the task asks for A100:1 per node" in info.value.message
    with pytest.raises(BackendError, match="needs 12"):  # the backend checks again under its lock
        b.provision("x", task_from_args(num_nodes=3, run="true", resources={"accelerators": "H100:4"}))
    assert not (sky_home / "local" / "x").exists() and b.find("x") is None


def test_gpus_held_by_another_cluster_are_not_given_twice(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_gpus(monkeypatch, tmp_path, [H100] * 8)
    b = LocalBackend(sky_home)
    first = b.provision("a", task_from_args(num_nodes=1, run="true", resources={"accelerators": "H100:6"}))
    assert first.nodes[0].extra["gpu_devices"] == [0, 1, 2, 3, 4, 5]
    four = task_from_args(num_nodes=1, run="true", resources={"accelerators": "H100:4"})
    with pytest.raises(SpecError, match=r"cluster 'a' holds 0,1,2,3,4,5 \(tear it down to free them\)"):
        choose_resources(b, four, "b")
    two = b.provision("c", task_from_args(num_nodes=2, run="true", resources={"accelerators": "H100:1"}))
    assert [n.extra["gpu_devices"] for n in two.nodes] == [[6], [7]]
    assert b.terminate("a").removed
    assert b.provision("b", four).nodes[0].extra["gpu_devices"] == [0, 1, 2, 3]
    # the same cluster again: its own GPUs count as its own
    assert choose_resources(b, four, "b").resources.accelerators is not None
    with pytest.raises(BackendError, match="exists with H100:4 per node but the task asks for H100:6"):
        b.provision("b", task_from_args(num_nodes=1, run="true", resources={"accelerators": "H100:6"}))
    b.terminate("b")
    b.terminate("c")


def test_fractions_round_up_and_share_a_device(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_gpus(monkeypatch, tmp_path, [H100] * 2)
    b = LocalBackend(sky_home)
    setups, runs = _run(
        b, "frac", task_from_args(num_nodes=4, run=DUMP, setup=DUMP, resources={"accelerators": "H100:0.5"})
    )
    assert [r["SKYPILOT_NUM_GPUS_PER_NODE"] for r in runs] == ["1"] * 4  # as SkyPilot: a fraction rounds up
    assert [r["CUDA_VISIBLE_DEVICES"] for r in runs] == ["0", "0", "1", "1"]
    assert setups[0]["SKYPILOT_SETUP_NUM_GPUS_PER_NODE"] == "1"
    b.terminate("frac")
    _, runs = _run(b, "frac2", task_from_args(num_nodes=1, run=DUMP, resources={"accelerators": "H100:1.5"}))
    assert (runs[0]["SKYPILOT_NUM_GPUS_PER_NODE"], runs[0]["CUDA_VISIBLE_DEVICES"]) == ("2", "0,1")
    b.terminate("frac2")


def test_no_gpus_asked_means_zero_and_no_cuda_visible_devices(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_gpus(monkeypatch, tmp_path, [H100] * 2)
    b = LocalBackend(sky_home)
    setups, runs = _run(b, "cpu", task_from_args(num_nodes=2, run=DUMP, setup=DUMP))
    assert [r["SKYPILOT_NUM_GPUS_PER_NODE"] for r in runs] == ["0", "0"]
    assert [s["SKYPILOT_SETUP_NUM_GPUS_PER_NODE"] for s in setups] == ["0", "0"]
    assert not any("CUDA_VISIBLE_DEVICES" in e for e in [*runs, *setups])
    b.terminate("cpu")


def test_declared_gpus_on_a_machine_without_the_tools(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    no_gpu_tools(monkeypatch)
    b = LocalBackend.from_config({"state_dir": str(sky_home), "accelerators": "H100:8"})
    assert "GPUs: 8x H100 (declared)" in b.test_connection()
    _, runs = _run(b, "decl", task_from_args(num_nodes=4, run=DUMP, resources={"accelerators": "h100:2"}))
    assert [r["CUDA_VISIBLE_DEVICES"] for r in runs] == ["0,1", "2,3", "4,5", "6,7"]
    b.terminate("decl")
    with pytest.raises(BackendError, match="accelerators: cannot read 'H100:eight'"):
        LocalBackend.from_config({"accelerators": "H100:eight"})
    bare = LocalBackend(sky_home)
    with pytest.raises(SpecError) as info:
        choose_resources(bare, task_from_args(run="true", resources={"accelerators": "H100:1"}))
    assert "this machine has no GPUs (neither nvidia-smi nor rocm-smi is installed)" in info.value.message
    assert '"accelerators" (e.g. "H100:8")' in info.value.message


def test_a_driver_that_fails_is_named(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_gpus(monkeypatch, tmp_path, [H100])
    monkeypatch.setenv("FAKE_NVIDIA_SMI_FAIL", "1")
    with pytest.raises(SpecError, match="nvidia-smi failed with exit code 9: NVIDIA-SMI has failed"):
        choose_resources(
            LocalBackend(sky_home), task_from_args(run="true", resources={"accelerators": "H100"})
        )


def test_amd_gpus_through_rocm_smi(sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    local_gpus(monkeypatch, tmp_path, [], rocm=[MI300X] * 4)
    b = LocalBackend(sky_home)
    _, runs = _run(b, "amd", task_from_args(num_nodes=2, run=DUMP, resources={"accelerators": "MI300X:2"}))
    assert [r["CUDA_VISIBLE_DEVICES"] for r in runs] == ["0,1", "2,3"]
    b.terminate("amd")


def test_the_first_alternative_this_machine_has_wins_and_the_job_sees_it(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_gpus(monkeypatch, tmp_path, [H100] * 8)
    b = LocalBackend(sky_home)
    spec = task_from_args(
        num_nodes=2, run=DUMP, resources={"ordered": [{"accelerators": "A100:8"}, {"accelerators": "H100:4"}]}
    )
    choice = choose_resources(b, spec)
    assert (choice.index, str(choice.resources.accelerators)) == (1, "H100:4")
    note = choice.note()
    assert note.startswith("resources: alternative 2 of 2 (H100:4); passed over: #1 (A100:8): ")
    assert "this machine has 8x H100 (nvidia-smi)" in note
    _, runs = _run(b, "alt", spec)  # the job gets the spec with both alternatives; the handle says which
    assert [r["SKYPILOT_NUM_GPUS_PER_NODE"] for r in runs] == ["4", "4"]
    assert [r["CUDA_VISIBLE_DEVICES"] for r in runs] == ["0,1,2,3", "4,5,6,7"]
    assert b.find("alt") is not None and b.find("alt").extra["resources"] == {"accelerators": "H100:4"}  # type: ignore[union-attr]
    b.terminate("alt")


def test_a_user_cuda_visible_devices_would_be_silently_overridden_so_it_is_an_error(
    sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    local_gpus(monkeypatch, tmp_path, [H100] * 2)
    spec = task_from_args(
        run="true", envs={"CUDA_VISIBLE_DEVICES": "1"}, resources={"accelerators": "H100:1"}
    )
    with pytest.raises(SpecError) as info:
        choose_resources(LocalBackend(sky_home), spec)
    assert info.value.field == "envs.CUDA_VISIBLE_DEVICES"
    # without a GPU request the user's own value is theirs
    choose_resources(LocalBackend(sky_home), task_from_args(run="true", envs={"CUDA_VISIBLE_DEVICES": "1"}))
