"""The node runtime's POSIX ``sh`` scripts: the rank wrapper, status, cancel, teardown and the keeper.

Their text is in ``airflow_provider_sky/node/scripts/`` (:func:`airflow_provider_sky.node.scripts.load`); here
each is named and said what it does. They travel on stdin (``sh -s -- ARGS``) and take only validated
ids, integers and paths as arguments (:mod:`airflow_provider_sky.node.runtime` builds those and parses what
the scripts print). The layout of a rank's directory they work on is in
:mod:`airflow_provider_sky.node.runtime`'s docstring.
"""

from __future__ import annotations

from airflow_provider_sky.node.scripts import load

#: Every process a rank starts inherits ``SKY_PROVIDER_MARK=<rank dir>/`` in its environment, so a
#: node finds all of them through ``/proc/<pid>/environ`` whatever they did to their process group or
#: session (``setsid``, double forks, ``nohup``). ``marked MARK...`` prints the pids whose environment
#: holds one of the marks (a prefix: ``<root>/jobs/`` is every process of a cluster's node). No single
#: quote in it: it is embedded in single-quoted helper scripts. The patterns go to ``grep -f -`` on
#: stdin: building ``-e`` arguments one ``set --`` at a time is quadratic in the number of marks.
MARKED_FUNCS = load("marked.sh")

#: ``clock`` sets ``$T`` to the time now (epoch seconds, to the hundredth) without a fork: /proc/uptime
#: (monotonic, centiseconds, read with a builtin) counted from a base ``cb`` (epoch) / ``cu`` (uptime),
#: both centiseconds, read once with ``date`` by the launcher (``runtime.CLOCK_BASE``); ``date``
#: without them.
CLOCK_FUNC = load("clock.sh")

#: The secrets' output filter in Python (``python3`` on the node): what each read returns is written at
#: once (a line reaches the log as soon as the rank prints it, and 100 MiB cost one write per read, not
#: per line), through its last line end (``\n``, or ``\r`` for progress bars when no secret holds one);
#: a partial line waits for its end, and one longer than 64 KiB is written but for its last
#: ``len(longest secret) - 1`` bytes, so memory stays bounded and a secret across the cut is still
#: whole in what waits. Values come from the mask file on fd 3, one a line. A read is searched for a
#: value only if it holds the byte of that value picked to look for first (a ``memchr``, a small part of
#: a search); the pick moves on to another byte of the value when a read has it without the value, so
#: it settles on one the rank does not print. No single quote in it: it travels single-quoted in
#: :data:`MASK_FUNC`.
MASK_PY = load("mask_filter.py")

#: The same in ``awk`` for nodes without Python (a busybox image): line by line, flushed per line
#: (mawk needs ``-W interactive`` for that, or it waits to fill its buffer), leftmost and longest first;
#: a line is held whole until its end. Its cost per line bounds its speed (``sed -u`` reads a byte per
#: call; busybox's ``sed`` flushes only when its buffer is full).
MASK_AWK = load("mask.awk")

#: ``maskfilter``: stdin to stdout with every value of the mask file open on fd 3 (one a line, longest
#: first) replaced by ``***``. ``maskpy`` where the node has Python (it keeps up with a fast rank, in
#: bounded memory): the system's first, which starts far sooner than a ``pyenv`` shim first in PATH.
#: Else, or should Python fail, ``maskawk`` goes on with the rest (it opens the mask anew through
#: /dev/fd/3). Figure 9 of ``benchmarks/`` measures both.
MASK_FUNC = load("mask.sh")

#: The wrapper. It runs the user's command in a child shell (its own session and process group,
#: so a kill reaches the whole tree but not the wrapper), and always records the exit code. The
#: child alone carries the mark; when the job has secrets, its output goes through ``maskfilter``,
#: which masks them before anything reaches the log on disk.
WRAPPER = load("wrapper.sh")

#: The first lines of every ``cmd.sh``: the env, then the secrets, in the rank's own shell, so a value
#: too big for the process environment still reaches ``run``. The wrapper hands the secrets over open
#: on fd 5 (``SKY_SECRETS_FD``), their file deleted already; else the file is sourced and deleted.
CMD_PROLOGUE = load("cmd_prologue.sh")

#: One call per machine per poll, covering every rank there (each with its own node root), so it
#: forks as little as it can: ``read`` (a builtin) for the small files, one ``wc`` for every log's size,
#: ``tail | head`` only when there are new log bytes: with many ranks on one machine, a fork per rank
#: per poll is seconds of CPU every interval. The poller's clock (``now``, or ``-``) is left in
#: ``polled``: the node's dead-man's switch and other watchers read it. Arguments: ``now``, then
#: ``root job rank offset max`` per rank. Per rank: a header line, then ``n`` log bytes, ``xn`` bytes
#: of an unreadable exit file and ``cn`` bytes of the cancel reason.
#:
#: A log's size must be read after its rank's exit file was seen (a rank reported over with a short
#: size would lose its last lines), so the batch also says which ranks had exited before it measured;
#: a rank that exits during the call gets its size read again on its own. A log the batch did not
#: list (created since, or a name ``wc`` prints differently) is measured on its own too.
STATUS_SCRIPT = load("status.sh")

#: The delayed SIGKILL of a fail-fast cancel, run detached: ``sh -c KILLER sh TICKS GROUPS`` with the
#: marks in ``$SKY_KILL_MARKS`` (one per line). It leaves as soon as everything it watches is gone.
KILLER = load("killer.sh")

#: TERM every listed rank's process group and every process carrying its mark, SIGKILL what is left
#: after the grace, then wait (bounded) until they are gone. ``reason`` goes in each unfinished rank's
#: cancel marker. A rank that already exited keeps its outcome; processes it left behind are killed.
#: Arguments: ``grace mode reason``, then ``root job rank`` per rank: one call covers every rank of a
#: machine, whatever node root each has (one ``grep`` of ``/proc`` finds all their processes).
#: ``mode``: ``wait`` (until they are gone), ``nowait`` (return after the SIGTERMs), ``after:JOBDIR``
#: (``nowait``, unless the machine's own fail-fast claimed the cancel in JOBDIR), ``first`` (the
#: machine's own fail-fast: ``nowait``, and a rank with a process group is signalled before any reason
#: is written, since a reason file per rank is slow to create for many ranks: its wrapper writes the reason
#: itself from the job's ``.cancelling/reason`` before its exit code, see :data:`WRAPPER`).
CANCEL_SCRIPT = load("cancel.sh")

#: ``claim RANKDIR``: true for the first caller only, for a rank directory made beforehand. The claim is
#: a file made with noclobber (``set -C``: an ``O_EXCL`` open, a builtin redirection), not the rank
#: directory's ``mkdir``: that is an exec per rank, a large share of a big gang's start. The gang start's launchers and the never-started records claim the same way.
CLAIM_FUNC = load("claim.sh").rstrip("\n")

#: Ranks the gang start skips because a sibling already failed: each record says cancelled (exit 143,
#: the reason in ``cancel``) without anything having run. ``job reason`` then ``root rank`` pairs; an
#: rank claimed already (by a launcher: :data:`CLAIM_FUNC`) is left alone (``EXISTS <rank>``, else
#: ``CANCELLED <rank>``). The rank directory's ``mkdir`` is its only fork per rank. The exit file is written in place (the status reads an empty one as not
#: written yet).
NEVER_STARTED_SCRIPT = load("never_started.sh")

#: Kill everything any job under the listed roots started (found by the mark, so a lost job directory or
#: exit file loses nothing), stop their keepers, then remove each root (``REMOVED <root>``, or ``ABSENT
#: <root>`` when it was gone already). ``sh -s -- GRACE ROOT...``: the roots of one machine.
TEARDOWN_SCRIPT = load("teardown.sh")
#: the line of the teardown script that removes the roots (left out by ``teardown_script(remove=False)``)
_REMOVE_ROOTS = '[ $# -eq 0 ] || remove_roots "$@" || exit 1\n'

#: The node's keeper (one per cluster root, or one for all roots of a machine): a dead-man's switch
#: that kills a job nobody polls any more (``orphan_timeout`` per rank), and SkyPilot's autodown for a
#: cluster left idle (``idle_down``). It counts its own ticks rather than comparing clocks, forks only
#: ``sleep``, and exits when it has nothing left to guard. ``sh -c KEEPER sky-keeper TICK TICK_MS`` with
#: the roots in ``$SKY_KEEPER_ROOTS`` (one per line).
KEEPER_SCRIPT = load("keeper.sh")


def teardown_script(remove: bool = True) -> str:
    """The teardown script with the cancel logic inlined: ``sh -s -- GRACE ROOT...``, one call for
    every node root of one machine (one scan of /proc, not one per node). ``remove=False``: the roots
    are left for the caller to take away once every process is gone (the local backend renames its
    cluster's tree and deletes it in the background: ``backends.local.trash``)."""
    if remove:
        return TEARDOWN_SCRIPT
    kept = TEARDOWN_SCRIPT.replace(_REMOVE_ROOTS, ":\n", 1)
    if kept == TEARDOWN_SCRIPT:  # the line changed in teardown.sh: never a teardown that removes regardless
        raise RuntimeError(f"teardown.sh has no line {_REMOVE_ROOTS.strip()!r} to leave out")
    return kept


#: Dump the stacks of every process of each listed rank into the rank's own log, once: ``mkdir
#: $d/hang`` is the lock (two watchers finding the same hang dump it once) and the marker the
#: status script reports. ``py-spy dump`` where the node has it (Python processes), else each
#: thread's state, ``wchan`` and kernel stack from /proc (the stack needs root). Arguments:
#: ``reason``, then ``root job rank`` per rank; prints ``DUMPED <rank>`` per rank dumped here.
#:
#: A rank with secrets writes through its mask filter (``$d/out``, a fifo while the filter runs): the
#: dump goes the same way, so a ``--hf-token "$TOKEN"`` in a command line (ours, or py-spy's header)
#: is masked like the rank's own output (whole arguments only: a cut one could show the start of a
#: secret). The fifo is opened read-write (an open that never blocks,
#: should the filter end meanwhile). A rank whose filter has ended (its command closed its output) can
#: mask nothing more: its dump shows no command lines and no py-spy output.
DUMP_SCRIPT = load("hang_dump.sh")
