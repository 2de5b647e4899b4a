"""Ask ext2/3/4 to place each cluster of the local backend in a block group of its own.

A local cluster is a tree of thousands of small files (1,024 ranks: ~13,000 inodes) created at once,
and its teardown deletes them at once. ext4 puts a new directory next to its parent's, so each cluster
reused the inodes the previous one freed; and ext4 without a journal skips an inode freed in the last
``dirty_expire_centisecs`` (30 s), scanning past every one of them for each new file: a gang start or a
fail-fast right after another cluster's teardown spent a third of its CPU in that scan. With the
directory's "top of hierarchy" flag (``chattr +T``), the Orlov allocator spreads its subdirectories
(the clusters, named per DAG run) across the disk's groups instead.

Another filesystem, or a user not allowed to set the flag, keeps its default: nothing depends on it.
"""

from __future__ import annotations

import array
import fcntl
import logging
import os

log = logging.getLogger(__name__)

#: linux/fs.h: FS_IOC_GETFLAGS / FS_IOC_SETFLAGS (an ``int`` despite the ``long`` in their macros)
#: and FS_TOPDIR_FL.
FS_IOC_GETFLAGS = 0x80086601
FS_IOC_SETFLAGS = 0x40086602
FS_TOPDIR_FL = 0x00020000


def mark_topdir(path: str | os.PathLike[str]) -> bool:
    """Set the flag on the directory ``path``; True when it is set (now or already)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        flags = array.array("i", [0])
        fcntl.ioctl(fd, FS_IOC_GETFLAGS, flags, True)
        if flags[0] & FS_TOPDIR_FL:
            return True
        flags[0] |= FS_TOPDIR_FL
        fcntl.ioctl(fd, FS_IOC_SETFLAGS, flags, True)
        return True
    except OSError as exc:  # tmpfs, xfs, ...: no such flag; or not ours to set
        log.debug("%s keeps the filesystem's default placement (%s)", path, exc.strerror)
        return False
    finally:
        os.close(fd)
