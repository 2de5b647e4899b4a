"""GPUs over SSH on real sshd hosts whose GPUs are FAKE: each GPU host has the fake nvidia-smi /
rocm-smi of ``tests/fakes`` first on its PATH with its own GPU list (``SSHDCluster(gpus=...)``); probing,
choosing hosts, the ranks and their env are real.

The hosts: 0 has 8x H100, 1 has 4x A100-80GB, 2 has 8x H100, 3 has no GPU tool at all, 4 has 2x MI300X
(rocm-smi).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from envdump import DUMP, parse
from gpus import A100_80, H100, MI300X
from sshd import SSHDCluster, described, needs_sshd, settled_user_processes

from airflow_provider_sky.backends.base import BackendError, choose_resources
from airflow_provider_sky.backends.headrecord import RECORDS_DIR
from airflow_provider_sky.backends.ssh import SSHBackend
from airflow_provider_sky.runners import ssh
from airflow_provider_sky.spec import SpecError, TaskSpec, task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from airflow_provider_sky.watch.loop import watch
from airflow_provider_sky.watch.setup_stage import run_setup

pytestmark = needs_sshd


@pytest.fixture(scope="module")
def gpu_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHDCluster]:
    gpus = {0: [H100] * 8, 1: [A100_80] * 4, 2: [H100] * 8}
    with SSHDCluster(5, tmp_path_factory.mktemp("sshd-gpus"), gpus=gpus, rocm_gpus={4: [MI300X] * 2}) as c:
        yield c
        ssh.close_all()
        for n in c.nodes:
            records = Path(n.home, RECORDS_DIR)
            left = [p.name for p in Path(n.home, ".sky_airflow").glob("*") if p != records]
            left += [p.name for p in records.glob("*.json")]
            assert left == [], f"{n.user}: clusters left: {left}"
            left_procs = settled_user_processes(n.user)
            assert left_procs == [], f"processes of {n.user} left behind: {described(left_procs)}"


def _backend(c: SSHDCluster, **kw: Any) -> SSHBackend:
    return c.ssh_backend(**kw)


def _wait(client: GangClient, job_id: str) -> Any:
    async def go() -> Any:
        last = None
        async for poll in watch(client, job_id, poll_interval=0.2):
            last = poll
        return last

    return asyncio.run(asyncio.wait_for(go(), 60))


def _run(
    b: SSHBackend, name: str, spec: TaskSpec
) -> tuple[list[str], list[dict[str, str]], list[dict[str, str]]]:
    """Choose, provision, setup and run as the cluster and job tasks do: (hosts by rank, setup envs, run envs)."""
    choice = choose_resources(b, spec, name)
    handle = b.provision(name, spec.with_resources(choice.resources))
    client = GangClient(b, handle)
    lines: dict[int, list[str]] = {}
    try:
        if spec.setup:
            run_setup(client, spec, "setup", on_log=lambda r, line: lines.setdefault(r, []).append(line))
        client.launch(spec, "job")
        poll = _wait(client, "job")
        assert poll.status.succeeded, poll.status.failure_message()
        runs = [parse(client.poll("job").chunks[r][1].decode()) for r in range(len(handle.nodes))]
    finally:
        client.close()
        down = b.terminate(name)
        assert down.removed and not down.unclean, f"teardown of {name}: {down}"
    setups = [parse("\n".join(lines[r])) for r in range(len(handle.nodes))] if spec.setup else []
    return [str(n.extra["host"]) for n in handle.nodes], setups, runs


def test_each_host_s_gpus_are_found_at_provision(gpu_hosts: SSHDCluster) -> None:
    b = _backend(gpu_hosts)
    probes = [b._probe((n.host, n.port)) for n in gpu_hosts.nodes]
    assert [p.gpus.describe() for p in probes] == [
        "8x H100 (nvidia-smi)",
        "4x A100-80GB (nvidia-smi)",
        "8x H100 (nvidia-smi)",
        "no GPUs (neither nvidia-smi nor rocm-smi is installed)",
        "2x MI300X (rocm-smi)",
    ]


def test_a_gang_asking_h100_8_runs_on_the_hosts_that_have_them(gpu_hosts: SSHDCluster) -> None:
    nodes = gpu_hosts.nodes
    spec = task_from_args(num_nodes=2, run=DUMP, setup=DUMP, resources={"accelerators": "H100:8"})
    hosts, setups, runs = _run(_backend(gpu_hosts), "h100", spec)
    assert hosts == [nodes[0].host, nodes[2].host]  # host 1 (A100-80GB) skipped, rank order kept
    assert [r["SKYPILOT_NODE_IPS"] for r in runs] == [f"{nodes[0].host}\n{nodes[2].host}"] * 2
    assert [r["SKYPILOT_NUM_GPUS_PER_NODE"] for r in runs] == ["8", "8"]
    assert [r["CUDA_VISIBLE_DEVICES"] for r in runs] == ["0,1,2,3,4,5,6,7"] * 2
    assert [s["SKYPILOT_SETUP_NUM_GPUS_PER_NODE"] for s in setups] == ["8", "8"]


def test_fewer_gpus_than_a_host_has_and_fractions(gpu_hosts: SSHDCluster) -> None:
    b = _backend(gpu_hosts)
    _, _, runs = _run(
        b, "h100-4", task_from_args(num_nodes=2, run=DUMP, resources={"accelerators": "H100:4"})
    )
    assert [(r["SKYPILOT_NUM_GPUS_PER_NODE"], r["CUDA_VISIBLE_DEVICES"]) for r in runs] == [
        ("4", "0,1,2,3")
    ] * 2
    _, _, runs = _run(
        b, "frac", task_from_args(num_nodes=2, run=DUMP, resources={"accelerators": "H100:0.5"})
    )
    assert [(r["SKYPILOT_NUM_GPUS_PER_NODE"], r["CUDA_VISIBLE_DEVICES"]) for r in runs] == [("1", "0")] * 2


def test_names_as_skypilot_gives_them(gpu_hosts: SSHDCluster) -> None:
    b = _backend(gpu_hosts)
    hosts, _, runs = _run(
        b, "a100", task_from_args(num_nodes=1, run=DUMP, resources={"accelerators": "a100-80gb:4"})
    )
    assert hosts == [gpu_hosts.nodes[1].host] and runs[0]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
    hosts, _, runs = _run(
        b, "amd", task_from_args(num_nodes=1, run=DUMP, resources={"accelerators": "MI300X:2"})
    )
    assert hosts == [gpu_hosts.nodes[4].host] and runs[0]["SKYPILOT_NUM_GPUS_PER_NODE"] == "2"


def test_the_wrong_type_is_refused_naming_every_host_and_what_it_has(gpu_hosts: SSHDCluster) -> None:
    b = _backend(gpu_hosts)
    spec = task_from_args(
        num_nodes=1, run="true", resources={"accelerators": "A100:1"}
    )  # A100 is not A100-80GB
    with pytest.raises(SpecError) as info:
        choose_resources(b, spec, "wrong")
    err = info.value
    assert err.field == "resources.accelerators"
    assert (
        "the task asks for 1 node(s) with A100:1; 0 of 5 hosts have it, so nothing was started" in err.message
    )
    for node, has in zip(
        gpu_hosts.nodes,
        [
            "8x H100 (nvidia-smi)",
            "4x A100-80GB (nvidia-smi)",
            "8x H100 (nvidia-smi)",
            "no GPUs (neither",
            "2x MI300X",
        ],
        strict=True,
    ):
        assert f"{node.user}@{node.host}:{node.port}: has {has}" in err.message
    with pytest.raises(BackendError, match="0 of 5 hosts have it"):  # the backend alone refuses it too
        b.provision("wrong", spec)
    assert all(not Path(n.home, ".sky_airflow", "wrong").exists() for n in gpu_hosts.nodes)


def test_too_few_hosts_with_the_gpus(gpu_hosts: SSHDCluster) -> None:
    b = _backend(gpu_hosts)
    with pytest.raises(SpecError) as info:
        choose_resources(b, task_from_args(num_nodes=3, run="true", resources={"accelerators": "H100:8"}))
    assert "3 node(s) with H100:8; 2 of 5 hosts have it" in info.value.message
    assert f"{gpu_hosts.nodes[0].host}:{gpu_hosts.nodes[0].port}: fits (8x H100" in info.value.message
    with pytest.raises(SpecError, match="the task asks for H100:16"):
        choose_resources(b, task_from_args(num_nodes=1, run="true", resources={"accelerators": "H100:16"}))


def test_the_first_alternative_the_hosts_have_wins(gpu_hosts: SSHDCluster) -> None:
    b = _backend(gpu_hosts)
    spec = task_from_args(
        num_nodes=2, run=DUMP, resources={"accelerators": ["A100-80GB:8", "H100:8", "MI300X:2"]}
    )
    choice = choose_resources(b, spec, "alt")
    assert (choice.index, str(choice.resources.accelerators)) == (1, "H100:8")
    assert (
        "passed over: #1 (A100-80GB:8): the task asks for 2 node(s) with A100-80GB:8; 0 of 5" in choice.note()
    )
    hosts, _, runs = _run(b, "alt", spec)
    assert hosts == [gpu_hosts.nodes[0].host, gpu_hosts.nodes[2].host]
    assert [r["SKYPILOT_NUM_GPUS_PER_NODE"] for r in runs] == ["8", "8"]


def test_declared_gpus_for_a_host_without_the_tools(gpu_hosts: SSHDCluster) -> None:
    n3 = gpu_hosts.nodes[3]
    b = _backend(gpu_hosts, accelerators=json.dumps({n3.host: "T4:2"}))
    hosts, _, runs = _run(
        b, "decl", task_from_args(num_nodes=1, run=DUMP, resources={"accelerators": "T4:2"})
    )
    assert hosts == [n3.host] and runs[0]["CUDA_VISIBLE_DEVICES"] == "0,1"
    # through the connection's extra, and a host the extra names that is not a host is an error
    config = {
        "host": ",".join(gpu_hosts.host_list()),
        "key_file": gpu_hosts.client_key_path,
        "accelerators": "L4:1",
    }
    assert SSHBackend.from_config(config).declared[(n3.host, n3.port)].describe() == "1x L4 (declared)"
    with pytest.raises(BackendError, match="'10.9.9.9' is not one of the hosts"):
        SSHBackend.from_config({**config, "accelerators": '{"10.9.9.9": "H100:8"}'})


def test_a_cluster_reused_with_more_gpus_than_its_hosts_have_is_refused(gpu_hosts: SSHDCluster) -> None:
    b = _backend(gpu_hosts)
    first = b.provision(
        "reuse", task_from_args(num_nodes=1, run="true", resources={"accelerators": "A100-80GB:2"})
    )
    assert first.nodes[0].extra["gpu_devices"] == [0, 1]
    again = b.provision(
        "reuse", task_from_args(num_nodes=1, run="true", resources={"accelerators": "A100-80GB:4"})
    )
    assert again.nodes[0].extra["gpu_devices"] == [0, 1, 2, 3]  # a node is the whole host
    with pytest.raises(BackendError, match="cluster 'reuse' exists on hosts that lack .*has 4x A100-80GB"):
        b.provision("reuse", task_from_args(num_nodes=1, run="true", resources={"accelerators": "H100:1"}))
    assert b.terminate("reuse").removed
