"""Exec with the script on stdin: on a v4-only API server (this 1.20 cluster) stdin never reaches EOF; a
length prefix fixes it. Run by hand: ``KUBECONFIG=/var/cache/k8s-local/pki/admin.kubeconfig python3 THIS``."""

import os
import time

from kubernetes import client, config
from kubernetes.stream import stream

KUBECONFIG = os.environ.get("KUBECONFIG", "/var/cache/k8s-local/pki/admin.kubeconfig")


def api() -> client.CoreV1Api:
    """An isolated client (never the global default configuration); a fresh one per exec stream."""
    return client.CoreV1Api(config.new_client_from_config(config_file=KUBECONFIG, persist_config=False))


def run(cmd: list[str], data: str, timeout: float = 10) -> None:
    r = stream(
        api().connect_get_namespaced_pod_exec,
        "eof",
        "default",
        command=cmd,
        stdin=True,
        stdout=True,
        stderr=True,
        tty=False,
        _preload_content=False,
    )
    print("  subprotocol:", getattr(r.sock, "subprotocol", None) if hasattr(r, "sock") else None)
    r.write_stdin(data)
    try:
        r.close_channel(0)
    except Exception as e:
        print("  close_channel:", e)
    out = ""
    t0 = time.time()
    while r.is_open() and time.time() - t0 < timeout:
        r.update(timeout=1)
        if r.peek_stdout():
            out += r.read_stdout()
    rc = r.returncode if not r.is_open() else "STILL OPEN (no EOF)"
    r.close()
    print(f"  {cmd!r}: out={out!r} rc={rc} in {time.time() - t0:.1f}s")


def main() -> None:
    v1 = api()
    container = client.V1Container(
        name="c",
        image="docker.io/library/busybox:local",
        image_pull_policy="Never",
        command=["sleep", "3600"],
    )
    pod = client.V1Pod(
        metadata=client.V1ObjectMeta(name="eof"),
        spec=client.V1PodSpec(restart_policy="Never", containers=[container]),
    )
    try:
        v1.delete_namespaced_pod("eof", "default", grace_period_seconds=0)
        time.sleep(2)
    except client.ApiException:
        pass
    v1.create_namespaced_pod("default", pod)
    for _ in range(60):
        if v1.read_namespaced_pod("eof", "default").status.phase == "Running":
            break
        time.sleep(1)
    script = "echo hi from script\n"
    print("1) sh -s with the script on stdin, stdin closed by close_channel:")
    run(["sh", "-s"], script)
    print("2) length-prefixed: head -c N | sh -s:")
    run(["sh", "-c", f"head -c {len(script.encode())} | sh -s"], script)
    v1.delete_namespaced_pod("eof", "default", grace_period_seconds=0)


if __name__ == "__main__":
    main()
