"""The Kubernetes backend's provisioning probe (one exec per pod: its home, and its agent started) is
asked again when the API server drops the exec stream mid-call, which a loaded test cluster did
(``exec stream failed: socket is already closed``); a probe that keeps failing, or times out, fails the
provisioning with the pod named. The exec stream cannot be made to break on demand against the real
cluster, so the runner here is a fake that breaks where told (its name says so)."""

from __future__ import annotations

from typing import Any

import pytest

from airflow_provider_sky.backends.kubernetes import backend as k8s
from airflow_provider_sky.backends.kubernetes.config import parse_kube_config
from airflow_provider_sky.backends.kubernetes.pods import PodState
from airflow_provider_sky.errors import CommandTimeout, RunnerError
from airflow_provider_sky.runners.base import RunResult


class BrokenStreamRunnerFake:
    """Raises the runner's error for its first ``breaks`` calls, then answers as a pod with python3."""

    def __init__(self, pod: str, breaks: int, error: RunnerError | None = None) -> None:
        self.pod, self.breaks, self.calls = pod, breaks, 0
        self.error = error or RunnerError(pod, "exec stream failed: socket is already closed")

    def run_script(self, script: str, timeout: float | None = None, **_: Any) -> RunResult:
        self.calls += 1
        if self.calls <= self.breaks:
            raise self.error
        return RunResult(0, b"/root\nAGENT\n", b"")


def _backend(
    monkeypatch: pytest.MonkeyPatch, breaks: int, error: RunnerError | None = None
) -> tuple[Any, dict[str, Any]]:
    b = k8s.KubernetesBackend(parse_kube_config({}))
    runners: dict[str, BrokenStreamRunnerFake] = {}

    def runner(pod: str, ip: str) -> BrokenStreamRunnerFake:
        return runners.setdefault(pod, BrokenStreamRunnerFake(pod, breaks, error))

    monkeypatch.setattr(b, "_pod_runner", runner)
    monkeypatch.setattr(k8s.time, "sleep", lambda s: None)
    return b, runners


PODS = [PodState(f"sky-c-{i}", "Running", f"10.0.0.{i + 1}", "n1") for i in range(2)]


def test_a_dropped_exec_stream_is_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    b, runners = _backend(monkeypatch, breaks=k8s.PROBE_TRIES - 1)
    nodes, agents = b._handle_nodes("c", PODS, (b"token", "10.0.0.1", 4000))
    assert [n.home for n in nodes] == ["/root", "/root"] and agents
    assert {pod: r.calls for pod, r in runners.items()} == dict.fromkeys(
        ["sky-c-0", "sky-c-1"], k8s.PROBE_TRIES
    )


def test_a_probe_that_keeps_failing_fails_naming_the_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    b, runners = _backend(monkeypatch, breaks=k8s.PROBE_TRIES)
    with pytest.raises(RunnerError, match="socket is already closed"):
        b._handle_nodes("c", PODS, None)
    assert all(r.calls == k8s.PROBE_TRIES for r in runners.values())


def test_a_probe_that_timed_out_is_not_asked_again(monkeypatch: pytest.MonkeyPatch) -> None:
    b, runners = _backend(
        monkeypatch, breaks=1, error=CommandTimeout("sky-c-0", "command timed out after 60s")
    )
    with pytest.raises(CommandTimeout, match="timed out"):
        b._handle_nodes("c", PODS[:1], None)
    assert runners["sky-c-0"].calls == 1
