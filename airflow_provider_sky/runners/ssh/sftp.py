"""Copy files to a node over SFTP, on a session of the runner's pooled connection.

:class:`SSHRunner`'s ``put_file`` / ``put_tree`` open the session, count the call and turn OSError
into RunnerError; the functions here do the copying on an open :class:`paramiko.SFTPClient`.
"""

from __future__ import annotations

import stat
from pathlib import Path

import paramiko

from airflow_provider_sky.runners.base import RunnerError, walk_tree


def open_client(t: paramiko.Transport) -> paramiko.SFTPClient:
    """An SFTP session on the transport (raises SSHException if the server offers none)."""
    client = paramiko.SFTPClient.from_transport(t)
    if client is None:
        raise paramiko.SSHException("sftp subsystem unavailable")
    return client


def remote_path(sftp: paramiko.SFTPClient, path: str) -> str:
    """``~`` / ``~/x`` -> the remote home; SFTP sessions start there, so resolve it once."""
    if path == "~" or path.startswith("~/"):
        home = sftp.normalize(".")
        rest = path[2:].lstrip("/")
        return f"{home.rstrip('/')}/{rest}" if rest else home
    return path


def makedirs(sftp: paramiko.SFTPClient, path: str, host: str) -> None:
    """``mkdir -p path``; RunnerError if a component exists and is not a directory."""
    parts = [p for p in path.split("/") if p]
    current = "/" if path.startswith("/") else ""
    for part in parts:
        current = f"{current}{part}" if current in ("", "/") else f"{current}/{part}"
        try:
            if not stat.S_ISDIR(sftp.stat(current).st_mode or 0):
                raise RunnerError(host, f"remote {current} exists and is not a directory")
        except FileNotFoundError:
            try:
                sftp.mkdir(current)
            except OSError:
                if not stat.S_ISDIR(sftp.stat(current).st_mode or 0):  # lost a race: fine if it is a dir now
                    raise


def put(sftp: paramiko.SFTPClient, local: Path, remote: str, mode: int | None) -> None:
    """Upload one file to an existing remote directory; its mode bits (or ``mode``) are applied."""
    st = local.stat()  # follows symlinks: we copy the target's content
    with open(local, "rb") as fh:
        sftp.putfo(fh, remote, file_size=st.st_size)
    sftp.chmod(remote, mode if mode is not None else stat.S_IMODE(st.st_mode))


def put_file(sftp: paramiko.SFTPClient, local: Path, remote: str, mode: int | None, host: str) -> None:
    """Upload ``local`` to ``remote`` (``~`` expanded), creating its parent directories."""
    dest = remote_path(sftp, remote)
    parent = dest.rsplit("/", 1)[0] if "/" in dest.rstrip("/") else ""
    if parent:
        makedirs(sftp, parent, host)
    put(sftp, local, dest, mode)


def put_tree(sftp: paramiko.SFTPClient, local: Path, remote: str, host: str) -> int:
    """Copy the directory ``local``'s entries (:func:`walk_tree`) into ``remote``, created if missing."""
    root = remote_path(sftp, remote)
    makedirs(sftp, root, host)
    count = 0
    for entry in walk_tree(local):
        dest = f"{root.rstrip('/')}/{entry.relative}"
        if entry.is_dir:
            try:
                sftp.mkdir(dest)
            except OSError:
                if not stat.S_ISDIR(sftp.stat(dest).st_mode or 0):
                    raise
        else:
            put(sftp, entry.path, dest, None)
            count += 1
    return count
