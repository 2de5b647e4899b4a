"""SkyPilot's ``workdir: {url, ref}``: every node checks the repository out into ``~/sky_workdir``, on the
local backend and on real sshd hosts, from a real ``git daemon`` on loopback."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from k8s_cluster import Image, K8sCluster, connection_extras
from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.backends.local import LocalBackend
from airflow_provider_sky.spec import SpecError, task_from_args

GIT = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run([*GIT, "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """(the repository's git:// URL, its first commit): tag v1 there, branch main one commit on (v2)."""
    base = tmp_path / "served"
    repo = base / "repo"
    repo.mkdir(parents=True)
    _git(repo, "init", "-q", "-b", "main")
    (repo / "version.txt").write_text("v1\n")
    _git(repo, "add", "version.txt")
    _git(repo, "commit", "-q", "-m", "one")
    _git(repo, "tag", "v1")
    first = _git(repo, "rev-parse", "HEAD").strip()
    (repo / "version.txt").write_text("v2\n")
    _git(repo, "commit", "-q", "-am", "two")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    daemon = subprocess.Popen(
        [
            "git",
            "daemon",
            "--reuseaddr",
            "--export-all",
            f"--base-path={base}",
            "--listen=127.0.0.1",
            f"--port={port}",
            str(base),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        # `git daemon` runs git-daemon as its child: its own group, so one signal ends both
        start_new_session=True,
    )
    url = f"git://127.0.0.1:{port}/repo"
    try:
        deadline = time.time() + 10
        while subprocess.run(["git", "ls-remote", url], capture_output=True).returncode != 0:
            assert time.time() < deadline, "git daemon did not start"
            time.sleep(0.1)
        yield url, first
    finally:
        os.killpg(daemon.pid, signal.SIGKILL)
        daemon.wait()


def _spec(url: str, ref: str | None, num_nodes: int = 2):  # type: ignore[no-untyped-def]
    workdir = {"url": url, **({"ref": ref} if ref else {})}
    return task_from_args(num_nodes=num_nodes, run="cat version.txt", workdir=workdir)


def test_every_local_node_checks_out_the_ref_and_a_reused_cluster_moves_on(
    sky_home: Path, served: tuple[str, str]
) -> None:
    url, first = served
    b = LocalBackend(sky_home)
    spec = _spec(url, "v1")
    h = b.provision("g", spec)
    try:
        for ref, want in (
            ("v1", "v1\n"),
            (first, "v1\n"),
            ("main", "v2\n"),
            (None, "v2\n"),
            (first[:12], "v1\n"),
        ):
            spec = _spec(url, ref)
            b.sync_files(h, spec)
            for n in h.nodes:
                assert (Path(n.home) / "sky_workdir" / "version.txt").read_text() == want, ref
                assert b.workdir(n, spec) == f"{n.home}/sky_workdir"  # where setup and run start
    finally:
        b.terminate("g")


def test_a_ref_the_repository_has_not_names_the_field(sky_home: Path, served: tuple[str, str]) -> None:
    url, _ = served
    b = LocalBackend(sky_home)
    spec = _spec(url, "no-such-branch", num_nodes=1)
    h = b.provision("g", spec)
    try:
        with pytest.raises(SpecError) as err:
            b.sync_files(h, spec)
        assert err.value.field == "workdir"
        assert f"checking out {url} at no-such-branch" in err.value.message
    finally:
        b.terminate("g")


@needs_sshd
def test_every_ssh_host_checks_out_the_repository(served: tuple[str, str], tmp_path: Path) -> None:
    from airflow_provider_sky.backends.ssh import SSHBackend
    from airflow_provider_sky.runners import ssh

    url, _ = served
    with SSHDCluster(2, tmp_path) as c:
        b = SSHBackend(
            c.host_list(),
            user="",
            key_file=c.client_key_path,
            known_hosts=c.known_hosts_path,
            connect_timeout=5.0,
            ready_timeout=5.0,
        )
        spec = _spec(url, "main")
        h = b.provision("g", spec)
        try:
            b.sync_files(h, spec)
            for node in h.nodes:
                res = b.runner(node).run_script("cat ~/sky_workdir/version.txt")
                assert res.returncode == 0 and res.stdout == b"v2\n", res
        finally:
            b.terminate("g")
            ssh.close_all()


def test_a_pod_without_git_is_a_clear_error_naming_the_field(k8s: K8sCluster, k8s_image: Image) -> None:
    """The test image has no git: the error says so and how to fix it, instead of a shell's 'not found'."""
    from airflow_provider_sky.backends.registry import by_kind

    b = by_kind("kubernetes").make(connection_extras(k8s, k8s_image))
    spec = _spec("https://example.com/org/repo.git", "main", num_nodes=1)
    h = b.provision("nogit", spec)
    try:
        with pytest.raises(SpecError) as err:
            b.sync_files(h, spec)
        assert err.value.field == "workdir"
        assert "has no git" in err.value.message and "apt-get install git" in err.value.message
    finally:
        b.terminate("nogit")
        b.close()
