"""The fused-MoE GEMMs' tiles on CUDA (ferry/kernels/triton_moe.py): for DeepSeek-V2-Lite's and
Qwen3-30B-A3B's expert shapes at decode and prompt-sized token counts, `fused_experts` with its
default tiles against the best of a sweep over BLOCK_M, BLOCK_N, BLOCK_K, warps and stages (both
GEMMs share one BLOCK_M, the alignment's; each GEMM its own other tiles), and the bytes and FLOPs
floors. CUDA-graph timings (triton.testing.do_bench_cudagraph) of the whole layer (alignment, both
GEMMs, SiLU-and-mul, the weighted sum). Needs a GPU. From the repo root:
    python3 scripts/moe_gemm_sweep.py [--peak-bandwidth 3.35e12] [--peak-flops 9.89e14] [--tokens 1 64 2048 ...]"""

from __future__ import annotations

import argparse
import functools
import itertools
import statistics

import torch
import triton
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench_cudagraph

from ferry.kernels import triton_moe as tm
from ferry.layers.moe import select_experts

# (experts, hidden, expert intermediate, top-k) of the routed experts
SHAPES = {"deepseek-v2-lite": (64, 2048, 1408, 6), "qwen3-30b-a3b": (128, 2048, 768, 8)}


ROUTINGS = 4


def _layers(batches, w13, w2, block_m=None, tiles=None) -> None:
    """fused_experts over each (x, weights, ids) of `batches` in turn."""
    for x, weights, ids in batches:
        tm.fused_experts(x, w13, w2, weights, ids, block_m, tiles)


def _tiles(block_n: int, block_k: int, warps: int, stages: int) -> dict[str, int]:
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}


def _name(block_m: int, t13: dict, t2: dict) -> str:
    def one(t: dict) -> str:
        if not t:
            return "default"
        return f"N{t['BLOCK_N']} K{t['BLOCK_K']} w{t['num_warps']} s{t['num_stages']}"

    return f"M{block_m} | {one(t13)} | {one(t2)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peak-bandwidth", type=float, default=3.35e12, help="bytes/s (default: an H100 SXM's)")
    p.add_argument("--peak-flops", type=float, default=9.89e14, help="bf16 FLOP/s (default: an H100 SXM's, dense)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2048])
    args = p.parse_args()
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    # 8 tilings a GEMM, 2 BLOCK_Ms a token count: ~64 compiles (shared by the shapes), ~1.2 s each
    grid = [(n, kk, w, s) for n, kk in itertools.product([64, 128], [64, 128]) for w, s in ((4, 3), (8, 4))]
    for name, (E, H, inter, k) in SHAPES.items():
        w13 = torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * 0.02
        w2 = torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * 0.02
        for T in args.tokens:
            # Each timing runs ROUTINGS batches routed apart, so that a decode step's few experts (75-104 MB)
            # are not the same ones, left in the 50 MB L2, run after run.
            batches = []
            for _ in range(ROUTINGS):
                x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
                batches.append((x, *select_experts(torch.randn(T, E, device="cuda"), k, renormalize=True)))
            touched = statistics.fmean(ids.unique().numel() for _, _, ids in batches)
            floor_bytes = touched * 3 * H * inter * 2 / args.peak_bandwidth * 1e6
            floor_flops = T * k * 3 * H * inter * 2 / args.peak_flops * 1e6
            x, weights, ids = batches[0]
            reference = tm.fused_experts(x, w13, w2, weights, ids)
            default_m = tm.block_m_for(T * k, E)
            layer = functools.partial(_layers, batches, w13, w2)  # (block_m, tiles) to come
            t_default = do_bench_cudagraph(layer) * 1e3 / ROUTINGS
            timings = []
            for block_m in (16, 32) if T * k <= 4 * E else (64, 128):  # decode sizes: big tiles only pad
                # each GEMM's tiles swept with the other's at its default, then the best pair together
                best = []
                for which in (0, 1):
                    scores = []
                    for n, kk, w, s in grid:
                        t = _tiles(n, kk, w, s)
                        pair = (t, None) if which == 0 else (None, t)
                        try:  # raised by the warm-up call, before the graph's capture
                            ms = do_bench_cudagraph(functools.partial(layer, block_m, pair), rep=20)
                        except OutOfResources as e:  # too much shared memory: not a candidate
                            print(f"  skipped {_name(block_m, *(u or {} for u in pair))}: {e}", flush=True)
                            continue
                        scores.append((ms, t))
                    if not scores:
                        raise RuntimeError(f"no tiling of GEMM {which} ran at BLOCK_M {block_m}")
                    best.append(min(scores, key=lambda st: st[0])[1])
                pair = (best[0], best[1])
                y = tm.fused_experts(x, w13, w2, weights, ids, block_m, pair)
                err = ((y.float() - reference.float()).norm() / reference.float().norm()).item()
                ms = do_bench_cudagraph(functools.partial(layer, block_m, pair)) / ROUTINGS
                timings.append((ms * 1e3, block_m, pair, err))
            timings.sort(key=lambda t: t[0])
            us, block_m, (t13, t2), err = timings[0]
            print(f"{name:17s} T={T:5d} ({touched:5.1f} experts): floor {max(floor_bytes, floor_flops):7.1f} us "
                  f"(bytes {floor_bytes:.1f}, FLOPs {floor_flops:.1f}); default (M{default_m}) {t_default:8.1f} us; "
                  f"best {us:8.1f} us = {t_default / us:.2f}x: {_name(block_m, t13, t2)}; rel. error {err:.1e}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
