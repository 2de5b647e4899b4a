"""The machine's floor for fail-fast: end N process groups at once, with nothing else on the machine.

Each of the N groups is what a local rank running ``sleep`` is (a ``bash`` running the command, its
``sleep`` child, in their own session) under a waiter in ``sh`` that, like the rank wrapper, notes the
time when its group is gone. One ``kill`` signals every group; the figure is the time from the signal
to the last waiter's note: what the kernel and the scheduler take to end N ranks and wake their
waiters here, before any provider code runs. Clocks: ``/proc/uptime`` (centiseconds), read with
builtins.
"""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import time
from pathlib import Path

RANK_CMD = "sleep 10000; :"  # bash forks sleep (no exec of the last command): two processes, as a rank

WAITER = rf"""d=$1
setsid bash -c '{RANK_CMD}' </dev/null >/dev/null 2>&1 &
c=$!
printf '%s\n' "$c" > "$d.pg"
trap ':' TERM INT HUP
wait "$c"
read -r u _x < /proc/uptime
printf '%s\n' "$u" > "$d.end"
"""

DRIVER = r"""n=$1; dir=$2
i=0
while [ "$i" -lt "$n" ]; do
  setsid sh "$dir/waiter.sh" "$dir/$i" </dev/null >/dev/null 2>&1 &
  i=$((i + 1))
done
# every group up (its waiter wrote its pgid), then a pause for the machine to settle
k=0
while :; do
  up=0; i=0
  while [ "$i" -lt "$n" ]; do [ -s "$dir/$i.pg" ] && up=$((up + 1)); i=$((i + 1)); done
  [ "$up" -ge "$n" ] && break
  k=$((k + 1)); [ "$k" -lt 600 ] || { echo "NOTUP $up"; exit 1; }
  sleep 0.1
done
sleep 2
neg=''; i=0
while [ "$i" -lt "$n" ]; do read -r p < "$dir/$i.pg"; neg="$neg -$p"; i=$((i + 1)); done
read -r t0 _x < /proc/uptime
kill -TERM $neg
echo "T0 $t0"
"""


def once(folder: Path, n: int, timeout: float = 120.0) -> tuple[float, float]:
    """(last, median) seconds from the one ``kill`` of N groups to their waiters' notes."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    (folder / "waiter.sh").write_text(WAITER)
    (folder / "driver.sh").write_text(DRIVER)
    try:
        out = subprocess.run(
            ["sh", str(folder / "driver.sh"), str(n), str(folder)],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=True,
        ).stdout
        t0 = float(out.split("T0 ", 1)[1].split()[0])
        ends: list[float] = []
        for _ in range(int(timeout * 10)):
            ends = [float(t) for t in (p.read_text() for p in folder.glob("*.end")) if t.strip()]
            if len(ends) >= n:
                break
            time.sleep(0.1)
        if len(ends) < n:
            raise RuntimeError(f"{n - len(ends)} of {n} waiters noted no end within {timeout:.0f} s")
        delays = [e - t0 for e in ends]
        return max(delays), statistics.median(delays)
    finally:
        _kill_left(folder)
        shutil.rmtree(folder, ignore_errors=True)


def _kill_left(folder: Path) -> None:
    """The groups of a failed run that still live (checked by their command: their ids may be reused)."""
    for p in folder.glob("*.pg"):
        try:
            pg = int(p.read_text())
            if RANK_CMD.encode() in Path(f"/proc/{pg}/cmdline").read_bytes():
                os.killpg(pg, signal.SIGKILL)
        except (OSError, ValueError):
            pass
