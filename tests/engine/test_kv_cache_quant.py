"""`--kv-cache-dtype int8 | fp8`: the engine on quantized caches (bundled SmolLM2 and a tiny
model through the Triton kernels), the KL each format costs on a small text, the memory
budget, and PD transfer of quantized blocks."""

from __future__ import annotations

import msgspec
import pytest
import torch

from ferry.bench.quality import DEFAULT_TEXT, compare
from ferry.config import EngineArgs
from ferry.core.block_hash import hash_prompt_blocks
from ferry.engine.llm_engine import LLMEngine
from ferry.kv_quant import BLOCK_LAYOUT, KV_FORMAT_DTYPES
from ferry.kv_transfer.blocks import KVBlocks
from ferry.sampling_params import SamplingParams
from ferry.worker.memory import blocks_in_budget, kv_bytes_per_block
from tests.conftest import assert_no_blocks_referenced, run_to_completion, tiny_llama

FORMATS = ["int8", "fp8"]
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
SHARED = list(range(1000, 1040))  # 2 full blocks of 16 + 8 tokens


def generate(engine, prompts, params=GREEDY):
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done = run_to_completion(engine)
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def fp32_tokens(make_engine):
    return generate(make_engine(), [SHARED + [5, 6, 7]])[0]


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantized_cache_generates_with_prefix_caching(make_engine, fp32_tokens, fmt):
    """A cached prefix read back from quantized blocks gives what computing it did; greedy tokens
    stay the fp32 cache's (on this prompt) and every block is freed."""
    engine = make_engine(kv_cache_dtype=fmt, max_num_batched_tokens=24)  # chunked prefill too
    assert engine.kv_cache_dtype == KV_FORMAT_DTYPES[fmt]
    k0 = engine.runner.kv_caches[0][0]
    assert k0.dtype == KV_FORMAT_DTYPES[fmt] and k0.shape[-1] == 64 + 4
    first = generate(engine, [SHARED + [5, 6, 7]])[0]
    again = generate(engine, [SHARED + [5, 6, 7]])[0]
    assert engine.get_stats().prefix_cache_hits >= 32
    assert again == first
    assert first == fp32_tokens  # the quantization error may flip a late near-tie, not these
    assert_no_blocks_referenced(engine)


@pytest.fixture(scope="module")
def text_ids(smollm):
    return smollm.tokenizer.encode(DEFAULT_TEXT)[:96]


@pytest.mark.parametrize("decode_rows", [False, True], ids=["prompt", "decode rows"])
@pytest.mark.parametrize("fmt, max_kl", [("int8", 0.005), ("fp8", 0.015)])
def test_kl_of_each_format_is_bounded(smollm, text_ids, fmt, max_kl, decode_rows):
    """Every position attends to quantized K/V (its own included), read by the prompt path or, as
    decode rows, by the C++ decode kernel (its own int8 arithmetic). Measured on these 96 tokens:
    int8 KL 0.0006, fp8 0.0030 (decode rows: 0.0007, 0.0033); one mean scale for all rows instead of each
    row's gives KL 4.3."""
    r = compare(smollm.model, smollm.model, text_ids, KV_FORMAT_DTYPES[fmt], decode_rows)
    assert r["kl_mean"] < max_kl, r
    assert r["top1_agreement"] > 0.9, r
    assert abs(r["ppl_candidate"] / r["ppl_reference"] - 1) < 0.05, r


@pytest.mark.parametrize("decode_rows", [False, True], ids=["prompt", "decode rows"])
def test_the_engines_kernels_read_what_the_reference_reads(smollm, text_ids, decode_rows):
    """`compare` runs the candidate through the attention an engine runs (on the CPU the C++ prefill
    kernel over blocks of 16, or, as decode rows of one sequence, each attending to the cache up to
    itself, the C++ decode kernel) and the reference through the exact backend: on an fp32 cache
    they agree, so what `ferry bench quality` reports for a quantized cache is the format's."""
    r = compare(smollm.model, smollm.model, text_ids, None, decode_rows=decode_rows)
    assert 0.0 <= r["kl_mean"] < 1e-6 and r["top1_agreement"] == 1.0, r


def test_budget_counts_the_scales_and_int8_holds_about_twice_bf16(make_engine):
    cfg = make_engine().runner.model.config  # head_dim 64
    bf16 = kv_bytes_per_block(cfg, 16, torch.bfloat16)
    for fmt in FORMATS:
        q = kv_bytes_per_block(cfg, 16, KV_FORMAT_DTYPES[fmt])
        assert q == 2 * cfg.num_hidden_layers * 16 * cfg.num_key_value_heads * (cfg.head_dim + 4)
        budget = 1000 * bf16
        assert 1.85 < blocks_in_budget(budget, q) / blocks_in_budget(budget, bf16) <= 2
    engine = make_engine(kv_cache_dtype="int8", num_kv_blocks=None, kv_cache_memory_bytes=64 * bf16)
    assert engine.kv.pool.num_blocks == 64 * bf16 // kv_bytes_per_block(cfg, 16, torch.int8) == 120
    held = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)
    assert held == engine.kv.pool.num_blocks * kv_bytes_per_block(cfg, 16, torch.int8)


def test_kv_cache_dtype_is_validated():
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="int4")
    for name in ("int8", "fp8", "fp8_e4m3"):
        EngineArgs(kv_cache_dtype=name)
        EngineArgs(kv_cache_dtype=name, block_size=2)
        with pytest.raises(ValueError, match="needs an even --block-size, got 5"):
            EngineArgs(kv_cache_dtype=name, block_size=5)  # its blocks hold tokens in pairs
    EngineArgs(kv_cache_dtype="bfloat16", block_size=5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pd_transfer_moves_quantized_blocks_as_stored(make_engine, fmt):
    from ferry.kv_transfer.blocks import export_blocks

    prompt = list(range(2000, 2070))  # 4 full blocks + 6 tokens
    dtype = KV_FORMAT_DTYPES[fmt]
    prefill = make_engine(kv_cache_dtype=fmt)
    colocated = generate(prefill, [prompt])[0]
    payload = prefill.export_kv(prompt)
    assert payload.dtype == str(dtype).removeprefix("torch.") and payload.encoding == "raw"
    cfg = prefill.runner.model.config
    assert payload.num_blocks == 4 and payload.num_bytes == 4 * kv_bytes_per_block(cfg, 16, dtype)
    hashes = hash_prompt_blocks(prompt, 16)
    assert export_blocks(prefill.kv, prefill.runner.kv_caches, hashes, encoding="int8") == payload  # not requantized
    decode = make_engine(kv_cache_dtype=fmt)
    assert decode.import_kv(payload) == 4
    # The imported blocks are bit for bit the exported ones.
    for h in payload.block_hashes:
        src, dst = prefill.kv.pool.get_cached_block(h).block_id, decode.kv.pool.get_cached_block(h).block_id
        for (pk, pv), (dk, dv) in zip(prefill.runner.kv_caches, decode.runner.kv_caches):
            assert torch.equal(pk[src].view(torch.uint8), dk[dst].view(torch.uint8))
            assert torch.equal(pv[src].view(torch.uint8), dv[dst].view(torch.uint8))
    assert generate(decode, [prompt])[0] == colocated
    assert decode.get_stats().prefix_cache_hits == 64
    # A peer with a float cache refuses the quantized payload and is refused its own, clearly,
    # changing nothing; so does one with the other quantized format (no engine needed to see it).
    other = make_engine()
    with pytest.raises(ValueError, match="same --kv-cache-dtype"):
        other.import_kv(payload)
    assert_no_blocks_referenced(other)
    generate(other, [prompt], SamplingParams(temperature=0, max_tokens=1))
    with pytest.raises(ValueError, match="same --kv-cache-dtype"):
        decode.import_kv(other.export_kv(prompt))
    mismatched = msgspec.structs.replace(payload, dtype="float8_e4m3fn" if fmt == "int8" else "int8")
    with pytest.raises(ValueError, match="same --kv-cache-dtype"):
        decode.import_kv(mismatched)
    # Quantized blocks from a ferry that stored them row by row (no `layout` in its payload: "rows")
    # are refused, not read in this layout; the wire form of an old payload decodes to that.
    assert payload.layout == BLOCK_LAYOUT
    old = msgspec.msgpack.decode(msgspec.msgpack.encode(list(msgspec.structs.astuple(payload))[:-1]), type=KVBlocks)
    assert old.layout == "rows" and old.data == payload.data
    fresh = make_engine(kv_cache_dtype=fmt)
    with pytest.raises(ValueError, match="same ferry"):
        fresh.import_kv(old)
    assert_no_blocks_referenced(fresh)


@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_and_torch_backends_agree_on_a_quantized_cache(fmt):
    """Mixed steps (decode rows beside prefill chunks, chunked prefill, prefix hits, blocks of 4)
    through the Triton kernels (interpreted) and the torch reference: the same tokens and the same
    cache bytes up to a step of rounding."""
    pytest.importorskip("triton")
    model = tiny_llama()
    shared = list(range(10, 30))
    prompts = [shared + [40, 41, 42], list(range(50, 59)), shared + [60], [7]]
    outs = {}
    for backend in ("torch", "triton"):
        args = EngineArgs(model="tiny", device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                          max_num_batched_tokens=24, attention_backend=backend, kv_cache_dtype=fmt)  # fmt: skip
        engine = LLMEngine(args, model=model, tokenizer=None, device=torch.device("cpu"), dtype=torch.float32)
        outs[backend] = generate(engine, prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        assert engine.kv.prefix_hits > 0
        assert_no_blocks_referenced(engine)
    assert outs["triton"] == outs["torch"]
