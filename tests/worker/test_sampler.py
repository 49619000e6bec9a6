import math

import pytest
import torch

from ferry.core.request import Request
from ferry.sampling_params import SamplingParams
from ferry.worker.sampler import Sampler, apply_penalties, apply_top_k_top_p_min_p, argmax_rows, banned_bad_words

NEG = float("-inf")


def make_req(params, prompt=(1, 2), output=()):
    r = Request("r", list(prompt), params, block_size=4, max_tokens=100)
    for t in output:
        r.append_token(t)
    return r


def test_argmax_rows_matches_torch_on_ties_nan_and_inf():
    """The CPU float32 path (numpy) picks what torch.argmax picks: the first of equal maxima, a NaN
    over everything, a row of -inf's first index; other dtypes take torch's own."""
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor(
        [
            [1.0, nan, 3.0, nan],
            [NEG, NEG, NEG, NEG],
            [2.0, 5.0, 5.0, 1.0],
            [inf, 1.0, inf, nan],
            [0.5, -1.0, 0.25, 0.75],
        ]
    )
    wide = torch.randn(16, 49152)
    for x in (rows, wide, wide[:, ::2], rows.to(torch.bfloat16)):
        got = argmax_rows(x)
        assert got.dtype == torch.int64
        assert got.tolist() == x.argmax(dim=-1).tolist()


def test_top_k_masks_all_but_k():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0], [1.0, 4.0, 3.0, 2.0]])
    out = apply_top_k_top_p_min_p(logits, torch.tensor([2, 0]), None, None)
    assert out[0].tolist() == [NEG, 4.0, 3.0, NEG]
    assert out[1].tolist() == [1.0, 4.0, 3.0, 2.0]  # 0 = disabled


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log().repeat(3, 1)
    out = apply_top_k_top_p_min_p(logits, None, torch.tensor([0.8, 0.81, 0.1]), None)
    assert torch.isinf(out[0]).tolist() == [True, False, True, False]  # 0.5 + 0.3 reaches 0.8
    assert torch.isinf(out[1]).tolist() == [True, False, False, False]  # needs 0.15 too
    assert torch.isinf(out[2]).tolist() == [True, False, True, True]  # the top token always stays


def test_min_p_relative_to_top_probability():
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    out = apply_top_k_top_p_min_p(probs.log(), None, None, torch.tensor([0.2]))  # threshold 0.1
    assert torch.isinf(out[0]).tolist() == [True, False, False, False]


def test_penalties_hand_computed():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0]])
    prompt_mask = torch.tensor([[True, False, False, False]])
    counts = torch.tensor([[0.0, 2.0, 1.0, 0.0]])
    out = apply_penalties(logits, prompt_mask, counts, torch.tensor([2.0]), torch.tensor([0.1]), torch.tensor([0.5]))
    expected = [2.0 / 2, -1.0 * 2 - 0.5 * 2 - 0.1, 0.5 / 2 - 0.5 - 0.1, 0.0]
    assert out[0].tolist() == pytest.approx(expected)


def test_sampler_penalties_from_requests():
    s = Sampler(4)
    logits = torch.tensor([[2.0, 1.9, 0.0, 0.0]])
    greedy = make_req(SamplingParams(temperature=0), prompt=[3])
    assert s(logits, [greedy]).token_ids == [0]
    rep = make_req(SamplingParams(temperature=0, repetition_penalty=1.5), prompt=[0])
    assert s(logits, [rep]).token_ids == [1]  # 2.0 / 1.5 < 1.9
    freq = make_req(SamplingParams(temperature=0, frequency_penalty=0.2), prompt=[3], output=[0])
    assert s(logits, [freq]).token_ids == [1]


def test_logit_bias_and_min_tokens():
    s = Sampler(4)
    logits = torch.tensor([[5.0, 1.0, 0.0, 0.0]])
    p = SamplingParams(temperature=0, logit_bias={2: 10.0})
    biased = make_req(p)
    assert s(logits, [biased]).token_ids == [2]
    built = biased.logit_bias_tensors
    assert built is not None and built[0].tolist() == [2]
    # Built once per request: later steps, here beside another biased request, reuse it.
    other = make_req(SamplingParams(temperature=0, logit_bias={1: 20.0, 3: -5.0}))
    assert s(logits.repeat(2, 1), [biased, other]).token_ids == [2, 1]
    assert biased.logit_bias_tensors is built
    p = SamplingParams(temperature=0, min_tokens=2)
    p.all_stop_token_ids = {0}
    assert s(logits, [make_req(p, output=[3])]).token_ids == [1]  # EOS (0) banned before min_tokens
    assert s(logits, [make_req(p, output=[3, 3])]).token_ids == [0]


def test_allowed_token_ids_leave_only_their_tokens_to_draw():
    s = Sampler(6)
    logits = torch.tensor([[5.0, 4.0, 0.0, 1.0, -1.0, 3.0]])
    greedy = make_req(SamplingParams(temperature=0, allowed_token_ids=[2, 3]))
    assert s(logits, [greedy]).token_ids == [3]
    mask = greedy.disallowed_mask
    assert mask.tolist() == [True, True, False, False, True, True]
    # Sampled rows draw only allowed tokens, beside a row without the rule, whose logits stay as they were.
    torch.manual_seed(0)
    free, before = make_req(SamplingParams(temperature=0)), logits.clone()
    rows = [make_req(SamplingParams(temperature=1.0, allowed_token_ids=[2, 4])) for _ in range(300)]
    drawn = s(logits.repeat(301, 1), [*rows, free]).token_ids
    assert set(drawn[:-1]) == {2, 4} and drawn[-1] == 0
    assert torch.equal(logits, before)
    assert s(logits, [greedy]).token_ids == [3] and greedy.disallowed_mask is mask  # built once per request
    # A draft model's logits may be narrower than the target's vocabulary: ids past them are left out.
    wide = make_req(SamplingParams(temperature=0, allowed_token_ids=[4, 9]))
    assert s(logits, [wide]).token_ids == [4]


def test_bad_words_ban_the_token_that_would_complete_them():
    words = [[1], [3, 0], [2, 3, 5]]
    assert banned_bad_words(words, [], []) == [1]
    assert banned_bad_words(words, [4, 3], []) == [1, 0]
    assert banned_bad_words(words, [2], [3]) == [1, 0, 5]  # the drafts before a row count as output
    assert banned_bad_words(words, [2, 3], [4]) == [1]
    assert banned_bad_words(words, [], [2, 3]) == [1, 0, 5]
    s = Sampler(6)
    logits = torch.tensor([[5.0, 6.0, 0.0, 1.0, -1.0, 4.0]])
    p = SamplingParams(temperature=0)
    p.bad_words_token_ids = words  # as the input processor fills it from bad_words
    assert s(logits, [make_req(p)]).token_ids == [0]
    assert s(logits, [make_req(p, output=[3])]).token_ids == [5]
    assert s(logits, [make_req(p, output=[2, 3])]).token_ids == [3]
    # Verifying the draft 3 after the output [2]: the row after the draft bans 0 and 5 as well.
    first = torch.tensor([[0.0, 0.0, 0.0, 9.0, 0.0, 0.0]])
    assert s.verify(torch.cat([first, logits]), [make_req(p, output=[2])], [[3]]).token_ids == [[3, 3]]
    assert s.verify(torch.cat([first, logits]), [make_req(p, output=[4])], [[3]]).token_ids == [[3, 5]]


def test_sampling_follows_the_distribution():
    s = Sampler(3)
    torch.manual_seed(0)
    probs = torch.tensor([0.7, 0.2, 0.1])
    reqs = [make_req(SamplingParams(temperature=1.0)) for _ in range(4000)]
    toks = torch.tensor(s(probs.log().repeat(4000, 1), reqs).token_ids)
    freq = torch.bincount(toks, minlength=3) / 4000
    assert torch.allclose(freq, probs, atol=0.03)
    # top_k=1 is greedy whatever the temperature.
    assert set(s(probs.log().repeat(50, 1), [make_req(SamplingParams(top_k=1)) for _ in range(50)]).token_ids) == {0}


def test_seeded_rows_do_not_depend_on_batch():
    s = Sampler(50)
    logits = torch.randn(1, 50)
    alone = [s(logits, [r]).token_ids[0] for r in [make_req(SamplingParams(seed=7))] * 1]
    r1 = make_req(SamplingParams(seed=7))
    first = [s(logits, [r1]).token_ids[0] for _ in range(5)]
    r2 = make_req(SamplingParams(seed=7))
    others = [make_req(SamplingParams()) for _ in range(3)]
    batched = [s(logits.repeat(4, 1), others[:1] + [r2] + others[1:]).token_ids[1] for _ in range(5)]
    assert first == batched and first[0] == alone[0]


def test_logprobs_of_raw_distribution():
    s = Sampler(4)
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    out = s(logits, [make_req(SamplingParams(temperature=0, logprobs=2, repetition_penalty=1.0))])
    lp, rank, top_ids, top_lps = out.logprobs[0]
    ref = torch.log_softmax(logits, -1)[0]
    assert out.token_ids == [1] and rank == 1
    assert lp == pytest.approx(ref[1].item()) and top_ids == [1, 2]
    assert top_lps == pytest.approx([ref[1].item(), ref[2].item()])
    assert math.isclose(sum(math.exp(x) for x in ref.tolist()), 1.0, rel_tol=1e-6)


def test_draft_draws_with_the_noise_its_verification_uses():
    """`Sampler.draft` draws as the target's row for the same output index will: from the same
    distribution a draft always equals the target's draw (seeded, or keyed by `noise_seed`), the
    drafts before it counted as output. From a different distribution q it equals the draw from p
    at least as often as the shared race guarantees, (1 - TV) / (1 + TV), and far more often than
    an independent draw would (sum of p * q)."""
    torch.manual_seed(0)
    n, V = 2000, 50
    sampler = Sampler(V)
    requests = []
    for i in range(n):
        r = make_req(SamplingParams(temperature=1.0, seed=i if i % 2 else None, presence_penalty=0.5), output=[3])
        if i % 2 == 0:
            r.noise_seed = 10_000 + i  # unseeded: keyed as a draft model keys it
        requests.append(r)
    p_logits = torch.randn(n, V) * 2
    prior = [[7, 9]] * n
    drafted = sampler.draft(p_logits, requests, prior)
    # Verify drafts 7, 9, d: rows 0 and 1 all but certain to draw 7 and 9, row 2 the draft model's
    # distribution after them, row 3 (the bonus) anything.
    sure = torch.full((n, V), -30.0)
    rows = torch.stack([sure.index_fill(1, torch.tensor([7]), 30.0), sure.index_fill(1, torch.tensor([9]), 30.0),
                        p_logits, p_logits], dim=1).reshape(4 * n, V)  # fmt: skip
    verified = sampler.verify(rows, requests, [[7, 9, d] for d in drafted])
    assert all(len(kept) == 4 and kept[2] == d for kept, d in zip(verified.token_ids, drafted))
    assert sampler.draft(p_logits, requests, prior) == drafted  # the same noise, every time

    q_logits = p_logits + torch.randn(n, V)
    from_q = torch.tensor(sampler.draft(q_logits, requests, prior))
    from_p = torch.tensor(drafted)
    processed = [sampler._process(x, [_row(r) for r in requests])[0] for x in (p_logits, q_logits)]
    p, q = (x.softmax(dim=-1) for x in processed)
    tv = 0.5 * (p - q).abs().sum(dim=-1)
    agree = (from_q == from_p).float().mean().item()
    assert agree >= ((1 - tv) / (1 + tv)).mean().item() - 0.03
    assert agree > (p * q).sum(dim=-1).mean().item() + 0.2


def _row(request):
    from ferry.worker.sampler import _Row

    return _Row(request, [7, 9])
