# shellcheck shell=sh

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
