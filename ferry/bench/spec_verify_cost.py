"""`ferry bench spec --verify-cost`: what a verify step costs against a plain decode step, by batch.

For each batch size B, B random prompts decode `--output-len` tokens twice through the same
model: once plainly (B rows a step), once verifying `--drafts` k drafts per request every step
(B * (k + 1) rows). The drafts are placeholders (each request's last token repeated): a verify
step's cost does not depend on whether its drafts are kept, only on its rows, and placeholders
make every step verify k of them (a proposer's drafts come and go with the text). Reports the
median wall time of the decode steps of each kind and their ratio: the price of speculation at
that batch, which the adaptive draft length weighs (issue 16 asks for it on a GPU at batch
1..64; it runs on any device the engine does).
"""

from __future__ import annotations

import dataclasses
import random
import statistics

from ferry.bench.latency import _requests, cache_sized_for, run_batch, timed_engine
from ferry.config import EngineArgs


def _placeholder_drafts(request, room: int) -> list[int]:
    return [request.all_token_ids[-1]] * room


def run(args, eargs: EngineArgs, loaded) -> dict:
    k = args.drafts
    spec = f'{{"method": "ngram", "num_speculative_tokens": {k}, "draft_length": "fixed"}}'
    max_seqs = max(args.batch_sizes)
    eargs = cache_sized_for(eargs, max_seqs, args.input_len + args.output_len + k + 1)
    plain = timed_engine(dataclasses.replace(eargs, speculative_config=None, max_num_seqs=max_seqs), loaded)
    verifying = timed_engine(dataclasses.replace(eargs, speculative_config=spec, max_num_seqs=max_seqs), loaded)
    verifying.core.proposer.ngram.propose = _placeholder_drafts
    vocab = plain.model_config.vocab_size
    rng = random.Random(0)
    rows = []
    print(f"verify-step cost: {k} drafts per request, prompts of {args.input_len} tokens, {args.output_len} out")
    for b in args.batch_sizes:
        prompts = _requests(rng, b, args.input_len, vocab)
        times: dict[str, list[float]] = {"plain": [], "verify": []}
        for _ in range(args.rounds):
            for name, engine, want_rows in (("plain", plain, b), ("verify", verifying, b * (k + 1))):
                steps = run_batch(engine, prompts, args.output_len, f"{name}{b}")
                times[name] += [dt for rec, dt in steps if rec.num_prefill_tokens == 0 and rec.num_decodes == want_rows]
        if not times["plain"] or not times["verify"]:
            raise RuntimeError(f"batch {b}: no decode steps of the expected shape (raise --output-len)")
        plain_s, verify_s = statistics.median(times["plain"]), statistics.median(times["verify"])
        row = {"batch_size": b, "plain_step_ms": plain_s * 1e3, "verify_step_ms": verify_s * 1e3,
               "ratio": verify_s / plain_s, "steps": {n: len(t) for n, t in times.items()}}  # fmt: skip
        rows.append(row)
        print(f"batch {b}: decode step {plain_s * 1e3:.2f} ms ({b} rows); verify step {verify_s * 1e3:.2f} ms "
              f"({b * (k + 1)} rows) = {verify_s / plain_s:.2f}x")  # fmt: skip
    return {"drafts": k, "input_len": args.input_len, "output_len": args.output_len, "batches": rows}
