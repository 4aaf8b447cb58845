"""Where ranks meet: rank 0's address and port, and the environment torchrun sets (private)."""

from __future__ import annotations

import os
import socket
import threading

MASTER_ADDR = "127.0.0.1"

# A forked child inherits every file descriptor open in the parent. Launches running in
# several threads take this lock while they hold descriptors their ranks must not share
# (the write ends of a rank's pipes, a port-probing socket) and while they fork.
FD_LOCK = threading.Lock()


def find_free_port(host: str = MASTER_ADDR) -> int:
    """Return a TCP port on ``host`` that was free a moment ago.

    Args:
        host: The address to bind to.

    Returns:
        A port number another process may still take before you bind it.

    Examples:
        >>> 1024 <= find_free_port() <= 65535
        True
    """
    # Under the lock: a rank forked meanwhile by a launch in another thread would inherit
    # the socket and keep the port bound, so that this launch's rank 0 could not listen on it.
    with FD_LOCK, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def master_port() -> int | None:
    """``MASTER_PORT`` when set (checked); ``None``: rank 0 serves on a socket we bind."""
    value = os.environ.get("MASTER_PORT")
    if not value:
        return None
    try:
        port = int(value)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ValueError(
            f"MASTER_PORT={value!r} is not a TCP port number (1-65535); set it to a free "
            "port, or unset it so that launch picks one"
        )
    with FD_LOCK, socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # Like torch's TCPStore, allow a port a finished run left in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((MASTER_ADDR, port))
        except OSError as exc:
            raise ValueError(
                f"MASTER_PORT={port} cannot be used on {MASTER_ADDR} ({exc.strerror}): "
                "another process holds it. Unset MASTER_PORT so that launch picks a free "
                "port, or set it to a free one."
            ) from None
    return port


def under_torchrun() -> bool:
    """Whether ``torchrun`` started this process (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set)."""
    return all(key in os.environ for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
