"""The node scripts are files in the package: each one loads whole (includes and embeds filled in) and the
text that travels to a node parses under dash and under busybox sh, the shells nodes have."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
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
    call = '|| remove_roots "$@"'  # the one call of the function that removes the roots
    assert call in node_scripts.teardown_script() and call not in keep
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


def _watchdog() -> str:
    """The wrapper's output watchdog, as it is in wrapper.sh: the subshell that USR1s the wrapper after
    ``$wt`` seconds (2 while a process of the rank's group is left) unless the wrapper TERMs it first."""
    text = load("wrapper.sh")
    start = text.index("  (\n    exec 4<&-; s=''; stop=''")
    end = text.index(") </dev/null >/dev/null 2>&1 &", start)
    return text[start:end] + ") </dev/null >/dev/null 2>&1 &\n"


@pytest.mark.parametrize("shell", [["dash"], ["busybox", "sh"], ["bash"]], ids=lambda s: s[0])
def test_the_wrappers_watchdog_takes_its_sleep_with_it_when_stopped_at_once_under_load(
    shell: list[str],
) -> None:
    """The wrapper TERMs its watchdog as soon as its rank's output is through, often right after starting
    it: the watchdog's ``sleep 2`` must go with it, even when the TERM comes between the sleep's fork and
    its exec (it then had the subshell's trap, which the exec drops: the sleep outlived the rank by 2 s, a
    few times in a hundred with the CPU busy). 400 watchdogs stopped at once beside two busy loops."""
    if shutil.which(shell[0]) is None:
        pytest.fail(f"{shell[0]} is missing: make system-deps installs it")
    tag = f"sky-watchdog-test-{uuid.uuid4().hex[:8]}"
    # the watchdog's sleep, renamed per test run so that only ours are counted
    body = "wt=2\n" + _watchdog().replace("sleep 2 &", '"$SLEEP" 2 &')
    script = f'{body}wd=$!\nkill "$wd" 2>/dev/null\nwait "$wd" 2>/dev/null\nexit 0\n'
    bindir = Path(tempfile.mkdtemp(prefix="sky-wd-"))
    sleeper = bindir / tag
    sleeper.symlink_to(shutil.which("sleep") or "/bin/sleep")
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(2)]
    try:
        for _ in range(400):
            subprocess.run(
                [*shell, "-c", script], env={"SLEEP": str(sleeper), "PATH": "/usr/bin:/bin"}, check=True
            )
        time.sleep(0.2)
        left = subprocess.run(
            ["pgrep", "-f", f"^{sleeper} 2$"], capture_output=True, text=True
        ).stdout.split()
        assert left == [], f"{len(left)} watchdog sleeps outlived their watchdog"
    finally:
        for h in hogs:
            h.kill()
            h.wait()
        subprocess.run(["pkill", "-KILL", "-f", f"^{sleeper} 2$"], check=False)
        shutil.rmtree(bindir, ignore_errors=True)


def _with_pid(target: int, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes] | None:
    """A new session and group leader whose pid is ``target`` (asked of the kernel through
    ``ns_last_pid``, root only; another fork on the machine may take the number first: asked again)."""
    for _ in range(100):
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(target - 1))
        proc = subprocess.Popen(argv, env=env, start_new_session=True)
        if proc.pid == target:
            return proc
        proc.kill()
        proc.wait()
    return None


@pytest.mark.parametrize("shell", [["dash"], ["busybox", "sh"]], ids=lambda s: s[0])
def test_the_sigkill_after_the_grace_spares_a_group_whose_number_was_reused(shell: list[str]) -> None:
    """A fail-fast's delayed SIGKILL (``killer.sh``) goes to the job's groups that outlived the grace. A
    group that ended meanwhile has a free number, which a busy machine gives out again within minutes
    (32768 pids at 200 a second): the stranger holding it now is not killed, and the rank that ignored
    the SIGTERM is."""
    mark = f"/tmp/sky-reuse-test-{uuid.uuid4().hex[:8]}/jobs/job/0/"
    ours = {**os.environ, "SKY_PROVIDER_MARK": mark}
    plain = {k: v for k, v in os.environ.items() if k != "SKY_PROVIDER_MARK"}
    ended = subprocess.Popen(["sleep", "60"], env=ours, start_new_session=True)
    ended.kill()
    ended.wait()  # its group is gone: the number is free
    stranger = _with_pid(ended.pid, ["sleep", "60"], plain)
    assert stranger is not None, f"pid {ended.pid} could not be had again"
    stubborn = subprocess.Popen(
        ["sh", "-c", "trap '' TERM; sleep 60 & wait"], env=ours, start_new_session=True
    )
    try:
        time.sleep(0.2)  # the stubborn rank's sleep has started
        subprocess.run(
            [*shell, "-c", node_scripts.KILLER, "sh", "2", f"{ended.pid} {stubborn.pid}"],
            env={**plain, "SKY_KILL_MARKS": mark},
            timeout=30,
            check=True,
        )
        assert stubborn.wait(10) == -signal.SIGKILL
        assert stranger.poll() is None, "the SIGKILL after the grace reached a group that is not the job's"
    finally:
        for proc in (stranger, stubborn):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.parametrize("shell", [["dash"], ["busybox", "sh"]], ids=lambda s: s[0])
def test_marked_finds_a_process_whose_mark_is_not_its_first_variable(shell: list[str]) -> None:
    """``marked`` reads every process's NUL-separated environ: busybox's grep (the one of a busybox
    image) stopped at the first NUL, so it found a process only when the mark was its first variable."""
    mark = f"/tmp/sky-marked-test-{uuid.uuid4().hex[:8]}/jobs/job/0/"
    proc = subprocess.Popen(
        ["sleep", "60"], env={"A": "1", "SKY_PROVIDER_MARK": mark, "Z": "2"}, start_new_session=True
    )
    try:
        script = f'{node_scripts.MARKED_FUNCS}\nmarked "$1"\n'
        out = subprocess.run(
            [*shell, "-c", script, "sh", mark], capture_output=True, text=True, timeout=30, check=True
        ).stdout.split()
        if out != [str(proc.pid)]:  # what the process looked like then: alive, and its mark readable?
            try:
                env = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
            except OSError as e:
                env = [repr(e).encode()]
            raise AssertionError(
                f"marked found {out}, not {proc.pid} (exit code {proc.poll()}, environ {env})"
            )
    finally:
        proc.kill()
        proc.wait()


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "SKY_PROVIDER_MARK"}


def _pids(d: Path) -> tuple[int, int]:
    """The (wrapper, group) pids a rank directory names, once both are written."""
    deadline = time.monotonic() + 10
    while True:
        try:
            return int((d / "pid").read_text()), int((d / "pgid").read_text())
        except (OSError, ValueError):
            assert time.monotonic() < deadline, f"{d} has no pid and pgid"
            time.sleep(0.02)


def _rank(root: Path, rank: int, *, kill_wrapper: bool = False) -> tuple[subprocess.Popen[bytes], int]:
    """A running rank as the wrapper leaves it: its command leads a group of its own (setsid), marked, a
    child of the wrapper, whose pid is in ``pid`` and the group's in ``pgid``; the wrapper and the
    group's number. ``kill_wrapper``: the wrapper is then SIGKILLed (the command lives on, re-parented)."""
    d = root / "jobs" / "job" / str(rank)
    d.mkdir(parents=True)
    script = 'SKY_PROVIDER_MARK="$1/" setsid sleep 60 & echo $! > "$1/pgid"; echo $$ > "$1/pid"; wait'
    wrapper = subprocess.Popen(["sh", "-c", script, "sh", str(d)], env=_plain_env())
    _, group = _pids(d)
    if kill_wrapper:
        wrapper.kill()
        wrapper.wait()
    return wrapper, group


def _gone(pid: int, timeout: float = 10.0) -> bool:
    """Whether process ``pid`` ended (reaped, or a zombie) within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("mode", ["wait", "nowait"])
@pytest.mark.parametrize("shell", [["dash"], ["busybox", "sh"]], ids=lambda s: s[0])
def test_a_cancel_spares_a_group_that_took_the_number_of_a_rank_ended_without_a_record(
    shell: list[str], mode: str, tmp_path: Path
) -> None:
    """A rank whose wrapper died with it leaves a ``pgid`` and no exit record; a cancel (a teardown, a
    fail-fast, a user's mark-failed) minutes later read that number and sent its SIGTERM to whatever
    process group holds it by then, another job's rank or an Airflow process. The rank running beside
    it, and one whose wrapper was killed while its command lives on, still get theirs."""
    root = tmp_path / "node"
    stale = root / "jobs" / "job" / "0"
    stale.mkdir(parents=True)
    ended = subprocess.Popen(["sleep", "0"], env=_plain_env())
    ended.wait()
    stranger = subprocess.Popen(["sleep", "60"], env=_plain_env(), start_new_session=True)
    (stale / "pid").write_text(f"{ended.pid}\n")  # its wrapper: gone
    (stale / "pgid").write_text(f"{stranger.pid}\n")  # its group's number: another's now
    wrapper, running = _rank(root, 1)
    _, orphan = _rank(root, 2, kill_wrapper=True)
    try:
        args = runtime.cancel_args(
            1.0, [(str(root), "job", r) for r in range(3)], wait=mode == "wait", reason="bye"
        )
        subprocess.run(
            [*shell, "-c", node_scripts.CANCEL_SCRIPT, "sh", *args], env=_plain_env(), timeout=30, check=True
        )
        assert _gone(running) and _gone(orphan), "a rank of the job outlived its cancel"
        time.sleep(1.5)  # past the grace: the delayed SIGKILL of a cancel that does not wait too
        assert stranger.poll() is None, "the cancel signalled a process group that is not the job's"
        for r in range(3):
            assert (root / "jobs" / "job" / str(r) / "cancel").read_text() == "bye\n"
    finally:
        for pg in (stranger.pid, running, orphan):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pg, signal.SIGKILL)
        stranger.wait()
        wrapper.wait(10)
