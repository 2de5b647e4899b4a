"""The rank triggers of a gang read the cluster and job XComs once per triggerer, even when they all
start at once: Airflow runs a trigger's sync XCom read through ``greenback``, which yields the event loop
while the supervisor answers, so every trigger started meanwhile used to miss the cache and ask too."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import greenback
import pytest

from airflow_provider_sky.triggers import gang
from airflow_provider_sky.triggers.gang import pulled, xcom_ref


class _SlowXComTI(SimpleNamespace):
    """A task instance whose XCom read takes 50 ms on the event loop (the supervisor's round trip)."""

    def xcom_pull(self, task_ids: str, key: str, map_indexes: int) -> Any:
        self.reads.append((task_ids, key))
        greenback.await_(asyncio.sleep(0.05))
        if self.fail_first and len(self.reads) == 1:
            raise RuntimeError("the supervisor went away")
        return {"name": "c", "task": task_ids}


def _ti(fail_first: bool = False) -> _SlowXComTI:
    return _SlowXComTI(dag_id="d", run_id="r", try_number=1, reads=[], fail_first=fail_first)


@pytest.fixture(autouse=True)
def _empty_cache() -> None:
    gang._PULLED.clear()
    gang._PULLING.clear()


async def _trigger(ti: _SlowXComTI) -> Any:
    await greenback.ensure_portal()
    return pulled({"ti": ti}, xcom_ref("cluster"))


def test_triggers_starting_together_read_an_xcom_once() -> None:
    ti = _ti()

    async def main() -> list[Any]:
        return await asyncio.gather(*(_trigger(ti) for _ in range(200)))

    got = asyncio.run(main())
    assert ti.reads == [("cluster", "return_value")]
    assert got == [{"name": "c", "task": "cluster"}] * 200
    # a later trigger of the same try reads nothing; a cleared gang (next try) reads anew
    assert asyncio.run(_trigger(ti)) == got[0] and len(ti.reads) == 1
    ti.try_number = 2
    asyncio.run(_trigger(ti))
    assert len(ti.reads) == 2


def test_a_failed_read_lets_the_waiting_triggers_read_it_themselves() -> None:
    ti = _ti(fail_first=True)

    async def main() -> list[Any]:
        return await asyncio.gather(*(_trigger(ti) for _ in range(20)), return_exceptions=True)

    got = asyncio.run(main())
    errors = [g for g in got if isinstance(g, BaseException)]
    assert [str(e) for e in errors] == ["the supervisor went away"]  # the first reader's own failure
    assert got.count({"name": "c", "task": "cluster"}) == 19
    assert len(ti.reads) == 2  # one failed, one more for all the others
    assert not gang._PULLING


def test_without_an_event_loop_it_reads_directly() -> None:
    ti = _SlowXComTI(dag_id="d", run_id="r", try_number=1, reads=[], fail_first=False)
    ti.xcom_pull = lambda task_ids, key, map_indexes: {"name": "c"}  # type: ignore[method-assign]
    assert pulled({"ti": ti}, xcom_ref("cluster")) == {"name": "c"}
    assert pulled({"ti": ti}, "plain") == "plain"
