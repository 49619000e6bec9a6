"""Sockets on this machine."""

from __future__ import annotations

import contextlib
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (another process may still take it before you)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_ports(n: int, host: str = "127.0.0.1", exclude: frozenset[int] = frozenset()) -> list[int]:
    """`n` distinct free TCP ports, none in `exclude`. All sockets stay bound until every port is
    picked: `free_port()` called n times may hand out one port twice (the kernel reuses a port
    the moment its socket closes), and two workers then race for it (seen in CI: `ferry up --pd
    1:1` started both on one port)."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < n:
            s = stack.enter_context(socket.socket())
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in exclude:
                ports.append(port)
        return ports
