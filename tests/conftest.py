"""Shared fixtures: the real SmolLM2 model is loaded once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import torch

# Triton kernels run on CPU tensors through Triton's interpreter when there is no GPU; the
# variable must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ferry.config import EngineArgs  # noqa: E402
from ferry.engine.llm_engine import LLMEngine
from ferry.models.config import ModelConfig
from ferry.models.llama import LlamaForCausalLM
from ferry.models.paths import default_model_path
from ferry.worker.model_loading import load_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def kernels():
    """ferry's compiled CPU kernels; a build failure fails the test (a compiler is part of the set-up)."""
    from ferry.kernels.cpu import cpu_kernels

    k = cpu_kernels()
    if k is None:
        pytest.fail("the CPU kernels did not build (a compiler is part of the test set-up)")
    return k


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer, device, dtype, path) of the bundled SmolLM2 in fp32 on the CPU, its Q4_1
    tensors dequantized (`quantization="none"`): the HF-exact reference."""
    return load_model(EngineArgs(device="cpu", dtype="float32", quantization="none"))


@pytest.fixture(scope="session")
def smollm_hf():
    """Hugging Face transformers' own model of the bundled GGUF (its GGUF loader, fp32, eval), loaded
    once a session: the reference the parity and loader tests hold ferry to (~15 s to load)."""
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                              dtype=torch.float32)  # fmt: skip
    return hf.eval()


@pytest.fixture(scope="session")
def smollm_gguf():
    """The bundled SmolLM2 as users run it: its Q4_1/Q8_0 blocks as stored, decode steps in the C++
    step (models/cpu_decode_step.py)."""
    return load_model(EngineArgs(device="cpu"))


def engine_over(loaded, draft_model=None, **kwargs) -> LLMEngine:
    """An LLMEngine over an already loaded model (fp32 on the CPU) with any engine args, and an
    already loaded draft model for speculative method draft_model."""
    model, tokenizer, device, dtype, path = loaded
    kwargs.setdefault("num_kv_blocks", 256)
    return LLMEngine(
        EngineArgs(model=path, device="cpu", dtype="float32", **kwargs),
        model=model,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        draft_model=draft_model,
    )


@pytest.fixture(scope="session")
def make_engine(smollm):
    """Build an LLMEngine over the shared SmolLM2 weights with any engine args."""

    def make(**kwargs) -> LLMEngine:
        return engine_over(smollm, **kwargs)

    return make


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, object]:
    """Step until idle; returns the final RequestOutput of each request."""
    done = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    else:
        raise AssertionError("engine did not finish")
    return done


def assert_no_blocks_referenced(engine: LLMEngine) -> None:
    pool = engine.kv.pool
    assert pool.num_referenced() == 0
    assert pool.num_free_blocks == pool.num_blocks
    assert not engine.kv.req_blocks


# A tiny Llama (GQA: 8 query heads over 2 KV heads) for logic tests of whole engine steps.
TINY_LLAMA = dict(
    architecture="LlamaForCausalLM",
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    rope_scaling=None,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    attention_bias=False,
    qk_norm=False,
    sliding_window=None,
    bos_token_id=None,
    eos_token_ids=[],
    dtype="float32",
)


def tiny_llama(random_norms: bool = False, **overrides) -> LlamaForCausalLM:
    """TINY_LLAMA (with `overrides`) with seeded random weights N(0, 0.1); norms stay 1 unless
    `random_norms` (N(1, 0.1)), in eval mode with its rotary tables built."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig(**{**TINY_LLAMA, **overrides}), max_position=512)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.1)
            elif random_norms:
                p.normal_(1.0, 0.1)
    model.init_rotary()
    return model.eval()


def dense_attention(q, k, v, q_pos, scale, window=None, softcap=None):
    """The attention oracle: q [M, H, D] at absolute positions q_pos; k, v [N, KVH, D] (any float
    dtype); causal by position (and within `window` positions, HF's sliding window; scores
    soft-capped as Gemma 2 does); fp32 result [M, H, D]."""
    H, kvh = q.shape[1], k.shape[1]
    k = k.float().repeat_interleave(H // kvh, dim=1)
    v = v.float().repeat_interleave(H // kvh, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    visible = torch.arange(k.shape[0], device=q.device)[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= torch.arange(k.shape[0], device=q.device)[None, :] > q_pos[:, None] - window
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hmn,nhd->mhd", s.softmax(-1), v)


def write_own_code_tokenizer(tokenizer, path) -> dict:
    """Save `tokenizer` to the directory `path` as a tokenizer that is its own Python code (an
    `auto_map` to tokenization_ferrytest.py, whose class upper-cases text before encoding), as
    --trust-remote-code loads; its tokenizer_config.json as written."""
    import json

    tokenizer.save_pretrained(path)
    (path / "tokenization_ferrytest.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\n"
        "class FerryTestTokenizerFast(PreTrainedTokenizerFast):\n"
        "    def encode(self, text, *args, **kwargs):\n"
        "        return super().encode(text.upper(), *args, **kwargs)\n"
    )
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "FerryTestTokenizer"
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_ferrytest.FerryTestTokenizerFast"]}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return config


def outputs_of_both_cpu_builds(script: str, tmp_path) -> tuple[dict, dict]:
    """Run `script` (it saves a dict of tensors to sys.argv[1]) in a process with the AVX2-only build
    of the CPU kernels (FERRY_CPU_ISA=avx2) and in one with the native build: (avx2, native)."""
    import subprocess
    import sys

    env = {**os.environ, "FERRY_CPU_ISA": "avx2"}
    root = Path(__file__).resolve().parent.parent  # so that the script can import tests.conftest
    run = dict(check=True, timeout=900, cwd=root)
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "avx2.pt")], env=env, **run)
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "native.pt")], **run)
    return torch.load(tmp_path / "avx2.pt"), torch.load(tmp_path / "native.pt")


def int8_values_rounding(rows, head_dim, group):
    """How far the CPU decode kernel's int16 softmax weights (AVX-512 or AVX2) may move an int8 cache's output,
    for one sequence's V rows [n, KVH, head_dim + 4] and `group` query heads per kv head: [KVH * group,
    head_dim]. Each partition's weights times V's row scales, w_t, are rounded in steps of max(w) / 32767;
    a weight moves by at most half a step, and w <= the largest V scale (softmax weights are <= 1, the
    denominator >= 1), so an output moves by at most max(scale) / 65534 x sum_t |v_int[t, d]|."""
    from ferry import kv_quant

    bound = kv_quant.scales_of(rows).amax() / 65534 * rows[..., :head_dim].float().abs().sum(0)
    return bound.repeat_interleave(group, dim=0)
