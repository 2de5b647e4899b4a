"""The node runtime's POSIX ``sh`` scripts: the rank wrapper, status, cancel, teardown and the keeper.

They travel on stdin (``sh -s -- ARGS``) and take only validated ids, integers and paths as arguments
(:mod:`airflow_provider_sky.runtime` builds those and parses what the scripts print). The layout of a
rank's directory they work on is in :mod:`airflow_provider_sky.runtime`'s docstring.
"""

from __future__ import annotations

#: Every process a rank starts inherits ``SKY_PROVIDER_MARK=<rank dir>/`` in its environment, so a
#: node finds all of them through ``/proc/<pid>/environ`` whatever they did to their process group or
#: session (``setsid``, double forks, ``nohup``). ``marked MARK...`` prints the pids whose environment
#: holds one of the marks (a prefix: ``<root>/jobs/`` is every process of a cluster's node). No single
#: quote in it: it is embedded in single-quoted helper scripts. The patterns go to ``grep -f -`` on
#: stdin: building ``-e`` arguments one ``set --`` at a time is quadratic (6 s for 1,024 marks).
MARKED_FUNCS = r"""
marked() {
  [ -r /proc/self/environ ] || return 0
  [ $# -gt 0 ] || return 0
  printf "SKY_PROVIDER_MARK=%s\n" "$@" | grep -l -F -f - /proc/[0-9]*/environ 2>/dev/null |
    while read -r _f; do _p=${_f#/proc/}; echo "${_p%/environ}"; done
}
killmarked() {
  _s=$1; shift
  for _p in $(marked "$@"); do kill "-$_s" "$_p" 2>/dev/null; done
}
"""

#: ``clock`` sets ``$T`` to the time now (epoch seconds, to the hundredth) without a fork: /proc/uptime
#: (monotonic, centiseconds, read with a builtin) counted from a base ``cb`` (epoch) / ``cu`` (uptime),
#: both centiseconds, read once with ``date`` by the launcher (``runtime.CLOCK_BASE``); ``date``
#: without them.
CLOCK_FUNC = r"""case "$cb$cu" in *[!0-9]*) cb='';; esac
clock() {
  if [ -n "$cb" ] && [ -n "$cu" ] && { read -r _u _x < /proc/uptime; } 2>/dev/null; then
    _u=${_u%.*}${_u#*.}; _u=${_u#"${_u%%[!0]*}"}
    case "$_u" in *[!0-9]*) ;; *) _u=$((${_u:-0} - cu + cb)); T=$((_u / 100)).$((_u / 10 % 10))$((_u % 10)); return 0;; esac
  fi
  T=$(date +%s.%N 2>/dev/null); case "$T" in *N*|'') T=$(date +%s);; esac
}
"""

#: The secrets' output filter in Python (``python3`` on the node): what each read returns is written at
#: once (a line reaches the log as soon as the rank prints it, and 100 MiB cost one write per read, not
#: per line), through its last line end (``\n``, or ``\r`` for progress bars when no secret holds one);
#: a partial line waits for its end, and one longer than 64 KiB is written but for its last
#: ``len(longest secret) - 1`` bytes, so memory stays bounded and a secret across the cut is still
#: whole in what waits. Values come from the mask file on fd 3, one a line. No single quote in it: it
#: travels single-quoted in :data:`MASK_FUNC`.
MASK_PY = r"""
import os
with open("/dev/fd/3", "rb") as f:
    vals = sorted({v for v in f.read().split(b"\n") if v}, key=lambda v: (-len(v), v))
try:
    import fcntl
    fcntl.fcntl(0, 1031, 1 << 20)  # F_SETPIPE_SZ: fewer, larger reads
except Exception:
    pass
pat = None  # compiled at the first secret seen: importing re is a third of the start
fast = None  # bytearray.find is slow on some output (300 MB/s); a compiled literal search 2-4 GB/s
seen = 0
keep = max([len(v) for v in vals] + [1]) - 1
limit = max(65536, keep)
cr = not any(b"\r" in v for v in vals)
# per value, its bytes to look for first (upper case first, then other non-letters, then the rest): a
# chunk without the picked byte cannot hold the value, and that memchr costs a small part of a search.
# A pick found without its value gives way to the next byte of the value, so the check settles on a byte
# the rank does not print, where the value has one.
bytesof = [sorted(set(v), key=lambda c: (not 65 <= c <= 90, c < 128 and chr(c).isalnum(), v.index(c))) for v in vals]
pick = [0] * len(vals)
size = 1 << 20
buf = bytearray(limit + size)  # what waits, then one read: reused (a new 1 MiB a read cost page faults)
mv = memoryview(buf)
held = 0
while True:
    got = os.readv(0, [mv[held : held + size]])
    n = held + got
    cut = n
    if got:
        # what waits (held) has no line end: only the new bytes are searched, \r past the last \n only
        cut = buf.rfind(b"\n", held, n) + 1
        if cr:
            cut = buf.rfind(b"\r", max(cut, held), n) + 1 or cut
        if n - cut > limit:
            cut = n - keep
        if not cut:
            held = n
            continue
    # a match starting before the cut ends by cut + keep: leftmost, longest first, in one pass
    end = min(n, cut + keep)
    out = mv[:cut]
    seen += got
    if fast is None and seen > 4 << 20:  # a rank that prints a lot: compiled searches, 3-4x the speed of find
        import re

        fast = [re.compile(re.escape(v)).search for v in vals]
    found = False
    for i, v in enumerate(vals):
        if buf.find(bytesof[i][pick[i]], 0, end) < 0:
            continue
        if fast[i](buf, 0, end) if fast else buf.find(v, 0, end) >= 0:
            found = True
            break
        pick[i] = (pick[i] + 1) % len(bytesof[i])
    if found:
        if pat is None:
            import re

            pat = re.compile(b"|".join(re.escape(v) for v in vals))
        parts, pos = [], 0
        for m in pat.finditer(buf, 0, end):
            if m.start() >= cut:
                break
            parts += [buf[pos : m.start()], b"***"]
            pos = m.end()
        cut = max(cut, pos)
        parts.append(buf[pos:cut])
        out = memoryview(b"".join(parts))
    while out:
        out = out[os.write(1, out) :]
    held = n - cut
    if held:
        buf[:held] = buf[cut:n]
    if not got:
        break
"""

#: The same in ``awk`` for nodes without Python (a busybox image): line by line, flushed per line
#: (mawk needs ``-W interactive`` for that, or it waits to fill its buffer), leftmost and longest first;
#: a line is held whole until its end. Its own cost per line bounds it (busybox: 12-35 MiB/s), still 5-15
#: times ``sed -u``; busybox's ``sed`` is faster but flushes only when its buffer is full.
MASK_AWK = r"""
BEGIN { while ((getline s < "/dev/fd/3") > 0) if (s != "") v[++n] = s; close("/dev/fd/3") }
{
  for (i = 1; i <= n; i++) if (index($0, v[i])) break
  if (i > n) { print; fflush(); next }
  t = $0; o = ""
  for (;;) {
    b = 0
    for (i = 1; i <= n; i++) if ((p = index(t, v[i])) > 0 && (b == 0 || p < b)) { b = p; l = length(v[i]) }
    if (b == 0) break
    o = o substr(t, 1, b - 1) "***"; t = substr(t, b + l)
  }
  print o t; fflush()
}
"""

#: ``maskfilter``: stdin to stdout with every value of the mask file open on fd 3 (one a line, longest
#: first) replaced by ``***``. ``maskpy`` where the node has Python (it keeps up with a rank writing
#: 100s of MB/s; ``sed -u`` read a byte per call, 2.3 MB/s, and held a whole line twice): the system's
#: first, which starts in 15 ms where a ``pyenv`` shim first in PATH takes 10 times that. Else, or
#: should Python fail, ``maskawk`` goes on with the rest (it opens the mask anew through /dev/fd/3).
MASK_FUNC = (
    r"""maskpy() {
  for _py in /usr/bin/python3 /usr/local/bin/python3 "$(command -v python3 2>/dev/null)"; do
    case "$_py" in /*) [ -x "$_py" ] || continue;; *) continue;; esac
    "$_py" -I -S -c '"""
    + MASK_PY
    + r"""'
    return
  done
  return 1
}
maskawk() {
  _w=''; [ -n "$(awk -W interactive 'BEGIN { }' </dev/null 2>&1)" ] || _w='-W interactive'
  LC_ALL=C awk $_w '"""
    + MASK_AWK
    + r"""'
}
maskfilter() { maskpy || maskawk; }
"""
)

#: The wrapper. It runs the user's command in a child shell (its own session and process group,
#: so a kill reaches the whole tree but not the wrapper), and always records the exit code. The
#: child alone carries the mark; when the job has secrets, its output goes through ``maskfilter``,
#: which masks them before anything reaches the log on disk.
WRAPPER = (
    r"""#!/bin/sh
# airflow-provider-sky rank wrapper: the user's command runs in a child shell, so an `exit`,
# `exec` or `set -e` in it can never skip recording its exit code.
d=$1
cwd=$2
# the machine's gang-start flag: a rank that fails on its own appends "rank code" to it, and the
# machine's launchers stop starting its siblings (runtime.launch_many_script)
gf=${3:-}
# Nothing below forks but the command's own start: 1,000 ranks of one machine start together, and a
# cancel wakes them all at once, where a `date` or `mv` each took seconds of CPU. The clock is
# /proc/uptime (monotonic, centiseconds, read with a builtin) counted from the base the launcher read
# once (arguments 4 and 5: epoch and uptime in centiseconds); `date` where either is missing.
cb=${4:-}; cu=${5:-}
"""
    + CLOCK_FUNC
    + MASK_FUNC
    + r"""tick() { sleep 0.05 2>/dev/null || sleep 1; }
sh_=/bin/sh
oldifs=$IFS; IFS=:; set -f
for p_ in $PATH; do [ -f "${p_:-.}/bash" ] && [ -x "${p_:-.}/bash" ] && { sh_=${p_:-.}/bash; break; }; done
set +f; IFS=$oldifs
cd "$cwd" 2>/dev/null || cd
clock; printf '%s\n' "$T" > "$d/start"
# cancelled before its command started (a cancel found no process group yet, or a rank of this machine
# has failed: its gang flag is set): the command never runs, and nothing of it stays on disk
if [ -f "$d/cancel" ] || { [ -n "$gf" ] && [ -s "$gf" ]; }; then
  if [ ! -f "$d/cancel" ]; then
    fr=''; fc=''; { read -r fr fc < "$gf"; } 2>/dev/null || :
    printf '%s\n' "@rank-failed $fr $fc" > "$d/cancel"
  fi
  [ ! -e "$d/secrets" ] && [ ! -e "$d/mask" ] || rm -f "$d/secrets" "$d/mask"
  # it never ran: it ends when it started (as the launchers' never-started records do)
  printf '%s\n' "$T" > "$d/end"; printf '143\n' > "$d/exit"
  exit 0
fi
out="$d/log"
if [ -f "$d/mask" ]; then
  [ ! -e "$d/out" ] && [ ! -e "$d/filter.done" ] || rm -f "$d/out" "$d/filter.done"
  if mkfifo -m 600 "$d/out" 2>/dev/null; then
    exec 3<"$d/mask"
    # the result file is masked like the log once the command ended (RESULT below): keep the mask open
    rmask=''; [ ! -f "$d/result_file" ] || { exec 4<"$d/mask"; rmask=1; }
    rm -f "$d/mask"
    (maskfilter <"$d/out" >>"$d/log" 2>&1; : > "$d/filter.done") &
    exec 3<&-
    out="$d/out"
  else
    rm -f "$d/mask"
    echo "airflow-provider-sky: could not create a pipe to mask secrets; output is not masked" >>"$d/log"
  fi
fi
# the memory cgroup's OOM-kill count in $ok (v2 memory.events, v1 memory.oom_control; a container sees
# its own at the mount's root): a rank SIGKILLed while it grew was killed for memory, not by a person
oomk() {
  ok=0; _fs=''
  if [ -r /proc/self/cgroup ]; then
    while IFS=: read -r _i _c _p; do
      if [ "$_c" = memory ]; then _fs="$_fs /sys/fs/cgroup/memory$_p/memory.oom_control"
      elif [ "$_i" = 0 ] && [ -z "$_c" ]; then _fs="$_fs /sys/fs/cgroup$_p/memory.events"; fi
    done < /proc/self/cgroup
  fi
  for _f in $_fs /sys/fs/cgroup/memory.events /sys/fs/cgroup/memory/memory.oom_control; do
    [ -r "$_f" ] || continue
    while read -r _k _v; do [ "$_k" = oom_kill ] && { ok=$_v; return 0; }; done < "$_f"
  done
}
oomk; oom0=$ok
if command -v setsid >/dev/null 2>&1; then
  SKY_PROVIDER_MARK="$d/" SKY_PROGRESS_FILE="$d/progress" setsid "$sh_" "$d/cmd.sh" "$d" >>"$out" 2>&1 </dev/null 4<&- &
else
  SKY_PROVIDER_MARK="$d/" SKY_PROGRESS_FILE="$d/progress" "$sh_" "$d/cmd.sh" "$d" >>"$out" 2>&1 </dev/null 4<&- &
fi
child=$!
# written in place (no `mv`): the readers take an empty or partial file as not written yet
printf '%s\n' "$child" > "$d/pgid"
printf '%s\n' "$$" > "$d/pid"
# and in the machine's list of started groups (one append): a failing sibling signals every group listed
# before it reads a file per rank (see the fail-fast below)
[ -z "$gf" ] || printf '%s %s\n' "${d##*/}" "$child" >> "${gf%/*}/.pgids" 2>/dev/null || :
# a cancel that found no pgid above wrote its reason, then read the pgid again: if that read came too
# early, the reason is here now, and this rank stops itself (whichever comes second sends the signal)
[ ! -f "$d/cancel" ] || kill -TERM "-$child" 2>/dev/null || kill -TERM "$child" 2>/dev/null || :
trap ':' TERM INT HUP
while :; do
  wait "$child"
  rc=$?
  kill -0 "$child" 2>/dev/null || break
done
# the end is when the command ended: taken first, written once the log is complete
clock; te=$T
# stopped by the machine's own fail-fast (CANCEL_SCRIPT's `first`: signalled before any reason was
# written): the reason goes in the exit file with the code, so no reader sees this rank failed on its own
cr=''
if [ "$rc" != 0 ] && [ -n "$gf" ] && [ ! -f "$d/cancel" ] && [ -f "${gf%/*}/.cancelling/reason" ]; then
  { read -r cr < "${gf%/*}/.cancelling/reason"; } 2>/dev/null || :
  case "$cr" in *[!A-Za-z0-9@\ ._-]*) cr='@rank-failed';; esac
fi
[ ! -e "$d/secrets" ] || rm -f "$d/secrets"
if [ "$out" != "$d/log" ]; then
  # let the filter flush the last lines (bounded: a leftover background process may hold the pipe)
  # (its last read takes a millisecond or two: short ticks first, the rank's end waits on this)
  i=0; while [ ! -f "$d/filter.done" ] && [ "$i" -lt 50 ]; do
    case $i in [0-4]) sleep 0.002 2>/dev/null || tick;; [5-9]) sleep 0.01 2>/dev/null || tick;; *) tick;; esac
    i=$((i + 1))
  done
  rm -f "$d/out"
fi
if [ "$rc" = 137 ]; then oomk; [ "$ok" -gt "$oom0" ] 2>/dev/null && : > "$d/oom"; fi
# RESULT: a rank that succeeded keeps (up to 1 MiB + 1 byte of) its result file as "$d/result",
# through the secrets' mask when the job has one, before its exit is written (a reader that saw the
# exit finds it); "~/" is the rank's HOME, a relative path is under its working directory
if [ "$rc" = 0 ] && [ -f "$d/result_file" ]; then
  rf=''; { IFS= read -r rf < "$d/result_file"; } 2>/dev/null || :
  case "$rf" in
    "~/"*) rh=$( . "$d/env" >/dev/null 2>&1; printf '%s' "$HOME"); rf="${rh:-$HOME}/${rf#"~/"}";;
  esac
  if [ -n "$rf" ] && [ -f "$rf" ] && [ -r "$rf" ]; then
    if [ -n "${rmask:-}" ]; then
      head -c 1048577 -- "$rf" 2>/dev/null | maskfilter 3<&4 > "$d/result" 2>/dev/null
    else
      head -c 1048577 -- "$rf" > "$d/result" 2>/dev/null
    fi
  else
    : > "$d/result.missing"
  fi
fi
# code, end and a fail-fast reason in one new file, one write (STATUS_SCRIPT reads all three from it):
# 1,000 ranks cancelled at once each create it together, and on ext4 a new inode costs a scan of the
# inodes deleted in the last minutes (the last teardown's); three files a rank took most of a second
if [ -n "$cr" ]; then printf '%s\n%s\n%s\n' "$rc" "$te" "$cr" > "$d/exit"; else printf '%s\n%s\n' "$rc" "$te" > "$d/exit"; fi
if [ "$rc" != 0 ] && [ -n "$gf" ] && [ -z "$cr" ] && [ ! -f "$d/cancel" ]; then
  # fail-fast on the node: the machine's first rank to fail on its own cancels every sibling listed
  # here at once (the watchers' poll does the same across machines, a poll later); an orphaned rank
  # was killed by the keeper, which stops its siblings itself. It claims the cancel (.cancelling)
  # before it sets the gang flag: a launcher that sees the flag without the claim cancels its ranks
  # itself (the failure came from elsewhere), with it leaves them to this rank (runtime.launch_many_script)
  j=${gf%/*}; own=''
  if [ ! -f "$d/orphaned" ] && [ -f "$j/.cancel.sh" ] && [ -f "$j/.ranks" ] && mkdir "$j/.cancelling" 2>/dev/null; then own=1; fi
  printf '%s %s\n' "${d##*/}" "$rc" >> "$gf" 2>/dev/null || :
  if [ -n "$own" ]; then
    me=${d##*/}; job=${j##*/}; g=3; [ -f "$j/.grace" ] && read -r g < "$j/.grace"
    m=''; [ -f "$d/oom" ] && m=' oom'
    nl='
'
    # every sibling group in .pgids whose rank has not ended (an ended rank's group number may be
    # another's by now) gets its signal at once: reading 1,023 pgid files first took 0.1-0.3 s
    early=$(awk -v me="$me" -v job="$job" '
      NR == FNR { r = $1; sub(/^[^ ]* /, ""); root[r] = $0; next }
      $1 != me && ($1 in root) && $2 ~ /^[0-9]+$/ && !(("-" $2) in seen) {
        f = root[$1] "/jobs/" job "/" $1 "/exit"
        if ((getline x < f) >= 0) { close(f); next }
        seen["-" $2] = 1; printf " -%s", $2
      }' "$j/.ranks" "$j/.pgids" 2>/dev/null) || early=''
    # the reason first (whole: written aside, renamed), then the signals: see CANCEL_SCRIPT's `first`
    printf '%s\n' "@rank-failed $me $rc$m" > "$j/.cancelling/reason.$$" && mv "$j/.cancelling/reason.$$" "$j/.cancelling/reason"
    # a group not there yet is a rank whose first process has not run setsid: that process, then
    if [ -n "$early" ] && ! kill -TERM $early 2>/dev/null; then
      for pg in $early; do kill -0 "$pg" 2>/dev/null || kill -TERM "${pg#-}" 2>/dev/null; done
    fi
    # then the rest (ranks not started yet, escaped processes, SIGKILL after the grace); no group twice.
    # "root job rank" lines for every other rank listed: one awk, where a `read` loop (a read(2) per
    # byte) took most of a second while the machine was busy starting the rest of a 1,024-rank gang
    ts=$(awk -v me="$me" -v job="$job" '{ r = $1; sub(/^[^ ]* /, ""); if (r != me) { print; print job; print r } }' "$j/.ranks" 2>/dev/null) || {
      ts=''
      while read -r r rt; do [ "$r" = "$me" ] || ts="$ts$rt$nl$job$nl$r$nl"; done < "$j/.ranks"
    }
    oldifs=$IFS; IFS=$nl; set -f; set -- $ts; set +f; IFS=$oldifs
    [ $# -eq 0 ] || SKY_SIGNALLED="$early" sh "$j/.cancel.sh" "$g" first "@rank-failed $me $rc$m" "$@" >/dev/null 2>&1 </dev/null
  fi
fi
"""
)

#: The first lines of every ``cmd.sh``: the env, then the secrets (sourced and deleted at once),
#: in the rank's own shell, so a value too big for the process environment still reaches ``run``.
CMD_PROLOGUE = """__sky_d=$1; shift
. "$__sky_d/env"
if [ -f "$__sky_d/secrets" ]; then . "$__sky_d/secrets"; rm -f "$__sky_d/secrets"; fi
unset __sky_d
"""

#: One call per machine per poll, covering every rank there (each with its own node root), so it
#: forks as little as it can: ``read`` (a builtin) for the small files, one ``wc`` for every log's size,
#: ``tail | head`` only when there are new log bytes. At 1,024 ranks on one machine a fork per rank
#: per poll is seconds of CPU every interval. The poller's clock (``now``, or ``-``) is left in
#: ``polled``: the node's dead-man's switch and other watchers read it. Arguments: ``now``, then
#: ``root job rank offset max`` per rank. Per rank: a header line, then ``n`` log bytes, ``xn`` bytes
#: of an unreadable exit file and ``cn`` bytes of the cancel reason.
#:
#: A log's size must be read after its rank's exit file was seen (a rank reported over with a short
#: size would lose its last lines), so the batch also says which ranks had exited before it measured;
#: a rank that exits during the call gets its size read again on its own. A log the batch did not
#: list (created since, or a name ``wc`` prints differently) is measured on its own too.
STATUS_SCRIPT = r"""
now=$1; shift
# "-CLOCK": a poll that leaves no mark still dates the log (``times``); "-" alone: no clock at all
clock=$now; case "$now" in -*) clock=${now#-}; now=-;; esac
sizes() {
  _x=''; _k=$(($# / 5))
  while [ "$_k" -gt 0 ]; do
    if [ -f "$1/jobs/$2/$3/exit" ]; then _x="${_x}1"; else _x="${_x}0"; fi
    set -- "$@" "$1/jobs/$2/$3/log"; shift 5; _k=$((_k - 1))
  done
  printf '%s\n' "x$_x"
  [ $# -gt 0 ] && wc -c -- "$@" 2>/dev/null
  :
}
sizes_=$(sizes "$@")
{
read -r early <&3 || early=x
early=${early#x}
lsz=''; lname=''; read -r lsz lname <&3 || :
while [ $# -ge 5 ]; do
  root=$1; j=$2; r=$3; off=$4; max=$5; shift 5
  d="$root/jobs/$j/$r"
  ex=-; st=-; en=-; ci=''; sz=-; c=0; n=0; pl=-; o=0; xn=0; cn=0; m=0; pg=-; h=0
  e1=${early%"${early#?}"}; early=${early#?}
  if [ -n "$lname" ] && [ "$lname" = "$d/log" ]; then
    sz=$lsz; lsz=''; lname=''; read -r lsz lname <&3 || :
  fi
  if [ ! -d "$d" ]; then
    state=missing
  else
    [ -f "$d/cancel" ] && c=1
    [ -f "$d/orphaned" ] && o=1
    [ -d "$d/hang" ] && h=1
    # the rank's progress file (SKY_PROGRESS_FILE): its mtime, a fork only for ranks that touch one
    [ -f "$d/progress" ] && pg=$(date -r "$d/progress" +%s 2>/dev/null)
    [ -f "$d/start" ] && read -r st < "$d/start"
    [ -f "$d/polled" ] && read -r pl < "$d/polled"
    [ "$now" = - ] || printf '%s\n' "$now" > "$d/polled"
    # an empty exit file is one being written (a never-started record writes it in place)
    if [ -s "$d/exit" ]; then
      state=exited
    elif [ -f "$d/pid" ] && read -r pid < "$d/pid"; then
      case "$pid" in ''|*[!0-9]*) pid=0;; esac
      if [ "$pid" -gt 0 ] && kill -0 "$pid" 2>/dev/null; then state=running
      elif [ -s "$d/exit" ]; then state=exited
      else state=lost; fi
    else
      state=pending
    fi
    if [ "$state" = exited ]; then
      [ "$e1" = 1 ] || sz=-
      # the wrapper writes "code, end[, fail-fast reason]" lines; other writers an end file beside it
      ex=''; e2=''; ci=''
      { read -r ex; read -r e2; read -r ci; } < "$d/exit" || :
      v=${ex#-}
      case "$v" in
        ''|*[!0-9]*) state=badexit; ex=-; ci=''; xn=$(wc -c < "$d/exit"); xn=$((xn + 0)); [ "$xn" -gt 200 ] && xn=200;;
      esac
      if [ -f "$d/end" ]; then read -r en < "$d/end"; else en=$e2; fi
      [ "$c" = 0 ] || ci=''
      [ -f "$d/oom" ] && m=1
    fi
    if [ "$sz" = - ] && [ -f "$d/log" ]; then sz=$(wc -c < "$d/log"); sz=$((sz + 0)); fi
    if [ "$c" = 1 ]; then cn=$(wc -c < "$d/cancel"); cn=$((cn + 0)); [ "$cn" -gt 500 ] && cn=500
    elif [ -n "$ci" ]; then c=1; cn=$((${#ci} + 1)); fi
  fi
  case "$sz" in ''|*[!0-9]*) sz=0;; esac
  if [ -n "$clock" ] && [ "$state" != missing ] && [ "$sz" -gt 0 ]; then
    # when the log grew, as "size clock" lines: a line read late still shows when it was printed
    tz=0; [ -f "$d/tsz" ] && read -r tz < "$d/tsz"
    case "$tz" in ''|*[!0-9]*) tz=0;; esac
    if [ "$sz" -gt "$tz" ]; then printf '%s %s\n' "$sz" "$clock" >> "$d/times"; printf '%s\n' "$sz" > "$d/tsz"; fi
  fi
  case "$st" in ''|*[!0-9.]*) st=-;; esac
  case "$en" in ''|*[!0-9.]*) en=-;; esac
  case "$pl" in ''|*[!0-9.]*) pl=-;; esac
  case "$pg" in ''|*[!0-9]*) pg=-;; esac
  if [ "$sz" -gt "$off" ] && [ "$max" -gt 0 ]; then n=$((sz - off)); [ "$n" -gt "$max" ] && n=$max; fi
  printf '@ %s %s %s %s %s %s %s %s %s %s %s %s %s %s %s %s\n' "$j" "$r" "$state" "$ex" "$st" "$en" "$sz" "$c" "$n" "$pl" "$o" "$xn" "$cn" "$m" "$pg" "$h"
  if [ "$n" -gt 0 ]; then tail -c +$((off + 1)) "$d/log" | head -c "$n"; fi
  if [ "$xn" -gt 0 ]; then head -c "$xn" "$d/exit"; fi
  if [ "$cn" -gt 0 ]; then if [ -n "$ci" ]; then printf '%s\n' "$ci"; else head -c "$cn" "$d/cancel"; fi; fi
done
} 3<<SKY_SIZES
$sizes_
SKY_SIZES
"""

#: The delayed SIGKILL of a fail-fast cancel, run detached: ``sh -c KILLER sh TICKS GROUPS`` with the
#: marks in ``$SKY_KILL_MARKS`` (one per line). It leaves as soon as everything it watches is gone.
KILLER = (  # no single quote in it: it travels inside one
    MARKED_FUNCS
    + r"""
cd /
ticks=$1; gs=$2; shift 2
nl="
"
oldifs=$IFS; IFS=$nl; set -f; set -- $SKY_KILL_MARKS; set +f; IFS=$oldifs
i=0
while [ "$i" -lt "$ticks" ]; do
  up=""
  for pg in $gs; do kill -0 "-$pg" 2>/dev/null && up=1; done
  [ -z "$up" ] && [ -z "$(marked "$@")" ] && exit 0
  sleep 0.1 2>/dev/null || sleep 1; i=$((i + 1))
done
for pg in $gs; do kill -KILL "-$pg" 2>/dev/null || kill -KILL "$pg" 2>/dev/null; done
i=0
while [ "$i" -lt 20 ] && [ -n "$(marked "$@")" ]; do
  killmarked KILL "$@"; sleep 0.1 2>/dev/null || sleep 1; i=$((i + 1))
done
"""
)

#: TERM every listed rank's process group and every process carrying its mark, SIGKILL what is left
#: after the grace, then wait (bounded) until they are gone. ``reason`` goes in each unfinished rank's
#: cancel marker. A rank that already exited keeps its outcome; processes it left behind are killed.
#: Arguments: ``grace mode reason``, then ``root job rank`` per rank: one call covers every rank of a
#: machine, whatever node root each has (one ``grep`` of ``/proc`` finds all their processes).
#: ``mode``: ``wait`` (until they are gone), ``nowait`` (return after the SIGTERMs), ``after:JOBDIR``
#: (``nowait``, unless the machine's own fail-fast claimed the cancel in JOBDIR), ``first`` (the
#: machine's own fail-fast: ``nowait``, and a rank with a process group is signalled before any reason
#: is written, since 1,000 reason files take the disk most of a second: its wrapper writes the reason
#: itself from the job's ``.cancelling/reason`` before its exit code, see :data:`WRAPPER`).
CANCEL_SCRIPT = (
    MARKED_FUNCS
    + r"""
grace=$1; mode=$2; reason=$3; shift 3
# "after:JOBDIR" (a watcher's fail-fast): nothing to do once a rank of this machine claimed the machine's
# own cancel there; it covers every rank of the machine, and a second cancel of 1,000 ranks writes 1,000
# reason files while the first one's victims need the CPU
case "$mode" in
  after:*) [ ! -d "${mode#after:}/.cancelling" ] || exit 0; mode=nowait;;
esac
tick() { sleep 0.1 2>/dev/null || sleep 1; }
groups=''; term=''
nl='
'
marks=${extra_mark:-}
while [ $# -ge 3 ]; do
  d="$1/jobs/$2/$3"; shift 3
  marks="$marks$nl$d/"
  [ -d "$d" ] || continue
  [ -f "$d/exit" ] && continue
  pg=''
  [ ! -f "$d/pgid" ] || { read -r pg < "$d/pgid"; } 2>/dev/null || pg=''
  case "$pg" in
    ''|*[!0-9]*)
      # no process group yet: the reason first, then the pgid once more (its wrapper, writing its pgid
      # meanwhile, checks for the reason right after: one of the two sends the signal; see WRAPPER)
      printf '%s\n' "$reason" > "$d/cancel"
      [ ! -f "$d/pgid" ] || { read -r pg < "$d/pgid"; } 2>/dev/null || pg=''
      case "$pg" in ''|*[!0-9]*) continue;; esac;;
    *) [ "$mode" = first ] || printf '%s\n' "$reason" > "$d/cancel";;
  esac
  groups="$groups $pg"
  # signalled already by the failing rank (SKY_SIGNALLED: " -PGID ..."): a group gets one SIGTERM
  case "${SKY_SIGNALLED:-} " in *" -$pg "*) ;; *) term="$term $pg";; esac
  echo "C $d"
done
# every reason first, then every group in one kill: 1,000 ranks signalled one by one would wake and
# take the CPU this loop needs before the last one is signalled (a group gone already: its pid, as is)
if [ -n "$term" ]; then
  neg=''
  for pg in $term; do neg="$neg -$pg"; done
  if ! kill -TERM $neg 2>/dev/null; then
    for pg in $term; do kill -0 "-$pg" 2>/dev/null || kill -TERM "$pg" 2>/dev/null; done
  fi
fi
oldifs=$IFS; IFS=$nl; set -f; set -- $marks; set +f; IFS=$oldifs
# then the marked processes outside those groups (escaped: setsid, a daemon, an orphan of an ended
# rank); a group's own members had their SIGTERM, and a second one runs a handler twice
outside=$(marked "$@")
if [ -n "$outside" ] && [ -n "$groups" ] && tab=$(ps -eo pid=,pgid= 2>/dev/null); then
  outside=$(printf '%s\n' "$tab" | awk -v m="$(echo $outside)" -v g="$groups" 'BEGIN {
    n = split(m, a, " "); for (i = 1; i <= n; i++) w[a[i]] = 1
    n = split(g, b, " "); for (i = 1; i <= n; i++) x[b[i]] = 1 }
    ($1 in w) && !($2 in x) { print $1 }')
fi
for p in $outside; do kill -TERM "$p" 2>/dev/null; done
if [ "$mode" != wait ]; then
  # fail-fast: return at once; a detached helper SIGKILLs whatever is left after the grace
  killer='__KILLER__'
  frac=${grace#*.}; ticks=$(( ${grace%.*} * 10 + ${frac%??} ))
  SKY_KILL_MARKS=$marks
  export SKY_KILL_MARKS
  if command -v setsid >/dev/null 2>&1; then setsid sh -c "$killer" sh "$ticks" "$groups" </dev/null >/dev/null 2>&1 &
  else nohup sh -c "$killer" sh "$ticks" "$groups" </dev/null >/dev/null 2>&1 & fi
  exit 0
fi
# A group is alive while it has a member that is not a zombie (a slow init may reap late).
# `kill -0` is a builtin and answers most rounds; `ps` (a fork) only tells zombies apart.
alive() {
  [ -n "$(marked "$@")" ] && return 0
  any=''
  for pg in $groups; do
    if kill -0 "-$pg" 2>/dev/null || kill -0 "$pg" 2>/dev/null; then any="$any $pg"; fi
  done
  [ -n "$any" ] || return 1
  if out=$(ps -eo pgid=,stat= 2>/dev/null); then
    printf '%s\n' "$out" | awk -v g="$any" 'BEGIN { n = split(g, a, " "); for (i = 1; i <= n; i++) w[a[i]] = 1 }
      ($1 in w) && $2 !~ /^Z/ { f = 1 } END { exit !f }'
    return $?
  fi
  return 0
}
limit=$(awk "BEGIN{print int($grace * 10)}")
i=0
while alive "$@" && [ "$i" -lt "$limit" ]; do tick; i=$((i + 1)); done
if alive "$@"; then
  for pg in $groups; do
    kill -KILL "-$pg" 2>/dev/null || kill -KILL "$pg" 2>/dev/null
    command -v pkill >/dev/null 2>&1 && pkill -KILL -s "$pg" 2>/dev/null
    echo "K $pg"
  done
  killmarked KILL "$@"
fi
i=0
while alive "$@" && [ "$i" -lt 50 ]; do killmarked KILL "$@"; tick; i=$((i + 1)); done
left=$(marked "$@")
[ -z "$left" ] || echo "LEFT" $left
exit 0
""".replace("__KILLER__", KILLER)
)

#: ``claim RANKDIR``: true for the first caller only, for a rank directory made beforehand. The claim is
#: a file made with noclobber (``set -C``: an ``O_EXCL`` open, a builtin redirection) where it was the
#: rank directory's ``mkdir``: an exec per rank, and a 1,024-rank start spent a fourth of its CPU in
#: ``mkdir``. The gang start's launchers and the never-started records claim the same way.
CLAIM_FUNC = r"""claim() { set -C; { true > "$1/claim"; } 2>/dev/null; _c=$?; set +C; return $_c; }"""

#: Ranks the gang start skips because a sibling already failed: each record says cancelled (exit 143,
#: the reason in ``cancel``) without anything having run. ``job reason`` then ``root rank`` pairs; an
#: rank claimed already (by a launcher: :data:`CLAIM_FUNC`) is left alone (``EXISTS <rank>``, else
#: ``CANCELLED <rank>``). The rank directory's ``mkdir`` is its only fork per rank: 1,000 skipped ranks
#: are recorded in a second. The exit file is written in place (the status reads an empty one as not
#: written yet).
NEVER_STARTED_SCRIPT = (
    CLAIM_FUNC
    + r"""
j=$1; reason=$2; shift 2
umask 077
t=$(date +%s.%N 2>/dev/null); case "$t" in *N*|'') t=$(date +%s);; esac
while [ $# -ge 2 ]; do
  d="$1/jobs/$j/$2"; r=$2; shift 2
  [ -d "$d" ] || mkdir -p "$d"
  if ! claim "$d"; then echo "EXISTS $r"; continue; fi
  printf '%s\n' "$reason" > "$d/cancel"
  printf '%s\n' "$t" > "$d/start"; printf '%s\n' "$t" > "$d/end"
  printf '143\n' > "$d/exit"
  echo "CANCELLED $r"
done
"""
)

#: Kill everything any job under the listed roots started (found by the mark, so a lost job directory or
#: exit file loses nothing), stop their keepers, then remove each root (``REMOVED <root>``, or ``ABSENT
#: <root>`` when it was gone already). ``sh -s -- GRACE ROOT...``: the roots of one machine.
TEARDOWN_SCRIPT = r"""
grace=$1; shift
nl="
"
roots=''
# one keeper guards every root of a machine: each pid is looked at once (a `tr` per root was a fork
# per node, a second of CPU for 1,024 local nodes)
seen=' '
for root in "$@"; do
  roots="$roots$root$nl"
  if [ -f "$root/keeper.pid" ] && read -r kp < "$root/keeper.pid"; then
    case "$seen" in *" $kp "*) continue;; esac
    seen="$seen$kp "
    case "$(tr '\000' ' ' < "/proc/$kp/cmdline" 2>/dev/null)" in *sky-keeper*) kill -KILL "-$kp" 2>/dev/null || kill -KILL "$kp" 2>/dev/null ;; esac
  fi
done
marks=''
triples=''
oldifs=$IFS; IFS=$nl; set -f
for root in $roots; do
  IFS=$oldifs; set +f
  marks="$marks$root/jobs/$nl"
  for d in "$root"/jobs/*/*; do
    [ -d "$d" ] || continue
    r=${d##*/}; j=${d%/*}; j=${j##*/}
    triples="$triples$root$nl$j$nl$r$nl"
  done
  IFS=$nl; set -f
done
set -- $triples
IFS=$oldifs; set +f
(
  extra_mark=${marks%$nl}
  set -- "$grace" wait "torn down" "$@"
  __CANCEL__
)
# a wrapper still alive without an exit code: kill it, but only if that pid is still our wrapper
# (pids are reused; without /proc a reused pid can't be told apart, so it is left alone)
IFS=$nl; set -f
for root in $roots; do
  IFS=$oldifs; set +f
  for d in "$root"/jobs/*/*; do
    [ -f "$d/pid" ] || continue
    [ -f "$d/exit" ] && continue
    read -r pid < "$d/pid" || continue
    [ -r "/proc/$pid/cmdline" ] || continue
    case "$(tr '\000' ' ' < "/proc/$pid/cmdline" 2>/dev/null)" in
      *"$d/rank.sh"*) kill -KILL "$pid" 2>/dev/null ;;
    esac
  done
  if [ -d "$root" ]; then echo "REMOVED $root"; else echo "ABSENT $root"; fi
  IFS=$nl; set -f
done
set -- $roots
IFS=$oldifs; set +f
__REMOVE__
"""

#: The node's keeper (one per cluster root, or one for all roots of a machine): a dead-man's switch
#: that kills a job nobody polls any more (``orphan_timeout`` per rank), and SkyPilot's autodown for a
#: cluster left idle (``idle_down``). It counts its own ticks rather than comparing clocks, forks only
#: ``sleep``, and exits when it has nothing left to guard. ``sh -c KEEPER sky-keeper TICK TICK_MS`` with
#: the roots in ``$SKY_KEEPER_ROOTS`` (one per line).
KEEPER_SCRIPT = (
    MARKED_FUNCS
    + r"""
tick=$1; tick_ms=$2
nl="
"
oldifs=$IFS; IFS=$nl; set -f; set -- $SKY_KEEPER_ROOTS; set +f; IFS=$oldifs
cd /
for root in "$@"; do [ -d "$root" ] && printf '%s\n' "$$" > "$root/keeper.pid"; done
idle=0; launched=-
while :; do
  sleep "$tick" 2>/dev/null || sleep 1
  any=0; active=0
  for root in "$@"; do
    [ -d "$root" ] || continue
    any=1
    for d in "$root"/jobs/*/*; do
      [ -f "$d/pid" ] || continue
      [ -f "$d/exit" ] && continue
      active=1
      [ -f "$d/orphaned" ] && continue
      to=0; [ -f "$d/orphan_timeout" ] && read -r to < "$d/orphan_timeout"
      case "$to" in ''|*[!0-9]*) to=0;; esac
      [ "$to" -gt 0 ] || continue
      pl=-; [ -f "$d/polled" ] && read -r pl < "$d/polled"
      spl=-; sidle=0; [ -f "$d/keeper" ] && read -r spl sidle < "$d/keeper"
      case "$sidle" in ''|*[!0-9]*) sidle=0;; esac
      if [ "$pl" != "$spl" ]; then sidle=0; else sidle=$((sidle + tick_ms)); fi
      printf '%s %s\n' "$pl" "$sidle" > "$d/keeper"
      if [ "$sidle" -ge $((to * 1000)) ]; then
        printf 'orphaned: nothing polled this job for %ss (Airflow lost it); the node killed its processes\n' "$to" > "$d/orphaned"
        pg=''; [ -f "$d/pgid" ] && read -r pg < "$d/pgid"
        case "$pg" in ''|*[!0-9]*) pg='';; esac
        [ -n "$pg" ] && kill -TERM "-$pg" 2>/dev/null
        killmarked TERM "$d/"
        (sleep 3; [ -n "$pg" ] && kill -KILL "-$pg" 2>/dev/null; killmarked KILL "$d/") </dev/null >/dev/null 2>&1 &
      fi
    done
  done
  [ "$any" = 1 ] || exit 0
  root=$1
  l=-; [ -f "$root/launched" ] && read -r l < "$root/launched"
  if [ "$active" = 1 ] || [ "$l" != "$launched" ]; then idle=0; launched=$l; continue; fi
  down=0; [ -f "$root/idle_down" ] && read -r down < "$root/idle_down"
  case "$down" in ''|*[!0-9]*) down=0;; esac
  [ "$down" -gt 0 ] || exit 0
  idle=$((idle + tick_ms))
  [ "$idle" -ge $((down * 1000)) ] || continue
  # idle for idle_down: tear the cluster down on this machine (SkyPilot's autodown)
  for r in "$@"; do killmarked KILL "$r/jobs/"; done
  ik=; off=
  for r in "$@"; do
    [ -f "$r/idle_kill" ] && read -r ik < "$r/idle_kill"
    [ -f "$r/idle_off" ] && off=$(cat "$r/idle_off")
    if [ -f "$r/idle_rm" ]; then while read -r p; do [ -n "$p" ] && rm -rf "$p"; done < "$r/idle_rm"; fi
    rm -rf "$r"
  done
  # the node itself ends with this process (a pod's entrypoint): its resources go back
  # (0: none; "kill 0" would end this keeper's own process group before the power-off below)
  case "$ik" in ''|0|*[!0-9]*) ;; *) kill -TERM "$ik" 2>/dev/null;; esac
  # or the machine powers itself off (an EC2 instance launched to terminate on shutdown)
  [ -n "$off" ] && sh -c "$off" </dev/null >/dev/null 2>&1
  exit 0
done
"""
)


def teardown_script(remove: bool = True) -> str:
    """The teardown script with the cancel logic inlined: ``sh -s -- GRACE ROOT...``, one call for
    every node root of one machine (the local backend's 1,024 nodes: one scan of /proc, not 1,024).
    ``remove=False``: the roots are left for the caller to take away once every process is gone (the
    local backend renames its cluster's tree and deletes it in the background: ``backends.local.trash``)."""
    rm = '[ $# -eq 0 ] || rm -rf -- "$@" || exit 1' if remove else ":"
    return TEARDOWN_SCRIPT.replace("__CANCEL__", CANCEL_SCRIPT).replace("__REMOVE__", rm)
