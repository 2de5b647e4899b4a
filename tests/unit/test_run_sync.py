"""``run_sync`` from inside a running loop returns with its thread gone, every time."""

from __future__ import annotations

import asyncio
import threading

import pytest

from airflow_provider_sky.aio import run_sync


async def _answer() -> int:
    return 42


async def _fail() -> int:
    raise ValueError("from the coroutine")


def _ours() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("sky-run-sync")]


def test_no_thread_is_left_running_when_it_returns() -> None:
    """Its thread ended before the call returned (it was still exiting in ~2 % of calls)."""

    async def caller() -> list[list[str]]:
        seen = []
        for _ in range(300):
            assert run_sync(_answer()) == 42
            seen.append(_ours())
        return seen

    assert [names for names in asyncio.run(caller()) if names] == []


def test_the_coroutine_s_exception_reaches_the_caller() -> None:
    async def caller() -> int:
        return run_sync(_fail())

    with pytest.raises(ValueError, match="from the coroutine"):
        asyncio.run(caller())
    assert _ours() == []
