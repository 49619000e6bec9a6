"""Speculative decoding's parts on their own: n-gram lookup, the drafting limits, the rejection
sampler's distribution (a chi-squared test), the sampler's verification of greedy drafts, and the
scheduler's rollback of rejected drafts' blocks."""

from __future__ import annotations

import itertools

import torch

from ferry.config import SpeculativeConfig
from ferry.core.kv_cache_manager import KVCacheManager
from ferry.core.request import Request
from ferry.core.scheduler import Scheduler
from ferry.sampling_params import SamplingParams
from ferry.worker.sampler import Sampler
from ferry.worker.spec_decode import DraftProposer
from ferry.worker.spec_decode.draft_length import (
    EXPLORE_EVERY,
    AcceptanceTracker,
    AdaptiveDraftLength,
    StepCostModel,
    allocate,
)
from ferry.worker.spec_decode.ngram import MAX_CANDIDATES, NgramProposer


def req(tokens, params=None, max_tokens=100, rid="r"):
    return Request(rid, list(tokens), params or SamplingParams(temperature=0.0), block_size=4, max_tokens=max_tokens)


def test_ngram_takes_the_longest_match_then_the_latest():
    p = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=4)
    # Suffix [7, 8, 9]: [8, 9] occurs at 1 and 5; only the later one is preceded by 7 too.
    r = req([8, 9, 1, 2, 7, 8, 9, 3, 4, 5, 0, 7, 8, 9])
    assert p.propose(r, 3) == [3, 4, 5]
    # Both occurrences match equally (2 tokens): the latest wins.
    r = req([5, 6, 1, 9, 5, 6, 2, 9, 5, 6])
    assert p.propose(r, 2) == [2, 9]
    assert p.propose(r, 0) == []
    assert p.propose(req([1, 2, 3, 4, 5]), 4) == []  # no earlier occurrence
    # Drafts stop where the context does.
    assert p.propose(req([1, 2, 3, 1, 2]), 5) == [3, 1, 2]


def test_ngram_index_follows_new_tokens():
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    r = req([4, 5, 6])
    assert p.propose(r, 2) == []
    r.append_token(4)  # now [4, 5, 6, 4]: 4 was followed by 5, 6
    assert p.propose(r, 2) == [5, 6]
    r.append_token(9)
    assert p.propose(r, 2) == []


def test_ngram_work_per_lookup_is_bounded_on_repetitive_input():
    """A context of one repeated token has as many candidates as tokens; a lookup tries a bounded
    number of the latest ones (and still proposes the repetition)."""
    p = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=8)
    r = req([3] * 5000)
    assert p.propose(r, 4) == [3, 3, 3, 3]
    index = p._indexes[r]
    assert len(index.follows[(3,)]) == 4999 > MAX_CANDIDATES


def test_drafts_leave_room_for_the_models_token():
    cfg = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2, draft_length="fixed")
    dp = DraftProposer(cfg, max_model_len=20)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1]
    a, b, c = req(tokens, max_tokens=3, rid="a"), req(tokens, rid="b"), req(tokens + [2] * 7, rid="c")
    for r in (a, b, c):
        r.num_computed_tokens = r.num_tokens - 1  # decoding
    prefill = req(tokens, rid="p")  # not yet computed: no drafts
    dp.propose([a, b, c, prefill])
    assert a.spec_token_ids == [2, 3]  # max_tokens 3: two drafts and the model's token
    assert b.spec_token_ids == [2, 3, 4, 5]
    assert len(c.spec_token_ids) == 2  # 17 tokens of max_model_len 20
    assert prefill.spec_token_ids == []
    dp.config.disable_by_batch_size = 3
    dp.propose([a, b, c, prefill])
    assert not any(r.spec_token_ids for r in (a, b, c))


def _throughput(worth, counts, num_rows, a, b, c=0.0):
    expected = len(worth) + sum(sum(w[:n]) for w, n in zip(worth, counts))
    return expected / (a + b * (num_rows + sum(counts)) + c * sum(counts))


def _linear_cost(a, b, max_rows=80):
    """The line a StepCostModel fits through steps that cost a + b * rows."""
    cost = StepCostModel()
    for _ in range(2):  # a row count's first step is not taken as its cost
        for rows in range(1, max_rows + 1):
            cost.observe(rows, a + b * rows)
    return cost.coefficients()


def _geometric(alpha, n):
    return [alpha ** (j + 1) for j in range(n)]


def test_draft_allocation_maximises_expected_tokens_per_second():
    """The greedy allocation reaches the best throughput any allocation has (brute force over
    every combination), for one request and for several sharing a step, with any non-increasing
    worth per draft (acceptance that is not independent from one position to the next)."""
    import itertools
    import random

    rng = random.Random(0)
    for trial in range(300):
        n = 1 if trial < 100 else rng.randint(2, 3)
        worth = []
        for _ in range(n):
            chances = [rng.choice([0.0, 0.05, 0.3, 0.6, 0.9, 0.99, rng.random()]) for _ in range(rng.randint(0, 5))]
            worth.append(list(itertools.accumulate(chances, lambda p, c: p * c)))
        a, b = rng.uniform(0.5, 2.0), rng.choice([0.01, 0.1, 0.3, 1.0]) * rng.uniform(0.5, 2.0)
        rows = n + rng.randint(0, 40)  # other requests' rows in the step
        c = rng.choice([0.0, 0.0, 0.05, 0.5]) * a  # drafting's own cost per draft (a draft model's)
        got = allocate(worth, rows, _linear_cost(a, b), c)
        assert all(0 <= k <= len(w) for k, w in zip(got, worth))
        best = max(
            _throughput(worth, combo, rows, a, b, c) for combo in itertools.product(*(range(len(w) + 1) for w in worth))
        )
        assert _throughput(worth, got, rows, a, b, c) >= best * (1 - 1e-12), (worth, a, b, c, rows, got)


def test_speculation_turns_itself_off_in_a_large_batch_or_with_poor_acceptance():
    cost = _linear_cost(1.0, 0.1)  # a row costs a tenth of the step's fixed part
    assert allocate([_geometric(0.8, 4)], 1, cost) == [4]  # batch 1: drafts pay
    assert allocate([_geometric(0.6, 4)], 1, cost) == [3]  # the 4th: 0.6^4 = 0.13 tokens for 7% more time
    assert allocate([_geometric(0.8, 4)] * 64, 64, cost) == [0] * 64  # 64 rows: the step is row-bound
    assert allocate([_geometric(0.05, 4)], 1, cost) == [0]  # drafts that are almost never kept
    assert allocate([_geometric(0.6, 4)], 1, _linear_cost(1.0, 0.0)) == [4]  # rows free: all with a chance
    assert allocate([_geometric(0.6, 4), _geometric(0.1, 2)], 2, None) == [4, 2]  # no estimate: all
    # A draft model's cost per draft: cheap drafts still pay, drafts dear as a step do not.
    assert allocate([_geometric(0.8, 4)], 1, cost, draft_seconds=0.05) == [4]
    assert allocate([_geometric(0.8, 4)], 1, cost, draft_seconds=1.0) == [0]


def test_the_policy_prices_a_draft_models_passes():
    """With passes of a draft model measured, choose() drafts nothing where a pass costs as much as
    a step (early exit through most layers), and drafts where passes are cheap."""
    r = req([1, 2, 3], rid="r")
    for pass_cost, want_drafts in ((0.002, False), (0.0001, True)):
        policy = AdaptiveDraftLength(4)
        for _ in range(2):
            for rows in range(1, 10):
                policy.observe_step(rows, 0.002 + 0.0002 * rows)
                policy.observe_draft_pass(rows, pass_cost * (1 + 0.1 * rows))
        for _ in range(5):
            policy.observe_verification(r, 4, 3)  # chances ~0.8
        assert (policy.choose([r], [4])[0] > 0) == want_drafts


def test_early_exit_verify_steps_price_a_draft_row_by_their_own_line():
    """Early exit verifies through the last layers only: its verify steps (every row from a stream)
    get their own line, whose slope prices an early-exit draft's row; the whole steps' line is left
    as the whole steps make it, and a step of both kinds goes in neither. Where whole rows are dear
    and rows from streams cheap, a draft with a modest chance then pays."""
    r = req([1, 2, 3], rid="r")

    def policy_with(stream_steps: bool) -> AdaptiveDraftLength:
        policy = AdaptiveDraftLength(4)
        for _ in range(3):
            for rows in range(1, 6):
                policy.observe_step(rows, 0.006 + 0.004 * rows)  # whole steps: rows dear
                if stream_steps:
                    policy.observe_step(rows, 0.002 + 0.0002 * rows, num_stream_rows=rows)
            policy.observe_draft_pass(1, 0.0003)
        for kept in (0, 0, 0, 1):
            policy.observe_verification(r, 4, kept)
        return policy

    plain, early_exit = policy_with(False), policy_with(True)
    for line, want in ((early_exit.step_cost, (0.006, 0.004)), (early_exit.stream_step_cost, (0.002, 0.0002))):
        assert all(abs(got - w) < 1e-9 for got, w in zip(line.coefficients(), want)), line.coefficients()
    # A step of both kinds (two forwards) is split by the whole steps' line: consistent with both
    # lines it leaves them as they are; a slow one raises the stream line's cost, not the whole one's.
    whole_before = early_exit.step_cost.coefficients()
    for _ in range(3):
        early_exit.observe_step(5, 0.006 + 0.004 * 2 + 0.002 + 0.0002 * 3, num_stream_rows=3)
    assert early_exit.step_cost.coefficients() == whole_before
    assert all(abs(got - w) < 1e-9 for got, w in zip(early_exit.stream_step_cost.coefficients(), (0.002, 0.0002)))
    slow = policy_with(True)
    for _ in range(20):
        slow.observe_step(5, 0.006 + 0.004 * 2 + 0.010, num_stream_rows=3)
    assert slow.step_cost.coefficients() == whole_before and slow.stream_step_cost.seconds(3) > 0.005
    chance = early_exit.acceptance.worth(r, 1)[0]
    # Pays at a stream row's price (0.2 ms + 0.3 ms of pass against a 10 ms step), not at a whole row's (4 ms).
    assert 0.06 < chance < 0.4, chance
    assert plain.choose([r], [4]) == [0]
    assert early_exit.choose([r], [4])[0] >= 1
    # Where every step drafted (none ran the whole model), a whole step is taken to cost a verify
    # step and a pass: drafts still pay where passes are cheap, and not where a pass costs most of a
    # step (early exit through most layers of a model not trained for it).
    for pass_seconds, drafts in ((0.0003, True), (0.008, False)):
        only_streams = AdaptiveDraftLength(4)
        for _ in range(3):
            for rows in range(1, 6):
                only_streams.observe_step(rows, 0.002 + 0.0002 * rows, num_stream_rows=rows)
            only_streams.observe_draft_pass(1, pass_seconds)
        for kept in (0, 0, 0, 1):
            only_streams.observe_verification(r, 4, kept)
        assert (only_streams.choose([r], [4])[0] > 0) == drafts, pass_seconds
    # A batch mixed from its first step (some requests drafting, others not) still gives the policy
    # a line to decide by, instead of none (with none, every draft would be verified for ever).
    mixed = AdaptiveDraftLength(4)
    for _ in range(3):
        for whole_rows, stream_rows in itertools.product((1, 2, 3), (1, 2, 3)):
            seconds = 0.006 + 0.004 * whole_rows + 0.002 + 0.0002 * stream_rows
            mixed.observe_step(whole_rows + stream_rows, seconds, num_stream_rows=stream_rows)
        mixed.observe_draft_pass(1, 0.008)  # passes dear
    assert mixed.step_cost.coefficients() is not None and mixed.stream_step_cost.coefficients() is not None
    for kept in (0, 0, 0, 1):
        mixed.observe_verification(r, 4, kept)
    assert mixed.choose([r], [4]) == [0]  # passes dear, a 0.3 chance: no draft pays


def test_early_exit_drafts_for_part_of_a_batch_only_if_the_second_forward_pays():
    """With early exit, a batch where some requests draft and others do not runs the verify forward
    beside the whole one, whose fixed cost the per-row allocation does not see: the policy drafts
    for part of the batch only where the step still gains once that cost is counted."""
    likely, hopeless = req([1, 2, 3], rid="likely"), req([4, 5, 6], rid="hopeless")
    chosen = {}
    for verify_fixed in (0.0005, 0.02):  # the verify forward's fixed cost: small, or twice a step's
        policy = AdaptiveDraftLength(4)
        for _ in range(3):
            for rows in range(1, 6):
                policy.observe_step(rows, 0.006 + 0.002 * rows)
                policy.observe_step(rows, verify_fixed + 0.0002 * rows, num_stream_rows=rows)
            policy.observe_draft_pass(1, 0.0003)
        for _ in range(6):
            policy.observe_verification(likely, 4, 4)  # kept every time
            policy.observe_verification(hopeless, 4, 0)  # never
        chosen[verify_fixed] = policy.choose([likely, hopeless], [4, 4])
    assert chosen[0.0005][0] > 0 and chosen[0.0005][1] == 0  # part of the batch drafts
    assert chosen[0.02] == [0, 0]  # the second forward would cost more than the drafts save


def test_step_cost_model_fits_the_engines_steps():
    model = StepCostModel()
    assert model.seconds(1) is None
    assert allocate([_geometric(0.1, 3)], 1, model.coefficients()) == [3]  # nothing measured yet: every draft
    model.observe(1, 0.5)  # a cold first step of its row count: not counted
    assert model.seconds(1) is None
    for _ in range(3):
        model.observe(1, 0.010)
    a, b = model.coefficients()  # one row count only: no slope, the prior's split of 10 ms
    assert abs(a + b - 0.010) < 1e-12 and abs(b - 0.1 * a) < 1e-12
    for rows in [1, 5, 3, 9, 1, 5, 2] * 60:  # the old steps' weight decays away
        model.observe(rows, 0.002 + 0.0005 * rows)
    a, b = model.coefficients()
    assert abs(a - 0.002) < 1e-4 and abs(b - 0.0005) < 1e-5
    assert abs(model.seconds(4) - (a + 4 * b)) < 1e-15
    for rows in [1, 9] * 200:  # noise that tilts the line downwards: never a negative row cost
        model.observe(rows, 0.010 if rows == 1 else 0.009)
    assert model.coefficients()[1] == 0.0
    model.observe(0, 1.0)
    model.observe(3, 0.0)
    assert model.coefficients()[1] == 0.0  # neither counted (no rows, no time)


def test_acceptance_is_counted_per_request_and_position_and_recovers_while_idle():
    tracker = AcceptanceTracker(4)
    copying, writing, new = req([1, 2, 3], rid="copy"), req([1, 2, 3], rid="write"), req([1], rid="new")
    assert tracker.chances(copying, 4) == [0.5] * 4  # the prior
    for _ in range(10):
        tracker.observe(copying, 4, 4)
        tracker.observe(writing, 4, 0)
    assert all(c > 0.8 for c in tracker.chances(copying, 4))
    assert tracker.chances(writing, 1)[0] < 0.3
    assert tracker.chances(writing, 2)[1] > 0.5  # position 2 only seen (pooled) after kept 1s
    assert tracker.worth(copying, 4) == sorted(tracker.worth(copying, 4), reverse=True)
    # A request with no evidence of its own takes the pooled chances: half its runs were kept whole.
    assert 0.45 < tracker.chances(new, 1)[0] < 0.55 and tracker.chances(new, 4)[3] > 0.8
    for _ in range(80):
        tracker.idle(writing)
    assert abs(tracker.chances(writing, 1)[0] - tracker.chances(new, 1)[0]) < 0.02  # back to the prior
    # Pooled evidence that nobody drafts against any more fades too, back to 1 in 2.
    for _ in range(30):
        tracker.observe(writing, 4, 0)
    low = tracker.chances(new, 1)[0]
    for _ in range(80):
        tracker.idle(None)
    assert low < 0.3 and abs(tracker.chances(new, 1)[0] - 0.5) < 0.01
    # A run kept whole then one cut at position 2: positions 1-2 tried, 3-4 not.
    fresh = AcceptanceTracker(4)
    fresh.observe(new, 4, 1)
    assert fresh.chances(new, 4)[2:] == [0.5, 0.5] and fresh.chances(new, 2)[1] < 0.5 < fresh.chances(new, 1)[0]


def test_the_policy_verifies_every_draft_now_and_then_to_measure_the_tail():
    """A request the allocation gives some drafts gets all it has every EXPLORE_EVERY-th time, so
    the chances of its later positions and the cost of longer steps get measured."""
    policy = AdaptiveDraftLength(8)
    for _ in range(2):
        for rows in range(1, 10):
            policy.observe_step(rows, 0.002 + 0.0008 * rows)  # rows dear: not every draft pays
    r = req([1, 2, 3], rid="r")
    got = [policy.choose([r], [8])[0] for _ in range(2 * EXPLORE_EVERY)]
    assert 0 < got[0] < 8
    assert [i for i, n in enumerate(got) if n == 8] == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1]
    nothing = req([1, 2, 3], rid="n")  # no candidates: nothing to explore
    assert policy.choose([nothing], [0]) == [0]


def chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_rejection_sampling_keeps_the_models_distribution():
    """Temperature 1, drafts fixed: the first kept token is distributed as the model's first row,
    and the second, when the first draft was kept, as its second row (chi-squared, 4 degrees of
    freedom: 18.5 is the 0.1% critical value; a sampler that kept every draft, or redrew from p
    itself on rejection, lands in the thousands)."""
    torch.manual_seed(0)
    sampler = Sampler(5)
    rows = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0], [0.0, 1.5, 0.2, 1.0, 0.3], [0.0] * 5])
    p0, p1 = rows[0].softmax(-1), rows[1].softmax(-1)
    n = 20000
    reqs = [req([1, 2, 3], SamplingParams(temperature=1.0)) for _ in range(n)]
    drafts = [[1, 3]] * n  # p0(1) ~ 0.23, p1(3) ~ 0.24
    out = sampler.verify(rows.repeat(n, 1), reqs, drafts)
    first = torch.tensor([t[0] for t in out.token_ids])
    assert chi2(torch.bincount(first, minlength=5).float(), p0) < 18.5
    second = torch.tensor([t[1] for t in out.token_ids if t[0] == 1])
    assert chi2(torch.bincount(second, minlength=5).float(), p1) < 18.5
    assert all(len(t) == 3 for t in out.token_ids if t[:2] == [1, 3])  # both kept: a bonus token


def test_greedy_verification_with_penalties_counts_the_drafts():
    """Row j is processed as if the first j drafts had been sampled: a frequency penalty sees
    them, and min_tokens counts them."""
    sampler = Sampler(4)
    row = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    # Draft 0 is the argmax of row 0; once it counts as output, row 1's argmax is 1.
    out = sampler.verify(row.repeat(3, 1), [req([2], p)], [[0, 0]])
    assert out.token_ids == [[0, 1]]
    p = SamplingParams(temperature=0.0, min_tokens=2, logprobs=1)
    p.all_stop_token_ids = {0}
    out = sampler.verify(row.repeat(3, 1), [req([2], p)], [[1, 1]])
    assert out.token_ids == [[1, 1, 0]]  # 0 banned in rows 0 and 1; row 2 follows two outputs
    assert [lp[0] for lp in out.logprobs[0]] == [
        torch.log_softmax(row[0], -1)[t].item() for t in (1, 1, 0)
    ]  # raw model logprobs of each kept token


def test_rollback_returns_the_blocks_only_rejected_drafts_needed():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    r = req([1, 2, 3, 4, 5, 6, 7])  # 7 tokens: 2 blocks
    sched.add_request(r)
    sched.schedule()
    r.append_token(8)
    r.spec_token_ids = [9, 10, 11, 12, 13]  # positions 7..12: 4 blocks in all
    out = sched.schedule()
    assert out.scheduled == [(r, 6)] and out.spec_token_ids == {"r": [9, 10, 11, 12, 13]}
    assert len(kv.req_blocks["r"]) == 4 and r.num_computed_tokens == 13
    sched.rollback(r, 4)  # one draft kept: 9 tokens' K/V, 3 blocks
    assert r.num_computed_tokens == 9 and len(kv.req_blocks["r"]) == 3
    assert kv.pool.num_free_blocks == 5
    sched.finish_request(r, r.status.FINISHED_ABORTED)
    assert kv.pool.num_free_blocks == 8 and kv.pool.num_referenced() == 0


def test_a_full_cache_takes_the_drafts_away_before_preempting():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    r = req([1, 2, 3, 4, 5, 6])
    sched.add_request(r)
    sched.schedule()
    r.append_token(7)
    r.spec_token_ids = [1, 2, 3, 4]  # would need a third block
    out = sched.schedule()
    assert out.scheduled == [(r, 1)] and not out.spec_token_ids and not out.preempted


def test_server_counts_spec_decode_as_vllm_names_them():
    """/metrics turns the core's running totals into counters (increments only), by position too."""
    from ferry.engine.messages import EngineStats
    from ferry.entrypoints.openai.metrics import ServerMetrics

    m = ServerMetrics("m")
    base = dict(num_running=1, num_waiting=0, kv_cache_usage=0.1, num_kv_blocks=8, prefix_cache_queries=0,
                prefix_cache_hits=0, num_preemptions=0, num_evictions=0)  # fmt: skip
    m.on_stats(EngineStats(**base, spec_num_drafts=2, spec_num_draft_tokens=8, spec_num_accepted_tokens=5,
                           spec_accepted_per_pos=[2, 2, 1, 0]))  # fmt: skip
    stats = EngineStats(**base, spec_num_drafts=3, spec_num_draft_tokens=12, spec_num_accepted_tokens=7,
                        spec_accepted_per_pos=[3, 2, 1, 1])  # fmt: skip
    m.on_stats(stats)
    assert stats.spec_mean_acceptance_length == 1 + 7 / 3
    text = m.render().decode()
    assert 'ferry:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'ferry:spec_decode_num_draft_tokens_total{model_name="m"} 12.0' in text
    assert 'ferry:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0' in text
    per_pos = 'ferry:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="%d"} %.1f'
    assert all(per_pos % (i, n) in text for i, n in enumerate([3, 2, 1, 1]))


def test_tree_verification_keeps_the_path_the_draws_follow():
    """A tree of drafts in preorder: root -> 1 (token 5) -> 2 (token 6); root -> 3 (token 7) ->
    4 (token 8). Rows draw 7 at the root and 8 after draft 3: the kept path is 3, 4 (drafts
    stored apart, to be moved), then the bonus from row 4; logprobs come from those rows."""
    sampler = Sampler(10)
    draws = [7, 0, 0, 8, 2]  # the argmax of each row: root, 1, 2, 3, 4
    logits = torch.full((5, 10), -5.0)
    logits[torch.arange(5), torch.tensor(draws)] = 5.0
    p = SamplingParams(temperature=0.0, logprobs=0)
    out = sampler.verify(logits, [req([1], p)], [[5, 6, 7, 8]], [[0, 1, 0, 3]])
    assert out.token_ids == [[7, 8, 2]] and out.kept_nodes == [[3, 4]] and out.last_rows == [4]
    assert [lp[0] for lp in out.logprobs[0]] == [torch.log_softmax(logits[i], -1)[t].item() for i, t in
                                                 ((0, 7), (3, 8), (4, 2))]  # fmt: skip
    # The same tree where the root draws 5 and draft 1's row draws 9 (no child): 5, then 9.
    logits[0], logits[1] = logits[0].roll(-2), logits[1].roll(9)
    out = sampler.verify(logits, [req([1], p)], [[5, 6, 7, 8]], [[0, 1, 0, 3]])
    assert out.token_ids == [[5, 9]] and out.kept_nodes == [[1]]
    # A chain is the tree whose every draft is the child of the one before.
    chain = sampler.verify(logits[:3], [req([1], p)], [[5, 6]])
    assert chain.token_ids == sampler.verify(logits[:3], [req([1], p)], [[5, 6]], [[0, 1]]).token_ids


def test_a_tree_is_laid_out_at_its_depths_with_its_ancestors_visible():
    from ferry.worker.step_plan import ancestor_bits, build_step_plan, tree_depths

    kv = KVCacheManager(num_blocks=8, block_size=4)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    r = req([1, 2, 3, 4, 5])
    sched.add_request(r)
    sched.schedule()
    r.append_token(6)  # the root: position 5
    r.spec_token_ids, r.spec_parents = [10, 11, 12, 13], [0, 1, 0, 3]
    out = sched.schedule()
    assert out.spec_parents == {"r": [0, 1, 0, 3]}
    plan, sampling, drafts = build_step_plan(out, 4)
    assert plan.input_ids.tolist() == [6, 10, 11, 12, 13]
    assert plan.positions.tolist() == [5, 6, 7, 6, 7]  # depths 0, 1, 2, 1, 2
    blocks = kv.block_ids("r")
    assert plan.slot_mapping.tolist() == [blocks[p // 4] * 4 + p % 4 for p in range(5, 10)]  # stored in turn
    assert plan.decode_seq_lens.tolist() == [6, 7, 8, 9, 10]
    assert plan.decode_tree.tolist() == [[6, 0], [6, 0b1], [6, 0b11], [6, 0b100], [6, 0b1100]]
    assert tree_depths([0, 1, 0, 3]) == [0, 1, 2, 1, 2] and ancestor_bits([0] * 64, 64) == -(1 << 63)


def test_early_exit_slots_wait_for_the_running_requests_and_stay_unpublished():
    """Early exit takes its drafts' slots before scheduling (core/kv_cache_manager.py:
    `allocate_slots(publish=False, keep_free=...)`): never the blocks running requests need for
    the tokens they have, and never a prefix-cache entry for a block its drafts half-wrote."""
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a, b = req([1, 2, 3, 4, 5, 6, 7], rid="a"), req([9, 9, 9, 9], rid="b")
    assert kv.allocate_slots(a, 7)  # two blocks
    a.num_computed_tokens = 7
    a.append_token(8)  # its 8th token: fits its second block
    assert kv.blocks_short([a, b]) == 1  # b holds nothing yet: one block for its 4 tokens
    assert not kv.allocate_slots(a, 1 + 5, publish=False, keep_free=1)  # drafts would need 2 more: 1 left
    assert kv.allocate_slots(a, 1 + 4, publish=False, keep_free=1)  # one more block, one left for b
    assert len(kv.req_blocks["a"]) == 3 and kv.pool.num_free_blocks == 1
    # The block a's 8th token fills is not published; the scheduler's own call (same room) publishes it.
    assert kv.pool.get_cached_block(a.block_hashes[1]) is None
    assert kv.allocate_slots(a, 1 + 4) and len(kv.req_blocks["a"]) == 3
    assert kv.pool.get_cached_block(a.block_hashes[1]) is not None
