"""Q4_0 GEMV at batch 1 on CUDA: ferry's GEMV kernels (ferry/kernels/triton_gguf.py, what one row of x
takes: floats, the default; integer dots; the word GEMV) with their default tiles and the best of a tile
sweep of each, and the tile (mma) kernel that batch 1 took before them, against cuBLAS on a bf16 weight of the same
shape and the bytes floor (the Q4_0 bytes over the datasheet bandwidth). Llama-3.1-8B's four projection
shapes; every timing cycles through copies of the weight too large for L2 together, as a model's
layers do. Then the K-quant kernels (Q4_K, Q5_K, Q6_K) with their default tiles at batch 1 and 4 rows,
against the same floor of their own bytes. CUDA-graph timings (triton.testing.do_bench_cudagraph); needs
a GPU, except --compile-only (each tiling's kernel compiled for an architecture, its resources printed).
From the repo root:
    python3 scripts/gguf_gemv_sweep.py [--peak-bandwidth 3.35e12]
    python3 scripts/gguf_gemv_sweep.py --compile-only 90"""

from __future__ import annotations

import argparse
import itertools

import torch
import triton
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench_cudagraph

from ferry.kernels import triton_gguf as tg

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# An H100's L2 holds 50 MB: a weight timed alone stays there between runs (the first leases' sweeps timed
# qkv, o and down so), which a model's layers never see, each reading its own weight from HBM. Every
# timing here cycles through distinct copies of the weight, at least this many bytes of them.
ROTATE_BYTES = 256 << 20


# The tilings timed per shape: (kernel, rows, blocks, warps, stages, K splits, preload). Floats: the
# fifth lease's sweep (2026-11-27, 99 tilings of rows and blocks a step, warps, K splits and PRELOAD,
# each weight read from HBM) found the best within 3% of one another at 29-45% of peak, 8 rows x 32-64
# blocks with 4-8 warps first; its leaders are kept here to time the word GEMV against in the same run.
TILINGS = (
    [
        ("fp", bn, blocks, warps, 1, split, preload)
        for (bn, blocks), warps, split, preload in itertools.product(
            [(8, 32), (8, 64), (16, 16)],
            [4, 8],
            [1, 4],
            [False, True],
        )
    ]
    + [("fp", 16, 8, 8, 3, 1, False)]  # the default until 2026-11-27's fifth lease (now N8 b64 w4 s1, above)
    + [("int8", 32, 16, 4, 3, split, False) for split in (1, 4)]  # the integer dots at their best tiles of 2026-11-27
    # The word GEMV (~4 instructions a value in its sm_90 SASS against the float kernel's ~8): a thread
    # takes BLOCK_N rows of one block, a warp 32 blocks; never timed before the sixth lease.
    + [
        ("words", bn, 32 * warps, warps, 1, split, False)
        for bn, warps, split in itertools.product([4, 8, 16], [1, 2, 4, 8], [1, 2, 4])
    ]
)


def copies(make, nbytes: int) -> list[torch.Tensor]:
    """make() called often enough for ROTATE_BYTES of weights of `nbytes` each (at least 2)."""
    return [make() for _ in range(max(2, -(-ROTATE_BYTES // nbytes)))]


def per_weight_us(fn, weights: list[torch.Tensor], rep: int = 100) -> float:
    """Microseconds per fn(w), timed in one CUDA graph over every weight in turn, as a model's layers run."""

    def each() -> None:
        for w in weights:
            fn(w)

    return do_bench_cudagraph(each, rep=rep) * 1e3 / len(weights)


def random_q4_0(n: int, k: int) -> torch.Tensor:
    """A weight in ferry's kernel layout: each row's K/2 quant bytes, then its K/32 fp16 scales."""
    quants = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
    scales = (torch.rand(n, k // 32, device="cuda") * 0.01 + 0.001).half().view(torch.uint8)
    return torch.cat([quants, scales], 1).contiguous()


def random_k_quant(qtype: int, n: int, k: int) -> torch.Tensor:
    """Random super-blocks as ggml stores them, with small positive fp16 super-scales (d, and dmin)."""
    block_bytes = tg.K_QUANTS[qtype]
    raw = torch.randint(0, 256, (n * k // 256, block_bytes), dtype=torch.uint8, device="cuda")
    d = torch.full((raw.shape[0], 1), 0.01, dtype=torch.float16, device="cuda").view(torch.uint8)
    if qtype == tg.Q6_K:
        raw[:, 208:210] = d
    else:
        raw[:, 0:2], raw[:, 2:4] = d, (d.view(torch.float16) * 0.4).view(torch.uint8)
    return raw.view(n, -1).contiguous()


def k_quant_timings(peak_bandwidth: float) -> None:
    print(f"{'type':5s} {'shape':8s} {'floor us':>8s} {'gemv us':>8s} {'4 rows us':>9s}  rel. errors (1 row, 4 rows)")
    for qtype, name in ((tg.Q4_K, "Q4_K"), (tg.Q5_K, "Q5_K"), (tg.Q6_K, "Q6_K")):
        for shape, (n, k) in SHAPES.items():
            datas = copies(lambda: random_k_quant(qtype, n, k), n * k // 256 * tg.K_QUANTS[qtype])  # noqa: B023
            data = datas[0]
            floor = data.numel() / peak_bandwidth * 1e6
            ref_w = tg.dequantize(data, qtype, k, torch.float32)
            times, errors = [], []
            for rows in (1, 4):
                x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                times.append(per_weight_us(lambda d: tg.gguf_matmul(x, d, qtype, k), datas))  # noqa: B023
                y = tg.gguf_matmul(x, data, qtype, k)
                ref = x.float() @ ref_w.T
                errors.append(((y.float() - ref).norm() / ref.norm()).item())
            words = ""
            if qtype == tg.Q4_K:  # the word GEMV (opt-in), at batch 1
                x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
                cfg = tg.gemv_config(n, k, qtype, tg.num_sms(x.device), words=True)
                run, y = launcher(tg.launch_gemv, x, n, cfg, qtype)
                t_words = per_weight_us(run, datas)
                run(data)
                ref = x.float() @ ref_w.T
                error = ((y.float() - ref).norm() / ref.norm()).item()
                words = f"; words {t_words:.1f} us ({floor / t_words:.0%}), {error:.1e}"
            print(f"{name:5s} {shape:8s} {floor:8.1f} {times[0]:8.1f} {times[1]:9.1f}  {errors[0]:.1e} {errors[1]:.1e}"
                  f"  ({floor / times[0]:.0%} of peak at batch 1{words})", flush=True)  # fmt: skip


def _config(nb: int, kernel: str, bn: int, blocks: int, warps: int, stages: int, split: int, preload: bool) -> dict:
    """launch_gemv's config for one of TILINGS over `nb` quant blocks a row (gemv_config's keys)."""
    per_split = triton.cdiv(triton.cdiv(nb, blocks), split) * blocks
    return {"BLOCK_N": bn, "BLOCKS": blocks, "split": triton.cdiv(nb, per_split), "blocks_per_split": per_split,
            "num_warps": warps, "num_stages": stages, "INT8_DOTS": kernel == "int8", "WORDS": kernel == "words",
            "PRELOAD": preload}  # fmt: skip


def _kernel(cfg: dict) -> str:
    return "int8" if cfg.get("INT8_DOTS") else "words" if cfg.get("WORDS") else "fp"


def _tiles(cfg: dict) -> str:
    kind = "fp+preload" if cfg.get("PRELOAD") else _kernel(cfg)
    return f"{kind} N{cfg['BLOCK_N']} b{cfg['BLOCKS']} w{cfg['num_warps']} s{cfg['num_stages']} split{cfg['split']}"


def launcher(launch, x: torch.Tensor, n: int, cfg: dict, qtype: int = tg.Q4_0):
    """fn(data): one launch (`tg.launch_gemv` / `tg.launch_tiles`) with the tiles of `cfg` into y, and y."""
    y = torch.empty(x.shape[0], n, dtype=x.dtype, device="cuda")
    return (lambda data: launch(x, data, qtype, cfg, y)), y


def compile_only(arch: int) -> None:
    """Each distinct kernel of TILINGS compiled for `arch` on this machine, GPU or not (ferry.tools.compile_check):
    registers and spills per thread, shared memory, the widest load, and how many programs an SM holds by
    registers, beside the Q4 bytes one loop step of a program reads and the SASS instructions its loop
    issues per weight value a thread takes (K = 14336: every tiling loops); then the same count for the
    K-quant GEMVs and for the decode tiles, plain and packed."""
    from ferry.tools.compile_check import REGISTERS_PER_SM, compiling_for, main_loop_instructions, report

    n, k = SHAPES["down"]  # the longest K (the kernel is the same for every shape)
    data = torch.empty(n, tg.block32_row_bytes(k, tg.Q4_0), dtype=torch.uint8)
    x, y = torch.empty(1, k, dtype=torch.bfloat16), torch.empty(1, n, dtype=torch.bfloat16)
    seen = set()
    with compiling_for(arch) as compiled:
        for kernel_kind, bn, blocks, warps, stages, _, preload in TILINGS:
            if (kernel_kind, bn, blocks, warps, stages, preload) in seen:
                continue  # K splits launch the same kernel
            seen.add((kernel_kind, bn, blocks, warps, stages, preload))
            cfg = _config(k // 32, kernel_kind, bn, blocks, warps, stages, 1, preload)
            tg.launch_gemv(x, data, tg.Q4_0, cfg, y)
            name, kernel = compiled[-1]
            r = report(name, "", kernel, arch)
            per_sm = REGISTERS_PER_SM // max(1, r.registers * 32 * warps)
            per_value = sum(main_loop_instructions(kernel.asm["cubin"]).values()) / (bn * blocks * 32 / (32 * warps))
            print(f"{_tiles(cfg)[:-7]:32s} registers {r.registers:3d}  spilled {r.local_bytes:4d} B"
                  f"  shared {r.shared_bytes:5d} B  widest load {r.widest_load:2d} B"
                  f"  programs/SM by registers {per_sm:2d}  Q4 bytes a loop step {bn * blocks * 16:5d}"
                  f"  loop instructions a value {per_value:4.1f}{'  ' + '; '.join(r.problems) if r.problems else ''}",
                  flush=True)  # fmt: skip
    # The K-quant GEMVs at their defaults (Q4_K's word twin too), and the decode tiles (16 rows of bf16 x)
    # plain and with packed nibbles: their loops' instructions a weight value.
    x = torch.empty(1, k, dtype=torch.bfloat16)
    with compiling_for(arch) as compiled:
        for qtype, name in ((tg.Q4_K, "Q4_K"), (tg.Q5_K, "Q5_K"), (tg.Q6_K, "Q6_K")):
            kdata = torch.empty(n, k // 256 * tg.K_QUANTS[qtype], dtype=torch.uint8)
            for words in (False, True) if qtype == tg.Q4_K else (False,):
                cfg = tg.gemv_config(n, k, qtype, 132, words=words)
                tg.launch_gemv(x, kdata, qtype, cfg, y)
                values = cfg["BLOCK_N"] * cfg.get("SB", 1) * 256 / (32 * cfg["num_warps"])
                per_value = sum(main_loop_instructions(compiled[-1][1].asm["cubin"]).values()) / values
                print(f"{name} gemv{' words' if words else ''}: loop instructions a value {per_value:4.1f}", flush=True)
        x16, y16 = torch.empty(16, k, dtype=torch.bfloat16), torch.empty(16, n, dtype=torch.bfloat16)
        for qtype, name in ((tg.Q4_0, "Q4_0"), (tg.Q4_1, "Q4_1")):
            qdata = torch.empty(n, tg.block32_row_bytes(k, qtype), dtype=torch.uint8)
            for packed in (False, True):
                cfg = tg.matmul_config(16, n, k, qtype, 132, packed=packed)
                tg.launch_tiles(x16, qdata, qtype, cfg, y16)
                values = cfg["BLOCK_N"] * cfg["BLOCK_K"] / (32 * cfg["num_warps"])
                per_value = sum(main_loop_instructions(compiled[-1][1].asm["cubin"]).values()) / values
                print(f"{name} decode tiles, 16 rows{' packed' if packed else ''}: loop instructions a value"
                      f" {per_value:4.1f}", flush=True)  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peak-bandwidth", type=float, default=3.35e12, help="bytes/s (default: an H100 SXM's datasheet)")
    p.add_argument("--compile-only", type=int, metavar="ARCH", help="no timings: compile the tilings for this "
                   "architecture (e.g. 90) and print their resources; needs no GPU")  # fmt: skip
    args = p.parse_args()
    if args.compile_only:
        compile_only(args.compile_only)
        return
    torch.manual_seed(0)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__)
    print(f"{'shape':8s} {'floor us':>8s} {'bf16 us':>8s} {'tiles us':>8s} {'default':>8s} {'int8 best':>9s}"
          f" {'fp best':>8s} {'words best':>10s}  best tiles of each; rel. errors: int8, fp, words")  # fmt: skip
    for name, (n, k) in SHAPES.items():
        datas = copies(lambda: random_q4_0(n, k), n * tg.block32_row_bytes(k, tg.Q4_0))  # noqa: B023
        data = datas[0]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        w_bf16 = copies(lambda: torch.randn(n, k, device="cuda", dtype=torch.bfloat16), n * k * 2)  # noqa: B023
        floor = data.numel() / args.peak_bandwidth * 1e6
        t_bf16 = per_weight_us(lambda w: torch.matmul(x, w.T), w_bf16)  # noqa: B023
        tiles_cfg = tg.matmul_config(1, n, k, tg.Q4_0, tg.num_sms(x.device))  # what batch 1 took before the GEMV
        t_tiles = per_weight_us(launcher(tg.launch_tiles, x, n, tiles_cfg)[0], datas)
        sms = tg.num_sms(x.device)
        default = tg.gemv_config(n, k, tg.Q4_0, sms, tg.GEMV_INT8_DOTS, tg.GEMV_WORDS)
        t_default = per_weight_us(launcher(tg.launch_gemv, x, n, default)[0], datas)
        ref = x.float() @ tg.dequantize(data, tg.Q4_0, k, torch.float32).T
        errors = []
        for int8_dots, words in ((True, False), (False, False), (False, True)):
            run, y = launcher(tg.launch_gemv, x, n, tg.gemv_config(n, k, tg.Q4_0, sms, int8_dots, words))
            run(data)
            errors.append(((y.float() - ref).norm() / ref.norm()).item())
        timings = []
        nb = k // 32
        for tiling in TILINGS:
            cfg = _config(nb, *tiling)
            if any(c == cfg for _, c in timings):  # a split this K cannot take: the same launch as a smaller one
                continue
            try:
                timings.append((per_weight_us(launcher(tg.launch_gemv, x, n, cfg)[0], datas, rep=20), cfg))
            except OutOfResources as e:  # a tiling too large for the SM: skipped, said
                print(f"{'':8s} {_tiles(cfg)}: {type(e).__name__}", flush=True)
        timings.sort(key=lambda t: t[0])
        # each kernel's best (None where every tiling of it ran out of resources)
        best = {kind: next((t for t in timings if _kernel(t[1]) == kind), (float("nan"), None))
                for kind in ("int8", "fp", "words")}  # fmt: skip
        print(
            f"{name:8s} {floor:8.1f} {t_bf16:8.1f} {t_tiles:8.1f} {t_default:8.1f} {best['int8'][0]:9.1f}"
            f" {best['fp'][0]:8.1f} {best['words'][0]:10.1f}  "
            + " | ".join(_tiles(c) if c else "-" for _, c in best.values())
            + "; "
            + " ".join(f"{e:.1e}" for e in errors)
            + f"  ({floor / timings[0][0]:.0%} of peak at best, {floor / t_default:.0%} by default)",
            flush=True,
        )
        ranked = [_tiles(c) for _, c in timings]
        print(f"{'':8s} runners-up: " + ", ".join(f"{_tiles(c)} {t:.1f}" for t, c in timings[1:4])
              + f"; the default ({_tiles(default)}) ranks {ranked.index(_tiles(default)) + 1} of {len(ranked)}"
              if _tiles(default) in ranked else "")  # fmt: skip
    k_quant_timings(args.peak_bandwidth)


if __name__ == "__main__":
    main()
