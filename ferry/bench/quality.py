"""`ferry bench quality`: how far a quantization moves the model from the fp32 one.

Both models read the same text teacher-forced (one prefill), and every
position's next-token distribution is compared: mean KL(fp32 || quantized),
top-1 agreement, and each model's perplexity on the text. This measures the
weight and activation quantization (`--quantization`; `gguf` or `auto` for a quantized GGUF
compares its blocks run as stored against the same file dequantized to fp32) and a quantized
KV cache (`--kv-cache-dtype int8 | fp8`, alone or with a weight quantization): with a quantized
cache every position of the prefill attends to the stored (quantized) K/V, its own included,
which is what decoding from that cache reads. A float `--kv-cache-dtype` (bf16) is not
measured this way: a single prefill attends to the fresh K/V. `--decode-rows` runs the quantized
model over the text as decode rows of one sequence (each token's row attends to the cache up to
itself): the decode kernels' arithmetic, which on the CPU quantizes q for an int8 cache's K dots.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import torch

from ferry.config import EngineArgs
from ferry.kv_quant import KV_FORMAT_DTYPES
from ferry.layers.gguf_linear import exact_prompt_rows, int8_dots_at_any_batch
from ferry.worker.model_loading import load_model

# Held out from the SmoothQuant calibration text (ferry/layers/smoothquant.py): prose, code, Q&A.
DEFAULT_TEXT = (
    "The river begins high in the mountains, where snow melts each spring and feeds a hundred small "
    "streams. By the time it reaches the valley it is wide and slow, and the town that grew up on its "
    "banks has depended on it for centuries: for water, for fish, and for the barges that carried "
    "grain and timber down to the sea. In the nineteenth century a railway arrived, and the barges "
    "slowly disappeared. Today the old warehouses along the quay have become restaurants, a museum "
    "and a library, and on summer evenings people sit by the water and watch the light fade.\n\n"
    "To compute the average of a list of numbers in Python, add them with sum() and divide by len(); "
    "for an empty list, decide first what the answer should be, because dividing by zero raises a "
    "ZeroDivisionError. The statistics module offers mean(), median() and stdev() as well.\n\n"
    "Q: What is the boiling point of water at sea level?\nA: 100 degrees Celsius, or 212 degrees "
    "Fahrenheit. At higher altitudes the air pressure is lower, so water boils at a lower temperature."
)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a .gguf file or HF model directory (default: bundled SmolLM2)")
    p.add_argument("--text-file", default=None, help="text to score (default: a built-in held-out paragraph)")
    p.add_argument("--max-tokens", type=int, default=1024, help="score at most this many tokens of the text")
    p.add_argument("--decode-rows", action="store_true",
                   help="the quantized model reads the text as decode rows (the decode kernels' arithmetic) "
                        "rather than as one prompt")  # fmt: skip
    p.add_argument("--json", default=None)


@torch.no_grad()
def compare(reference, candidate, token_ids: list[int], kv_cache_dtype: torch.dtype | None = None,
            decode_rows: bool = False) -> dict[str, float]:  # fmt: skip
    """Teacher-forced comparison of two loaded models (LlamaForCausalLM) on one token sequence; the
    candidate's K/V go through a cache of `kv_cache_dtype` (None: the model dtype), read as one
    prompt or (`decode_rows`) as a decode row per token, through the attention an engine runs
    (on the CPU, the C++ prefill or decode kernel); the reference's through the exact one."""
    ref_logits = reference.compute_logits(reference._forward_prompt(token_ids)).float()
    hidden = candidate._forward_prompt(token_ids, kv_cache_dtype, decode_rows=decode_rows, engine_kernels=True)
    got_logits = candidate.compute_logits(hidden).float()
    # KL in float64: two near-equal distributions' KL is a sum of tiny terms of both signs, which
    # fp32 rounded to -0.0000; each position's KL is then clamped at 0, as the true one is. By
    # chunks of positions, so the float64 copies of [T, vocab] never exist whole (GBs for a long
    # text and a 150k vocabulary).
    targets = token_ids[1:] + [-1]  # the last position predicts nothing in the text
    kl, agree, ref_lp, got_lp = [], [], [], []
    for ref_c, got_c, tgt in zip(ref_logits.split(256), got_logits.split(256), torch.tensor(targets).split(256)):
        ref, got = ref_c.double().log_softmax(-1), got_c.double().log_softmax(-1)
        kl.append((ref.exp() * (ref - got)).sum(-1).clamp_min(0.0))
        agree.append(ref.argmax(-1) == got.argmax(-1))
        rows = (tgt >= 0).nonzero().squeeze(1).to(ref.device)
        picked = tgt.to(ref.device)[rows, None]
        ref_lp.append(ref[rows].gather(1, picked).squeeze(1))
        got_lp.append(got[rows].gather(1, picked).squeeze(1))
    return {
        "tokens": len(token_ids),
        "kl_mean": torch.cat(kl).mean().item(),
        "top1_agreement": torch.cat(agree).float().mean().item(),
        "ppl_reference": math.exp(-torch.cat(ref_lp).mean().item()),
        "ppl_candidate": math.exp(-torch.cat(got_lp).mean().item()),
    }


def main(args: argparse.Namespace) -> int:
    eargs = EngineArgs.from_cli_args(args)
    eargs.model = args.model
    kv_format = eargs.kv_cache_dtype if eargs.kv_cache_dtype in KV_FORMAT_DTYPES else None
    if eargs.quantization in (None, "none") and kv_format is None:
        raise ValueError(
            "give the quantization to measure, e.g. --quantization int8 or gguf, or --kv-cache-dtype int8 or fp8"
        )
    if args.max_tokens < 2:
        raise ValueError(f"--max-tokens must be >= 2, got {args.max_tokens}")
    text = DEFAULT_TEXT
    if args.text_file:
        with open(args.text_file, encoding="utf-8") as f:
            text = f.read()
    loaded = load_model(replace(eargs, quantization="none"))
    reference, tokenizer = loaded.model, loaded.tokenizer
    if tokenizer is None:
        raise ValueError("the model has no tokenizer to encode the text with")
    ids = tokenizer.encode(text)[: args.max_tokens]
    if len(ids) < 2:
        raise ValueError("the text is shorter than two tokens")
    kv_dtype = KV_FORMAT_DTYPES[kv_format] if kv_format else None
    if eargs.quantization in (None, "none"):
        candidate = reference  # the KV cache alone
    else:
        candidate = load_model(eargs).model
        if candidate.quantization is None:
            raise ValueError(
                f"--quantization {eargs.quantization}: this checkpoint runs unquantized; nothing to compare"
            )
    label = " + ".join(x for x in (candidate.quantization, kv_format and f"{kv_format} KV cache") if x)
    if args.decode_rows:
        label += ", decode rows"
    results = []

    def measured(name: str) -> dict:
        return {"quantization": name, **compare(reference, candidate, ids, kv_dtype, args.decode_rows)}

    if candidate.quantization == "gguf":
        # The exact path dequantizes into an fp32 GEMM (K-quant prompt rows take it); the int8 dots
        # quantize activations per 32 values (decode rows, and every row of Q4_0/Q4_1/Q8_0).
        with exact_prompt_rows():
            results.append(measured(f"{label} (exact GEMM)"))
        with int8_dots_at_any_batch():
            results.append(measured(f"{label} (int8 dots)"))
    else:
        results.append(measured(label))
    for result in results:
        print(
            f"{result['quantization']} vs unquantized over {result['tokens']} tokens: "
            f"KL {result['kl_mean']:.4f}, top-1 agreement {result['top1_agreement']:.3f}, "
            f"perplexity {result['ppl_reference']:.2f} -> {result['ppl_candidate']:.2f} "
            f"({result['ppl_candidate'] / result['ppl_reference'] - 1:+.1%})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if len(results) > 1 else results[0], f, indent=2)
    return 0
