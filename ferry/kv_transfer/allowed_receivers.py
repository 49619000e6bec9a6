"""Which KV receivers a prefill worker may push to (`--kv-transfer-allowed-receivers`).

A prefill worker pushes a prompt's KV blocks to the `decode_receiver` named in
the request's `kv_transfer_params`. The gateway names the decode worker it
chose, but anyone who reaches a prefill worker directly could name their own
address and be sent the offer (the prompt's block hashes) and, with no secret
set, the blocks. So a worker connects only to receivers in its operator's
allow-list: entries are IP networks (`10.0.0.0/8`, `fd00::/8`), single
addresses, or host names (matched exactly, as written: the operator trusts
their own DNS), each optionally with `:PORT`. The default is loopback only,
which is what `ferry up --pd` and one-host deployments use; multi-host
deployments list their decode workers' network.
"""

from __future__ import annotations

import functools
import ipaddress
import re

_TARGET = re.compile(r"tcp://(?:\[(?P<v6>[0-9a-fA-F:.]+)\]|(?P<host>[A-Za-z0-9.-]+)):(?P<port>[0-9]{1,5})")


class ReceiverAllowList:
    def __init__(self, entries: list[str] | tuple[str, ...]) -> None:
        self.networks: list[tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, int | None]] = []
        self.hosts: list[tuple[str, int | None]] = []
        for entry in entries:
            self._add(entry.strip())

    def _add(self, entry: str) -> None:
        host, port = entry, None
        m = re.fullmatch(r"\[(.+)\](?::(\d+))?", entry)  # [v6] or [v6]:port
        if m:
            host, port = m.group(1), int(m.group(2)) if m.group(2) else None
        elif entry.count(":") == 1:  # v4 or a name with a port (a bare v6 address has several colons)
            host, p = entry.split(":")
            if not p.isdigit():
                raise ValueError(f"--kv-transfer-allowed-receivers: bad port in {entry!r}")
            port = int(p)
        if not host:
            raise ValueError(f"--kv-transfer-allowed-receivers: empty entry {entry!r}")
        try:
            self.networks.append((ipaddress.ip_network(host, strict=False), port))
        except ValueError:
            if not re.fullmatch(r"[A-Za-z0-9.-]+", host):
                raise ValueError(f"--kv-transfer-allowed-receivers: {entry!r} is not an address, network or host "
                                 "name") from None  # fmt: skip
            self.hosts.append((host.lower(), port))

    def allows(self, target: str) -> bool:
        """Whether `tcp://host:port` is a receiver this worker may push to."""
        m = _TARGET.fullmatch(target)
        if m is None:
            return False
        host, port = m.group("v6") or m.group("host"), int(m.group("port"))
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return any(host.lower() == h and p in (None, port) for h, p in self.hosts)
        return any(address in net and p in (None, port) for net, p in self.networks)


@functools.cache
def allow_list(entries: tuple[str, ...]) -> ReceiverAllowList:
    """The allow-list of a worker's (immutable) configuration, parsed once."""
    return ReceiverAllowList(entries)
