"""A gang's result: what a downstream task gets once every rank succeeded (no Airflow here).

By default it is rank 0's last output line (as ``@task.bash`` pushes its last line); with a task spec's
``result_file`` it is that file's content on rank 0 (JSON decoded when it parses); with
``ranks="all"`` a list, one per rank. The rank wrapper keeps the file as ``<rank dir>/result`` when its
command exits 0, through the same secrets mask as the log (``node_scripts.WRAPPER``), so a result
shows no secret the log would not show. Results are bounded: XComs are for small values.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from airflow_provider_sky.errors import ResultError as ResultError
from airflow_provider_sky.model.gang import GangStatus
from airflow_provider_sky.node.scripts import load

if TYPE_CHECKING:
    from airflow_provider_sky.watch.jobs import GangClient

#: default bound of a gang's result (every rank's part together), in bytes
DEFAULT_MAX_BYTES = 64 * 1024
#: the largest bound one may ask for: the rank wrapper keeps at most one byte more of a result file
MAX_BYTES_LIMIT = 1024 * 1024
#: results up to this size (JSON) also travel in the gang's asset events' ``extra``
SMALL_RESULT = 1024

#: ``root job rank max``: ``RESULT <size>`` then up to ``max`` bytes of the kept result file,
#: ``MISSING`` (the rank succeeded but the file was not there), or ``NONE`` (nothing kept)
RESULT_SCRIPT = load("result.sh")


def check_result_args(result_ranks: Any, result_max_bytes: Any) -> tuple[int | str, int]:
    """Validate ``result_ranks`` (a rank number or ``"all"``) and ``result_max_bytes`` at DAG parse time."""
    ranks: int | str
    if result_ranks == "all":
        ranks = "all"
    elif isinstance(result_ranks, int) and not isinstance(result_ranks, bool) and result_ranks >= 0:
        ranks = result_ranks
    else:
        raise ValueError(
            f"result_ranks: must be a rank number (0 is the head) or 'all', got {result_ranks!r}"
        )
    if (
        isinstance(result_max_bytes, bool)
        or not isinstance(result_max_bytes, int)
        or not 0 < result_max_bytes <= MAX_BYTES_LIMIT
    ):
        raise ValueError(
            f"result_max_bytes: must be a whole number of bytes from 1 to {MAX_BYTES_LIMIT} (1 MiB), got "
            f"{result_max_bytes!r}; write bigger outputs to storage and make result_file hold their location"
        )
    return ranks, result_max_bytes


def result_config(result_ranks: int | str, result_file: str | None, max_bytes: int) -> dict[str, Any]:
    """What the gang's watcher needs to read the result (trigger kwargs: no secret in it)."""
    return {"ranks": result_ranks, "file": result_file, "max_bytes": int(max_bytes)}


def _too_big(what: str, max_bytes: int, file: str | None) -> ResultError:
    fix = (
        f"keep result_file ({file}) small: write large outputs to storage and put their location (a path or URI) in it"
        if file
        else "print a short last line, or write the result to a file and name it with result_file"
    )
    return ResultError(
        f"the gang succeeded but its result ({what}) is more than result_max_bytes={max_bytes} bytes, "
        f"the most an XCom of this gang may hold: {fix}, or raise result_max_bytes (at most {MAX_BYTES_LIMIT})"
    )


def last_line(data: bytes, complete: bool) -> str | None:
    """The last non-blank line of ``data`` (the end of a log), right-stripped like ``@task.bash``'s;
    None when there is none. ``complete``: ``data`` is the whole log (else its first line may be cut)."""
    text = data.decode("utf-8", "replace").rstrip()
    if not text:
        return None
    cut = max(text.rfind("\n"), text.rfind("\r"))
    if cut < 0 and not complete:
        raise ValueError("line longer than what was read")
    return text[cut + 1 :].rstrip()


def decode_file(data: bytes) -> Any:
    """A result file's content: its JSON value when it parses, else its text (one final newline off)."""
    text = data.decode("utf-8", "replace")
    try:
        return json.loads(text)
    except ValueError:
        return text[:-1] if text.endswith("\n") else text


async def _rank_line(client: GangClient, status: GangStatus, rank: int, budget: int) -> tuple[Any, int]:
    size = status.by_rank(rank).log_size
    start = max(0, size - budget - 2)
    data = await client.aread_log(status.job_id, rank, start, size - start)
    try:
        line = last_line(data, complete=start == 0)
    except ValueError:
        raise _too_big(f"rank {rank}'s last output line", budget, None) from None
    used = len(line.encode()) if line else 0
    if used > budget:
        raise _too_big(f"rank {rank}'s last output line", budget, None)
    return line, used


async def _rank_file(
    client: GangClient, status: GangStatus, rank: int, file: str | None, budget: int
) -> tuple[Any, int] | None:
    """The rank's kept result file; None when the job kept none and ``file`` is None (not asked for)."""
    node = client.node_of(rank)
    res = await client.runner(node).arun_script(
        RESULT_SCRIPT, [node.root, status.job_id, str(rank), str(budget + 1)], timeout=60
    )
    head, _, body = res.stdout.partition(b"\n")
    words = head.decode("utf-8", "replace").split()
    if res.returncode != 0 or not words:
        raise ResultError(
            f"the gang succeeded but rank {rank}'s result file could not be read on {node.ip}: "
            f"{res.error_text or head!r}"
        )
    if words[0] == "MISSING":
        file = file or "(the job's)"
        raise ResultError(
            f"the gang succeeded but result_file {file} was not there (or not readable) on rank {rank} "
            f"({node.ip}) when its command ended: write it before the command exits, or fix the path "
            "(~/ is the rank's home, a relative path is under its working directory)"
        )
    if words[0] != "RESULT" and file is None:
        return None
    if words[0] != "RESULT":
        raise ResultError(
            f"the gang succeeded but rank {rank} ({node.ip}) kept no result file: was the job started "
            f"with result_file={file!r}? Give the job task the same result_file"
        )
    if int(words[1]) > budget:
        file = file or "(the job's)"
        raise _too_big(f"result_file {file} of rank {rank}, {words[1]} bytes", budget, file)
    return decode_file(body), len(body)


async def read_result(client: GangClient, status: GangStatus, config: Mapping[str, Any]) -> Any:
    """The result of a gang that succeeded (``config``: :func:`result_config`). Raises :class:`ResultError`."""
    from airflow_provider_sky.runners.base import RunnerError

    max_bytes = int(config.get("max_bytes") or DEFAULT_MAX_BYTES)
    file = config.get("file")
    which = config.get("ranks", 0)
    ranks = [r.rank for r in status.ranks] if which == "all" else [int(which)]
    if any(r >= len(status.ranks) for r in ranks):
        raise ResultError(f"result_ranks={which}: the gang has only {len(status.ranks)} ranks")
    gate = asyncio.Semaphore(max(1, client.call_limit))

    async def one(rank: int) -> tuple[Any, int]:
        async with gate:
            # the job's own result_file (its spec's) when it kept one, else the last output line
            kept = await _rank_file(client, status, rank, str(file) if file else None, max_bytes)
            return kept if kept is not None else await _rank_line(client, status, rank, max_bytes)

    try:
        parts = await asyncio.gather(*(one(r) for r in ranks))
    except RunnerError as exc:
        raise ResultError(f"the gang succeeded but its result could not be read: {exc}") from exc
    total = sum(n for _, n in parts)
    if total > max_bytes:
        raise _too_big(f"{len(parts)} ranks' parts, {total} bytes together", max_bytes, file)
    values = [v for v, _ in parts]
    return values if which == "all" else values[0]


def small(value: Any) -> bool:
    """Whether a result is small enough to travel in an asset event's ``extra`` as well."""
    try:
        return len(json.dumps(value)) <= SMALL_RESULT
    except (TypeError, ValueError):
        return False
