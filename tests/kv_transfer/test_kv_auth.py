"""The KV receiver against hostile peers, on a real ZMQ socket: with the deployment's secret it takes
only messages sealed with it (unauthenticated, wrong-secret and replayed ones are dropped before
decoding), refuses oversized pushes and opens only the shared-memory segments it named itself."""

from __future__ import annotations

import socket
import threading
import time
from multiprocessing import shared_memory

import msgspec
import pytest
import zmq

from ferry.config import KVTransferConfig
from ferry.kv_transfer.blocks import KVBlocks
from ferry.kv_transfer.connector import KVConnector, cache_fingerprint
from ferry.kv_transfer.core_channel import CoreChannel
from ferry.kv_transfer.protocol import CHUNK_BYTES, Chunk, Done, Have, Offer, Push, WireMessage
from ferry.kv_transfer.receiver import ImportJob, Receiver
from ferry.utils.deployment_secret import AuthError, MessageAuth, load_secret, warn_if_unsealed

SECRET = b"deployment-secret-0123456789"
FINGERPRINT = cache_fingerprint("ns")  # the receiver's model and cache
HELD = {b"h0"}  # the receiver's cache holds this block


def blocks(n: int, nbytes: int = 64) -> KVBlocks:
    return KVBlocks(1, 1, 1, nbytes // 8, "float32", [f"b{i}".encode() for i in range(n)], None, b"\0" * (nbytes * n))


@pytest.fixture()
def receiver():
    ctx = zmq.Context()
    channel = CoreChannel(ctx)
    r = Receiver(channel, "127.0.0.1", 0, max_payload_bytes=4096, has_block=HELD.__contains__,
                 fingerprint=FINGERPRINT, secret=SECRET,
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


def offer(tid: str, hashes=(b"h0", b"h1"), fingerprint: str = FINGERPRINT) -> bytes:
    return msgspec.msgpack.encode(Offer(tid, list(hashes), fingerprint))


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


def test_offers_of_another_model_or_cache_are_refused(receiver):
    """Blocks hash by tokens alone: a prefill worker of another model of the same shape (a
    fine-tune), or with another --kv-cache-dtype, would have its blocks imported and decoded from.
    The receiver refuses the offer, and an offer without a fingerprint (an older ferry) too."""
    _, channel, peer = receiver
    good = MessageAuth(SECRET)
    for tid, fingerprint in (("other", cache_fingerprint("another-model")), ("old", "")):
        peer.send_multipart(good.seal([offer(tid, fingerprint=fingerprint)]))
        answer = reply(peer, good)
        assert isinstance(answer, Done) and answer.transfer_id == tid and not answer.ok
        assert "another model or cache layout" in answer.error and FINGERPRINT in answer.error
    peer.send_multipart(good.seal([offer("same")]))
    assert isinstance(reply(peer, good), Have)
    assert not channel.drain()


def test_oversized_pushes_streams_and_foreign_segments_are_refused(receiver):
    r, channel, peer = receiver
    auth = MessageAuth(SECRET)

    def send_push(tid: str, payload: KVBlocks, shm_name: str | None = None, total: int | None = None) -> None:
        meta = msgspec.structs.replace(payload, data=b"", scales=b"")
        total = payload.num_bytes if total is None else total
        push = Push(tid, meta, len(payload.data), shm_name, total_bytes=0 if shm_name else total)
        peer.send_multipart(auth.seal([msgspec.msgpack.encode(push)]))

    def send_chunk(tid: str, offset: int, data: bytes, sock: zmq.Socket = peer) -> None:
        sock.send_multipart(auth.seal([msgspec.msgpack.encode(Chunk(tid, offset)), data]))

    def job() -> ImportJob:
        assert channel.wake.poll(30_000)
        (j,) = channel.drain()
        return j

    def transfer(tid: str, payload: KVBlocks) -> ImportJob:
        send_push(tid, payload)
        send_chunk(tid, 0, payload.data)
        return job()

    # A push announcing more than the whole cache (4,096 bytes) is refused at once, before any chunk.
    big = blocks(100)  # 6,400 bytes
    send_push("big", big)
    j = job()
    assert j.payload is None and "more KV bytes" in j.error
    # A stream past the size its push announced ends the transfer at the first byte too many; the
    # rest of that stream is dropped (no push in progress), and so are chunks of pushes never made.
    small = blocks(1)
    send_push("over", small)
    send_chunk("over", 0, small.data + b"\1" * 64)
    j = job()
    assert j.transfer_id == "over" and j.payload is None and "past the size" in j.error
    for i in range(20):
        send_chunk("over", 128 + 64 * i, b"\1" * 64)
        send_chunk("never-pushed", 64 * i, b"\2" * 64)
    # Out of order: an error too.
    send_push("order", blocks(2))
    send_chunk("order", 64, b"\0" * 64)
    j = job()
    assert j.transfer_id == "order" and "out of order" in j.error
    # Pushes being assembled together may not exceed the cache either.
    half = blocks(40)  # 2,560 bytes: one fits, two do not
    send_push("first", half)
    send_push("second", half)
    j = job()
    assert j.transfer_id == "second" and "being received already" in j.error
    send_chunk("first", 0, half.data[:1000])
    send_chunk("first", 1000, half.data[1000:])
    j = job()
    assert j.transfer_id == "first" and j.error is None and j.payload.data == half.data
    # A frame bigger than any chunk may be is cut off by ZMQ (MAXMSGSIZE) before it is buffered: the
    # push before it is taken (its offer answered after it, in order), the oversized chunk never arrives.
    assert r.sock.getsockopt(zmq.MAXMSGSIZE) <= CHUNK_BYTES + (1 << 20)
    other = peer.context.socket(zmq.DEALER)
    other.setsockopt(zmq.LINGER, 0)
    other.connect(r.addr)
    meta = msgspec.structs.replace(small, data=b"", scales=b"")
    other.send_multipart(auth.seal([msgspec.msgpack.encode(Push("huge", meta, 64, None, total_bytes=64))]))
    other.send_multipart(auth.seal([offer("sync")]))
    assert reply(other, auth).transfer_id == "sync"
    send_chunk("huge", 0, b"\3" * 64 + b"\4" * (2 << 20), sock=other)  # would end "huge" with an error job
    assert not channel.wake.poll(1000)
    assert r._assemblies["huge"].received == 0  # noqa: SLF001
    other.close()
    # A segment the receiver did not name (here: one that exists, named by the peer) is never opened.
    foreign = shared_memory.SharedMemory(create=True, size=128)
    try:
        send_push("foreign", blocks(1), shm_name=foreign.name)
        j = job()
        assert j.transfer_id == "foreign" and j.payload is None and "not named by this receiver" in j.error
    finally:
        foreign.close()
        foreign.unlink()
    # Nothing above was imported, nothing is left over, and a good transfer still goes through.
    j = transfer("good", small)
    assert j.transfer_id == "good" and j.error is None and j.payload.data == small.data
    assert set(r._assemblies) == {"huge"} and r._assembling_bytes == 64  # noqa: SLF001 (it expires later)
    assert not channel.drain()


def test_a_connector_with_the_secret_gets_through_and_one_without_does_not(tmp_path):
    """The real sender (tcp and shm) against the real receiver, as two workers of a deployment run them."""
    ctx = zmq.Context()
    try:
        decode = KVConnector(KVTransferConfig(role="decode", port=0, secret=SECRET, timeout=5.0), ctx, "ns", 16 << 20,
                             HELD.__contains__)  # fmt: skip
        # 9 MiB of distinct bytes: three chunks over tcp, reassembled in order.
        large = KVBlocks(1, 1, 1, 512, "float32", [f"L{i}".encode() for i in range(2304)], None,
                         bytes(range(256)) * (9 << 12))  # fmt: skip
        cases = (("tcp", SECRET, True, blocks(3), "ns"), ("tcp", SECRET, True, large, "ns"),
                 ("shm", SECRET, True, blocks(3), "ns"), ("tcp", None, False, blocks(3), "ns"),
                 ("shm", SECRET, False, blocks(3), "another-model"))  # fmt: skip
        for transport, secret, ok, payload, namespace in cases:
            prefill = KVConnector(KVTransferConfig(role="prefill", transport=transport, secret=secret, timeout=2.0),
                                  ctx, namespace, 16 << 20, lambda h: False)  # fmt: skip
            try:
                prefill.send("r", payload, decode.receiver_addr)
                if ok:  # the decode side's core imports and answers
                    assert decode.wake.poll(30_000)
                    (job,) = decode.drain()
                    assert job.error is None and job.payload.block_hashes == payload.block_hashes
                    assert job.payload.data == payload.data
                    decode.receiver.reply(job.identity, _done(job))
                assert prefill.wake.poll(30_000)
                (result,) = prefill.drain()
                assert result.outcome.ok is ok, result.outcome
                if not ok:
                    want = "another model" if namespace != "ns" else "no answer"
                    assert want in result.outcome.error and not decode.drain()
            finally:
                prefill.close()
        decode.close()
    finally:
        ctx.term()


def _done(job: ImportJob):
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


def test_a_kv_port_beyond_loopback_without_a_secret_is_warned_about(caplog):
    for host in ("127.0.0.1", "127.3.0.1", "::1", "[::1]", "localhost"):
        assert not warn_if_unsealed("the KV receiver", host, None), host
    for host in ("0.0.0.0", "10.0.0.5", "::", "*", "decode-0.ferry.svc"):
        assert not warn_if_unsealed("the KV receiver", host, SECRET), host
        caplog.clear()
        assert warn_if_unsealed("the KV receiver", host, None), host
        assert "without a deployment secret" in caplog.text and host in caplog.text


def test_a_receiver_that_does_not_answer_holds_up_only_its_own_transfers():
    """Each receiver has its own lane: transfers queued for a dead decode worker (each waits out the
    timeout) do not hold up one to a live worker queued after them, which went out behind them,
    waited past twice the timeout and failed."""
    ctx = zmq.Context()
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    dead = f"tcp://127.0.0.1:{probe.getsockname()[1]}"
    probe.close()  # nothing listens there
    decode = KVConnector(KVTransferConfig(role="decode", port=0, secret=SECRET, timeout=5.0), ctx, "ns", 16 << 20,
                         HELD.__contains__)  # fmt: skip
    prefill = KVConnector(KVTransferConfig(role="prefill", transport="tcp", secret=SECRET, timeout=2.0), ctx, "ns",
                          16 << 20, lambda h: False)  # fmt: skip
    try:
        for i in range(3):
            prefill.send(f"dead-{i}", blocks(2), dead)
        prefill.send("live", blocks(3), decode.receiver_addr)
        assert decode.wake.poll(30_000)
        (job,) = decode.drain()
        decode.receiver.reply(job.identity, _done(job))
        assert _outcome(prefill, "live").ok  # (behind the dead ones it waited past 2 x the timeout and failed)
    finally:
        prefill.close()
        decode.close()
        ctx.term()


def _outcome(connector: KVConnector, request_id: str):
    """The outcome of `request_id`'s send, whatever else the connector reports first."""
    while True:
        assert connector.wake.poll(30_000), f"no outcome for {request_id}"
        for result in connector.drain():
            if result.outcome.request_id == request_id:
                return result.outcome


def test_a_sender_thread_that_dies_takes_its_lane_with_it():
    """A lane whose thread stopped (here: its hand-off to the core failed) is retired: later sends to
    that receiver get a new lane, not a queue nobody reads."""
    ctx = zmq.Context()
    decode = KVConnector(KVTransferConfig(role="decode", port=0, secret=SECRET, timeout=5.0), ctx, "ns", 16 << 20,
                         HELD.__contains__)  # fmt: skip
    prefill = KVConnector(KVTransferConfig(role="prefill", transport="tcp", secret=SECRET, timeout=5.0), ctx, "ns",
                          16 << 20, lambda h: False)  # fmt: skip
    post = prefill.channel.post
    broken = threading.Event()

    def post_once_broken(event, waker):
        if not broken.is_set():
            broken.set()
            raise zmq.ZMQError(zmq.ENOTSOCK)
        post(event, waker)

    prefill.channel.post = post_once_broken
    try:
        for request_id in ("first", "second"):
            prefill.send(request_id, blocks(2), decode.receiver_addr)
            assert decode.wake.poll(30_000)
            (job,) = decode.drain()
            decode.receiver.reply(job.identity, _done(job))
            if request_id == "first":  # its outcome is lost with the thread: wait for the lane to go
                wait_until(lambda: decode.receiver_addr not in prefill._lanes)
        assert _outcome(prefill, "second").ok
    finally:
        prefill.close()
        decode.close()
        ctx.term()


def wait_until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_model_is_named_by_its_files_not_its_path(tmp_path):
    """The fingerprint a KV offer carries names the model wherever each worker mounts it: the same
    files under another path (or with a trailing slash, or a README beside them) are the same model;
    a fine-tune of the same shape (other weight values) is not."""
    from ferry.kv_transfer.coordinator import model_identity

    def checkpoint(where, first: bytes, extra: dict[str, bytes] | None = None) -> str:
        where.mkdir()
        (where / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
        (where / "model.safetensors").write_bytes(first + bytes(3 << 20))  # 3 MiB and a bit: both ends read
        for name, data in (extra or {}).items():
            (where / name).write_bytes(data)
        return str(where)

    a = checkpoint(tmp_path / "a", b"weights-A")
    same = checkpoint(tmp_path / "elsewhere", b"weights-A", {"README.md": b"# a model card"})
    tuned = checkpoint(tmp_path / "tuned", b"weights-B")
    assert model_identity(a) == model_identity(same) == model_identity(a + "/")
    assert model_identity(tuned) != model_identity(a)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(100))
    assert model_identity(str(gguf)) == model_identity(str(tmp_path / "." / "m.gguf")) != model_identity(a)
