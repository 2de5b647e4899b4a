"""The Airflow UI as a user sees it, in Debian's Chromium (headless, driven by selenium through Debian's
chromium-driver; nothing downloads a browser or a driver).

A real stack (api-server, scheduler, dag-processor, triggerer; SQLite, local backend) runs
``tests/dags/sky_test_ui.py``: 4 ranks, rank 2 prints four lines 2 s apart and fails, the others are
cancelled. Then the browser checks what the issue asks for: the grid labels the mapped rank tasks
``rank 0`` … ``rank 3``; the failed rank's log shows its own output, each line at the second it was
printed, the root cause as one short line near the top, no blank ``INFO -`` lines and no raw event
dicts; a cancelled rank's log names the failing rank.

Screenshots of every page checked go to ``$SKY_TEST_ARTIFACTS/ui/`` (default ``tests/artifacts/ui/``,
ignored by git), also when a check fails; the path is printed.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

import pytest
from leaks import job_processes

from devstack.stack import AirflowStack

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "sky_test_ui"
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ARTIFACTS = Path(os.environ.get("SKY_TEST_ARTIFACTS") or REPO / "tests" / "artifacts") / "ui"
#: a log line as the UI's log view renders it: "[2026-12-03 16:51:41] INFO - text"
LOG_LINE = re.compile(
    r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\][ \t]*\n?[ \t]*(INFO|ERROR|WARNING|DEBUG|CRITICAL)[ \t]*\n?[ \t]*- ?([^\n]*)"
)

_missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
pytestmark = [
    pytest.mark.airflow_services,
    pytest.mark.skipif(
        bool(_missing),
        reason=f"needs Debian's chromium and chromium-driver ({', '.join(_missing)} missing; `make test` "
        "installs them as root; fix: apt-get install -y --no-install-recommends chromium chromium-driver)",
    ),
]


class Page:
    """A Chromium page of the stack's UI; every page visited is also a screenshot in ARTIFACTS."""

    def __init__(self, base_url: str) -> None:
        os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never download a browser or driver
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service

        opts = webdriver.ChromeOptions()
        opts.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1000"):
            opts.add_argument(arg)
        self.driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
        self.base_url = base_url

    def open(self, path: str, shot: str, expect: list[str], timeout: float = 60.0) -> str:
        """Load ``path``, wait until its text holds every string of ``expect`` (the React app loads its
        data after the page), screenshot it as ``shot``; the page's text."""
        self.driver.get(self.base_url + path)
        deadline = time.monotonic() + timeout
        text = ""
        try:
            while time.monotonic() < deadline:
                text = self.driver.find_element("tag name", "body").text
                if all(e in text for e in expect):
                    time.sleep(0.5)  # let the last rows render before the screenshot
                    return self.driver.find_element("tag name", "body").text
                time.sleep(0.5)
            missing = [e for e in expect if e not in text]
            raise AssertionError(f"{path}: {missing} not shown after {timeout:.0f} s; the page read:\n{text}")
        finally:
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            self.driver.save_screenshot(str(ARTIFACTS / shot))
            print(f"screenshot: {ARTIFACTS / shot}")

    def close(self) -> None:
        self.driver.quit()


@pytest.fixture(scope="module")
def ui(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AirflowStack, str, Page]]:
    """The stack with the run of ``sky_test_ui`` over (failed), and a browser on its UI."""
    base = tmp_path_factory.mktemp("airflow-ui")
    sky, dags = base / "sky", base / "dags"
    sky.mkdir()
    dags.mkdir()
    (dags / f"{DAG_ID}.py").symlink_to(REPO / "tests" / "dags" / f"{DAG_ID}.py")
    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    stack = AirflowStack(base / "airflow", dags, {"SKY_PROVIDER_HOME": str(sky)})
    try:
        with stack:
            run_id = stack.trigger(DAG_ID)
            assert stack.wait_run(DAG_ID, run_id, timeout=240) == "failed"
            page = Page(stack.url)
            try:
                yield stack, run_id, page
            finally:
                page.close()
    finally:
        left = job_processes(sky)
        for pid, _ in left:
            try:
                os.kill(pid, 9)
            except OSError:
                pass
    assert not left, f"processes left under {sky}: {left}"


def _run_path(run_id: str) -> str:
    return f"/dags/{DAG_ID}/runs/{quote(run_id, safe='')}"


def _log_lines(text: str) -> list[tuple[str, str, str]]:
    """(time, level, message) of every log line the page shows, in order."""
    return [(m.group(1), m.group(2), m.group(3).strip()) for m in LOG_LINE.finditer(text)]


def _seconds(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").timestamp()


def test_grid_labels_the_rank_tasks(ui: tuple[AirflowStack, str, Page]) -> None:
    stack, run_id, page = ui
    labels = [f"rank {i}" for i in range(4)]
    # the run's task instances: the mapped rank tasks by their label, not a bare map index
    text = page.open(_run_path(run_id), "run-task-instances.png", ["train.rank", *labels])
    assert all(label in text for label in labels), text
    # the mapped task's own list of instances
    text = page.open(f"{_run_path(run_id)}/tasks/train.rank/mapped", "rank-task-instances.png", labels)
    assert all(label in text for label in labels), text
    # what the UI reads, from the API: every rank's label set (by the scheduler's policy hook)
    ranks = sorted(
        (t for t in stack.task_instances(DAG_ID, run_id) if t["task_id"] == "train.rank"),
        key=lambda t: t["map_index"],
    )
    assert [t["rendered_map_index"] for t in ranks] == labels


def test_failed_rank_log(ui: tuple[AirflowStack, str, Page]) -> None:
    _, run_id, page = ui
    cause = (
        "root cause: rank 2 (127.1.0.3) exited with code 3; its last output: rank 2: loss is NaN, giving up"
    )
    text = page.open(f"{_run_path(run_id)}/tasks/train.rank/mapped/2", "failed-rank-log.png", [cause])
    lines = _log_lines(text)
    messages = [m for _, _, m in lines]
    assert lines, text
    # the rank's own output, in order
    steps = [i for i, m in enumerate(messages) if m.startswith("rank 2: ")]
    assert [messages[i] for i in steps] == [
        "rank 2: step 1",
        "rank 2: step 2",
        "rank 2: step 3",
        "rank 2: loss is NaN, giving up",
    ], messages
    # each line at the time the node printed it: 2 s apart, not all at the second they were read
    at = [_seconds(lines[i][0]) for i in steps[:3]]
    assert all(1 <= b - a <= 4 for a, b in zip(at, at[1:], strict=False)), [lines[i] for i in steps]
    # the root cause: one short line, the first error, near the top (within the first lines)
    first_error = next(i for i, (_, level, _) in enumerate(lines) if level == "ERROR")
    assert messages[first_error] == cause, messages
    assert messages.count(cause) == 1, messages
    assert first_error <= 6, messages
    # no blank "INFO -" line, no raw event dict
    assert all(m for m in messages), lines
    assert "TriggerEvent<{" not in text and "'kind': 'rank'" not in text, text


def test_cancelled_rank_log_names_the_failing_rank(ui: tuple[AirflowStack, str, Page]) -> None:
    _, run_id, page = ui
    cause = (
        "rank 0 cancelled; root cause: rank 2 (127.1.0.3) exited with code 3; "
        "its last output: rank 2: loss is NaN, giving up"
    )
    text = page.open(f"{_run_path(run_id)}/tasks/train.rank/mapped/0", "cancelled-rank-log.png", [cause])
    messages = [m for _, _, m in _log_lines(text)]
    assert "rank 0: training" in messages, messages
    errors = [m for _, level, m in _log_lines(text) if level == "ERROR"]
    assert errors == [cause], messages
    assert all(m for m in messages), messages
    assert "TriggerEvent<{" not in text, text


def test_the_run_page_shows_which_rank_failed_first_and_why(ui: tuple[AirflowStack, str, Page]) -> None:
    """The cause on the surface: the run's note (written by the provider's listener) is on the run's page,
    and the failing rank's own page shows its note, without opening a log."""
    stack, run_id, page = ui
    note = stack.dag_run(DAG_ID, run_id).get("note") or ""
    first = "rank 2 (127.1.0.3) exited with code 3, failed first"
    assert note.startswith(first), note
    assert "rank 2: loss is NaN, giving up" in note, note
    # the run's header shows the note's first line (the UI shortens the rest behind "...")
    page.open(_run_path(run_id), "run-note.png", [first])
    text = page.open(f"{_run_path(run_id)}/tasks/train.rank/mapped/2", "failed-rank-note.png", [first])
    assert first in text, text
