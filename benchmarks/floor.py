"""Airflow's floor: the tasks and the trigger of sky_gang's DAG shape with no provider work in them.

Figure 4 (``dags/bench_floor.py``) and figure 5 (``dags/scale/bench_scale.py``'s
``bench_scale_floor_<N>``) build ``sky_gang``'s shape from these: what such a run takes is what
Airflow's scheduler, executor and triggerer take for the shape, the least any provider can take. The
stacks put the repository on ``PYTHONPATH``: the triggerer imports :class:`FloorWaitTrigger` from here.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.triggers.base import BaseTrigger, StartTriggerArgs, TaskSuccessEvent, TriggerEvent
from pydantic import JsonValue

#: where a floor job task leaves the moment its ranks end (one file per run), read by the triggers
FOLDER_ENV = "BENCH_FLOOR_DIR"


class FloorOperator(BaseOperator):
    """Returns ``value``; with ``start_from_trigger`` it starts and ends in the triggerer, never on a worker."""

    start_from_trigger = False

    def __init__(
        self,
        *,
        value: Any = None,
        start_from_trigger: bool = False,
        start_trigger_args: StartTriggerArgs | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.value = value
        self.start_from_trigger = start_from_trigger
        if start_trigger_args is not None:
            self.start_trigger_args = start_trigger_args

    def execute(self, context: Any) -> Any:
        return self.value

    def execute_complete(self, context: Any, event: Any = None) -> None:
        return None


def moment_file(folder: str, run_id: str) -> Path:
    """Where a run's floor job leaves its ranks' end (a run id may hold a slash)."""
    return Path(folder) / run_id.replace("/", "_")


class FloorJobOperator(FloorOperator):
    """The job task of the scale floor: the ranks "run" ``seconds`` from its end. It leaves that moment
    in a file (:func:`moment_file`) for the rank triggers, and returns the rank tasks' kwargs."""

    def __init__(self, *, seconds: float, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seconds = seconds

    def execute(self, context: Any) -> Any:
        path = moment_file(os.environ[FOLDER_ENV], context["run_id"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(repr(time.time() + self.seconds))
        return self.value


class FloorWaitTrigger(BaseTrigger):
    """Fires once the moment its run's floor job left is past (read from a file every ``poll`` seconds,
    no call to Airflow), ending its task from the triggerer as the provider's rank triggers do; with
    ``xcom``, pushing a ``sky_rank``-sized XCom as they do. The run id and map index come from the
    context directly (no Jinja: the provider's triggers avoid it too, see ``render_template_fields``)."""

    def __init__(self, folder: str, poll: float = 0.5, xcom: bool = False, path: str = "", rank: int = -1):
        super().__init__()
        self.folder, self.poll, self.xcom, self.path, self.rank = folder, poll, xcom, path, rank

    def render_template_fields(self, context: Any, jinja_env: Any = None) -> None:
        self.path = str(moment_file(self.folder, context["run_id"]))
        self.rank = int(context["ti"].map_index)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        kwargs = {k: getattr(self, k) for k in ("folder", "poll", "xcom", "path", "rank")}
        return f"{__name__}.{type(self).__name__}", kwargs

    async def run(self) -> AsyncIterator[TriggerEvent]:
        while True:
            try:
                moment = float(Path(self.path).read_text())
            except (OSError, ValueError):
                moment = None
            if moment is not None and time.time() >= moment:
                break
            await asyncio.sleep(self.poll)
        summary: dict[str, JsonValue] = {
            "rank": self.rank,
            "ip": "127.0.0.1",
            "state": "succeeded",
            "exit_code": 0,
            "end": moment,
        }
        yield TaskSuccessEvent(xcoms={"sky_rank": summary} if self.xcom else None)


def in_triggerer(trigger_cls: str, trigger_kwargs: dict[str, Any]) -> dict[str, Any]:
    """An operator's kwargs to start in the triggerer with that trigger and end from there."""
    return {
        "start_from_trigger": True,
        "start_trigger_args": StartTriggerArgs(
            trigger_cls=trigger_cls,
            trigger_kwargs=trigger_kwargs,
            next_method="execute_complete",
            next_kwargs=None,
            timeout=None,
        ),
    }
