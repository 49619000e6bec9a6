"""Every Triton kernel the engine launches (GGUF-quantized and int8 weights' included) compiles for an H100
(sm_90) on this CPU-only machine, within the chip's limits; and the check does flag a kernel that
does not fit.

Runs in a subprocess: the test session sets TRITON_INTERPRET=1 (see conftest.py), which
replaces Triton's compiler with the interpreter for every kernel defined afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = r"""
import json, torch
from ferry.tools.compile_check import compiling_for, engine_kernels, report
from ferry.kernels import triton_attention as attn
from dataclasses import asdict

for r in engine_kernels("qwen3-0.6b", "bfloat16", arch=90, max_num_seqs=64, quantization="gguf"):
    print(json.dumps(asdict(r)))
for r in engine_kernels("qwen3-0.6b", "bfloat16", arch=90, max_num_seqs=64, quantization="int8"):
    if r.case.startswith("int8"):
        print(json.dumps(asdict(r)))
for r in engine_kernels("qwen3-30b-a3b", "bfloat16", arch=90, max_num_seqs=16):
    if r.case.startswith("moe"):
        print(json.dumps(asdict(r)))
for r in engine_kernels("deepseek-v2-lite", "bfloat16", arch=90, max_num_seqs=16):
    if "latent" in r.case:
        print(json.dumps(asdict(r)))
for r in engine_kernels("gemma-2-9b", "bfloat16", arch=90, max_num_seqs=16):
    if "cap=" in r.case:
        print(json.dumps(asdict(r)))
# A prefill tile too large for one block's shared memory: 3 stages of bf16 K/V tiles of 512 keys.
kc = torch.empty(4, 16, 8, 128, dtype=torch.bfloat16)
q = torch.empty(8, 16, 128, dtype=torch.bfloat16)
with compiling_for(90) as compiled:
    attn.paged_prefill(q, kc, kc, torch.zeros(1, 4, dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32),
                       torch.tensor([8], dtype=torch.int32), 8, 0.1, torch.empty_like(q), block_n=512, rows=16)
print(json.dumps({"oversized": report(compiled[0][0], "oversized", compiled[0][1], 90).problems}))
"""


def test_engine_kernels_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    *kernels, oversized = rows
    by_name = {}
    for r in kernels:
        by_name.setdefault(r["kernel"], []).append(r)
        assert r["problems"] == [], r
        assert r["registers"] > 0
    assert set(by_name) == {"_store_kv_kernel", "_decode_kernel", "_merge_splits_kernel", "_prefill_kernel",
                            "_rotary_kernel", "_add_rms_norm_kernel", "_silu_and_mul_kernel",
                            "_gguf_matmul_kernel", "_gguf_gemv_kernel", "_gguf_gemv_int8_kernel",
                            "_gguf_gemv_words_kernel", "_q4k_gemv_words_kernel",
                            "_kquant_matmul_kernel",
                            "_kquant_gemv_kernel", "_quantize_rows_kernel",
                            "_int8_matmul_kernel", "_moe_gemm_kernel", "_latent_decode_kernel",
                            "_align_count_kernel", "_align_offsets_kernel", "_align_scatter_kernel"}  # fmt: skip
    # The GGUF dequantize-matmul: each 32-block type at a decode and a prefill shape, on tensor cores,
    # without spills (checked above with every kernel's other limits).
    gguf = {r["case"]: r for r in by_name["_gguf_matmul_kernel"]}
    assert set(gguf) == {f"{t} {c}" for t in ("Q4_0", "Q4_1", "Q8_0") for c in ("decode", "prefill")} | {
        "Q4_0 decode packed", "Q4_1 decode packed"}  # fmt: skip
    assert all(r["tensor_cores"] in ("mma", "wgmma") and r["local_bytes"] == 0 for r in gguf.values())
    # Batch 1's GEMV, in floats (the default), with integer dots (PTX dp4a) and in words: CUDA cores, the
    # weight bytes in 16-byte loads.
    for name in ("_gguf_gemv_kernel", "_gguf_gemv_int8_kernel", "_gguf_gemv_words_kernel"):
        gemv = {r["case"]: r for r in by_name[name]}
        assert set(gemv) == {f"{t} gemv" for t in ("Q4_0", "Q4_1", "Q8_0")}, name
        assert all(r["tensor_cores"] == "-" and r["widest_load"] == 16 for r in gemv.values()), gemv
    # The K-quants' twins of both. Q6_K's 210-byte super-blocks are only 2-byte aligned: its loads are
    # 2 bytes wide (BENCHMARKS.md); Q4_K's 144 and Q5_K's 176 bytes keep 16-byte loads.
    k_tiles = {r["case"]: r for r in by_name["_kquant_matmul_kernel"]}
    assert set(k_tiles) == {f"{t} {c}" for t in ("Q4_K", "Q5_K", "Q6_K") for c in ("decode", "prefill")}
    assert all(r["tensor_cores"] in ("mma", "wgmma") and r["local_bytes"] == 0 for r in k_tiles.values())
    k_gemv = {r["case"]: r["widest_load"] for r in by_name["_kquant_gemv_kernel"]}
    assert k_gemv == {"Q4_K gemv": 16, "Q5_K gemv": 16, "Q6_K gemv": 2}, k_gemv
    assert [(r["case"], r["widest_load"]) for r in by_name["_q4k_gemv_words_kernel"]] == [("Q4_K gemv", 16)]
    # The W8A8 GEMM: integer dots on tensor cores (mma.sync for 16-row decode tiles, wgmma for prefill).
    int8 = {r["case"]: r["tensor_cores"] for r in by_name["_int8_matmul_kernel"]}
    assert int8 == {"int8 decode": "mma", "int8 prefill": "wgmma"}, int8
    # The fused MoE's two GEMMs at a decode and a prefill shape, on tensor cores (Qwen3-30B-A3B's experts).
    moe = {r["case"]: r["tensor_cores"] for r in by_name["_moe_gemm_kernel"]}
    assert set(moe) == {f"moe {s} {g}" for s in ("decode", "prefill") for g in ("gate_up", "down")}
    assert set(moe.values()) <= {"mma", "wgmma"}, moe
    # Its pairs' alignment: three launches a step, for 128 experts, each within the limits checked above.
    align = {(r["kernel"], r["case"]) for r in kernels if r["case"].endswith("align")}
    kernels_of_align = ("_align_count_kernel", "_align_offsets_kernel", "_align_scatter_kernel")
    assert align == {(k, f"moe {s} align") for k in kernels_of_align for s in ("decode", "prefill")}
    # DeepSeek-V2-Lite's latent attention: its rows stored without a V, the absorbed decode on tensor cores.
    latent = {r["case"]: r for r in by_name["_latent_decode_kernel"]}
    assert latent and all(r["tensor_cores"] in ("mma", "wgmma") and r["local_bytes"] == 0 for r in latent.values())
    assert any(r["case"] == "store latent rows" for r in by_name["_store_kv_kernel"])
    # ... and its prefill chunks' expanded K/V (192-wide heads) through the varlen prefill kernel.
    (expanded,) = [r for r in by_name["_prefill_kernel"] if r["case"] == "latent prefill expanded"]
    assert expanded["tensor_cores"] in ("mma", "wgmma") and expanded["local_bytes"] == 0, expanded
    # Gemma 2's soft-capped global and windowed layers (head_dim 256) fit without spills.
    gemma = {r["case"] for r in kernels if "cap=" in r["case"]}
    assert {"prefill cap=50", "prefill window=4096 cap=50"} <= gemma
    assert any(c.startswith("decode splits=") and "window=4096" in c for c in gemma)
    # One decode specialisation per split count that a CUDA-graph batch size can ask for (1..16).
    plain = [r for r in by_name["_decode_kernel"] if "cap=" not in r["case"]]
    assert sorted(int(r["case"].split("=")[1]) for r in plain) == [1, 2, 4, 8, 16]
    # bf16 attention runs its dots on tensor cores: Hopper's wgmma for the 64-row prefill tiles.
    assert {r["tensor_cores"] for r in by_name["_decode_kernel"]} <= {"mma", "wgmma"}
    assert by_name["_prefill_kernel"][0]["tensor_cores"] == "wgmma"
    assert any("shared memory" in p for p in oversized["oversized"]), oversized


WORDS_SCRIPT = r"""
import torch
from ferry.kernels import triton_gguf as tg
from ferry.tools.compile_check import compiling_for, main_loop_instructions

n, k = 4096, 14336  # Llama-3.1-8B's down projection: 448 blocks, every tiling loops over K
data = torch.empty(n, tg.block32_row_bytes(k, tg.Q4_0), dtype=torch.uint8)
x, y = torch.empty(1, k, dtype=torch.bfloat16), torch.empty(1, n, dtype=torch.bfloat16)
for words in (False, True):
    cfg = tg.gemv_config(n, k, tg.Q4_0, 132, words=words)
    with compiling_for(90) as compiled:
        tg.launch_gemv(x, data, tg.Q4_0, cfg, y)
    ops = main_loop_instructions(compiled[-1][1].asm["cubin"])
    values = cfg["BLOCK_N"] * cfg["BLOCKS"] * 32 / (32 * cfg["num_warps"])  # a thread's weight values a step
    print(compiled[-1][0], sum(ops.values()) / values, (ops["FFMA"] + ops["FADD"]) / values, ops["BAR"])
"""


def test_word_gemv_loop_issues_about_half_the_instructions():
    """The word GEMV's reason to be, read from its sm_90 SASS: its loop issues ~4 instructions a weight
    value (one LOP3, two float ops, the rest amortized over a block's rows) against the float kernel's ~8,
    and fewer barriers a step (its x values are loaded where the tile's layout needs them, not converted
    through shared memory; the block scales still are)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", WORDS_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (floats, f_per_value, _, f_bars), (words, w_per_value, w_float_ops, w_bars) = [
        (name, float(a), float(b), int(c)) for name, a, b, c in (line.split() for line in proc.stdout.splitlines())
    ]
    assert (floats, words) == ("_gguf_gemv_kernel", "_gguf_gemv_words_kernel")
    assert w_per_value < 4.5 and f_per_value > 7, (w_per_value, f_per_value)
    assert 1.9 <= w_float_ops <= 2.1 and w_bars < f_bars, (w_float_ops, w_bars, f_bars)


def test_widest_global_load_reads_vector_loads_and_async_copies():
    from ferry.tools.compile_check import widest_global_load

    assert widest_global_load("\tld.global.b16 {%rs1}, [%rd1];\n\tld.global.v2.b32 {%r1, %r2}, [%rd2];") == 8
    assert widest_global_load("\t@%p3 ld.global.L1::evict_last.v4.b32 { %r5, %r6, %r7, %r8 }, [ %rd9 + 0 ];") == 16
    assert widest_global_load("\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd2 + 0 ], 0x10, %r3;") == 16
    assert widest_global_load("\tcp.async.ca.shared.global [ %r1 + 0 ], [ %rd2 + 0 ], 0x4, %r3;") == 4
    assert widest_global_load("\tld.shared.v4.b32 {%r1, %r2, %r3, %r4}, [%r5];") == 0
