"""The CUDA path of GGUF block-quantized weights (ferry/kernels/triton_gguf.py), interpreted on the CPU:
the fused dequantize-matmuls (Q4_0/Q4_1/Q8_0 and the K-quants, tile and GEMV kernels) and the torch
dequantizers against the CPU kernels' dequantization (itself checked against gguf-py in
test_gguf_kernels.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from ferry.layers.gguf_linear import GGUF_QUANT_TYPES, GGUFWeight, exact_prompt_rows, gguf_available, gguf_linear

tg = pytest.importorskip("ferry.kernels.triton_gguf")
pytestmark = pytest.mark.skipif(not gguf_available(), reason="no C++ compiler for the CPU reference kernels")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the kernels' device; references are on the CPU

# 40 output rows: a partial 64-row tile; 320 columns: 10 blocks, a partial K tile, and K split across
# programs at decode sizes (few output tiles). K-quants: 768 columns, 3 super-blocks (an odd count: a
# short last split).
N, K = 40, 320
ALL_TYPES = list(GGUF_QUANT_TYPES)
GEMV_INT8_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # the GEMV's integer dots: 32-value blocks of whole words a row


def _columns(type_name: str) -> int:
    return 768 if type_name.endswith("_K") else K


def _weight(type_name: str, n: int = N, k: int = K, order: bool = False, seed: int = 0) -> GGUFWeight:
    rng = np.random.default_rng(seed)
    _, block, block_bytes = GGUF_QUANT_TYPES[type_name]
    if type_name.endswith("_K"):  # random bytes, small positive fp16 super-scales (as test_gguf_kernels.py)
        raw = rng.integers(0, 256, size=(n * k // block, block_bytes), dtype=np.uint8)
        d = np.full(len(raw), 0.01, np.float16).view(np.uint8).reshape(-1, 2)
        if type_name == "Q6_K":
            raw[:, 208:210] = d
        else:
            raw[:, 0:2], raw[:, 2:4] = d, np.full(len(raw), 0.004, np.float16).view(np.uint8).reshape(-1, 2)
        raw = raw.reshape(n, -1)
    else:
        raw = quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[type_name])
    w = GGUFWeight.from_numpy(raw, type_name, (n, k))
    if order:  # GPTQ desc_act: weight column j multiplies activation column input_order[j]
        w.input_order = torch.from_numpy(rng.permutation(k))
    return w


def _fp32_close(y: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 sums in another order: the random K-quant bytes give outputs in the hundreds whose small
    entries are cancellations, so the absolute bound scales with the largest output."""
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=max(1e-4, 1e-6 * expected.abs().max().item()))


def _int8_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each 32-value block quantized to int8 and back (scale max |x| / 127, rounded to
    nearest, ties away from zero), in fp32: what the integer-dot GEMV multiplies the weight with."""
    m, k = x.shape
    blocks = x.float().view(m, k // 32, 32)
    scale = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 127
    v = blocks / scale
    return (torch.sign(v) * torch.floor(v.abs() + 0.5) * scale).view(m, k)


def _int8_dots_reference(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """The integer-dot GEMV's result in fp32: x in the weight's column order, its blocks through int8."""
    xs = x if w.input_order is None else x[:, w.input_order]
    return _int8_blocks(xs) @ tg.dequantize(w.data, w.qtype, w.in_features).T


def _reference(x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
    """fp32 x @ dequant(w).T with the weight rounded to x's dtype, as the kernel feeds the dot. (Triton
    3.6's interpreter truncates fp32 -> bf16 where the GPU rounds to nearest: bf16 results here are
    compared within two ulps of the largest output.)"""
    return x.float() @ w.dequantize().to(x.dtype).float().T


@pytest.mark.parametrize("type_name", ALL_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", [False, True])
def test_fused_matmul_matches_the_dequantized_weight(type_name, dtype, order):
    k = _columns(type_name)
    w = _weight(type_name, k=k, order=order)
    bias = torch.randn(N).to(dtype)
    for m in (1, 3, 17):  # the GEMV kernel (split K), decode tiles (split K), and a prefill tile
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        y = gguf_linear(x.to(DEVICE), [w.to(DEVICE)], bias.to(DEVICE), triton=True).cpu()
        assert y.dtype == dtype and y.shape == (m, N)
        expected = _reference(x, w) + bias.float()  # one row too: the float GEMV is the default
        if dtype == torch.float32:
            _fp32_close(y, expected)
        else:  # fp32 sums rounded to bf16, the bias added in bf16: within two ulps of the largest output
            torch.testing.assert_close(y.float(), expected, rtol=0, atol=expected.abs().max().item() / 64)


def test_decode_shapes_split_k_and_read_each_byte_once():
    """At decode sizes the grid covers the SMs by splitting K (each split reads its own slice of every
    row: each weight byte is read once), and a split result equals an unsplit one."""
    for n, k in ((6144, 4096), (4096, 14336), (4096, 4096), (28672, 4096)):  # Llama-3.1-8B's projections
        cfg = tg.matmul_config(4, n, k, tg.Q4_0, num_sms=132)
        programs = -(-n // cfg["BLOCK_N"]) * cfg["split"]
        assert programs >= 132 and cfg["split"] * cfg["k_per_split"] >= k > (cfg["split"] - 1) * cfg["k_per_split"]
        gemv = tg.gemv_config(n, k, tg.Q4_0, num_sms=132)  # batch 1: the GEMV kernel, in quant blocks of 32
        per_split, nb = gemv["blocks_per_split"], k // 32
        assert -(-n // gemv["BLOCK_N"]) * gemv["split"] >= 132 and per_split % gemv["BLOCKS"] == 0
        assert gemv["split"] * per_split >= nb > (gemv["split"] - 1) * per_split
        for qtype in tg.K_QUANTS:  # K-quants split in whole super-blocks
            for cfg, per_split in ((tg.matmul_config(4, n, k, qtype, 132), "sb_per_split"),
                                   (tg.gemv_config(n, k, qtype, 132), "sb_per_split")):  # fmt: skip
                assert -(-n // cfg["BLOCK_N"]) * cfg["split"] >= 132
                assert cfg["split"] * cfg[per_split] >= k // 256 > (cfg["split"] - 1) * cfg[per_split]
    assert tg.matmul_config(64, 4096, 4096, tg.Q4_0)["split"] == 1
    assert tg.matmul_config(64, 4096, 4096, tg.Q6_K)["split"] == 1
    w = _weight("Q4_1", n=16, k=1024)
    x = torch.randn(2, 1024)
    assert tg.matmul_config(2, 16, 1024, w.qtype)["split"] == 8
    y = tg.gguf_matmul(x.to(DEVICE), w.data.to(DEVICE), w.qtype, 1024).cpu()
    torch.testing.assert_close(y, _reference(x, w), rtol=1e-5, atol=1e-4)


class _LaunchCounter:
    """Stands in for a Triton kernel in triton_gguf's namespace: counts its launches, then launches it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def _gemv_kernel_name(type_name: str, kernel: str) -> str:
    if kernel == "words":
        return "_q4k_gemv_words_kernel" if type_name == "Q4_K" else "_gguf_gemv_words_kernel"
    if kernel == "int8":
        return "_gguf_gemv_int8_kernel"
    return "_kquant_gemv_kernel" if type_name.endswith("_K") else "_gguf_gemv_kernel"


GEMV_CASES = ([(t, "float") for t in ALL_TYPES] + [(t, "int8") for t in GEMV_INT8_TYPES]
              + [(t, "words") for t in (*GEMV_INT8_TYPES, "Q4_K")])  # fmt: skip


@pytest.mark.parametrize("type_name,kernel", GEMV_CASES)
def test_one_row_takes_the_gemv_kernel_split_or_not(type_name, kernel, monkeypatch):
    """Batch 1 runs the GEMV kernel: partial row tiles, a partial last step of quant blocks, K split
    over programs or not, fp32 and bf16 activations; the fp32 result is the dequantized weight's times x,
    or, with integer dots (asked for, 32-value types only), times x's blocks through int8. The float
    kernel with its weight loaded a step ahead (PRELOAD) gives the same bits. The word GEMV (asked for,
    32-value types and Q4_K) is the dequantized weight's times x too."""
    int8_dots, words = kernel == "int8", kernel == "words"
    k = 7 * 256 if type_name.endswith("_K") else 100 * 32  # 7 super-blocks; 100 blocks: steps of 64, then 36
    if type_name == "Q4_K" and words:
        k = 20 * 256  # 2 warps' 16 super-blocks a step, then 4
    # two row tiles, the last partial: one SM then takes no split (8 rows a program; the K-quant float
    # kernel and the integer dots take 32)
    n = 41 if int8_dots or (type_name.endswith("_K") and not words) else 11
    launched = _LaunchCounter(getattr(tg, _gemv_kernel_name(type_name, kernel)))
    monkeypatch.setattr(tg, _gemv_kernel_name(type_name, kernel), launched)
    w = _weight(type_name, n=n, k=k, seed=3)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5))
    reference = _int8_dots_reference if int8_dots else _reference
    expected = reference(x, w)
    results = []
    for sms in (1, 132):  # one SM: no split; 132: split K
        monkeypatch.setattr(tg, "num_sms", lambda device, sms=sms: sms)
        cfg = tg.gemv_config(n, k, w.qtype, sms, int8_dots=int8_dots, words=words)
        assert (cfg["split"] > 1) == (sms > 1) and cfg.get("INT8_DOTS", False) == int8_dots
        assert cfg.get("WORDS", False) == words
        if words and type_name == "Q4_K":
            assert cfg["SB"] == 16 and cfg["num_warps"] == 2
        elif words:  # 100 blocks: 2 warps' 64 a step, the last step partial (unsplit)
            assert cfg["BLOCKS"] == 64 and cfg["num_warps"] == 2
        # the float kernel with its weight bytes loaded a step ahead: the same arithmetic, the same bits
        cfg = {**cfg, "PRELOAD": kernel == "float" and not type_name.endswith("_K")}
        y = tg.launch_gemv(x.to(DEVICE), w.data.to(DEVICE), w.qtype, cfg, torch.empty(1, n, device=DEVICE)).cpu()
        _fp32_close(y, expected)
        results.append(y)
        xb = x.to(DEVICE, torch.bfloat16)
        yb = tg.launch_gemv(xb, w.data.to(DEVICE), w.qtype, cfg, torch.empty(1, n, dtype=xb.dtype, device=DEVICE))
        bound = expected.abs().max().item() / 64  # two bf16 ulps of the largest output
        torch.testing.assert_close(yb.cpu().float(), reference(x.bfloat16(), w), rtol=0, atol=bound)
    torch.testing.assert_close(results[0], results[1], rtol=1e-5, atol=1e-5)
    if kernel == "float" and not type_name.endswith("_K"):  # preloaded or not: bit for bit
        cfg = {**tg.gemv_config(n, k, w.qtype, 1), "BLOCKS": 4}  # 25 steps
        xd, wd = x.to(DEVICE), w.data.to(DEVICE)
        plain = tg.launch_gemv(xd, wd, w.qtype, cfg, torch.empty(1, n, device=DEVICE))
        ahead = tg.launch_gemv(xd, wd, w.qtype, {**cfg, "PRELOAD": True}, torch.empty(1, n, device=DEVICE))
        assert torch.equal(plain, ahead)
    # and through the public entry point, which takes the integer dots (the word GEMV) only where
    # GEMV_INT8_DOTS (GEMV_WORDS) says
    monkeypatch.setattr(tg, "GEMV_INT8_DOTS", int8_dots)
    monkeypatch.setattr(tg, "GEMV_WORDS", words)
    _fp32_close(tg.gguf_matmul(x.to(DEVICE), w.data.to(DEVICE), w.qtype, k).cpu(), expected)
    assert launched.launches == 4 + 2 * (kernel == "float" and not type_name.endswith("_K")) + 1  # no fallback


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1"])
def test_decode_tiles_with_packed_nibbles(type_name, monkeypatch):
    """Decode tiles (2-16 rows of x) asked to take their nibbles packed (exact integers in x's 16-bit
    dtype, the block scale after the dots): the dequantized weight's product, split or not, bf16 and
    fp16, a partial row tile; other types, fp32 x and prompt tiles keep the plain path."""
    k, n = 10 * 32, 75  # 2.5 K tiles of 128 (split in two at 132 SMs); 64-row tiles, the second partial
    w = _weight(type_name, n=n, k=k, seed=6)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(7))
    for sms in (1, 132):
        cfg = tg.matmul_config(3, n, k, w.qtype, sms, packed=True)
        assert cfg["PACKED"] and (cfg["split"] > 1) == (sms > 1)
        for dtype in (torch.bfloat16, torch.float16):
            xd = x.to(dtype)
            y = tg.launch_tiles(
                xd.to(DEVICE), w.data.to(DEVICE), w.qtype, cfg, torch.empty(3, n, dtype=dtype, device=DEVICE)
            )
            expected = _reference(xd.float(), w)
            bound = expected.abs().max().item() / 64  # two 16-bit ulps of the largest output
            torch.testing.assert_close(y.cpu().float(), expected, rtol=0, atol=bound)
    assert not tg.matmul_config(3, n, k, tg.Q8_0, packed=True)["PACKED"]
    assert not tg.matmul_config(64, n, k, w.qtype, packed=True)["PACKED"]  # prompt tiles
    assert not tg.matmul_config(3, n, k, w.qtype)["PACKED"]  # off unless asked
    monkeypatch.setattr(tg, "GEMM_PACKED", True)  # through the entry point
    y = tg.gguf_matmul(x.to(DEVICE, torch.bfloat16), w.data.to(DEVICE), w.qtype, k).cpu().float()
    expected = _reference(x.bfloat16().float(), w)
    torch.testing.assert_close(y, expected, rtol=0, atol=expected.abs().max().item() / 64)


def _lanes_of(word: int, kind: str) -> list[float]:
    """The two 16-bit lanes of a 32-bit word as floats (low half first)."""
    if kind == "bf16x2":
        return [float(np.array([(word >> sh & 0xFFFF) << 16], np.uint32).view(np.float32)[0]) for sh in (0, 16)]
    return [float(np.array([word >> sh & 0xFFFF], np.uint16).view(np.float16)[0]) for sh in (0, 16)]


def _run_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """The few PTX instructions `_nibbles_asm` uses, run on 32-bit words as the PTX manual defines them
    (prmt's default mode, lop3 with its truth table, shr.b32, fma.rn on bf16x2 / f16x2 lanes): what its
    constants do, checked without a GPU (the kernel tests on CUDA run the real thing)."""
    regs = dict(inputs)

    def val(tok: str) -> int:
        return int(tok, 0) if tok[0].isdigit() else regs[tok]

    def pack(values: list[float], kind: str) -> int:
        out = 0
        for v, sh in zip(values, (0, 16)):
            if kind == "bf16x2":
                bits = int(np.array([v], np.float32).view(np.uint32)[0])
                assert bits & 0xFFFF == 0, "inexact bf16 (the values are meant to be small integers)"
                out |= (bits >> 16) << sh
            else:
                out |= int(np.array([v], np.float16).view(np.uint16)[0]) << sh
        return out

    for ins in asm.strip("{} ").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        if op == "prmt.b32":  # default mode: result byte i = byte sel_i of {b, a} (a bytes 0-3, b 4-7)
            src = [(val(a[1]) >> 8 * i) & 0xFF for i in range(4)] + [(val(a[2]) >> 8 * i) & 0xFF for i in range(4)]
            sel = val(a[3])
            regs[a[0]] = sum(src[(sel >> 4 * i) & 7] << 8 * i for i in range(4))
        elif op == "shr.b32":
            regs[a[0]] = val(a[1]) >> int(a[2])
        elif op == "mov.b32":
            regs[a[0]] = val(a[1])
        elif op == "lop3.b32":  # bit i of the result: lut bit (a_i << 2 | b_i << 1 | c_i)
            x, y, z, lut = val(a[1]), val(a[2]), val(a[3]), val(a[4])
            regs[a[0]] = sum(
                ((lut >> ((x >> i & 1) << 2 | (y >> i & 1) << 1 | (z >> i & 1))) & 1) << i for i in range(32)
            )
        elif op in ("fma.rn.bf16x2", "fma.rn.f16x2"):
            kind = op.split(".")[-1]
            lanes = [_lanes_of(val(t), kind) for t in a[1:4]]
            prod = [p * q + r for p, q, r in zip(*lanes)]  # exact here: small integers and powers of two
            regs[a[0]] = pack(prod, kind)
        else:
            raise AssertionError(f"no emulation of {op}")
    return regs


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("zero", [8, 0])
def test_packed_nibble_ptx_constants(fp16, zero):
    """`_nibbles_asm`'s PTX, run by the emulation above over random bytes: $0, $1 hold bytes 0-3's low
    nibbles minus `zero`, $2, $3 their high ones, lane by lane in element order."""
    asm = tg._nibbles_asm(fp16, zero)
    kind = "f16x2" if fp16 else "bf16x2"
    rng = np.random.default_rng(zero + fp16)
    for word in [0, 0xFFFFFFFF, *rng.integers(0, 2**32, 200, dtype=np.uint64).tolist()]:
        word = int(word)
        out = _run_ptx(asm.replace("$4", "in"), {"in": word, "$0": 0, "$1": 0, "$2": 0, "$3": 0})
        got_lo = [v for r in ("$0", "$1") for v in _lanes_of(out[r], kind)]
        got_hi = [v for r in ("$2", "$3") for v in _lanes_of(out[r], kind)]
        data = [(word >> 8 * i) & 0xFF for i in range(4)]
        assert got_lo == [(b & 15) - zero for b in data] and got_hi == [(b >> 4) - zero for b in data], hex(word)


def test_int8_dots_need_whole_words_per_row(monkeypatch):
    """Q4_0 and Q8_0 rows of an odd number of blocks are not whole int32 words: the float GEMV takes them
    even where the integer dots are asked for; by default every type takes the float GEMV."""
    assert not tg.gemv_config(8, 96 * 32, tg.Q4_0)["INT8_DOTS"]
    assert tg.gemv_config(8, 96 * 32, tg.Q4_0, int8_dots=True)["INT8_DOTS"]  # 96 blocks: 1,728 bytes a row
    assert not tg.gemv_config(8, 3 * 32, tg.Q4_0, int8_dots=True)["INT8_DOTS"]  # 3 blocks: 54 bytes
    assert not tg.gemv_config(8, 3 * 32, tg.Q8_0, int8_dots=True)["INT8_DOTS"]  # 102 bytes
    assert tg.gemv_config(8, 3 * 32, tg.Q4_1, int8_dots=True)["INT8_DOTS"]  # 60 bytes
    # the word GEMV likewise
    assert not tg.gemv_config(8, 96 * 32, tg.Q4_0)["WORDS"]
    assert tg.gemv_config(8, 96 * 32, tg.Q4_0, words=True)["WORDS"]
    assert not tg.gemv_config(8, 3 * 32, tg.Q4_0, words=True)["WORDS"]
    assert not tg.gemv_config(8, 3 * 32, tg.Q8_0, words=True)["WORDS"]
    assert tg.gemv_config(8, 3 * 32, tg.Q4_1, words=True)["WORDS"]
    assert not tg.gemv_config(8, 3 * 32, tg.Q4_1, int8_dots=True, words=True)["WORDS"]  # one or the other
    monkeypatch.setattr(tg, "GEMV_INT8_DOTS", True)
    monkeypatch.setattr(tg, "GEMV_WORDS", True)
    w = _weight("Q4_0", n=8, k=3 * 32, seed=4)
    x = torch.randn(1, 3 * 32)
    _fp32_close(tg.gguf_matmul(x.to(DEVICE), w.data.to(DEVICE), w.qtype, 3 * 32).cpu(), _reference(x, w))


@pytest.mark.parametrize("type_name", list(GGUF_QUANT_TYPES))
def test_torch_dequantize_matches_the_cpu_kernels(type_name):
    """Embedding rows and K-quant matmuls on CUDA dequantize with torch ops: the CPU kernels' values."""
    w = _weight(type_name, k=512)
    data = w.data.to(DEVICE)
    torch.testing.assert_close(tg.dequantize(data, w.qtype, 512).cpu(), w.dequantize(), rtol=0, atol=0)
    rows = torch.tensor([3, 0, 3])
    torch.testing.assert_close(tg.dequantize(data[rows.to(DEVICE)], w.qtype, 512, torch.bfloat16).cpu(),
                               w.dequantize()[rows].to(torch.bfloat16), rtol=0, atol=0)  # fmt: skip


def test_k_quants_and_mixed_parts_on_the_triton_path():
    """A Q4_K_M-style linear (Q4_1, Q6_K and Q5_K parts, one fused kernel each): the parts' outputs
    concatenated."""
    parts = [_weight("Q4_1", k=512, seed=1), _weight("Q6_K", k=512, seed=2), _weight("Q5_K", k=512, seed=3)]
    x = torch.randn(3, 512).to(torch.bfloat16)
    y = gguf_linear(x.to(DEVICE), [p.to(DEVICE) for p in parts], None, triton=True).cpu()
    expected = torch.cat([_reference(x, p) for p in parts], dim=-1)
    torch.testing.assert_close(y.float(), expected, rtol=0, atol=expected.abs().max().item() / 64)


def test_cuda_is_allowed_for_gguf_and_other_cases_still_refused():
    from types import SimpleNamespace

    from ferry.distributed.parallel_state import SINGLE
    from ferry.worker.model_loading import _gguf_unavailable, resolve_quantization

    cuda = torch.device("cuda")
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert _gguf_unavailable(cuda, dtype) is None
    assert "float32" in _gguf_unavailable(torch.device("cpu"), torch.bfloat16)
    tensors = {"model.layers.0.mlp.up_proj.weight": "Q4_0"}
    gguf_file = SimpleNamespace(
        hf_quantization=None, format="gguf", path="x.gguf", gguf_quantized_tensors=lambda: tensors
    )
    assert resolve_quantization("auto", gguf_file, cuda, torch.bfloat16, SINGLE) == "gguf"
    assert resolve_quantization("gguf", gguf_file, cuda, torch.float16, SINGLE) == "gguf"
    assert resolve_quantization("none", gguf_file, cuda, torch.bfloat16, SINGLE) is None
    # A GGUF's blocks shard over ranks (tests/worker/test_tensor_parallel.py); a converted GPTQ/AWQ
    # checkpoint's do not yet: it is dequantized there, with the reason logged.
    assert resolve_quantization("auto", gguf_file, cuda, torch.bfloat16, SimpleNamespace(size=2)) == "gguf"
    gptq = SimpleNamespace(hf_quantization=SimpleNamespace(method="gptq", kernel_unsupported=lambda _: None),
                           config=SimpleNamespace(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                                  head_dim=16))  # fmt: skip
    assert resolve_quantization("auto", gptq, cuda, torch.bfloat16, SINGLE) == "gguf"
    assert resolve_quantization("auto", gptq, cuda, torch.bfloat16, SimpleNamespace(size=2)) is None


@pytest.mark.skipif(DEVICE != "cpu", reason="CPU tensors through the interpreter (tests/gpu runs the model on CUDA)")
def test_a_dummy_int4_model_runs_on_the_triton_path(tmp_path, monkeypatch):
    """`--load-format dummy --quantization gguf` (random Q4_0 projections) through the Triton kernels,
    forced on CPU tensors: a prompt's hidden states equal the CPU path's exact (dequantize + GEMM) ones."""
    import json

    import ferry.layers.linear as linear_module
    from ferry.config import EngineArgs
    from ferry.worker.model_loading import load_model

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    # Keep ggml's row layout: on a CPU model the loader interleaves Q4_0 rows for the C++ kernel,
    # a layout the Triton kernels (the CUDA path's) never see.
    monkeypatch.setattr(GGUFWeight, "interleave", lambda self: self)
    model = load_model(EngineArgs(model=str(tmp_path), device="cpu", quantization="gguf", load_format="dummy")).model
    ids = [1, 5, 9, 33, 2]
    with exact_prompt_rows():  # the exact CPU path, not the int8 dots Q4_0 prompt rows take by default
        exact = model._forward_prompt(ids)
    calls = []

    def on_triton(x, parts, bias):
        calls.append(len(parts))
        return gguf_linear(x, parts, bias, triton=True)

    monkeypatch.setattr(linear_module, "gguf_linear", on_triton)
    torch.testing.assert_close(model._forward_prompt(ids), exact, rtol=1e-4, atol=1e-4)
    assert len(calls) == 2 * 4  # every projection of both layers took the Triton kernels
