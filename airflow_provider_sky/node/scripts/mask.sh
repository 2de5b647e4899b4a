# shellcheck shell=sh
maskpy() {
  for _py in /usr/bin/python3 /usr/local/bin/python3 "$(command -v python3 2>/dev/null)"; do
    case "$_py" in /*) [ -x "$_py" ] || continue;; *) continue;; esac
    "$_py" -I -S -c '@sky:mask_filter.py@'
    return
  done
  return 1
}
maskawk() {
  _w=''; [ -n "$(awk -W interactive 'BEGIN { }' </dev/null 2>&1)" ] || _w='-W interactive'
  # shellcheck disable=SC2086 # empty, or the two words -W interactive
  LC_ALL=C awk $_w '@sky:mask.awk@'
}
maskfilter() { maskpy || maskawk; }
