"""Randomised add / step / abort sequences against the scheduler and KV-cache manager.

After every operation: free + referenced == num_blocks; every ref count equals
the number of requests holding the block; a request owns exactly the blocks
its computed tokens need; a block shared by two requests is a published
prefix block. At the end, with everything finished or aborted, nothing is
referenced.
"""

import random
from collections import Counter

import pytest

from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.request import Request, RequestStatus
from ferry.core.scheduler import Scheduler
from ferry.sampling_params import SamplingParams
from ferry.utils.math import cdiv

BS = 4


def check_invariants(kv: KVCacheManager, sched: Scheduler) -> None:
    pool = kv.pool
    holders = Counter(b.block_id for blocks in kv.req_blocks.values() for b in blocks)
    for block in pool.blocks:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
        if block.ref_cnt > 1:
            assert block.block_hash is not None, "only published prefix blocks are shared"
    assert pool.num_free_blocks + pool.num_referenced() == pool.num_blocks
    assert set(pool.free_block_ids()) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for rid, blocks in kv.req_blocks.items():
        req = sched.requests[rid]
        assert req.status == RequestStatus.RUNNING
        assert len(blocks) == cdiv(req.num_computed_tokens, BS)
    for req in sched.waiting:
        assert req.request_id not in kv.req_blocks and req.num_computed_tokens == 0
    assert len(sched.running) <= sched.max_num_seqs
    for h, block in pool.cached.items():
        assert block.block_hash == h


@pytest.mark.parametrize("seed", range(40))
def test_random_workload_keeps_invariants_and_frees_everything(seed):
    rng = random.Random(seed)
    kv = KVCacheManager(num_blocks=rng.randint(12, 40), block_size=BS, enable_prefix_caching=rng.random() < 0.8)
    max_len = kv.pool.num_blocks * BS
    sched = Scheduler(
        kv, max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=rng.randint(4, 40), max_model_len=max_len
    )
    prefixes = [[rng.randrange(50) for _ in range(rng.randint(1, 12))] for _ in range(3)]
    next_id = 0
    for _ in range(300):
        op = rng.random()
        if op < 0.25:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randint(0, 10))]
            max_tokens = rng.randint(1, 12)
            if len(prompt) + max_tokens <= max_len:
                sched.add_request(
                    Request(
                        str(next_id),
                        prompt,
                        SamplingParams(max_tokens=max_tokens),
                        priority=rng.randint(0, 2),
                        arrival_time=float(next_id),
                        block_size=BS,
                        max_tokens=max_tokens,
                    )
                )
                next_id += 1
        elif op < 0.33 and sched.requests:
            sched.abort_request(rng.choice(list(sched.requests)))
        else:
            out = sched.schedule()
            check_invariants(kv, sched)
            for req, _ in out.scheduled:
                if req.status == RequestStatus.RUNNING and req.num_computed_tokens == req.num_tokens:
                    req.append_token(rng.randrange(50))
                    if req.num_output_tokens >= req.max_tokens:
                        sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
        check_invariants(kv, sched)
    # Drain: everything left either finishes or is aborted.
    for _ in range(2000):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        for req, _ in out.scheduled:
            if req.num_computed_tokens == req.num_tokens:
                req.append_token(1)
                if req.num_output_tokens >= req.max_tokens:
                    sched.finish_request(req, RequestStatus.FINISHED_LENGTH)
        check_invariants(kv, sched)
    assert not sched.has_unfinished_requests(), "the scheduler must always make progress"
    assert kv.pool.num_referenced() == 0 and kv.pool.num_free_blocks == kv.pool.num_blocks
