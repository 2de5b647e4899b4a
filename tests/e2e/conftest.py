"""The e2e tier: a failed test keeps the logs of every Airflow stack still running.

A failure under a real scheduler and triggerer is often a race seen once; its stack's logs (the
services', the tasks', the triggers' and the bridges') are copied out of the test's tmp dir, which pytest
rotates away, and the report names where they are, with the end of the triggerer's log.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from devstack.stack import AirflowStack


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
