"""Turn a rank's exit code into words a user understands (139 → segmentation fault)."""

from __future__ import annotations

import signal

_SIGNAL_WORDS: dict[int, str] = {
    signal.SIGSEGV: "segmentation fault (SIGSEGV)",
    signal.SIGKILL: "killed by SIGKILL (often the out-of-memory killer)",
    signal.SIGABRT: "aborted (SIGABRT, e.g. NCCL watchdog, failed assert)",
    signal.SIGBUS: "bus error (SIGBUS)",
    signal.SIGFPE: "floating point exception (SIGFPE)",
    signal.SIGTERM: "terminated (SIGTERM: preemption or cancel)",
    signal.SIGINT: "interrupted (SIGINT)",
}


#: a rank SIGKILLed while its memory cgroup counted an OOM kill (``memory.events`` / ``memory.oom_control``
#: around the rank), or a container Kubernetes reports ``OOMKilled``: never read as a cancel or a person's kill
OOM_REASON = "out of memory (killed by the OOM killer)"


def signal_of(code: int) -> int | None:
    """The signal behind an exit code: shells report 128+N, Python's subprocess reports -N."""
    if code < 0:
        return -code
    if 128 < code < 128 + 65:
        return code - 128
    return None


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: int | None, k8s_reason: str | None = None) -> str:
    """Plain-words reason for an exit code, as SkyPilot prints "(likely due to Segmentation Fault)"."""
    if k8s_reason == "OOMKilled":
        return OOM_REASON
    if code is None:
        return "no exit code"
    if code == 0:
        return "succeeded"
    if code == 127:
        return "command not found"
    if code == 126:
        return "command not executable"
    signum = signal_of(code)
    if signum is not None:
        return _SIGNAL_WORDS.get(signum, f"killed by {_signal_name(signum)}")
    return f"exited with code {code}"
