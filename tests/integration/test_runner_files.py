"""File transfer through the runner interface: LocalRunner.put_file / put_tree on real files.

The last test copies the same tree with LocalRunner and with SSHRunner (a real sshd) and compares what
arrived, so both runners give ``put_tree`` the same meaning.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from sshd import SSHDCluster, needs_sshd

from airflow_provider_sky.runners.base import CALLS
from airflow_provider_sky.runners.local import LocalRunner
from unit.test_runner_files import EXPECTED, make_tree, node  # noqa: F401  (shared with the unit half; fixtures among them)


def listing(root: Path) -> dict[str, tuple[str, int, str]]:
    """relative path -> (kind, permission bits, content) of everything under ``root``; links show as ``l``."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            st = path.lstat()
            kind = "l" if stat.S_ISLNK(st.st_mode) else "d" if stat.S_ISDIR(st.st_mode) else "f"
            text = path.read_text() if kind == "f" else ""
            out[str(path.relative_to(root))] = (kind, stat.S_IMODE(st.st_mode), text)
    return out


def without_dir_modes(found: dict[str, tuple[str, int, str]]) -> dict[str, tuple[str, int | None, str]]:
    """Directories are created, not copied: their mode is the umask's, so leave it out."""
    return {k: (kind, None if kind == "d" else mode, text) for k, (kind, mode, text) in found.items()}


def test_put_tree_copies_contents_modes_and_follows_symlinks(node: LocalRunner, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    os.utime(src / "a.txt", (1_000_000_000, 1_000_000_000))
    CALLS.reset()
    assert node.put_tree(src, "~/work") == 7
    assert CALLS.counts == {"127.0.0.1": 1}
    work = Path(node.home) / "work"
    assert without_dir_modes(listing(work)) == EXPECTED
    assert (work / "a.txt").stat().st_mtime == 1_000_000_000  # times kept, as the local backend's copy did
    res = node.run_script("cd work && sub/run.sh && linkdir/run.sh")
    assert res.returncode == 0 and res.text == "ran\nran\n"

    # again, into a tree that has changed: files are overwritten, others are left alone
    (work / "a.txt").write_text("old\n")
    (work / "mine.txt").write_text("kept\n")
    (src / "a.txt").write_text("new\n")
    assert node.put_tree(src, "~/work/") == 7
    assert (work / "a.txt").read_text() == "new\n" and (work / "mine.txt").read_text() == "kept\n"

    # relative and absolute destinations inside the home
    assert node.put_tree(src / "sub", "rel/dir") == 2
    assert (Path(node.home) / "rel" / "dir" / "run.sh").stat().st_mode & 0o777 == 0o755
    assert node.put_tree(src / "sub", f"{node.home}/abs") == 2
    assert (Path(node.home) / "abs" / "deeper" / "ü.txt").read_text() == "unicode name\n"


@needs_sshd
def test_local_and_ssh_runners_copy_the_same_tree(node: LocalRunner, tmp_path: Path) -> None:
    from airflow_provider_sky.runners import ssh

    src = make_tree(tmp_path / "src")
    show = (
        "cd work && export LC_ALL=C && find . -mindepth 1 -type d -printf '%P d\\n' | sort && "
        "find . ! -type d -printf '%P %y %m\\n' | sort && find . -type f -exec sha256sum {} + | sort"
    )
    assert node.put_tree(src, "~/work") == 7
    node.put_file(src / "a.txt", "~/work/extra/z.txt", mode=0o640)
    local = node.run_script(show)
    assert local.returncode == 0, local.error_text
    with SSHDCluster(1, tmp_path) as cluster:
        try:
            remote = ssh.SSHRunner(cluster.node_config(0))
            assert remote.put_tree(src, "~/work") == 7
            remote.put_file(src / "a.txt", "~/work/extra/z.txt", mode=0o640)
            over_ssh = remote.run_script(show)
            remote.close()
        finally:
            ssh.close_all()
    assert over_ssh.returncode == 0, over_ssh.error_text
    assert over_ssh.text == local.text
    assert "sub/run.sh f 755" in local.text and "extra/z.txt f 640" in local.text
