# shellcheck shell=sh

# the bucket mounts of a cluster root (one per line in $1/mounts), lazily (a busy one is detached at once):
# before anything under the root is deleted, since a delete through a mount would empty the bucket
unmount_buckets() {
  [ -f "$1/mounts" ] || return 0
  while IFS= read -r _m; do
    [ -n "$_m" ] && { fusermount3 -u -z "$_m" || fusermount -u -z "$_m" || umount -l "$_m"; } >/dev/null 2>&1
  done < "$1/mounts"
}
