"""The Redis block store against a real redis-server with a password: AUTH and TLS from the URL, and
values sealed with the deployment's secret, so blocks written without it (or moved between keys) are
never read."""

from __future__ import annotations

import pytest
import redis
from server_utils import redis_server

from ferry.kv_transfer.blocks import KVBlocks
from ferry.kv_transfer.redis_store import RedisBlockStore

PASSWORD = "redis-test-password-7"


@pytest.fixture(scope="module")
def redis_port():
    with redis_server(PASSWORD) as port:
        yield port


def block(h: bytes, parent: bytes | None, fill: int) -> KVBlocks:
    return KVBlocks(block_size=2, num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32", block_hashes=[h],
                    parent_hash=parent, data=bytes([fill]) * (2 * 2 * 2 * 4))  # fmt: skip


def chain(*blocks: KVBlocks) -> KVBlocks:
    first, data = blocks[0], b"".join(b.data for b in blocks)
    return KVBlocks(first.block_size, first.num_layers, first.num_kv_heads, first.head_dim, first.dtype,
                    [b.block_hashes[0] for b in blocks], first.parent_hash, data)  # fmt: skip


def store(port: int, secret: bytes | None, password: str | None = PASSWORD) -> RedisBlockStore:
    auth = f":{password}@" if password else ""
    return RedisBlockStore(f"redis://{auth}127.0.0.1:{port}/0", "test-model", 60, 5.0, None, secret)


def test_tls_comes_with_a_rediss_url(tmp_path):
    """`rediss://` against a TLS-only redis-server: the server's certificate is verified (against the
    CA named in the URL), plain connections are refused, and sealed blocks round-trip over it."""
    ca = str(tmp_path / "ca.pem")
    secret = b"deployment-secret-0123456789"
    with redis_server(PASSWORD, tls_ca=ca) as port:
        url = f"rediss://:{PASSWORD}@127.0.0.1:{port}/0"
        tls = RedisBlockStore(f"{url}?ssl_ca_certs={ca}", "test-model", 60, 5.0, None, secret)
        h1, h2 = b"\x01" * 16, b"\x02" * 16
        assert tls.put(chain(block(h1, None, 1), block(h2, h1, 2)))[0] == 2
        assert [b.data for b in tls.get_chain([h1, h2], None)] == [bytes([1]) * 32, bytes([2]) * 32]
        with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            RedisBlockStore(url, "test-model", 60, 5.0, None, secret).client.ping()  # the system's CAs only
        with pytest.raises(redis.ConnectionError):
            store(port, secret).client.ping()  # redis:// to a TLS port


def test_the_password_comes_with_the_url(redis_port):
    with pytest.raises(redis.AuthenticationError):
        store(redis_port, None, password=None).client.ping()
    with pytest.raises(redis.AuthenticationError):
        store(redis_port, None, password="wrong").client.ping()
    assert store(redis_port, None).client.ping()


def test_values_are_sealed_with_the_deployment_secret(redis_port):
    secret = b"deployment-secret-0123456789"
    ours = store(redis_port, secret)
    ours.client.flushdb()
    h1, h2, h3 = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
    written, nbytes = ours.put(chain(block(h1, None, 1), block(h2, h1, 2)))
    assert written == 2 and nbytes == len(ours.client.get(ours.key(h1))) + len(ours.client.get(ours.key(h2)))
    got = ours.get_chain([h1, h2], None)
    assert [b.block_hashes for b in got] == [[h1], [h2]] and got[1].data == bytes([2]) * 32

    # Someone with write access to Redis but not the secret stores a block for h3 (a plain value,
    # or one sealed with another secret): the chain stops before it.
    for forger in (store(redis_port, None), store(redis_port, b"another-secret-0123456789")):
        ours.client.delete(ours.key(h3))
        forger.put(block(h3, h2, 9))
        assert [b.block_hashes[0] for b in ours.get_chain([h1, h2, h3], None)] == [h1, h2]
    # A genuine value moved to another key is refused too (the MAC covers the key).
    ours.client.set(ours.key(h3), ours.client.get(ours.key(h2)))
    assert len(ours.get_chain([h1, h2, h3], None)) == 2
    ours.client.set(ours.key(h3), b"\x00garbage")
    assert len(ours.get_chain([h1, h2, h3], None)) == 2
    # Without a secret, a store reads nothing a sealed deployment wrote (the values do not decode).
    assert store(redis_port, None).get_chain([h1], None) == []
