"""`--kv-transfer-allowed-receivers`: a prefill worker pushes only to receivers its operator listed."""

import pytest

from ferry.config import KV_DEFAULT_ALLOWED_RECEIVERS
from ferry.kv_transfer.allowed_receivers import ReceiverAllowList


def test_default_is_loopback_only():
    allowed = ReceiverAllowList(KV_DEFAULT_ALLOWED_RECEIVERS)
    assert allowed.allows("tcp://127.0.0.1:5555") and allowed.allows("tcp://127.9.9.9:1")
    assert allowed.allows("tcp://[::1]:5555") and allowed.allows("tcp://localhost:80")
    for target in ("tcp://10.0.0.1:5555", "tcp://attacker.example.com:5555", "tcp://[fd00::1]:5555",
                   "tcp://0.0.0.0:5555", "tcp://127.0.0.1.evil.com:1", "ipc:///tmp/x", "tcp://127.0.0.1"):  # fmt: skip
        assert not allowed.allows(target), target


def test_networks_addresses_hosts_and_ports():
    allowed = ReceiverAllowList(["10.0.0.0/8", "192.168.1.7:6000", "decode-0.ferry.svc"])
    assert allowed.allows("tcp://10.200.3.4:1234")
    assert allowed.allows("tcp://192.168.1.7:6000") and not allowed.allows("tcp://192.168.1.7:6001")
    assert allowed.allows("tcp://DECODE-0.ferry.svc:7000") and not allowed.allows("tcp://decode-1.ferry.svc:7000")
    assert not allowed.allows("tcp://11.0.0.1:1234")
    v6 = ReceiverAllowList(["fd00::/8", "[2001:db8::1]:9000"])
    assert v6.allows("tcp://[fd12::5]:1") and v6.allows("tcp://[2001:db8::1]:9000")
    assert not v6.allows("tcp://[2001:db8::1]:9001") and not v6.allows("tcp://10.0.0.1:1")


@pytest.mark.parametrize("entry", ["", "10.0.0.0/8:x", "bad host!", "[::1]:y"])
def test_bad_entries_are_refused_with_the_flag_named(entry):
    with pytest.raises(ValueError, match="--kv-transfer-allowed-receivers"):
        ReceiverAllowList([entry])
