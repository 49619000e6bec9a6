"""GGUF matmuls on the CPU, by type and row count: ferry's int8-dot kernel (cpu_kernels().gguf_linear,
activations quantized per 32 values; Q4_0/Q4_1 interleaved by 8 rows as the loader leaves them) against
the exact path (gguf_dequantize, then torch's fp32 GEMM), in GFLOP/s (2 M N K per matmul) and us, best
of --repeats. What `INT8_PROMPT_TYPES` and `GEMM_MIN_ROWS` in ferry/layers/gguf_linear.py rest on.
Shapes: SmolLM2-135M's projections for the 32-value types; K-quant rows need K a multiple of 256, so
they take a 3072 x 768 weight (and SmolLM2's gate_up shape is not one). Weights are hot in cache; a
decode step reads them from memory (`ferry bench latency` measures that). From the repo root:
    python3 scripts/gguf_cpu_sweep.py [--rows 1 16 64 512] [--threads 2] [--shapes head] [--plain-rows]
    FERRY_CPU_ISA=avx2 python3 scripts/gguf_cpu_sweep.py   # the AVX2 build of the same kernels
    python3 scripts/gguf_cpu_sweep.py --against HEAD~1 --rounds 5 --rows 16 300   # int8 dots, REV vs this tree
    python3 scripts/gguf_cpu_sweep.py --against HEAD~1 --model-pass 30 --types Q4_1 --rows 1 16 64 300 --rounds 20
--against REV builds REV's gguf_quant_cpu.cpp alone and times its gguf_linear and this tree's alternately,
best of --repeats in each of --rounds rounds (the median of the rounds is printed): the VM's speed drifts by
10-40% between runs, so an old/new comparison must share the minute."""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from kernels_at_revision import kernel_at

from ferry.kernels.cpu import cpu_flags, cpu_kernels
from ferry.layers.gguf_linear import GGUF_QUANT_TYPES, GGUFWeight

SMOLLM2 = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}
K_QUANT_SHAPE = {"3072x768": (3072, 768)}


def random_weight(type_name: str, n: int, k: int, rng: np.random.Generator, plain: bool = False) -> GGUFWeight:
    """gguf-py quantizes the 32-value types; it cannot quantize K-quants, whose blocks are random bytes
    with small positive fp16 super-scales (what the kernel reads is the same either way). `plain`: the
    32-value types' rows as the file stores them, not interleaved by 8 as the loader leaves them."""
    if not type_name.endswith("_K"):
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[type_name])
        w = GGUFWeight.from_numpy(raw, type_name, (n, k))
        return w if plain else w.interleave()
    _, _, block_bytes = GGUF_QUANT_TYPES[type_name]
    blocks = n * k // 256
    raw = rng.integers(0, 256, size=(blocks, block_bytes), dtype=np.uint8)
    scale = np.full(blocks, 0.01, np.float16).view(np.uint8).reshape(blocks, 2)
    if type_name == "Q6_K":
        raw[:, 208:210] = scale
    else:
        raw[:, 0:2], raw[:, 2:4] = scale, scale
    return GGUFWeight.from_numpy(raw.reshape(n, -1), type_name, (n, k))


BINDING = """#include <torch/extension.h>
torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor w, int64_t qtype, c10::optional<torch::Tensor> bias);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gguf_linear", &gguf_linear); }
"""


def gguf_kernel_at(rev: str):
    """gguf_linear of commit `rev`: gguf_quant_cpu.cpp, and from the split on gguf_prompt_cpu.cpp."""
    return kernel_at(rev, lambda f: f.startswith("gguf_"), lambda texts: BINDING, "gguf")


def cases(args, rng):
    """(type, shape name, weight [n, k], activations [rows, k], n) for every type, shape and row count
    asked for, drawn from rng in one order whatever the caller times."""
    for type_name in args.types:
        shapes = K_QUANT_SHAPE if type_name.endswith("_K") else {s: SMOLLM2[s] for s in args.shapes}
        for shape_name, (n, k) in shapes.items():
            w = random_weight(type_name, n, k, rng, args.plain_rows)
            for rows in args.rows:
                yield type_name, shape_name, w, torch.randn(rows, k), n


def against(args, kernels, rng) -> None:
    """This tree's gguf_linear and REV's, alternately, on the same weights and activations."""
    old = gguf_kernel_at(args.against)
    print(f"| type | shape | rows | {args.against} us | this tree us | speed-up |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for type_name, shape_name, w, x, _ in cases(args, rng):
        times = {"old": [], "new": []}
        for _ in range(args.rounds):
            for tag, mod in (("old", old), ("new", kernels)):
                times[tag].append(best_of(lambda: mod.gguf_linear(x, w.data, w.qtype, None), args.repeats))  # noqa: B023
        o, n_ = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"| {type_name} | {shape_name} | {len(x)} | {o * 1e6:.0f} | {n_ * 1e6:.0f} | {o / n_:.2f}x |")


def against_model_pass(args, kernels, rng) -> None:
    """This tree's gguf_linear and REV's, alternately, over a whole model's worth of distinct weights
    (--model-pass LAYERS of SmolLM2's four projections in --types[0], then the tied head in Q8_0 as
    the bundled file has it): ~100 MB for 30 layers, more than any cache, so the weights stream from
    memory as in a decode step, where hot-cache timings of one weight miss prefetch and layout
    effects (a branch added to gguf_dot_rows cost its 1-row pass 25% here and nothing hot)."""
    old = gguf_kernel_at(args.against)
    layers = [[random_weight(args.types[0], n, k, rng) for n, k in SMOLLM2.values() if n != 49152]
              for _ in range(args.model_pass)]  # fmt: skip
    weights = [w for layer in layers for w in layer] + [random_weight("Q8_0", *SMOLLM2["head"], rng)]
    print(f"| rows | {args.against} ms | this tree ms | speed-up |  ({args.model_pass} layers of {args.types[0]}"
          f" + a Q8_0 head, {sum(w.data.numel() for w in weights) / 1e6:.0f} MB)")  # fmt: skip
    print("| ---: | ---: | ---: | ---: |")
    for rows in args.rows:
        x = {k: torch.randn(rows, k) for k in {w.in_features for w in weights}}
        times = {"old": [], "new": []}
        for r in range(args.rounds):
            order = (("old", old), ("new", kernels)) if r % 2 else (("new", kernels), ("old", old))
            for tag, mod in order:
                times[tag].append(best_of(lambda: [mod.gguf_linear(x[w.in_features], w.data, w.qtype, None)  # noqa: B023
                                                   for w in weights], args.repeats))  # fmt: skip
        o, n_ = statistics.median(times["old"]), statistics.median(times["new"])
        print(f"| {rows} | {o * 1e3:.2f} | {n_ * 1e3:.2f} | {o / n_:.2f}x |")


def best_of(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512])
    parser.add_argument("--types", nargs="+", default=list(GGUF_QUANT_TYPES))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=["qkv", "o", "gate_up", "down"],
        choices=list(SMOLLM2),
        help="SmolLM2 shapes for the 32-value types (head: the tied 49152 x 576 output head)",
    )
    parser.add_argument("--plain-rows", action="store_true", help="Q4_0/Q4_1/Q8_0 rows not interleaved by 8")
    parser.add_argument("--against", metavar="REV", help="time REV's gguf_linear beside this tree's, alternately")
    parser.add_argument("--rounds", type=int, default=5, help="with --against: alternations per case")
    parser.add_argument(
        "--model-pass", type=int, metavar="LAYERS", help="with --against: all of LAYERS layers' weights, from memory"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("no C++ compiler: ferry's CPU kernels are not built")
    isa = "avx512_vnni" if "avx512_vnni" in cpu_flags() else "avx2"
    print(f"threads {args.threads}, CPU flags include {isa} (FERRY_CPU_ISA picks the build)")
    if args.against:
        (against_model_pass if args.model_pass else against)(args, kernels, np.random.default_rng(0))
        return
    print("| type | shape | rows | int8 dots us | GFLOP/s | dequantize + GEMM us | GFLOP/s | int8 / GEMM |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for type_name, shape_name, w, x, n in cases(args, np.random.default_rng(0)):
        (rows, k), flops = x.shape, 2 * x.shape[0] * n * x.shape[1]
        int8 = best_of(lambda: kernels.gguf_linear(x, w.data, w.qtype, None), args.repeats)  # noqa: B023
        gemm = best_of(lambda: x @ kernels.gguf_dequantize(w.data, w.qtype, k).t(), args.repeats)  # noqa: B023
        print(f"| {type_name} | {shape_name} | {rows} | {int8 * 1e6:.0f} | {flops / int8 / 1e9:.0f} "
              f"| {gemm * 1e6:.0f} | {flops / gemm / 1e9:.0f} | {gemm / int8:.2f}x |")  # fmt: skip


if __name__ == "__main__":
    main()
