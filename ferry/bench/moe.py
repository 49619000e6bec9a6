"""`ferry bench moe`: a mixture of experts' decode time per token against a dense model with the same
active parameters, in one run.

Both models are built here with random weights (`--load-format dummy`): a Qwen3-MoE-shaped model
(`--experts` experts of `--moe-intermediate-size`, `--top-k` per token, every layer sparse) and its
dense twin, a Qwen3 model identical but for an MLP of top_k x moe_intermediate_size, i.e. the same
parameters per token. For each batch size B, B requests of `--input-len` random tokens are
prefilled (their prompt tok/s is printed too), then decode `--output-len` tokens together; TPOT is the
mean wall time of the steps in which all B decode (as `ferry bench latency` times them). A MoE step
reads only the experts its tokens chose: at B=1 that is top_k of them per layer; as B grows, nearly
all of them, so its bytes per step approach the total parameters while its FLOPs stay those of the
active ones. The bytes each step reads are printed beside the times (the experts touched are counted from the router's
choices in the timed steps). `--quantization gguf`: both models' projections and experts as random
Q4_0 blocks, run as stored by the CPU kernels (a quantized MoE GGUF's experts keep their blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile

import torch

from ferry.bench.hardware import device_name, measure_cpu_read_bandwidth
from ferry.bench.latency import _fmt_bytes, _requests, prefill_tok_per_s, run_batch
from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.layers.moe import FusedMoE
from ferry.models.config import ModelConfig
from ferry.models.dummy_weights import weight_shapes, write_config_dir


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hidden-size", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32], help="expert counts to measure, each in turn")
    p.add_argument("--top-k", type=int, nargs="+", default=[2, 4], help="experts per token, one per --experts value")
    p.add_argument("--moe-intermediate-size", type=int, nargs="+", default=[1536, 768],
                   help="each expert's intermediate size, one per --experts value")  # fmt: skip
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64], metavar="B")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None, choices=["gguf"],
                   help="gguf: every projection and expert as random Q4_0 blocks (the CPU kernels), "
                        "in both models")  # fmt: skip
    p.add_argument("--bench-seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the results to this file")


def _config(args: argparse.Namespace, experts: int, top_k: int, inter: int, dense: bool) -> dict:
    h = args.hidden_size
    d = {
        "architectures": ["Qwen3ForCausalLM" if dense else "Qwen3MoeForCausalLM"],
        "vocab_size": 32000,
        "hidden_size": h,
        "intermediate_size": top_k * inter,  # the dense twin's MLP: the MoE's active width
        "num_hidden_layers": args.layers,
        "num_attention_heads": h // 64,
        "num_key_value_heads": max(1, h // 256),
        "head_dim": 64,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if not dense:
        d.update(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter, norm_topk_prob=True)
    return d


def _count_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total, active per token) parameters, the embedding table excluded (a lookup reads one row)."""
    total = active = 0
    for name, shape in weight_shapes(cfg):
        if name == "model.embed_tokens.weight":
            continue
        n = 1
        for s in shape:
            n *= s
        total += n
        if ".mlp.experts." in name:
            n = n * cfg.num_experts_per_tok // cfg.num_experts  # an expert's share, times k chosen
        active += n
    return total, active


class _ExpertsTouched:
    """Counts, per MoE layer call, how many distinct experts the step's tokens chose (forward hooks)."""

    def __init__(self, model) -> None:
        self.counts: list[int] = []
        self.handles = [m.register_forward_pre_hook(self._hook) for m in model.modules() if isinstance(m, FusedMoE)]

    def _hook(self, module, inputs) -> None:
        self.counts.append(int(torch.unique(inputs[2]).numel()))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _measure(args, path: str) -> dict[int, dict]:
    """One engine over the dummy model at `path`: a row per batch size."""
    tokens = max(args.batch_sizes) * (args.input_len + args.output_len + 16)
    eargs = EngineArgs(model=path, load_format="dummy", device=args.device, dtype=args.dtype,
                       quantization=args.quantization, max_num_seqs=max(args.batch_sizes),
                       enable_prefix_caching=False, num_kv_blocks=tokens // 16 + 16)  # fmt: skip
    engine = LLMEngine(eargs)
    rows = {}
    try:
        cfg = engine.model_config
        total, active = _count_params(cfg)
        for batch in args.batch_sizes:
            rng = random.Random(args.bench_seed)
            run_batch(engine, _requests(rng, batch, args.input_len, cfg.vocab_size), 5, "warm")
            prompts = _requests(rng, batch, args.input_len, cfg.vocab_size)
            steps = run_batch(engine, prompts, args.output_len, "b")
            decode = [dt for r, dt in steps if r.num_prefill_tokens == 0 and r.num_decodes == batch]
            row = {"tpot_ms": statistics.fmean(decode) * 1e3, "decode_steps": len(decode), "params_total": total,
                   "params_active": active, "params_read_per_step": active,
                   "prefill_tok_per_s": prefill_tok_per_s(steps)}  # fmt: skip
            if cfg.moe_layers:
                # Counted on a second, untimed greedy run of the same prompts through the layer-by-layer
                # forward (the C++ decode step routes identically, but has no module hooks). Only the
                # decode steps' calls (prefill calls come first and see more tokens): the last ones.
                touched = _ExpertsTouched(engine.model)
                cpp_step, engine.model.cpu_decode_step = engine.model.cpu_decode_step, None
                try:
                    recount = run_batch(engine, prompts, args.output_len, "count")
                finally:
                    engine.model.cpu_decode_step = cpp_step
                    touched.close()
                decodes = sum(1 for r, _ in recount if r.num_prefill_tokens == 0 and r.num_decodes == batch)
                per_layer = touched.counts[-decodes * len(cfg.moe_layers) :]
                row["experts_touched_per_layer"] = statistics.fmean(per_layer)
                expert_params = 3 * cfg.hidden_size * cfg.moe_intermediate_size
                extra = row["experts_touched_per_layer"] - cfg.num_experts_per_tok
                row["params_read_per_step"] += len(cfg.moe_layers) * expert_params * extra
            rows[batch] = row
        return rows
    finally:
        engine.shutdown()


def main(args: argparse.Namespace) -> int:
    if not len(args.experts) == len(args.top_k) == len(args.moe_intermediate_size):
        raise ValueError("--experts, --top-k and --moe-intermediate-size take one value per shape, in order")
    elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    if args.quantization == "gguf":
        elem = 18 / 32  # Q4_0: 18 bytes a block of 32 weights
    device = torch.device(args.device)
    quant = ", Q4_0 projections and experts" if args.quantization == "gguf" else ""
    print(f"{device_name(device)}; hidden {args.hidden_size}, {args.layers} layers, {args.dtype}{quant}; prompt "
          f"{args.input_len}, output {args.output_len} tokens; timings of one run, compared within it")  # fmt: skip
    if device.type == "cpu":
        print(f"memory read bandwidth (tensor.sum over 256 MB): {measure_cpu_read_bandwidth() / 1e9:.1f} GB/s")
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for experts, top_k, inter in zip(args.experts, args.top_k, args.moe_intermediate_size):
            paths = {
                kind: write_config_dir(os.path.join(tmp, f"{kind}-{experts}x{inter}-top{top_k}"),
                                       _config(args, experts, top_k, inter, dense=kind == "dense"))
                for kind in ("moe", "dense")
            }  # fmt: skip
            measured = {kind: _measure(args, path) for kind, path in paths.items()}
            for batch in args.batch_sizes:
                moe, dense = measured["moe"][batch], measured["dense"][batch]
                ratio = moe["tpot_ms"] / dense["tpot_ms"]
                results.append({"experts": experts, "top_k": top_k, "moe_intermediate_size": inter, "batch_size": batch,
                                "moe": moe, "dense": dense, "tpot_ratio": ratio})  # fmt: skip
                print(
                    f"{experts:3d} experts top-{top_k} (x{inter}) B={batch:3d}: MoE TPOT {moe['tpot_ms']:8.2f} ms "
                    f"({moe['params_total'] / 1e6:.0f}M params, {moe['params_active'] / 1e6:.0f}M active; "
                    f"{moe['experts_touched_per_layer']:.1f} experts/layer touched, reads "
                    f"{_fmt_bytes(moe['params_read_per_step'] * elem)}/step) vs dense twin {dense['tpot_ms']:8.2f} ms "
                    f"({dense['params_total'] / 1e6:.0f}M, reads {_fmt_bytes(dense['params_read_per_step'] * elem)})"
                    f": {ratio:.2f}x; prefill {moe['prefill_tok_per_s']:.0f} vs {dense['prefill_tok_per_s']:.0f}"
                    " prompt tok/s"
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
