"""Commands in pods through the exec API (real cluster): arguments arrive literally, the script and its
secrets never appear on a command line, an abandoned call's process ends, a poll is one exec per pod."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import pytest
from k8s_cluster import LOCAL_DIR, K8sCluster

from airflow_provider_sky.backends.kubernetes.backend import KubernetesBackend
from airflow_provider_sky.runners.base import CALLS, RunnerError
from airflow_provider_sky.spec import task_from_args
from airflow_provider_sky.watch.jobs import GangClient
from integration.test_k8s_backend import _wait, backend, extras  # noqa: F401  (fixtures)


def test_arguments_arrive_literally_and_the_script_stays_off_the_command_line(
    backend: KubernetesBackend,
) -> None:
    h = backend.provision("argv", task_from_args(num_nodes=1, run="true"))
    runner = backend.runner(h.nodes[0])
    weird = ["a b", "$(touch /tmp/canary)", "'q'", '"dq"', "-n", "", "x;y", "\\n"]
    res = runner.run_script('printf "%s|" "$@"; [ ! -e /tmp/canary ] || echo CANARY', weird)
    assert res.returncode == 0 and res.text == "|".join(weird) + "|", res
    # a secret in the script is on stdin only: no process in the pod shows it in its arguments
    # (ps writes a file first: a grep in a pipe with ps shows the pattern itself, when ps sees it in time)
    res = runner.run_script(
        'SECRET_TOKEN=hunter2-s3cr3t; ps -o args > /tmp/ps.out; grep -c "hunter2-s3cr3t" /tmp/ps.out || true'
    )
    assert res.text.strip() == "0", res
    res = runner.run_script("ps -o args")
    assert "hunter2" not in res.text
    backend.terminate("argv")


def test_an_abandoned_call_ends_in_the_pod(backend: KubernetesBackend) -> None:
    h = backend.provision("abandon", task_from_args(num_nodes=1, run="true"))
    runner = backend.runner(h.nodes[0])

    unhandled: list[str] = []

    async def give_up() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: unhandled.append(str(ctx.get("message"))))
        call = asyncio.ensure_future(runner.arun_script("sleep 47; echo late", timeout=2))
        await asyncio.sleep(1)
        call.cancel()
        await asyncio.sleep(2.5)  # the call's thread ends (its socket closed under it) while the loop runs
        gc.collect()  # a never-retrieved exception is reported when its future is collected

    asyncio.run(give_up())
    # the thread's own error is taken by the runner, not left for asyncio to log as a bug in the bridge's log
    assert not [m for m in unhandled if "never retrieved" in m], unhandled
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if "sleep 47" not in runner.run_script("ps -o args").text:
            break
        time.sleep(0.5)
    assert "sleep 47" not in runner.run_script("ps -o args").text  # killed at its timeout, not left running
    backend.terminate("abandon")


def test_a_poll_is_one_exec_per_pod(backend: KubernetesBackend) -> None:
    spec = task_from_args(num_nodes=4, run="sleep 3")
    h = backend.provision("calls", spec)
    c = GangClient(backend, h)
    c.launch(spec, "job")
    for _ in range(3):
        CALLS.reset()
        c.poll("job")
        assert CALLS.total() == 4, CALLS.counts
    _wait(c, "job")
    backend.terminate("calls")


def test_a_call_whose_stream_goes_silent_ends_at_its_timeout(
    k8s: K8sCluster,
    backend: KubernetesBackend,
) -> None:
    """The pod's kubelet stops (SIGSTOP) mid-call: nothing more comes down the stream, no close either.
    The call ends at its own limit with an error saying so; it used to wait for the next frame forever
    (a pytest that could not exit, its last exec thread blocked at interpreter shutdown)."""
    if not k8s.local:
        pytest.skip("stops a kubelet of the local test cluster (tests/k8s/k8s-local.sh)")
    h = backend.provision("silent", task_from_args(num_nodes=1, run="true"))
    try:
        runner = backend.runner(h.nodes[0])
        node = backend.core.read_namespaced_pod(h.nodes[0].node_id, backend.namespace).spec.node_name
        suffix = "" if node == "localhost" else node.rsplit(".", 1)[-1]
        kubelet = int((LOCAL_DIR / "run" / f"kubelet{suffix}.pid").read_text())

        async def call() -> BaseException | None:
            task = asyncio.ensure_future(runner.arun_script("echo up; sleep 30", timeout=4))
            await asyncio.sleep(1.5)  # the stream is open and the script runs
            os.kill(kubelet, signal.SIGSTOP)
            try:
                await task
            except RunnerError as exc:
                return exc
            return None

        started = time.monotonic()
        try:
            err = asyncio.run(call())
        finally:
            os.kill(kubelet, signal.SIGCONT)
        took = time.monotonic() - started
        assert isinstance(err, RunnerError) and "timed out after 4s" in str(err), err
        assert took < 10, f"the call took {took:.1f}s for a 4 s limit (stream open included)"
    finally:
        backend.terminate("silent")
