"""A gang's watch settings are one frozen object, checked once and written as trigger kwargs once; a
trigger serialized by an earlier release still loads and serializes the same."""

from __future__ import annotations

import json
from typing import Any

import pytest

from airflow_provider_sky.operators.job import SkyJobOperator
from airflow_provider_sky.operators.rank import SkyRankOperator
from airflow_provider_sky.sensors.gang import SkyGangSensor
from airflow_provider_sky.spec import SpecError
from airflow_provider_sky.triggers.gang import SkyGangTrigger, SkyRankTrigger
from airflow_provider_sky.watch.retry import RetryPolicy
from airflow_provider_sky.watch.settings import WatchSettings

HANDLE = {"name": "c", "backend": "local", "nodes": []}
RETRY = {"retries": 2, "delay": 5.0, "exponential": True, "exit_codes": (1, 137), "any_nonzero": False}

#: what the release before WatchSettings serialized (SkyRankTrigger.serialize(), SkyGangTrigger.serialize())
OLD_RANK = {
    "cluster": HANDLE,
    "job_id": "j",
    "sky_conn_id": "sky_default",
    "poll_interval": 1.0,
    "grace": 2.0,
    "lost_after": 5.0,
    "hang_timeout": 30.0,
    "retry": RETRY,
    "fire_after": 100.0,
    "end_from_trigger": False,
    "rank": 2,
    "log_offset": 7,
}
OLD_GANG = {
    "cluster": HANDLE,
    "job_id": "j",
    "sky_conn_id": "sky_default",
    "poll_interval": 0.5,
    "grace": 3.0,
    "lost_after": 10.0,
    "hang_timeout": 0.0,
    "retry": None,
    "fire_after": None,
    "end_from_trigger": False,
    "result": {"ranks": 0},
    "resume_on_success": True,
}


@pytest.mark.parametrize(("cls", "old"), [(SkyRankTrigger, OLD_RANK), (SkyGangTrigger, OLD_GANG)])
def test_a_trigger_serialized_before_loads_and_serializes_the_same(cls: Any, old: dict[str, Any]) -> None:
    path, kwargs = cls(**old).serialize()
    assert path == f"airflow_provider_sky.triggers.gang.{cls.__name__}"
    assert kwargs == old
    json.dumps(kwargs)  # what the triggerer stores: JSON values only
    assert cls(**kwargs).serialize()[1] == kwargs  # and it round-trips


def test_a_trigger_from_a_release_without_hang_or_retry_takes_the_defaults() -> None:
    oldest = {k: v for k, v in OLD_RANK.items() if k not in ("hang_timeout", "retry", "log_offset")}
    trigger = SkyRankTrigger(**oldest)
    assert trigger.watch == WatchSettings("sky_default", 1.0, 2.0, 5.0, 0.0, RetryPolicy())
    assert (trigger.hang_timeout, trigger.retry) == (0.0, None)


def test_the_trigger_holds_the_settings_it_was_given() -> None:
    trigger = SkyRankTrigger(**OLD_RANK)
    assert trigger.watch.retry == RetryPolicy(2, 5.0, True, (1, 137), False)
    assert (trigger.poll_interval, trigger.grace, trigger.lost_after) == (1.0, 2.0, 5.0)
    with pytest.raises(SpecError, match="^lost_after: must be at least poll_interval"):
        SkyRankTrigger(**{**OLD_RANK, "poll_interval": 6.0})


def test_the_operators_hand_their_triggers_the_same_settings() -> None:
    rank = SkyRankOperator(
        task_id="r", cluster=HANDLE, rank=1, job_id="j", poll_interval=2, hang_timeout=10, gang_retries=1
    )
    sensor = SkyGangSensor(
        task_id="s", cluster=HANDLE, job_id="j", poll_interval=2, hang_timeout=10, gang_retries=1
    )
    job = SkyJobOperator(
        task_id="job", cluster=HANDLE, run="true", poll_interval=2, hang_timeout=10, gang_retries=1
    )
    assert rank.watch == sensor.watch == job.watch
    trigger = rank._trigger(deferring=False)
    assert trigger.watch == rank.watch
    assert trigger.serialize()[1]["retry"] == job.retry == RetryPolicy.build(1).to_dict()


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"poll_interval": 0}, "poll_interval"),
        ({"grace": -1}, "grace"),
        ({"lost_after": 0.2}, "lost_after"),
        ({"hang_timeout": "10"}, "hang_timeout"),
    ],
)
def test_a_bad_setting_is_named_once_for_every_watcher(args: dict[str, Any], field: str) -> None:
    base = {"sky_conn_id": None, "poll_interval": 0.5, "grace": 3.0, "lost_after": 10.0}
    with pytest.raises(SpecError) as err:
        WatchSettings.build(**{**base, **args})
    assert err.value.field == field
    with pytest.raises(SpecError) as again:
        SkyGangSensor(task_id="s", cluster=HANDLE, job_id="j", **{**base, **args})
    assert str(again.value) == str(err.value)


def test_the_other_timing_arguments_are_checked_in_the_same_call() -> None:
    """``orphan_timeout`` is checked before ``hang_timeout``, as each entry point always did."""
    with pytest.raises(SpecError, match="^orphan_timeout"):
        WatchSettings.build(None, 0.5, 3.0, 10.0, "x", orphan_timeout=-1)


def test_sky_gangs_sensor_trigger_knows_the_rank_task_in_both_ways_it_starts() -> None:
    """The gang sensor's trigger looks at the rank tasks' states (a rank task marked failed while no
    triggerer ran its trigger): ``sky_gang`` names its rank task in the trigger it starts in the
    triggerer and in the one its sensor defers to, and the name survives the trigger's serialization."""
    import pendulum
    from airflow.sdk import DAG

    from airflow_provider_sky.taskgroup import sky_gang

    with DAG("d", schedule=None, start_date=pendulum.datetime(2026, 1, 1, tz="UTC")):
        group = sky_gang("train", num_nodes=2, run="true")
    sensor = group.sensor
    assert sensor.start_trigger_args is not None
    assert sensor.start_trigger_args.trigger_kwargs["rank_task_id"] == "train.rank"
    sensor.job_id = "j"
    kwargs = sensor._trigger(deferring=False).serialize()[1]
    assert kwargs["rank_task_id"] == "train.rank"
    assert SkyGangTrigger(**kwargs).serialize()[1] == kwargs
    # a sensor on its own (no rank tasks) looks at nothing, and serializes as before
    alone = SkyGangSensor(task_id="s", cluster=HANDLE, job_id="j")
    assert "rank_task_id" not in alone._trigger(deferring=False).serialize()[1]
