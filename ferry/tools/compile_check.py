"""Compile the engine's Triton kernels for a GPU architecture on a machine without one.

The interpreter (TRITON_INTERPRET=1) runs the kernels' arithmetic on the CPU but not
Triton's GPU compiler, so it misses what only compilation shows: layouts the backend
rejects, shared memory beyond the chip's limit, registers spilled to local memory, and
whether tensor cores (mma / wgmma) are used. This module compiles every kernel the engine
launches for a model, with the shapes and constants the engine would use, down to a cubin
(Triton ships ptxas), then reads each kernel's resources with Triton's cuobjdump.

How: Triton asks its active driver for the target; a stand-in driver answers with the
chosen architecture, and launches become warm-ups (compile, never run) for the duration.
The wrappers in ferry.kernels (triton_attention, triton_fused, triton_moe, triton_gguf, triton_int8)
are called as the engine calls them, on CPU tensors of the right dtypes and shapes, so the compiled
specialisations are the ones a GPU run would build.

    python -m ferry.tools.compile_check --model llama-3.1-8b --dtype bfloat16 [--arch 90]

Exit status 1 when a kernel fails to compile or exceeds the architecture's limits.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch

# Per-block limits of the architectures we target (CUDA programming guide, compute capability tables).
MAX_SHARED_BYTES = {80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
REGISTERS_PER_SM = 64 * 1024
H100_SMS = 132


@dataclass
class KernelReport:
    kernel: str
    case: str  # which engine launch this is (e.g. "decode splits=4")
    num_warps: int
    num_stages: int
    registers: int  # per thread
    shared_bytes: int  # dynamic shared memory Triton asks for at launch
    local_bytes: int  # per-thread local memory: register spills (our kernels keep no local arrays)
    tensor_cores: str  # "wgmma", "mma" or "-"
    widest_load: int  # bytes of the widest global load in the PTX: 16 means 128-bit vector loads
    problems: list[str]


class _TargetDriver:
    """Stands in for Triton's CUDA driver: reports a target, owns no device."""

    def __init__(self, arch: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("cpu")


@contextlib.contextmanager
def compiling_for(arch: int) -> Iterator[list]:
    """Within this context kernel launches compile for `arch` and return without running;
    yields the list that collects (kernel name, CompiledKernel) per launch."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("unset TRITON_INTERPRET: the interpreter replaces Triton's compiler")
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    compiled: list = []
    original_run = JITFunction.run

    def warmup_run(self, *args, grid, warmup, **kwargs):
        kernel = original_run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    previous = driver._active  # None until a real driver was looked up (none exists without a GPU)
    driver.set_active(_TargetDriver(arch))
    JITFunction.run = warmup_run
    try:
        yield compiled
    finally:
        JITFunction.run = original_run
        driver._active = previous


def _cuobjdump() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def _resource_usage(cubin: bytes) -> dict[str, int]:
    """REG / SHARED / LOCAL ... of the kernel in a cubin, as cuobjdump -res-usage prints them."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    usage: dict[str, int] = {}
    for line in out.splitlines():
        if "REG:" in line:
            for field in line.split():
                name, _, value = field.partition(":")
                if value.isdigit():
                    usage[name] = int(value)
    return usage


def main_loop_instructions(cubin: bytes) -> collections.Counter:
    """SASS opcodes in the kernel's longest loop (the body between a label and the furthest branch back to
    it; nvdisasm, shipped with Triton), counted; the whole kernel's if it has no loop. What a value costs
    in issue slots, read without a GPU."""
    nvdisasm = os.path.join(os.path.dirname(_cuobjdump()), "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        lines = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout.splitlines()
    labels = {line.strip().rstrip(":"): i for i, line in enumerate(lines) if re.match(r"^\.L\w+:$", line.strip())}
    loop = None
    for i, line in enumerate(lines):
        target = re.search(r"BRA `?\(?(\.L\w+)", line)
        start = labels.get(target.group(1), i) if target else i
        if start < i and (loop is None or i - start > loop[1] - loop[0]):
            loop = (start, i)
    first, last = loop or (0, len(lines) - 1)
    ops: collections.Counter = collections.Counter()
    for line in lines[first : last + 1]:
        op = re.match(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if op:
            ops[op.group(1)] += 1
    return ops


def widest_global_load(ptx: str) -> int:
    """Bytes one thread moves in the widest global load of the PTX (ld.global.v4.b32, or an asynchronous
    copy to shared memory `cp.async... 16`): a bandwidth-bound kernel wants 16, coalesced across the warp."""
    widest = 0
    for line in ptx.splitlines():
        op, _, operands = line.strip().lstrip("@!%p0123456789 ").partition(" ")
        if op.startswith("cp.async.") and ".shared.global" in op:
            fields = operands.replace(";", "").split(",")  # [dst], [src], bytes (0x10), optional src-size
            with contextlib.suppress(IndexError, ValueError):
                widest = max(widest, int(fields[2].strip(), 0))
            continue
        if not op.startswith("ld.global"):
            continue
        parts = op.split(".")
        lanes = next((int(q[1:]) for q in parts if q in ("v2", "v4", "v8")), 1)
        bits = next((int(q[1:]) for q in reversed(parts) if q[:1] in "bsuf" and q[1:].isdigit()), 0)
        widest = max(widest, lanes * bits // 8)
    return widest


def report(kernel_name: str, case: str, kernel, arch: int) -> KernelReport:
    usage = _resource_usage(kernel.asm["cubin"])
    ptx = kernel.asm["ptx"]
    md = kernel.metadata
    regs = usage.get("REG", 0)
    problems = []
    limit = MAX_SHARED_BYTES.get(arch)
    if limit is not None and md.shared > limit:
        problems.append(f"shared memory {md.shared} B > {limit} B per block")
    if regs * 32 * md.num_warps > REGISTERS_PER_SM:
        problems.append(f"{regs} registers x {32 * md.num_warps} threads > {REGISTERS_PER_SM}")
    if usage.get("LOCAL", 0):
        problems.append(f"{usage['LOCAL']} B of local memory per thread (register spills)")
    cores = "wgmma" if "wgmma" in ptx else "mma" if "mma.sync" in ptx else "-"
    return KernelReport(kernel_name, case, md.num_warps, md.num_stages, regs, md.shared, usage.get("LOCAL", 0), cores,
                        widest_global_load(ptx), problems)  # fmt: skip


def _graph_split_counts(num_kv_heads: int, max_num_seqs: int, num_sms: int) -> list[int]:
    from ferry.kernels.triton_attention import decode_num_splits
    from ferry.worker.cuda_graphs import graph_batch_sizes

    sizes = set(graph_batch_sizes(max_num_seqs)) | set(range(1, max_num_seqs + 1))
    return sorted({decode_num_splits(b, num_kv_heads, num_sms) for b in sizes})


def engine_kernels(
    model: str,
    dtype: str = "bfloat16",
    arch: int = 90,
    tensor_parallel_size: int = 1,
    block_size: int = 16,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    num_sms: int = H100_SMS,
    kv_cache_dtype: str = "auto",
    quantization: str | None = None,
) -> list[KernelReport]:
    """Compile every kernel launch the engine makes for `model` (a shipped config name or a
    directory with config.json) and report its resources on `arch`; `kv_cache_dtype` as the
    engine's flag (int8 / fp8: the quantized cache's kernel variants); `quantization="gguf"` adds
    the GGUF dequantize-matmuls (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) at batch 1, a decode and a
    prefill shape, "int8" the W8A8 activation quantizer and int8 GEMM at the decode and prefill ones."""
    from ferry.kernels import triton_attention as attn
    from ferry.kernels import triton_fused as fused
    from ferry.kv_quant import KV_FORMAT_DTYPES, row_width
    from ferry.models.loader import read_hf_config
    from ferry.models.paths import resolve_model_path

    cfg = read_hf_config(resolve_model_path(model, "dummy"))
    dt = getattr(torch, dtype)
    tp = tensor_parallel_size
    heads, kvh, d = cfg.num_attention_heads // tp, max(1, cfg.num_key_value_heads // tp), cfg.head_dim
    hidden, inter = cfg.hidden_size, cfg.intermediate_size // tp
    T, B = max_num_batched_tokens, 8
    reports: list[KernelReport] = []

    def launch(case: str, fn, *args, **kwargs) -> None:
        with compiling_for(arch) as compiled:
            fn(*args, **kwargs)
        reports.extend(report(name, case, k, arch) for name, k in compiled)

    cache_dt = (
        dt if kv_cache_dtype == "auto" else KV_FORMAT_DTYPES.get(kv_cache_dtype) or getattr(torch, kv_cache_dtype)
    )
    k_cache = torch.empty(4, block_size, kvh, row_width(d, cache_dt), dtype=cache_dt)
    v_cache = torch.empty_like(k_cache)
    # index tensors as the engine builds them (int64: ferry/layers/attention/metadata.py)
    tables = torch.zeros(B, 8, dtype=torch.int64)
    seq_lens = torch.ones(B, dtype=torch.int64)
    qkv = torch.empty(T, (heads + 2 * kvh) * d, dtype=dt)
    q, k, v = qkv.split([heads * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(T, heads, d), k.view(T, kvh, d), v.view(T, kvh, d)

    if cfg.is_mla:  # one latent row per token: the store without V, the absorbed decode, the expanded prefill
        from ferry.kernels import triton_mla

        width = cfg.kv_cache_width  # the latent, then the rotary key
        cache = torch.empty(4, block_size, 1, row_width(width, cache_dt), dtype=cache_dt)
        launch("store latent rows", attn.store_kv, torch.empty(T, 1, width, dtype=dt), None, cache, None,
               torch.zeros(T, dtype=torch.int64))  # fmt: skip
        for splits in _graph_split_counts(triton_mla.head_blocks(heads), max_num_seqs, num_sms):
            launch(f"latent decode splits={splits}", triton_mla.paged_latent_decode,
                   torch.empty(B, heads, width, dtype=dt), cache, tables, seq_lens, 0.1, cfg.kv_lora_rank,
                   splits)  # fmt: skip
        # prefill: the chunks' contexts expanded per head (V padded to K's width), through the varlen kernel
        qk = cfg.qk_nope_head_dim + cfg.head_dim
        expanded = torch.empty(4, block_size, heads, qk, dtype=dt)
        q_expanded = torch.empty(T, heads, qk, dtype=dt)
        launch("latent prefill expanded", attn.paged_prefill, q_expanded, expanded, expanded, tables,
               torch.tensor([0, T]), torch.tensor([T]), T, 0.1, torch.empty_like(q_expanded))  # fmt: skip
    else:
        launch("store new K/V", attn.store_kv, k, v, k_cache, v_cache, torch.zeros(T, dtype=torch.int64))
    # Each kind of layer's attention: global, and windowed where the model has local layers; with its
    # soft cap (Gemma 2). Window and cap are compile-time constants of the kernels.
    kinds = {(cfg.layer_window(i), cfg.attn_logit_softcapping) for i in range(cfg.num_hidden_layers)}
    kinds = set() if cfg.is_mla else kinds
    for window, softcap in sorted(kinds, key=lambda wc: wc[0] or 0):
        tag = (f" window={window}" if window else "") + (f" cap={softcap:g}" if softcap else "")
        for splits in _graph_split_counts(kvh, max_num_seqs, num_sms):
            launch(f"decode splits={splits}{tag}", attn.paged_decode, q[:B], k_cache, v_cache, tables, seq_lens, 0.1,
                   splits, out=torch.empty(B, heads, d, dtype=dt), window=window, softcap=softcap)  # fmt: skip
        launch(f"prefill{tag}", attn.paged_prefill, q, k_cache, v_cache, tables,
               torch.zeros(B + 1, dtype=torch.int64), seq_lens, T, 0.1, torch.empty(T, heads, d, dtype=dt),
               window=window, softcap=softcap)  # fmt: skip
    cos = torch.empty(16, d // 2, dtype=torch.float32)
    launch("rotary q/k", fused.rotary_, torch.zeros(T, dtype=torch.int64), q, k, cos, cos.clone())
    launch("residual + RMSNorm", fused.add_rms_norm, torch.empty(T, hidden, dtype=dt), torch.empty(T, hidden, dtype=dt),
           torch.empty(hidden, dtype=dt), 1e-6)  # fmt: skip
    launch("SiLU-and-mul", fused.silu_and_mul, torch.empty(T, 2 * inter, dtype=dt))
    if cfg.moe_layers:
        from ferry.kernels import triton_moe

        E, top_k, mi = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size // tp
        w13, w2 = torch.empty(E, 2 * mi, hidden, dtype=dt), torch.empty(E, hidden, mi, dtype=dt)
        for case, rows in (("moe decode", max_num_seqs), ("moe prefill", T)):
            block_m = triton_moe.block_m_for(rows * top_k, E, dt.itemsize <= 2)
            launch(f"{case} align", triton_moe.moe_align, torch.zeros(rows, top_k, dtype=torch.int64), E, block_m)
            tiles = triton_moe.padded_pairs(rows * top_k, E, block_m) // block_m
            aligned = (torch.zeros(tiles * block_m, dtype=torch.int64), torch.zeros(tiles, dtype=torch.int64),
                       torch.zeros(1, dtype=torch.int64))  # fmt: skip
            launch(f"{case} gate_up", triton_moe.moe_gemm, torch.empty(rows, hidden, dtype=dt), w13,
                   torch.empty(rows * top_k, 2 * mi, dtype=dt), aligned, top_k, block_m, True)  # fmt: skip
            launch(f"{case} down", triton_moe.moe_gemm, torch.empty(rows * top_k, mi, dtype=dt), w2,
                   torch.empty(rows * top_k, hidden, dtype=dt), aligned, top_k, block_m, False,
                   torch.empty(rows * top_k, dtype=torch.float32))  # fmt: skip
    if quantization == "gguf":
        from ferry.kernels import triton_gguf as gguf
        from ferry.layers.gguf_linear import GGUF_QUANT_TYPES

        for type_name in GGUF_QUANT_TYPES:
            tid, block, block_bytes = GGUF_QUANT_TYPES[type_name]
            # down_proj at batch 1 (the GEMV kernel) and at 4 rows (the tile kernel's decode tiles; K split
            # across programs in both); prefill: gate_up over the token budget
            for case, rows, n, k in (("gemv", 1, hidden, inter), ("decode", 4, hidden, inter),
                                     ("prefill", T, 2 * inter, hidden)):  # fmt: skip
                data = torch.empty(n, k // block * block_bytes, dtype=torch.uint8)
                launch(f"{type_name} {case}", gguf.gguf_matmul, torch.empty(rows, k, dtype=dt), data, tid, k)
                if case == "decode" and tid in (gguf.Q4_0, gguf.Q4_1):  # the opt-in packed nibbles beside it
                    cfg = gguf.matmul_config(rows, n, k, tid, packed=True)
                    launch(f"{type_name} decode packed", gguf.launch_tiles, torch.empty(rows, k, dtype=dt), data,
                           tid, cfg, torch.empty(rows, n, dtype=dt))  # fmt: skip
                if case == "gemv" and (tid in gguf.BLOCK32_TYPES or tid == gguf.Q4_K):  # the opt-in GEMVs beside it
                    cfgs = [gguf.gemv_config(n, k, tid, words=True)]
                    if tid in gguf.BLOCK32_TYPES:
                        cfgs.append(gguf.gemv_config(n, k, tid, int8_dots=True))
                    for cfg in cfgs:
                        launch(f"{type_name} gemv", gguf.launch_gemv, torch.empty(rows, k, dtype=dt), data,
                               tid, cfg, torch.empty(rows, n, dtype=dt))  # fmt: skip
    if quantization == "int8":
        from ferry.kernels import triton_int8

        for case, rows, n, k in (("decode", 1, hidden, inter), ("prefill", T, 2 * inter, hidden)):
            launch(f"int8 {case}", triton_int8.quantize_rows, torch.empty(rows, k, dtype=dt))
            xq, sx = torch.empty(rows, k, dtype=torch.int8), torch.empty(rows, dtype=torch.float32)
            wq, sw = torch.empty(n, k, dtype=torch.int8), torch.empty(n, dtype=torch.float32)
            launch(f"int8 {case}", triton_int8.int8_matmul, xq, sx, wq, sw, None, dt)
    return reports


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ferry.tools.compile_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-3.1-8b", help="shipped config name or a directory with config.json")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: H100/H200)")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8"]
    )
    p.add_argument("--quantization", default=None, choices=["gguf", "int8"],
                   help="also the GGUF dequantize-matmul kernels (gguf) or the W8A8 ones (int8)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object per kernel instead of a table")
    args = p.parse_args(argv)
    try:
        reports = engine_kernels(args.model, args.dtype, args.arch, args.tensor_parallel_size, args.block_size,
                                 args.max_num_seqs, args.max_num_batched_tokens,
                                 kv_cache_dtype=args.kv_cache_dtype, quantization=args.quantization)  # fmt: skip
    except Exception as e:  # a compile error is the finding: print it, exit 1
        print(f"compile failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    if args.json:
        for r in reports:
            print(json.dumps(asdict(r)))
    else:
        print(f"{args.model} {args.dtype} sm_{args.arch} tp={args.tensor_parallel_size} kv {args.kv_cache_dtype}")
        print(f"{'kernel':24} {'case':22} {'warps':>5} {'stages':>6} {'regs':>5} {'shared':>8} {'spill':>6} {'tc':>6} "
              f"{'load':>5}")  # fmt: skip
        for r in reports:
            line = (f"{r.kernel:24} {r.case:22} {r.num_warps:5} {r.num_stages:6} {r.registers:5} {r.shared_bytes:8} "
                    f"{r.local_bytes:6} {r.tensor_cores:>6} {r.widest_load:4}B  {'; '.join(r.problems)}")  # fmt: skip
            print(line.rstrip())
    return 1 if any(r.problems for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
