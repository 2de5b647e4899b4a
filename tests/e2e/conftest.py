"""The e2e tier: its modules run slowest first, and a failed test keeps the logs of every Airflow stack
still running.

``make test`` runs the tier on two xdist workers, a module on one worker (its stack starts once), each
worker taking the next module when it is nearly done with one: with the slowest modules first, the two
workers end within a minute of each other instead of one waiting for the other's last long module.

A failure under a real scheduler and triggerer is often a race seen once; its stack's logs (the
services', the tasks', the triggers' and the bridges') are copied out of the test's tmp dir, which pytest
rotates away, and the report names where they are, with the end of the triggerer's log.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devstack.stack import AirflowStack

HERE = Path(__file__).resolve().parent

#: the e2e modules, slowest first (the lanes' times: docs/development.md), but ``real`` after ``reliability``: ``celery`` and ``real`` each start their
#: stacks with every DAG triggered at once, and both at once load 2 cores 15 times over. A module not
#: named here runs after them. ``make test`` passes ``--no-loadscope-reorder``, else xdist would order
#: the modules by their number of tests.
SLOWEST_FIRST = (
    "test_airflow_celery.py",
    "test_reliability_airflow.py",
    "test_airflow_real.py",
    "test_k8s_agent_airflow.py",
    "test_aws_airflow.py",
    "test_ui_browser.py",
    "test_airflow_triggerers.py",
)


# trylast: after the Kubernetes plugin's order (its modules last), which the e2e tier does not want
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The e2e tests in the order of :data:`SLOWEST_FIRST`, each module's own order kept."""
    at = [i for i, item in enumerate(items) if item.path.parent == HERE]
    rank = {name: n for n, name in enumerate(SLOWEST_FIRST)}
    ordered = sorted((items[i] for i in at), key=lambda item: rank.get(item.path.name, len(rank)))
    for i, item in zip(at, ordered, strict=True):
        items[i] = item


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.failed:
        return
    for stack in list(AirflowStack.running):
        try:
            kept = stack.keep_logs(item.name)
            tail = stack.log_tail("triggerer")
        except Exception as exc:  # the report must not fail on a stack that is going away
            report.sections.append(("airflow stack", f"its logs could not be kept: {exc!r}"))
            continue
        report.sections.append(
            ("airflow stack", f"logs kept in {kept}; the end of the triggerer's log:\n{tail}")
        )
