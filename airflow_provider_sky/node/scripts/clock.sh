# shellcheck shell=sh
case "$cb$cu" in *[!0-9]*) cb='';; esac
clock() {
  if [ -n "$cb" ] && [ -n "$cu" ] && { read -r _u _x < /proc/uptime; } 2>/dev/null; then
    _u=${_u%.*}${_u#*.}; _u=${_u#"${_u%%[!0]*}"}
    case "$_u" in *[!0-9]*) ;; *) _u=$((${_u:-0} - cu + cb)); T=$((_u / 100)).$((_u / 10 % 10))$((_u % 10)); return 0;; esac
  fi
  T=$(date +%s.%N 2>/dev/null); case "$T" in *N*|'') T=$(date +%s);; esac
}
