"""KV events: what the BlockPool records, and the publisher's PUB / replay sockets."""

import msgspec
import pytest
import zmq

from ferry.config import KVEventsConfig
from ferry.core.block_hash import hash_prompt_blocks
from ferry.core.block_pool import BlockPool
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.kv_events import (
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventPublisher,
    ReplayRequest,
    ReplayResponse,
)
from ferry.core.request import Request
from ferry.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), block_size=4, max_tokens=4)


def test_pool_records_stored_chains_evictions_and_clears():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.pool.enable_events()
    a = make_request("a", list(range(10)))  # two full blocks + 2 tokens
    assert kv.allocate_slots(a, 10)
    events = kv.pool.events.take()
    hashes = hash_prompt_blocks(list(range(10)), 4)
    assert events == [BlockStored(hashes, None)]  # one event for the chain, no parent
    assert kv.pool.events.take() == []
    kv.free(a)
    # A new 16-token request needs all 4 blocks: the two cached ones are evicted.
    b = make_request("b", list(range(100, 116)))
    assert kv.allocate_slots(b, 16)
    events = kv.pool.events.take()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(hashes)
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == hash_prompt_blocks(list(range(100, 116)), 4)
    kv.free(b)
    assert kv.pool.reset_prefix_cache()
    assert kv.pool.events.take() == [AllBlocksCleared()]


def test_stored_event_carries_the_parent_of_a_later_block():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.pool.enable_events()
    r = make_request("r", list(range(6)))
    assert kv.allocate_slots(r, 6)  # block 0 full
    first = kv.pool.events.take()
    r.num_computed_tokens = 6
    for t in (6, 7):
        r.append_token(t)
    assert kv.allocate_slots(r, 2)  # block 1 fills: its parent is block 0
    h = hash_prompt_blocks(list(range(8)), 4)
    assert first == [BlockStored([h[0]], None)]
    assert kv.pool.events.take() == [BlockStored([h[1]], h[0])]


def test_pool_without_events_records_nothing():
    pool = BlockPool(2)
    assert pool.events is None
    (blk,) = pool.allocate(1)
    pool.cache_block(blk, b"x" * 16)  # no recorder: nothing to fail on


@pytest.fixture
def publisher():
    ctx = zmq.Context()
    pub = KVEventPublisher(ctx, KVEventsConfig(buffer_steps=3))
    yield ctx, pub
    pub.close()
    ctx.term()


def _replay(ctx, pub: KVEventPublisher, start_seq: int, snapshot) -> ReplayResponse:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{pub.replay_port}")
    dealer.send_multipart([b"", msgspec.msgpack.encode(ReplayRequest(start_seq))])
    for _ in range(100):
        pub.serve_replays(snapshot)
        if dealer.poll(20):
            break
    resp = msgspec.msgpack.decode(dealer.recv_multipart()[-1], type=ReplayResponse)
    dealer.close()
    return resp


def test_publisher_sends_numbered_batches_and_replays(publisher):
    ctx, pub = publisher
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    sub.connect(f"tcp://127.0.0.1:{pub.port}")
    # PUB drops messages until the subscription has propagated: publish until one arrives.
    got = None
    for _ in range(200):
        pub.publish([BlockStored([b"a" * 16], None)])
        if sub.poll(10):
            topic, payload = sub.recv_multipart()
            got = msgspec.msgpack.decode(payload, type=KVEventBatch)
            break
    assert got is not None and topic == TOPIC and got.events == [BlockStored([b"a" * 16], None)]
    pub.publish([])  # an empty step publishes nothing
    first_missed = pub.seq + 1
    for i in range(3):
        pub.publish([BlockRemoved([bytes([i]) * 16])])
    # Still in the ring buffer (3 batches): the batches themselves.
    resp = _replay(ctx, pub, first_missed, lambda: pytest.fail("no snapshot expected"))
    assert [b.seq for b in resp.batches] == [first_missed, first_missed + 1, first_missed + 2]
    assert resp.snapshot is None
    # Older than the buffer, or a new subscriber (start 0): a snapshot as of the latest seq.
    resp = _replay(ctx, pub, 1, lambda: [b"h" * 16])
    assert resp.batches is None and resp.snapshot.seq == pub.seq and resp.snapshot.block_hashes == [b"h" * 16]
    assert _replay(ctx, pub, 0, lambda: []).snapshot.seq == pub.seq
    # Nothing missed yet (asking for the next seq): an empty replay.
    assert _replay(ctx, pub, pub.seq + 1, lambda: []).batches == []
    sub.close()


def test_publisher_ignores_garbage_on_the_replay_socket(publisher):
    ctx, pub = publisher
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{pub.replay_port}")
    dealer.send_multipart([b"", b"\xff\x00not msgpack"])
    for _ in range(20):
        pub.serve_replays(lambda: [])  # must not raise
        if dealer.poll(5):
            break
    assert not dealer.poll(50)  # and sends nothing back
    dealer.close()
