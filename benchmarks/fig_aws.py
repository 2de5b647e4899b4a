"""Figure 7: the AWS EC2 backend's lifecycle against moto's server: time and EC2 API calls.

moto's server (HTTP, on a free loopback port) plays EC2; moto boots nothing, so each instance is reached at
a real sshd host of ``tests/support/sshd.py`` through the tests' ``FakeNetwork`` (the only fake). Per gang size N
(4 and 16): provision (one RunInstances for all N, the running waiter, SSH banner probe, login, host keys
pinned, the head's record), find from a fresh backend, and terminate (TerminateInstances, the terminated
waiter, the cluster's security group and key pair deleted); every EC2 call goes through a counting proxy
(``tests/moto_ec2.measure_lifecycle``, the function the tests use). The times are this machine's SSH and
moto's answers, not AWS's (real instances take a minute or more to boot): the figure is about the client's
own cost and how many calls it makes, which must not grow per instance per poll.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from typing import Any

from benchmarks.common import TESTS, Row

NS = (4, 16)


def run(plan: Any, say: Callable[..., None], ns: tuple[int, ...] = NS) -> list[Row]:
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from moto_ec2 import IMAGE, REGION, FakeNetwork, MotoEC2, measure_lifecycle
    from sshd import SSHDCluster

    from airflow_provider_sky.backends.aws import AWSBackend
    from airflow_provider_sky.runners import ssh

    reps = 1 if plan.quick else 3
    rows: list[Row] = []
    moto = MotoEC2().start()
    real_endpoint, real_agent_address = AWSBackend.endpoint, AWSBackend.agent_address
    try:
        with SSHDCluster(max(ns), tempfile.mkdtemp(prefix="sky-bench-aws-")) as hosts:
            net = FakeNetwork(hosts, moto)
            AWSBackend.endpoint = lambda self, inst: net.endpoint(self, inst)  # type: ignore[method-assign]
            AWSBackend.agent_address = FakeNetwork.agent_address  # type: ignore[method-assign]
            config = {
                "login": "testing",
                "password": "testing",
                "region_name": REGION,
                "private_key": hosts.client_key_text,
                "image_id": IMAGE,
                "provision_timeout": 120,
            }
            for n in ns:
                lives = []
                for rep in range(reps):
                    moto.reset()
                    net.assigned.clear()
                    life = measure_lifecycle(moto, config, n, f"bench-{n}-{rep}")
                    ssh.close_all()
                    net.power_off_gone()
                    say(
                        f"  N={n}: provision {life.provision_s:.2f} s, find {life.find_s:.2f} s, terminate "
                        f"{life.terminate_s:.2f} s, {life.calls} EC2 calls {life.provision_calls}"
                    )
                    lives.append(life)
                rows += [
                    Row("7 aws provision (moto+sshd)", n, [x.provision_s for x in lives]),
                    Row("7 aws find", n, [x.find_s for x in lives]),
                    Row("7 aws terminate", n, [x.terminate_s for x in lives]),
                    Row(
                        "7 aws EC2 calls / lifecycle",
                        n,
                        [float(x.calls) for x in lives],
                        unit="calls",
                        goal="< 2N + 20",
                        met=all(x.calls < 2 * n + 20 for x in lives),
                        note="one RunInstances and one TerminateInstances for all N; CreateTags per instance once",
                    ),
                ]
    finally:
        AWSBackend.endpoint = real_endpoint  # type: ignore[method-assign]
        AWSBackend.agent_address = real_agent_address  # type: ignore[method-assign]
        moto.stop()
    return rows
