"""File transfer through the runner interface: LocalRunner.put_file / put_tree on real files.

The last test copies the same tree with LocalRunner and with SSHRunner (a real sshd) and compares what
arrived, so both runners give ``put_tree`` the same meaning.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from airflow_provider_sky.runners.base import RunnerError, walk_tree
from airflow_provider_sky.runners.local import LocalRunner


def make_tree(src: Path) -> Path:
    """A workdir with a subdir, an executable, a non-ASCII name, symlinks to a file, a dir and a parent."""
    (src / "sub" / "deeper").mkdir(parents=True)
    (src / "a.txt").write_text("alpha\n")
    (src / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "sub" / "run.sh").chmod(0o755)
    (src / "sub" / "deeper" / "ü.txt").write_text("unicode name\n")
    (src / "secret.txt").write_text("s\n")
    (src / "secret.txt").chmod(0o600)
    (src / "link.txt").symlink_to("a.txt")
    (src / "linkdir").symlink_to("sub")
    (src / "loop").symlink_to(".")  # must not recurse forever
    return src


EXPECTED = {
    "a.txt": ("f", 0o644, "alpha\n"),
    "link.txt": ("f", 0o644, "alpha\n"),
    "secret.txt": ("f", 0o600, "s\n"),
    "sub": ("d", None, ""),
    "sub/run.sh": ("f", 0o755, "#!/bin/sh\necho ran\n"),
    "sub/deeper": ("d", None, ""),
    "sub/deeper/ü.txt": ("f", 0o644, "unicode name\n"),
    "linkdir": ("d", None, ""),
    "linkdir/run.sh": ("f", 0o755, "#!/bin/sh\necho ran\n"),
    "linkdir/deeper": ("d", None, ""),
    "linkdir/deeper/ü.txt": ("f", 0o644, "unicode name\n"),
}


@pytest.fixture
def node(tmp_path: Path) -> LocalRunner:
    home = tmp_path / "home"
    home.mkdir()
    return LocalRunner("127.0.0.1", str(home))


@pytest.fixture(autouse=True)
def _umask() -> Iterator[None]:
    old = os.umask(0o022)
    yield
    os.umask(old)


def test_walk_tree_follows_links_and_skips_loops(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = make_tree(tmp_path / "src")
    with caplog.at_level(logging.WARNING):
        entries = [(e.relative, e.is_dir) for e in walk_tree(src)]
    assert entries == [
        ("a.txt", False),
        ("link.txt", False),
        ("linkdir", True),
        ("linkdir/deeper", True),
        ("linkdir/deeper/ü.txt", False),
        ("linkdir/run.sh", False),
        ("secret.txt", False),
        ("sub", True),
        ("sub/deeper", True),
        ("sub/deeper/ü.txt", False),
        ("sub/run.sh", False),
    ]
    assert any("symlink loop" in r.getMessage() and "loop" in r.getMessage() for r in caplog.records)


def test_put_file(node: LocalRunner, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    home = Path(node.home)
    node.put_file(src / "a.txt", "~/x/y/z.txt", mode=0o600)
    node.put_file(src / "sub" / "run.sh", f"{node.home}/abs/run.sh")
    node.put_file(src / "link.txt", "plain.txt")  # a symlink: its target's content
    assert (home / "x" / "y" / "z.txt").read_text() == "alpha\n"
    assert stat.S_IMODE((home / "x" / "y" / "z.txt").stat().st_mode) == 0o600
    assert stat.S_IMODE((home / "abs" / "run.sh").stat().st_mode) == 0o755
    assert not (home / "plain.txt").is_symlink() and (home / "plain.txt").read_text() == "alpha\n"
    node.put_file(src / "secret.txt", "~/x/y/z.txt")  # overwrites, and takes the new file's mode
    assert (home / "x" / "y" / "z.txt").read_text() == "s\n"
    assert node.put_tree(src / "a.txt", "~/single.txt") == 1  # put_tree of a file is put_file
    assert (home / "single.txt").read_text() == "alpha\n"


def test_destinations_outside_the_home_are_refused(node: LocalRunner, tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src")
    home = Path(node.home)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("untouched\n")
    (home / "escape").symlink_to(outside)  # e.g. left in the home by a setup script
    for dest in ("~/../outside/new.txt", "../outside/new.txt", str(outside / "new.txt"), "~/escape/new.txt"):
        with pytest.raises(RunnerError, match="outside the node's home"):
            node.put_file(src / "a.txt", dest)
        with pytest.raises(RunnerError, match="outside the node's home"):
            node.put_tree(src, dest)
    with pytest.raises(RunnerError, match="outside the node's home"):
        node.put_file(src / "a.txt", "~/escape/victim.txt")
    # a link inside the destination tree is checked too, not only the root
    (home / "work").mkdir()
    (home / "work" / "a.txt").symlink_to(outside / "victim.txt")
    with pytest.raises(RunnerError, match="outside the node's home"):
        node.put_tree(src, "~/work")
    assert sorted(p.name for p in outside.iterdir()) == ["victim.txt"]
    assert (outside / "victim.txt").read_text() == "untouched\n"
    # a link that stays inside the home is fine
    (home / "inside").symlink_to(home / "work")
    node.put_file(src / "secret.txt", "~/inside/s.txt")
    assert (home / "work" / "s.txt").read_text() == "s\n"


def test_copy_errors(node: LocalRunner, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    home = Path(node.home)
    with pytest.raises(RunnerError, match="No such file"):
        node.put_file(tmp_path / "missing", "~/m")
    with pytest.raises(RunnerError, match="No such file"):
        node.put_tree(tmp_path / "missing", "~/m")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "gone").symlink_to(tmp_path / "nowhere")
    with pytest.raises(RunnerError, match="broken symlink"):
        node.put_tree(broken, "~/b")
    (home / "file").write_text("f\n")
    (tmp_path / "one.txt").write_text("1\n")
    with pytest.raises(RunnerError, match="copy of"):  # a parent that is a file
        node.put_file(tmp_path / "one.txt", "~/file/below")
    with pytest.raises(RunnerError, match="copy of"):
        node.put_tree(make_tree(tmp_path / "src"), "~/file")
    special = tmp_path / "special"
    special.mkdir()
    os.mkfifo(special / "fifo")
    (special / "ok.txt").write_text("ok\n")
    with caplog.at_level(logging.WARNING):
        assert node.put_tree(special, "~/sp") == 1
    assert sorted(p.name for p in (home / "sp").iterdir()) == ["ok.txt"]
    assert any("not a regular file" in r.getMessage() for r in caplog.records)
