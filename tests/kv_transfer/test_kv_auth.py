"""The KV receiver against hostile peers, on a real ZMQ socket: with the deployment's secret it takes
only messages sealed with it (unauthenticated, wrong-secret and replayed ones are dropped before
decoding), refuses oversized pushes and opens only the shared-memory segments it named itself."""

from __future__ import annotations

import threading
from multiprocessing import shared_memory

import msgspec
import pytest
import zmq

from ferry.config import KVTransferConfig
from ferry.kv_transfer.blocks import KVBlocks
from ferry.kv_transfer.connector import KVConnector
from ferry.kv_transfer.core_channel import CoreChannel
from ferry.kv_transfer.protocol import Have, Offer, Push, WireMessage
from ferry.kv_transfer.receiver import ImportJob, Receiver
from ferry.utils.deployment_secret import AuthError, MessageAuth, load_secret

SECRET = b"deployment-secret-0123456789"
HELD = {b"h0"}  # the receiver's cache holds this block


def blocks(n: int, nbytes: int = 64) -> KVBlocks:
    return KVBlocks(1, 1, 1, nbytes // 8, "float32", [f"b{i}".encode() for i in range(n)], None, b"\0" * (nbytes * n))


@pytest.fixture()
def receiver():
    ctx = zmq.Context()
    channel = CoreChannel(ctx)
    r = Receiver(channel, "127.0.0.1", 0, max_payload_bytes=4096, has_block=HELD.__contains__, secret=SECRET,
                 timeout=5.0)  # fmt: skip
    thread = threading.Thread(target=r.run, daemon=True)
    thread.start()
    peer = ctx.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(r.addr)
    yield r, channel, peer
    r.stop()
    thread.join(5)
    peer.close(0)
    channel.close()
    ctx.term()


def reply(peer: zmq.Socket, auth: MessageAuth):
    assert peer.poll(30_000), "no reply"
    return msgspec.msgpack.decode(auth.open(peer.recv_multipart())[0], type=WireMessage)


def offer(tid: str, hashes=(b"h0", b"h1")) -> bytes:
    return msgspec.msgpack.encode(Offer(tid, list(hashes)))


def test_only_sealed_fresh_messages_are_answered(receiver):
    _, _, peer = receiver
    good = MessageAuth(SECRET)
    peer.send_multipart([offer("plain")])  # no MAC at all
    peer.send_multipart(MessageAuth(b"some-other-secret-0000").seal([offer("wrong")]))
    sealed = good.seal([offer("once")])
    peer.send_multipart(sealed)
    peer.send_multipart(sealed)  # the same bytes again: a replay
    tampered = good.seal([offer("tampered")])
    tampered[0] = offer("tampered", (b"h0", b"evil"))
    peer.send_multipart(tampered)
    peer.send_multipart(good.seal([offer("last")]))
    # Messages are handled in order: the first two replies answer "once" and "last", so every
    # other message was dropped.
    first, second = reply(peer, good), reply(peer, good)
    assert (first.transfer_id, second.transfer_id) == ("once", "last")
    assert isinstance(first, Have) and first.num_held == 1 and first.shm_name.startswith("ferry-kv-")
    assert not peer.poll(200)


def test_oversized_pushes_and_foreign_segments_are_refused(receiver):
    _, channel, peer = receiver
    auth = MessageAuth(SECRET)

    def push(payload: KVBlocks, shm_name: str | None = None, frames=()) -> ImportJob:
        meta = msgspec.structs.replace(payload, data=b"", scales=b"")
        peer.send_multipart(auth.seal([msgspec.msgpack.encode(Push("t", meta, len(payload.data), shm_name)),
                                       *frames]))  # fmt: skip
        assert channel.wake.poll(30_000)
        (job,) = channel.drain()
        return job

    big = blocks(100)  # 6,400 bytes > this receiver's 4,096
    job = push(big, frames=[big.data])
    assert job.payload is None and "more KV bytes" in job.error
    # A segment the receiver did not name (here: one that exists, named by the peer) is never opened.
    foreign = shared_memory.SharedMemory(create=True, size=128)
    try:
        job = push(blocks(1), shm_name=foreign.name)
        assert job.payload is None and "not named by this receiver" in job.error
    finally:
        foreign.close()
        foreign.unlink()
    small = blocks(1)
    job = push(small, frames=[small.data])
    assert job.error is None and job.payload.data == small.data


def test_a_connector_with_the_secret_gets_through_and_one_without_does_not(tmp_path):
    """The real sender (tcp and shm) against the real receiver, as two workers of a deployment run them."""
    ctx = zmq.Context()
    try:
        decode = KVConnector(KVTransferConfig(role="decode", port=0, secret=SECRET, timeout=5.0), ctx, "ns", 1 << 20,
                             HELD.__contains__)  # fmt: skip
        for transport, secret, ok in (("tcp", SECRET, True), ("shm", SECRET, True), ("tcp", None, False)):
            prefill = KVConnector(KVTransferConfig(role="prefill", transport=transport, secret=secret, timeout=2.0),
                                  ctx, "ns", 1 << 20, lambda h: False)  # fmt: skip
            try:
                payload = blocks(3)
                prefill.send("r", payload, decode.receiver_addr)
                if ok:  # the decode side's core imports and answers
                    assert decode.wake.poll(30_000)
                    (job,) = decode.drain()
                    assert job.error is None and job.payload.block_hashes == payload.block_hashes
                    decode.receiver.reply(job.identity, _done(job))
                assert prefill.wake.poll(30_000)
                (result,) = prefill.drain()
                assert result.outcome.ok is ok, result.outcome
                if not ok:
                    assert "no answer" in result.outcome.error and not decode.drain()
            finally:
                prefill.close()
        decode.close()
    finally:
        ctx.term()


def _done(job: ImportJob):
    from ferry.kv_transfer.protocol import Done

    return Done(job.transfer_id, True, job.payload.num_blocks)


def test_secrets_load_from_a_file_or_the_environment(tmp_path, monkeypatch):
    monkeypatch.delenv("FERRY_KV_TRANSFER_SECRET", raising=False)
    assert load_secret(None) is None
    path = tmp_path / "secret"
    path.write_text("s" * 32 + "\n")
    assert load_secret(str(path)) == b"s" * 32
    path.write_text("short")
    with pytest.raises(ValueError, match="16 bytes"):
        load_secret(str(path))
    monkeypatch.setenv("FERRY_KV_TRANSFER_SECRET", "e" * 20)
    assert load_secret(None) == b"e" * 20
    with pytest.raises(AuthError):
        MessageAuth(SECRET).open([b"just one frame"])
    assert "secret" not in repr(KVTransferConfig(secret=SECRET))  # never logged
