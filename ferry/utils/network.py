"""Sockets on this machine.

A port picked by binding port 0 and closing the socket is free only until someone else binds it,
and ferry's own processes bind ports at random as they start (the engine core's ZMQ sockets for
KV events and KV transfers), from the same range the kernel hands out for port 0. So a launcher
that starts several servers at once reserves their ports (`reserve_ports`: sockets it keeps
bound) and hands each socket to its server (`ferry serve --fd`), and a server binds its own port
before it starts anything else (`server_socket`).
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def port_number(text: str) -> int:
    """A --port value: 0 (any free port) to 65535, else an argparse error naming it."""
    import argparse

    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number (0 to 65535)")
    return port


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


def reserve_port(host: str = "127.0.0.1") -> tuple[socket.socket, int]:
    """One reserved port (reserve_ports): its socket, held until a server has it (`--fd`), and its number."""
    sock = reserve_ports(1, host)[0]
    return sock, sock.getsockname()[1]


class ServerSocket(socket.socket):
    """A server's TCP socket: SO_REUSEADDR comes on in `listen`, just before the kernel listens.
    Not before: a bound socket with it could share its port with another that has it too (ZMQ's
    random binds); nothing can share a listening port, and the listen fails with EADDRINUSE if
    one did in between. Not after: a connection whose handshake completed in between would not
    inherit it, and its TIME_WAIT would keep a restarted server off the port for a minute."""

    def listen(self, *backlog: int) -> None:
        self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        super().listen(*backlog)


def server_socket(host: str, port: int, fd: int | None = None) -> ServerSocket:
    """The TCP socket a server will serve on, bound and not yet listening (uvicorn listens when its
    HTTP side is up, so clients are refused until then, as with uvicorn's own bind): the inherited
    socket `fd` (bound by a launcher; `port` is then only what it was told) or `host:port` bound
    here. Bound without SO_REUSEADDR, so no other socket can share the port meanwhile (one that is
    bound with it could, ZMQ's random binds included); only when that fails does it bind with it,
    as uvicorn does, for a port whose last server left connections in TIME_WAIT. It sets the
    option itself as it listens (ServerSocket). ValueError (a flag to change) for a taken port
    or a bad fd."""
    if fd is not None:
        return _inherited_socket(fd)
    try:
        return _bound_socket(host, port)
    except OSError as e:
        raise ValueError(f"cannot serve on {host}:{port}: {e.strerror or e}") from None


def _bound_socket(host: str, port: int) -> ServerSocket:
    for reuse in (False, True):
        # AF_INET6 for "::" as uvicorn binds it: Linux's default (bindv6only 0) lets IPv4 in too,
        # where socket.create_server would make it IPv6-only.
        sock = ServerSocket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            if reuse:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            return sock
        except OSError:
            sock.close()
            if reuse:
                raise
    raise AssertionError("unreachable")


def _inherited_socket(fd: int) -> ServerSocket:
    try:
        sock = ServerSocket(fileno=fd)
    except OSError as e:
        raise ValueError(f"--fd {fd}: not an open socket ({e})") from None
    if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
        sock.detach()
        raise ValueError(f"--fd {fd}: not a TCP socket")
    if sock.getsockname()[1] == 0:
        sock.detach()
        raise ValueError(f"--fd {fd}: the socket is not bound to a port")
    sock.set_inheritable(False)  # ours alone from here: no child of this server keeps the port open
    return sock


@contextlib.contextmanager
def handed_over(cmd: list[str], sock: socket.socket | None) -> Iterator[tuple[list[str], tuple[int, ...]]]:
    """A child's command and pass_fds for a server given `sock` (`--fd`; none: the command as is);
    the socket is closed here on leaving, once the child has it: held here too, the port would take
    connections while the child is dead."""
    try:
        yield ([*cmd, "--fd", str(sock.fileno())], (sock.fileno(),)) if sock is not None else (cmd, ())
    finally:
        if sock is not None:
            sock.close()


def allow_rebind(sock: socket.socket) -> None:
    """SO_REUSEADDR on a listening server socket (ServerSocket sets it as it listens; this is for an
    event loop that listens without calling `listen` on the Python object)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
