"""Sockets on this machine.

A port picked by binding port 0 and closing the socket is free only until someone else binds it,
and ferry's own processes bind ports at random as they start (the engine core's ZMQ sockets for
KV events and KV transfers), from the same range the kernel hands out for port 0. So a launcher
that starts several servers at once reserves their ports (`reserve_ports`: sockets it keeps
bound) and hands each socket to its server (`ferry serve --fd`), and a server binds and listens
on its own port before it starts anything else (`listening_socket`).
"""

from __future__ import annotations

import socket

BACKLOG = 2048  # uvicorn's default


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (another process may still take it before you)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_ports(n: int, host: str = "127.0.0.1") -> list[socket.socket]:
    """`n` TCP sockets bound to distinct free ports of `host`. They are not listening and have no
    SO_REUSEADDR, so no other socket can bind their ports (with or without SO_REUSEADDR) while
    they stay open; the caller closes them (or hands them over). All are held until every port
    is picked, so none is handed out twice (the kernel gives a port out again the moment its
    socket closes: seen in CI, two `ferry up --pd` workers on one port)."""
    socks: list[socket.socket] = []
    try:
        while len(socks) < n:
            socks.append(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET))
            socks[-1].bind((host, 0))
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def listening_socket(host: str, port: int, fd: int | None = None) -> socket.socket:
    """The TCP socket a server serves on, listening from now on: the inherited socket `fd` (bound
    by a launcher; `port` is then only what it was told) or `host:port` bound here (SO_REUSEADDR,
    as uvicorn binds: a restart need not wait out the last run's TIME_WAIT connections).
    Listening at once keeps the port ours while the rest starts (a bound socket that is not
    listening shares its port with any other SO_REUSEADDR bind); connections made before the
    HTTP side runs wait in the backlog. OSError when the port is taken, ValueError for a bad fd."""
    if fd is None:
        # As uvicorn binds (not socket.create_server, which makes "::" IPv6-only where Linux's
        # default lets it take IPv4 too, as uvicorn's did).
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(BACKLOG)
        except BaseException:
            sock.close()
            raise
        return sock
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise ValueError(f"--fd {fd}: not an open socket ({e})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise ValueError(f"--fd {fd}: not a TCP socket")
    if sock.getsockname()[1] == 0:
        sock.detach()
        raise ValueError(f"--fd {fd}: the socket is not bound to a port")
    sock.set_inheritable(False)  # ours alone from here: no child of this server keeps the port open
    # The launcher held it without SO_REUSEADDR (so nothing could share it); set now, before the
    # first connection: accepted connections inherit it, and without it their TIME_WAIT would keep
    # a replica restarted on this port from binding it for a minute.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.listen(BACKLOG)
    return sock
