"""The node scripts are files in the package: each one loads whole (includes and embeds filled in) and the
text that travels to a node parses under dash and under busybox sh, the shells nodes have."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from airflow_provider_sky.node import runtime
from airflow_provider_sky.node import shell as node_scripts
from airflow_provider_sky.node.scripts import load, names

SHELLS = [["dash", "-n"], ["busybox", "sh", "-n"]]


def _parses(text: str, tmp_path: Path, what: str) -> None:
    script = tmp_path / "script.sh"
    script.write_text(text)
    for shell in SHELLS:
        if shutil.which(shell[0]) is None:
            pytest.fail(f"{shell[0]} is missing: make system-deps installs it")
        p = subprocess.run([*shell, str(script)], capture_output=True, text=True)
        assert p.returncode == 0, (what, shell[0], p.stderr)


@pytest.mark.parametrize("name", [n for n in names() if n.endswith(".sh")])
def test_each_script_loads_whole_and_parses_under_dash_and_busybox(name: str, tmp_path: Path) -> None:
    text = load(name)
    for marker in ("$SKY_SCRIPTS", "@sky:", "@sky-quoted:", "# shellcheck"):
        assert marker not in text, (name, marker)
    _parses(text, tmp_path, name)


def test_the_mask_filter_travels_whole_inside_the_wrapper() -> None:
    """The Python and awk filters sit in single quotes in the wrapper: all of each is there, as code."""
    compile(node_scripts.MASK_PY, "mask_filter.py", "exec")
    assert node_scripts.MASK_PY.strip() in node_scripts.WRAPPER
    assert node_scripts.MASK_AWK.strip() in node_scripts.WRAPPER
    assert node_scripts.KILLER.strip() in node_scripts.CANCEL_SCRIPT


def test_the_teardown_without_removal_removes_nothing(tmp_path: Path) -> None:
    keep = node_scripts.teardown_script(remove=False)
    assert "rm -rf --" in node_scripts.teardown_script() and "rm -rf --" not in keep
    _parses(keep, tmp_path, "teardown_script(remove=False)")


def test_a_launch_script_with_hostile_values_parses_and_quotes_them(tmp_path: Path) -> None:
    """What a builder fills in (env values, secrets, a working directory, a result path) is quoted: the
    whole launch script, every script file inside it, parses."""
    hostile = "x'; touch /tmp/pwned; echo '$(id)` \"\n"
    rl = runtime.RankLaunch(
        rank=0,
        command="echo hi",
        env={"A": hostile},
        secrets={"TOK": hostile + "secret-value"},
        cwd="/tmp/" + hostile,
        result_file="~/" + hostile,
    )
    text = runtime.launch_many_script(
        "job", [("/tmp/root", rl, runtime.Guard(orphan_timeout=5))], flag="/tmp/f"
    )
    _parses(text, tmp_path, "launch_many_script")
