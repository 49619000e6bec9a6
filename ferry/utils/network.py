"""Sockets on this machine."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (another process may still take it before you)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
