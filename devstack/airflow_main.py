"""``python -m devstack.airflow_main <args>``: the ``airflow`` CLI (as ``python -m airflow <args>``) with
Python's garbage collector tuned for Airflow's heap; every service of a devstack stack runs under it.

An Airflow process holds ~600,000 objects once its imports are done, and a full collection walks them
all (0.37 s of CPU on our 2-core machines). With Python's default first threshold (700 allocations) a
service ran 8-10 full collections while it started and, serving tasks and the API, one every few
seconds: profiles of ``make test`` (perf, the whole machine) found 20-29 % of the api-servers',
triggerers' and schedulers' CPU in the collector. A first threshold of 50,000 lets short-lived objects
die before a young collection promotes them, so far fewer reach the old generation and trigger a full
pass. Reference counting frees everything else as before; only reference cycles wait longer. Airflow
itself freezes the heap (``gc.freeze``) before it forks executors' and DAG processors' workers for
the same reason; forked task processes inherit this setting.
"""

from __future__ import annotations

import gc
import runpy

#: Python's default is (700, 10, 10)
GC_THRESHOLD = (50_000, 10, 10)


def main() -> None:
    gc.set_threshold(*GC_THRESHOLD)
    runpy.run_module("airflow", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
