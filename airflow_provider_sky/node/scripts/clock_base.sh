# shellcheck shell=sh
cb=''; cu=''
if [ -r /proc/uptime ]; then
  w_=''; i_=0
  while [ "$i_" -lt 3 ]; do
    i_=$((i_ + 1))
    read -r u1_ x_ < /proc/uptime
    e_=$(date +%s%N 2>/dev/null) || e_=''
    # shellcheck disable=SC2034 # x_: the field read skips
    read -r u2_ x_ < /proc/uptime
    case "$e_" in ''|*[!0-9]*) break;; esac
    u1_=${u1_%.*}${u1_#*.}; u1_=${u1_#"${u1_%%[!0]*}"}; u2_=${u2_%.*}${u2_#*.}; u2_=${u2_#"${u2_%%[!0]*}"}
    d_=$((${u2_:-0} - ${u1_:-0}))
    if [ -z "$w_" ] || [ "$d_" -lt "$w_" ]; then w_=$d_; cu=$(((${u1_:-0} + ${u2_:-0}) / 2)); cb=$((e_ / 10000000)); fi
    [ "$d_" -gt 1 ] || break
  done
fi
# shellcheck source=clock.sh
. "$SKY_SCRIPTS/clock.sh"
