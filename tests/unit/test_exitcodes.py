from __future__ import annotations

import pytest

from airflow_provider_sky.node.exitcodes import describe_exit, signal_of


@pytest.mark.parametrize(
    ("code", "words"),
    [
        (139, "segmentation fault (SIGSEGV)"),
        (-11, "segmentation fault (SIGSEGV)"),
        (137, "killed by SIGKILL (often the out-of-memory killer)"),
        (-9, "killed by SIGKILL"),
        (134, "aborted (SIGABRT"),
        (-6, "aborted (SIGABRT"),
        (135, "bus error (SIGBUS)"),
        (136, "floating point exception (SIGFPE)"),
        (143, "terminated (SIGTERM"),
        (130, "interrupted (SIGINT)"),
        (127, "command not found"),
        (126, "command not executable"),
        (129, "killed by SIGHUP"),
        (-10, "killed by SIGUSR1"),
        (1, "exited with code 1"),
        (2, "exited with code 2"),
        (0, "succeeded"),
    ],
)
def test_exit_codes_read_as_words(code: int, words: str) -> None:
    assert words in describe_exit(code)


def test_kubernetes_oom_reason_wins_over_the_code() -> None:
    assert describe_exit(137, k8s_reason="OOMKilled") == "out of memory (killed by the OOM killer)"


def test_signal_of_only_for_signal_range() -> None:
    assert signal_of(139) == 11
    assert signal_of(-15) == 15
    assert signal_of(1) is None
    assert signal_of(128) is None
