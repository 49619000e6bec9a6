"""Batched, vectorized sampling over the rows of a logits matrix.

Order (as vLLM): the grammar's token mask (structured output), allowed_token_ids, bad_words, logit bias,
min_tokens (stop tokens masked), repetition /
presence / frequency penalties, then greedy argmax or temperature, top-k,
top-p, min-p and a draw. The draw is `argmax(p / q)` with `q ~ Exp(1)`, which
samples from `p`. A seeded request's `q` for its k-th output token comes from a
generator seeded by (seed, k) alone: its tokens do not depend on the batch, on
preemption, on which worker samples which token (prefill/decode disaggregation),
nor on speculation. Logprobs are of the raw model distribution. On a GPU all of
it runs on the device; the sampled ids are the step's one device -> host read
(logprobs, when asked, add theirs).

`verify` takes a request's draft tokens (speculative decoding) with one logits row per
position: row j is the distribution after the first j drafts, processed as if they had been
sampled (penalties and min_tokens count them). Each row draws its token exactly as it would
without drafts, and drafts are kept while they equal those draws; at the first that differs,
the row's own draw is the next token, and after all of them the last row's draw follows as a
bonus. For a greedy row the draw is the argmax. For a sampling row this is rejection sampling
against a one-hot draft, coupled by the shared noise: the draft is kept with probability p(draft)
(the chance it wins the race) and otherwise the winner is distributed as p without the draft,
renormalized, as Leviathan et al.'s residual; so tokens are distributed as without drafts, and
a seeded request's are the very same tokens with speculation on or off.

`draft` samples a draft model's tokens as the target would (the request's processing, with the
drafts before it counted as output) and with the very noise the target's row for that output
index will use: an unseeded request gets a noise key of its own for this (`Request.noise_seed`).
Coupled through one race, the draft equals the target's draw with probability at least
(1 - TV) / (1 + TV) for draft and target distributions TV apart, close to the 1 - TV of Leviathan
et al.'s min(1, p/q) test, and the kept tokens are the target's own draws: distributed exactly as
without speculation, seed for seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ferry.core.request import Request
from ferry.structured_output.bitmask import apply_bitmask, fill_bitmask
from ferry.worker.step_plan import tree_paths

Logprob = tuple[float, int, list[int], list[float]]  # (sampled logprob, its rank, top ids, top logprobs)


def ranked_logprobs(logprobs: torch.Tensor, tokens: list[int], k: int) -> list[Logprob]:
    """Per row of `logprobs` [rows, vocab]: the logprob of `tokens[row]`, its rank (1: the most
    likely) and the row's `k` most likely tokens with their logprobs."""
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logprobs.device).unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_vals, top_idx = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], logprobs[:, :0].long())
    return list(zip(chosen.squeeze(1).tolist(), ranks.tolist(), top_idx.tolist(), top_vals.tolist()))


def _logit_bias_tensors(request: Request, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A request's logit_bias as (token ids, biases) on `device`, built on its first step only: up
    to 300 entries a request, which a Python loop per step would walk again every token."""
    cached = request.logit_bias_tensors
    if cached is None or cached[0].device != device:
        bias = request.sampling_params.logit_bias
        ids = torch.tensor([int(t) for t in bias], dtype=torch.long, device=device)
        cached = (ids, torch.tensor([float(b) for b in bias.values()], dtype=torch.float32, device=device))
        request.logit_bias_tensors = cached
    return cached


def _disallowed_mask(request: Request, vocab: int, device: torch.device) -> torch.Tensor:
    """True for each token `allowed_token_ids` leaves out, built on the request's first step only."""
    mask = request.disallowed_mask
    if mask is None or mask.device != device or mask.shape[0] != vocab:
        mask = torch.ones(vocab, dtype=torch.bool, device=device)
        ids = [t for t in request.sampling_params.allowed_token_ids if t < vocab]  # (a draft's narrower vocabulary)
        mask[torch.tensor(ids, dtype=torch.long, device=device)] = False
        request.disallowed_mask = mask
    return mask


def banned_bad_words(bad_words: list[list[int]], output: list[int], prior: list[int]) -> list[int]:
    """The last tokens of the bad words (token ids) whose other tokens end `output + prior`: the next
    token must not complete them (vLLM's rule; a one-token word is always banned)."""
    banned = []
    for word in bad_words:
        n = len(word) - 1
        if n == 0:
            banned.append(word[0])
        elif n <= len(output) + len(prior):
            tail = (output[-n:] + prior)[-n:] if len(prior) < n else prior[-n:]
            if tail == word[:-1]:
                banned.append(word[-1])
    return banned


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value (the first of equals; a NaN counts as largest), int64.
    On the CPU through numpy: torch's CPU argmax took ~70 us for one 49k-wide float32 row (1% of a
    SmolLM2 decode step) and ~690 us for 16 rows, numpy's 6 and 69 (2026-11-27, the 2-vCPU EPYC)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2:
        return torch.from_numpy(np.argmax(x.detach().contiguous().numpy(), axis=-1).astype(np.int64, copy=False))
    return x.argmax(dim=-1)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (sampled logprob, sampled rank, top token ids, top logprobs) or None.
    logprobs: list[Logprob | None]


@dataclass
class VerifiedOutput:
    """Per request: the tokens it keeps this step (accepted drafts, then the model's own token)
    and their logprobs (None where not asked for)."""

    token_ids: list[list[int]]
    logprobs: list[list[Logprob] | None]
    # Per request, the logits row whose draw is its last kept token (Medusa heads draft from
    # that row's hidden state).
    last_rows: list[int]
    # Per request, the drafts it kept (1-based, in the order laid out): 1..m for a chain; for a
    # tree the accepted path, whose K/V the runner moves to consecutive slots.
    kept_nodes: list[list[int]]


@dataclass
class _Row:
    """One logits row: its request and the drafts that precede it (counted as output)."""

    request: Request
    prior: list[int]

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.prior)


def apply_penalties(
    logits: torch.Tensor,
    prompt_mask: torch.Tensor,
    output_counts: torch.Tensor,
    repetition: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
) -> torch.Tensor:
    """vLLM's penalties. Repetition covers prompt and output tokens; presence and
    frequency only generated ones. All per row tensors are [B] or [B, 1]."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition.unsqueeze(1).expand_as(logits)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, scaled, logits)
    logits = logits - frequency.unsqueeze(1) * output_counts
    logits = logits - presence.unsqueeze(1) * (output_counts > 0).to(logits.dtype)
    return logits


def apply_top_k_top_p_min_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None, min_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask (to -inf) the tokens outside top-k, the top-p nucleus and min-p.

    `top_k` [B] long with 0 = off, `top_p` [B] in (0, 1], `min_p` [B] in [0, 1].
    Rows of already temperature-scaled logits.
    """
    if top_k is not None or top_p is not None:
        sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
        mask = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if top_k is not None:
            vocab = logits.shape[-1]
            k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
            ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
            mask |= ranks >= k.unsqueeze(1)
        if top_p is not None:
            probs = sorted_logits.masked_fill(mask, float("-inf")).softmax(dim=-1)
            # Drop a token when the mass strictly before it already reaches top_p;
            # the most likely token is always kept.
            mass_before = probs.cumsum(dim=-1) - probs
            mask |= mass_before >= top_p.unsqueeze(1)
            mask[:, 0] = False
        logits = logits.scatter(-1, sorted_idx, sorted_logits.masked_fill(mask, float("-inf")))
    if min_p is not None:
        probs = logits.softmax(dim=-1)
        threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def _token_generator(seed: int, index: int) -> torch.Generator:
    """The generator of a seeded request's noise for its output token `index` (splitmix64's
    constants mix the two, so nearby seeds and indices give unrelated streams)."""
    mixed = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & 0xFFFF_FFFF_FFFF_FFFF
    mixed ^= mixed >> 31
    g = torch.Generator()
    g.manual_seed(mixed)
    return g


class Sampler:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        """Sample one token for each row; row i belongs to requests[i]."""
        rows = [_Row(r, []) for r in requests]
        logits, raw_logprobs, params = self._process(logits, rows)
        token_ids = self._draw(logits, rows, params).tolist()
        logprob_rows: list = [None] * len(rows)
        if raw_logprobs is not None:
            want = [i for i, p in enumerate(params) if p.logprobs is not None]
            for i, lp in zip(want, self._logprobs(raw_logprobs, want, [token_ids[i] for i in want], params)):
                logprob_rows[i] = lp
        return SamplerOutput(token_ids, logprob_rows)

    def verify(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        drafts: list[list[int]],
        parents: list[list[int] | None] | None = None,
    ) -> VerifiedOutput:
        """Verify each request's drafts: its 1 + len(drafts[i]) consecutive logits rows decide
        which it keeps, and the token that follows them. With `parents[i]` (a tree in preorder,
        `Request.spec_parents`) row j follows draft j's path, and the kept drafts are the path
        whose every draft equals the draw of its parent's row."""
        parents = parents or [None] * len(drafts)
        trees = [p if p is not None else list(range(len(d))) for d, p in zip(drafts, parents)]
        paths = [tree_paths(tree) for tree in trees]  # per request, each node's drafts from the root
        rows = [_Row(r, [d[a - 1] for a in path]) for r, d, ps in zip(requests, drafts, paths) for path in ps]
        logits, raw_logprobs, params = self._process(logits, rows)
        sampled = self._draw(logits, rows, params).tolist()
        token_ids: list[list[int]] = []
        kept_rows: list[list[int]] = []  # the rows whose draws a request keeps, in order
        kept_nodes: list[list[int]] = []
        row = 0
        for d, tree in zip(drafts, trees):
            node, kept, at, nodes = 0, [], [], []
            while True:
                token = sampled[row + node]
                kept.append(token)  # the draft itself where it agrees
                at.append(row + node)
                node = next((c for c in range(node + 1, len(d) + 1) if tree[c - 1] == node and d[c - 1] == token), 0)
                if not node:
                    break
                nodes.append(node)
            token_ids.append(kept)
            kept_rows.append(at)
            kept_nodes.append(nodes)
            row += len(d) + 1
        logprobs: list[list[Logprob] | None] = [None] * len(drafts)
        if raw_logprobs is not None:
            want = [n for n, r in enumerate(requests) if r.sampling_params.logprobs is not None]
            lp_rows = [i for n in want for i in kept_rows[n]]
            lps = iter(self._logprobs(raw_logprobs, lp_rows, [t for n in want for t in token_ids[n]], params))
            for n in want:
                logprobs[n] = [next(lps) for _ in token_ids[n]]
        return VerifiedOutput(token_ids, logprobs, [at[-1] for at in kept_rows], kept_nodes)

    def draft(self, logits: torch.Tensor, requests: list[Request], priors: list[list[int]]) -> list[int]:
        """A draft model's next token for each row: requests[i] after its drafts `priors[i]`,
        drawn as the target's row at that output index will draw (same processing, same noise)."""
        rows = [_Row(r, prior) for r, prior in zip(requests, priors)]
        logits, _, params = self._process(logits, rows, logprobs=False)
        return self._draw(logits, rows, params).tolist()

    def _process(
        self, logits: torch.Tensor, rows: list[_Row], logprobs: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None, list]:
        """Logit bias, min_tokens and penalties applied; the raw logprobs when any row asks (and
        `logprobs`)."""
        logits = logits.float()
        params = [r.request.sampling_params for r in rows]
        want = logprobs and any(p.logprobs is not None for p in params)
        raw_logprobs = logits.log_softmax(dim=-1) if want else None
        # A grammar still closed (reasoning) constrains only rows whose drafts may open it.
        constrained = [i for i, r in enumerate(rows) if r.request.grammar is not None
                       and (r.request.grammar.open or r.prior)]  # fmt: skip
        if constrained:  # structured output: what the grammar forbids is never drawn
            bitmask = fill_bitmask([(rows[i].request.grammar, rows[i].prior) for i in constrained], logits.shape[1])
            logits = apply_bitmask(logits, constrained, bitmask)
        logits = self._apply_token_rules(logits, rows)
        if any(p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty for p in params):
            logits = self._penalize(logits, rows)
        return logits, raw_logprobs, params

    def _draw(self, logits: torch.Tensor, rows: list[_Row], params: list) -> torch.Tensor:
        """Each row's token: the argmax for greedy rows, a draw from p for the others."""
        # Decided on the host: a device-side `.all()` would be a second device -> host read.
        if all(p.greedy for p in params):
            return argmax_rows(logits)
        device = logits.device
        B, V = logits.shape
        temp = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params], device=device)
        scaled = logits / temp.unsqueeze(1)
        top_k = top_p = min_p = None
        if any(p.top_k > 0 for p in params):
            top_k = torch.tensor([p.top_k for p in params], device=device)
        if any(p.top_p < 1.0 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device, dtype=torch.float32)
        scaled = apply_top_k_top_p_min_p(scaled, top_k, top_p, min_p)
        probs = scaled.softmax(dim=-1)
        q = self._exponential_noise(B, V, rows, device)
        drawn = argmax_rows(probs / q)
        greedy = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(greedy, argmax_rows(logits), drawn)

    @staticmethod
    def _logprobs(raw_logprobs: torch.Tensor, rows: list[int], tokens: list[int], params: list) -> list[Logprob]:
        """(logprob, rank, top ids, top logprobs) of `tokens[j]` in row `rows[j]` of the raw model
        distribution, with each row's request's number of top logprobs."""
        if not rows:
            return []
        ranked = ranked_logprobs(raw_logprobs[rows], tokens, max(params[i].logprobs for i in rows))
        out = []
        for (lp, rank, top_ids, top_lps), i in zip(ranked, rows):
            n = params[i].logprobs
            out.append((lp, rank, top_ids[:n], top_lps[:n]))
        return out

    def _apply_token_rules(self, logits: torch.Tensor, sample_rows: list[_Row]) -> torch.Tensor:
        """allowed_token_ids, bad_words, logit_bias and min_tokens applied to a copy of `logits`
        (the caller's is left as it is)."""
        rows, cols, vals = [], [], []
        ban_rows, ban_cols = [], []
        allowed_rows = []
        for i, row in enumerate(sample_rows):
            p = row.request.sampling_params
            if p.allowed_token_ids is not None:
                allowed_rows.append(i)
            if p.bad_words_token_ids:
                banned = banned_bad_words(p.bad_words_token_ids, row.request.output_token_ids, row.prior)
                banned = [t for t in banned if t < logits.shape[1]]
                ban_rows += [i] * len(banned)
                ban_cols += banned
            if p.logit_bias:
                ids, bias = _logit_bias_tensors(row.request, logits.device)
                rows.append(torch.full_like(ids, i))
                cols.append(ids)
                vals.append(bias)
            # A finished grammar allows only EOS: min_tokens cannot hold it open (it would leave no token).
            if row.num_output_tokens < p.min_tokens and not (row.request.grammar and row.request.grammar.is_stopped()):
                for tok in p.all_stop_token_ids:
                    ban_rows.append(i)
                    ban_cols.append(tok)
        if not (rows or ban_rows or allowed_rows):
            return logits
        logits = logits.clone()
        if allowed_rows:
            V = logits.shape[1]
            masks = torch.stack([_disallowed_mask(sample_rows[i].request, V, logits.device) for i in allowed_rows])
            logits[allowed_rows] = logits[allowed_rows].masked_fill(masks, float("-inf"))
        if rows:
            logits[torch.cat(rows), torch.cat(cols)] += torch.cat(vals).to(logits.dtype)
        if ban_rows:
            logits[ban_rows, ban_cols] = float("-inf")
        return logits

    def _penalize(self, logits: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
        B, V = logits.shape
        device = logits.device
        prompt_mask = torch.zeros(B, V, dtype=torch.bool, device=device)
        output_counts = torch.zeros(B, V, dtype=logits.dtype, device=device)
        for i, row in enumerate(rows):
            r = row.request
            if r.prompt_token_ids:
                prompt_mask[i, torch.tensor(r.prompt_token_ids, device=device)] = True
            output = r.output_token_ids + row.prior
            if output:
                toks = torch.tensor(output, device=device)
                output_counts[i].index_add_(0, toks, torch.ones(len(toks), dtype=logits.dtype, device=device))
        params = [row.request.sampling_params for row in rows]
        rep = torch.tensor([p.repetition_penalty for p in params], device=device, dtype=logits.dtype)
        pres = torch.tensor([p.presence_penalty for p in params], device=device, dtype=logits.dtype)
        freq = torch.tensor([p.frequency_penalty for p in params], device=device, dtype=logits.dtype)
        return apply_penalties(logits, prompt_mask, output_counts, rep, pres, freq)

    @staticmethod
    def _exponential_noise(B: int, V: int, rows: list[_Row], device: torch.device) -> torch.Tensor:
        """Exp(1) noise for the exponential race: argmax(p / q) draws from p.

        -log(U) from torch.rand, not Tensor.exponential_: on the CPU exponential_ costs
        ~12 ms for a [16, 49152] batch, rand + log ~2 ms. U = 0 (probability 2^-24 per
        element) gives q = inf and only removes that one token from the race; the
        -log(1 - U) form would instead give q = 0 and force an arbitrary token."""
        q = torch.rand(B, V, device=device)
        for i, row in enumerate(rows):
            seed = row.request.sampling_params.seed
            if seed is None:
                seed = row.request.noise_seed
            if seed is not None:
                # Drawn on the CPU from a generator keyed by (seed, output index): the same
                # numbers whatever the batch, device, step interleaving or drafts.
                q[i] = torch.rand(V, generator=_token_generator(seed, row.num_output_tokens)).to(device)
        return q.log_().neg_()
