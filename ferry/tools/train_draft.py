"""`ferry train-draft --method medusa`: Medusa heads for any model ferry loads, trained on the
model's own answers (self-distillation, Medusa-1: the model frozen, the heads learn).

1. Generate: the model answers the shipped instructions (ferry/tools/draft_prompts.py; chat
   template, greedy unless `--temperature`) through ferry's own engine, batched. After each step
   the runner holds the hidden state each request sampled its token from (the LM head's input,
   `ModelRunner.logits_hidden`), computed by the very kernels serving uses; it is recorded with
   the token.
2. Train: head i learns, from the hidden state that produced token t, the token t + 1 + i of
   the same answer (what the model itself said there), by cross-entropy through the target's LM
   head (frozen, dequantized once for the gradient); Medusa's loss weights 0.8^i; AdamW. A fresh
   head is the identity, so it starts by guessing the token its hidden state produced.
3. Report each head's top-1 accuracy on held-out answers (the last `--eval-fraction` of the
   prompts), the chance it proposes exactly the model's token: head 1's is the first draft's
   acceptance rate at temperature 0. Save the heads (medusa.py's layout) to `--output`.

Serve them with `--speculative-config '{"method": "medusa", "model": OUTPUT,
"num_speculative_tokens": K}'`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ferry.config import EngineArgs
from ferry.sampling_params import SamplingParams
from ferry.tools.draft_prompts import PROMPTS

if TYPE_CHECKING:  # imported when run: every `ferry` command builds this one's parser
    from ferry.engine.llm_engine import LLMEngine
    from ferry.worker.spec_decode.medusa import MedusaHeads

logger = logging.getLogger(__name__)

MEDUSA_LOSS_DECAY = 0.8  # head i's loss weight is 0.8 ** i (Medusa's)
IGNORE = -100  # no target: the answer ends before the token this head would guess


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--method", choices=["medusa"], default="medusa", help="what to train (Medusa heads)")
    p.add_argument("--model", default=None, help="the model the heads draft for (default: bundled SmolLM2)")
    p.add_argument("--output", required=True, help="directory to write config.json and model.safetensors to")
    p.add_argument("--num-heads", type=int, default=4, help="heads, one draft token each")
    p.add_argument("--num-layers", type=int, default=1, help="residual blocks per head")
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS), help=f"instructions answered (<= {len(PROMPTS)})")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens per answer at most")
    p.add_argument("--temperature", type=float, default=0.0, help="of the answers (0: greedy)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=256, help="positions per optimizer step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-fraction", type=float, default=0.1, help="share of the answers held out")
    p.add_argument("--json", default=None, help="also write the report to this file")


def generate_with_hidden(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> list[tuple[torch.Tensor, list[int]]]:
    """Per prompt: the hidden states [n, H] its answer's n tokens were sampled from, and the tokens."""
    runner = engine.runner
    rows: dict[str, list[torch.Tensor]] = {}
    tokens: dict[str, list[int]] = {}
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        rows[str(i)], tokens[str(i)] = [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        hidden = runner.logits_hidden
        for rid, row in runner.last_row_of().items():
            rows[rid].append(hidden[row].float().cpu())
        for out in outputs:  # delta outputs would be simpler; the final one has every token
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
    result = []
    for i in range(len(prompts)):
        rid = str(i)
        n = len(tokens[rid])  # a stop string's tail is not in the tokens; its rows are dropped
        result.append((torch.stack(rows[rid][:n]), tokens[rid]))
    return result


def training_pairs(answers: list[tuple[torch.Tensor, list[int]]], num_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [N, H], targets [N, num_heads]): the row that sampled token t, and for head i the
    answer's token t + 1 + i (IGNORE past its end)."""
    hiddens, targets = [], []
    for hidden, toks in answers:
        n = len(toks)
        t = torch.full((n, num_heads), IGNORE, dtype=torch.long)
        for i in range(num_heads):
            if n > i + 1:
                t[: n - 1 - i, i] = torch.tensor(toks[i + 1 :], dtype=torch.long)
        hiddens.append(hidden)
        targets.append(t)
    return torch.cat(hiddens), torch.cat(targets)


def head_accuracy(
    heads: MedusaHeads, lm_head: torch.Tensor, hidden: torch.Tensor, targets: torch.Tensor
) -> list[float]:
    """Per head, the share of positions (with a target) whose top-1 guess is the target."""
    right = torch.zeros(heads.num_heads)
    total = torch.zeros(heads.num_heads)
    with torch.no_grad():
        for start in range(0, len(hidden), 1024):
            states = heads(hidden[start : start + 1024])
            guess = torch.stack([F.linear(s, lm_head).argmax(-1) for s in states], dim=1)
            t = targets[start : start + 1024]
            valid = t != IGNORE
            right += ((guess == t) & valid).sum(0).float()
            total += valid.sum(0).float()
    return (right / total.clamp(min=1)).tolist()


def fastest_head_dtype(lm_head: torch.Tensor) -> torch.dtype:
    """float32 or bfloat16, whichever runs the LM-head GEMM and its backward faster here (bf16 halves
    the time where the CPU has bf16 dot products, and is emulated, slower, where it has not)."""
    h = torch.randn(256, lm_head.shape[1], requires_grad=True)
    best, best_s = torch.float32, float("inf")
    for dtype in (torch.float32, torch.bfloat16):
        w = lm_head.to(dtype)
        seconds = []
        for _ in range(3):
            t0 = time.perf_counter()
            F.linear(h.to(dtype), w).float().logsumexp(-1).sum().backward()
            seconds.append(time.perf_counter() - t0)
        logger.info("LM head GEMM + backward over 256 rows in %s: %.0f ms", dtype, min(seconds) * 1e3)
        if min(seconds) < best_s:
            best, best_s = dtype, min(seconds)
    return best


def train(
    heads: MedusaHeads,
    lm_head: torch.Tensor,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    *,
    epochs: int,
    batch_size: int,
    lr: float,
    seed: int,
) -> list[float]:
    """Train the heads' blocks (the LM head frozen, in the dtype `lm_head` has); the mean loss of
    each epoch."""
    params = [p for p in heads.blocks.parameters()]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    steps = epochs * math.ceil(len(hidden) / batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=max(steps, 1), pct_start=0.1)
    weights = [MEDUSA_LOSS_DECAY**i for i in range(heads.num_heads)]
    g = torch.Generator().manual_seed(seed)
    losses = []
    for epoch in range(epochs):
        order = torch.randperm(len(hidden), generator=g)
        total, count = 0.0, 0
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            states = heads(hidden[idx])
            t = targets[idx]
            loss = sum(
                w * F.cross_entropy(F.linear(s.to(lm_head.dtype), lm_head).float(), t[:, i], ignore_index=IGNORE)
                for i, (w, s) in enumerate(zip(weights, states))
                if (t[:, i] != IGNORE).any()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
            count += len(idx)
        losses.append(total / max(count, 1))
        logger.info("epoch %d: loss %.3f", epoch + 1, losses[-1])
    return losses


def main(args: argparse.Namespace) -> int:
    if not 1 <= args.num_prompts <= len(PROMPTS):
        raise ValueError(f"--num-prompts must be in [1, {len(PROMPTS)}]")
    if not 0.0 < args.eval_fraction < 1.0:
        raise ValueError("--eval-fraction must be in (0, 1)")
    from ferry.engine.llm_engine import LLMEngine
    from ferry.worker.spec_decode.medusa import MedusaHeads

    torch.manual_seed(args.seed)
    eargs = EngineArgs.from_cli_args(args)
    eargs.model = args.model
    eargs.speculative_config = None
    engine = LLMEngine(eargs)
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("train-draft needs the model's tokenizer (its chat template) to ask it questions")
    cfg = engine.model_config
    texts = PROMPTS[: args.num_prompts]
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False)
        for t in texts
    ]  # fmt: skip
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    t0 = time.perf_counter()
    answers = generate_with_hidden(engine, prompts, params)
    gen_s = time.perf_counter() - t0
    num_tokens = sum(len(toks) for _, toks in answers)
    print(f"generated {num_tokens} tokens for {len(prompts)} prompts in {gen_s:.0f} s")
    lm_head = engine.model.dense_lm_head().float()
    engine.shutdown()

    held = max(1, round(len(answers) * args.eval_fraction))
    train_h, train_t = training_pairs(answers[:-held], args.num_heads)
    eval_h, eval_t = training_pairs(answers[-held:], args.num_heads)
    heads = MedusaHeads(cfg.hidden_size, cfg.vocab_size, args.num_heads, args.num_layers)
    before = head_accuracy(heads, lm_head, eval_h, eval_t)
    t1 = time.perf_counter()
    head_dtype = fastest_head_dtype(lm_head)
    losses = train(heads, lm_head.to(head_dtype), train_h, train_t, epochs=args.epochs, batch_size=args.batch_size,
                   lr=args.lr, seed=args.seed)  # fmt: skip
    train_s = time.perf_counter() - t1
    after = head_accuracy(heads, lm_head, eval_h, eval_t)
    heads.save(args.output)
    print(f"trained {args.num_heads} heads on {len(train_h)} positions, {args.epochs} epochs, in {train_s:.0f} s "
          f"(LM head in {str(head_dtype).removeprefix('torch.')})")  # fmt: skip
    for i, (b, a) in enumerate(zip(before, after)):
        print(f"head {i + 1} (token +{i + 2}): held-out top-1 accuracy {b:.1%} untrained -> {a:.1%}")
    print(f"saved to {args.output}")
    report = {
        "model": args.model or "default",
        "prompts": len(prompts),
        "generated_tokens": num_tokens,
        "generate_seconds": gen_s,
        "train_positions": len(train_h),
        "heldout_positions": len(eval_h),
        "train_seconds": train_s,
        "lm_head_dtype": str(head_dtype).removeprefix("torch."),
        "epoch_losses": losses,
        "heldout_accuracy_untrained": before,
        "heldout_accuracy": after,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
