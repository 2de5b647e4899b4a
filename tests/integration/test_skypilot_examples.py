"""SkyPilot's multi-node examples: each YAML of ``tests/data/skypilot_examples`` (origins and
expected outcomes in its ``index.yaml``; not verbatim copies, see there) parses as it is; on a backend with
enough GPUs the cluster provisions, setup and run go, and every rank sees the right ``SKYPILOT_*`` values
and ``CUDA_VISIBLE_DEVICES``. The ``run`` and ``setup`` commands are replaced by an env dump here (as
arguments: the files are used as they are).

The GPUs are FAKE (this machine has none): the fake nvidia-smi of ``tests/fakes`` on PATH for the local
backend, and on the SSH test hosts (``SSHDCluster(gpus=...)``). Everything else is real.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from envdump import DUMP, parse
from gangs import wait_done
from gpus import local_gpus
from sshd import SSHDCluster, described, needs_sshd, settled_user_processes

from airflow_provider_sky.backends.base import Backend, ClusterHandle, choose_resources
from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.backends.registry import conn_types
from airflow_provider_sky.runners import ssh
from airflow_provider_sky.spec import SpecError, TaskSpec, is_bucket_source, load_task_yaml
from airflow_provider_sky.watch.jobs import GangClient
from airflow_provider_sky.watch.setup_stage import run_setup
from unit.test_skypilot_examples import DATA, DEVICES, EXAMPLES, LINES, MIXED_BOX, ON_SSH, _expect, _named

#: a fake nvidia-smi line per SkyPilot name the examples ask for


def _dumping(name: str) -> TaskSpec:
    """The example as it is, with run (and setup, when it has one) replaced by the env dump."""
    spec = load_task_yaml(DATA / name)
    overrides: dict[str, Any] = {"run": DUMP}
    if spec.setup:
        overrides["setup"] = DUMP
    return load_task_yaml(DATA / name, overrides=overrides)


def _sources_exist(spec: TaskSpec) -> bool:
    sources = [spec.workdir] if spec.workdir else []
    sources += list(spec.file_mounts.values())
    return all(Path(s).expanduser().exists() for s in sources if s and not is_bucket_source(s))


def _brought(b: Backend, name: str, spec: TaskSpec) -> TaskSpec:
    """A source the user would bring (a key at ~/.ssh/sky-key) is named before anything is provisioned,
    with every other problem of the spec; the rest of the example then runs without it."""
    if _sources_exist(spec):
        return spec
    with pytest.raises(SpecError, match="does not exist; fix the path"):
        choose_resources(b, spec, name, conn_types())
    here = {d: s for d, s in spec.file_mounts.items() if is_bucket_source(s) or Path(s).expanduser().exists()}
    return dataclasses.replace(spec, file_mounts=here)


def _check_gang(b: Backend, name: str, spec: TaskSpec, handle: ClusterHandle) -> list[dict[str, str]]:
    """Sync, setup and run like the cluster and job tasks; every rank's run env (setup env checked here)."""
    b.sync_files(handle, spec)
    client = GangClient(b, handle)
    lines: dict[int, list[str]] = {}
    try:
        if spec.setup:
            run_setup(client, spec, "setup", on_log=lambda r, line: lines.setdefault(r, []).append(line))
        client.launch(spec, "job")
        poll = wait_done(client, timeout=60)
        assert poll.status.succeeded, poll.status.failure_message()
        runs = [parse(client.poll("job").chunks[r][1].decode()) for r in range(len(handle.nodes))]
    finally:
        client.close()
    n = len(handle.nodes)
    for rank, env in enumerate(runs):
        assert env["SKYPILOT_NODE_RANK"] == env["NODE_RANK"] == env["RANK"] == str(rank), name
        assert env["SKYPILOT_NUM_NODES"] == env["WORLD_SIZE"] == env["NNODES"] == str(n)
        assert env["SKYPILOT_NODE_IPS"].split("\n") == handle.ips
        assert env["MASTER_ADDR"] == handle.ips[0]
        assert env["SKYPILOT_TASK_ID"] == "job"
        for key, value in spec.envs.items():
            if key in env:
                assert env[key] == value
    if spec.setup:
        setups = [parse("\n".join(lines[r])) for r in range(n)]
        for rank, env in enumerate(setups):
            assert env["SKYPILOT_SETUP_NODE_RANK"] == str(rank)
            assert env["SKYPILOT_SETUP_NODE_IPS"].split("\n") == handle.ips
            assert env["SKYPILOT_SETUP_NUM_GPUS_PER_NODE"] == runs[rank]["SKYPILOT_NUM_GPUS_PER_NODE"]
            assert env.get("CUDA_VISIBLE_DEVICES") == runs[rank].get("CUDA_VISIBLE_DEVICES")
    return runs


def _disk_gb(path: Path) -> float:
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).total / 1024**3


# ------------------------------------------------------------------------------------------- local backend


@pytest.mark.parametrize("name", _named("runs") + _named("refused"))
def test_on_the_local_backend_of_a_machine_with_enough_gpus(
    name: str, sky_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = _dumping(name)
    acc = spec.resources.accelerators
    per_node = acc.gpus_per_node if acc else 0
    local_gpus(monkeypatch, tmp_path, [LINES[acc.name]] * (spec.num_nodes * per_node) if acc else [])
    b = LocalBackend(sky_home)
    spec = _brought(b, name, spec)
    expect = _expect(name)
    if isinstance(expect, dict):  # refused: every field named at once, nothing made
        with pytest.raises(SpecError) as info:
            choose_resources(b, spec, name, conn_types())
        assert info.value.field.split(", ") == expect["refused"], info.value
        assert not (sky_home / "local" / name).exists()
        return
    needs = EXAMPLES[name].get("needs_disk_gb")
    if needs and _disk_gb(sky_home) < needs * 0.95:
        with pytest.raises(SpecError) as info:
            choose_resources(b, spec, name, conn_types())
        assert info.value.field in ("resources", "resources.disk_size")  # "resources": each alternative's why
        assert f"the task asks for {needs} GB" in info.value.message
        # on a machine with that disk it runs: a FAKE disk size (this machine's disk is smaller)
        real = shutil.disk_usage
        fake = real(sky_home)._replace(total=int(needs * 1.1 * 1024**3))
        monkeypatch.setattr("airflow_provider_sky.backends.local.backend.shutil.disk_usage", lambda _: fake)
        assert choose_resources(b, spec, name, conn_types()).index == 0
    choice = choose_resources(b, spec, name, conn_types())
    handle = b.provision(name, spec.with_resources(choice.resources))
    try:
        runs = _check_gang(b, name, spec, handle)
    finally:
        b.terminate(name)
    want = str(per_node)
    assert [r["SKYPILOT_NUM_GPUS_PER_NODE"] for r in runs] == [want] * spec.num_nodes
    if acc is None:
        assert not any("CUDA_VISIBLE_DEVICES" in r for r in runs)
    else:  # node i has its own devices: 0..k-1, k..2k-1, ...
        expected = [
            ",".join(str(d) for d in range(i * per_node, (i + 1) * per_node)) for i in range(spec.num_nodes)
        ]
        assert [r["CUDA_VISIBLE_DEVICES"] for r in runs] == expected


# ------------------------------------------------------------------------------------------- SSH hosts

#: each host a mixed GPU box: devices of a type keep the indices nvidia-smi gives them
#: the runnable examples whose hosts need no more CPUs than this test machine has (2)


@pytest.fixture(scope="module")
def mixed_hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SSHDCluster]:
    with SSHDCluster(2, tmp_path_factory.mktemp("sshd-corpus"), gpus={0: MIXED_BOX, 1: MIXED_BOX}) as c:
        yield c
        ssh.close_all()
        for node in c.nodes:
            left = settled_user_processes(node.user)
            assert left == [], f"processes of {node.user} left behind: {described(left)}"


@needs_sshd
@pytest.mark.parametrize("name", ON_SSH)
def test_on_ssh_hosts_that_have_the_gpus(name: str, mixed_hosts: SSHDCluster) -> None:
    from airflow_provider_sky.backends.ssh import SSHBackend

    spec = _dumping(name)
    b = SSHBackend(
        mixed_hosts.host_list(),
        user="",
        key_file=mixed_hosts.client_key_path,
        known_hosts=mixed_hosts.known_hosts_path,
        connect_timeout=5.0,
        ready_timeout=5.0,
    )
    spec = _brought(b, name, spec)
    needs = EXAMPLES[name].get("needs_disk_gb")
    if needs and _disk_gb(Path(mixed_hosts.nodes[0].home)) < needs * 0.95:
        with pytest.raises(SpecError) as info:
            choose_resources(b, spec, name, conn_types())
        assert info.value.field in ("resources", "resources.disk_size")
        assert f"GiB disk at its home, the task asks for {needs} GB" in info.value.message
        return
    choice = choose_resources(b, spec, name, conn_types())
    handle = b.provision(name, spec.with_resources(choice.resources))
    try:
        runs = _check_gang(b, name, spec, handle)
    finally:
        b.terminate(name)
        b.close()
    acc = choice.resources.accelerators
    if acc is None:
        assert not any("CUDA_VISIBLE_DEVICES" in r for r in runs)
    else:
        devices = ",".join(str(d) for d in DEVICES[acc.name][: acc.gpus_per_node])
        assert [r["CUDA_VISIBLE_DEVICES"] for r in runs] == [devices] * spec.num_nodes
        assert [r["SKYPILOT_NUM_GPUS_PER_NODE"] for r in runs] == [str(acc.gpus_per_node)] * spec.num_nodes
