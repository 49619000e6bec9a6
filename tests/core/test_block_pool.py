import pytest

from ferry.core.block_hash import hash_block_tokens, hash_prompt_blocks, salt_fingerprint
from ferry.core.block_pool import BlockPool
from ferry.utils.deployment_secret import block_hash_salt


def test_allocate_takes_from_head_in_order():
    pool = BlockPool(6)
    assert [b.block_id for b in pool.allocate(3)] == [0, 1, 2]
    assert pool.free_block_ids() == [3, 4, 5]
    assert all(b.ref_cnt == 1 for b in pool.blocks[:3])
    with pytest.raises(RuntimeError):
        pool.allocate(4)


def test_free_appends_to_tail_and_keeps_hash():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(a, h)
    pool.free([c, b, a])  # eviction order chosen by the caller
    assert pool.free_block_ids() == [3, 2, 1, 0]
    assert a.block_hash == h and pool.get_cached_block(h) is a
    assert pool.num_referenced() == 0


def test_lru_eviction_drops_hash_of_reused_block():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [hash_block_tokens(None, [i]) for i in range(3)]
    for blk, h in zip(blocks, hashes):
        pool.cache_block(blk, h)
    pool.free([blocks[1], blocks[0], blocks[2]])  # LRU order: 1, 0, 2
    (got,) = pool.allocate(1)
    assert got.block_id == 1 and got.block_hash is None
    assert pool.get_cached_block(hashes[1]) is None
    assert pool.get_cached_block(hashes[0]) is blocks[0]
    assert pool.num_evictions == 1
    assert pool.free_block_ids() == [0, 2]


def test_touch_pulls_cached_free_block_out_of_queue_and_shares():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h" * 16)
    pool.free([b, a])
    assert pool.free_block_ids() == [2, 1, 0]
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.free_block_ids() == [2, 1]
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free([a])
    assert a.ref_cnt == 1 and 0 not in pool.free_block_ids()
    pool.free([a])
    assert pool.free_block_ids() == [2, 1, 0]
    assert pool.num_free_blocks + pool.num_referenced() == pool.num_blocks


def test_duplicate_hash_keeps_first_block():
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"x" * 16)
    pool.cache_block(b, b"x" * 16)
    assert pool.get_cached_block(b"x" * 16) is a and b.block_hash is None


def test_double_free_is_caught():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.free([a])
    with pytest.raises(AssertionError):
        pool.free([a])


def test_block_hash_is_stable_and_chained():
    # A fixed value: the hash must not change between processes or releases (gateway routing relies on it).
    assert hash_block_tokens(None, [1, 2, 3]).hex() == "4fb4c0296c2b6c94b6ec3f32255d6b23"
    h = hash_prompt_blocks(list(range(40)), 16)
    assert len(h) == 2
    assert h[1] == hash_block_tokens(h[0], list(range(16, 32)))
    # A cache salt changes every block's hash (through the chain's root), and only the salt does.
    salted = hash_prompt_blocks(list(range(32)), 16, cache_salt="tenant-a")
    assert not set(salted) & set(h[:2]) and salted != hash_prompt_blocks(list(range(32)), 16, cache_salt="tenant-b")
    assert salted == hash_prompt_blocks(list(range(32)), 16, cache_salt="tenant-a")
    assert hash_prompt_blocks(list(range(32)), 16, cache_salt="") == h[:2]
    assert hash_block_tokens(h[0], [5]) != hash_block_tokens(None, [5])
    # A deployment salt (derived from the deployment's secret) changes every hash too, with or without
    # a cache salt; its public fingerprint names it without giving it away.
    d1, d2 = block_hash_salt(b"deployment-one-secret"), block_hash_salt(b"deployment-two-secret")
    ours = hash_prompt_blocks(list(range(32)), 16, deployment_salt=d1)
    assert not set(ours) & set(h[:2]) and ours != hash_prompt_blocks(list(range(32)), 16, deployment_salt=d2)
    tenant = hash_prompt_blocks(list(range(32)), 16, cache_salt="tenant-a", deployment_salt=d1)
    assert not set(tenant) & (set(ours) | set(salted))
    assert block_hash_salt(None) is None and salt_fingerprint(None) is None
    assert salt_fingerprint(d1) == salt_fingerprint(block_hash_salt(b"deployment-one-secret")) != salt_fingerprint(d2)
    assert d1.hex() not in salt_fingerprint(d1)
