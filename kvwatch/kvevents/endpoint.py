"""What an endpoint names on this machine, checked before ZMQ touches it
(settings and the source both ask; this module imports nothing of kvwatch)."""

from __future__ import annotations

import os
import stat


def ipc_path_problem(endpoint: str) -> str | None:
    """ZMQ binding ipc://PATH removes whatever PATH is: a path that exists and
    is not a socket (a leftover one is replaced, as after a crash) is refused."""
    path = endpoint[len("ipc://"):]
    try:
        mode = os.lstat(path).st_mode
    except (OSError, ValueError):
        return None  # nothing there (or no such path): ZMQ creates the socket
    if stat.S_ISSOCK(mode):
        return None
    return (f"{endpoint} names {path}, which exists and is not a socket: kvwatch will not replace it "
            "(name another path, or remove it)")
