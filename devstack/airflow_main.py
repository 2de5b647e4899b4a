"""``python -m devstack.airflow_main <args>``: the ``airflow`` CLI (as ``python -m airflow <args>``) with
Python's garbage collector set for Airflow's heap; every service of a devstack stack runs under it.

An Airflow process holds ~600,000 objects once its imports are done, and with Python's defaults every
full collection walks them all again (0.37 s of CPU each on our 2-core machines): 8-10 of them while a
service starts, then one whenever a quarter more objects have reached the old generation, and a last
one at exit. Profiles of ``make test`` (perf, the whole machine) found 20-29 % of the api-servers',
triggerers' and schedulers' CPU in the collector. :func:`tune_gc` freezes (``gc.freeze``) what
survives each full collection, so the next one walks only what was made since: a stack's start costs
about a quarter less CPU. Airflow freezes its heap the same way before it forks executor and DAG
processor workers. Reference counting frees a frozen object as before; only a reference cycle that was
alive at a full collection and dies later is never collected. Forked task processes inherit it.
"""

from __future__ import annotations

import gc
import runpy
from typing import Any


def _freeze_survivors(phase: str, info: dict[str, Any]) -> None:
    # the end of a full collection: what is left in the generations survived it
    if phase == "stop" and info["generation"] == 2:
        gc.freeze()


def tune_gc() -> None:
    """After each full collection, its survivors are frozen (see the module)."""
    if _freeze_survivors not in gc.callbacks:
        gc.callbacks.append(_freeze_survivors)


def main() -> None:
    tune_gc()
    runpy.run_module("airflow", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
