"""Early exit's verification from the draft's residual streams (worker/spec_decode/early_exit.py):
rows fed one at a time through the first layers, then together through the last layers from the
streams those left, give the logits and the K/V cache the whole model gives them: to the bit on
the C++ decode step (the bundled GGUF), within rounding on the layer-by-layer path (a tiny fp32
model)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_llama
from test_hf_parity import _tiny_config, ferry_greedy

from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.worker.model_runner import ModelRunner
from ferry.worker.step_plan import decode_rows_plan

BS = 16


def runner_over(model) -> ModelRunner:
    return ModelRunner(model, block_size=BS, device=torch.device("cpu"), dtype=torch.float32)


@pytest.mark.parametrize("which", ["gguf_cpp_step", "tiny_python"])
def test_last_layers_from_the_drafts_streams_equal_the_whole_model(smollm_gguf, which):
    model = smollm_gguf.model if which == "gguf_cpp_step" else tiny_llama(num_hidden_layers=4, random_norms=True)
    assert (model.cpu_decode_step is not None) == (which == "gguf_cpp_step")
    exit_at = len(model.layers) - 2
    target = runner_over(model)
    target.allocate_kv_cache(4)
    blocks = [2, 0, 3]  # out of order, as a busy pool hands them out
    vocab = model.config.vocab_size
    prompt = [(t * 37 + 11) % vocab for t in range(21)]
    rows = [(t, p, blocks) for p, t in enumerate(prompt)]
    target.forward(decode_rows_plan(rows, BS, []))  # the prompt's K/V, one decode row each
    snapshot = [(k.clone(), v.clone()) for k, v in target.kv_caches]
    tokens = [5, 77 % vocab, 301 % vocab]  # the last token, then 2 drafts
    verify = [(t, len(prompt) + j, blocks) for j, t in enumerate(tokens)]
    whole = target.forward(decode_rows_plan(verify, BS, [0, 1, 2]))
    whole_cache = [(k.clone(), v.clone()) for k, v in target.kv_caches]

    for (k, v), (k0, v0) in zip(target.kv_caches, snapshot):
        k.copy_(k0)
        v.copy_(v0)
    draft = runner_over(model.first_layers(exit_at))
    draft.kv_caches = target.kv_caches[:exit_at]  # the target's own cache, as the proposer shares it
    streams = []
    for row in verify:  # the draft's passes: one row each, the last without logits
        _, stream = draft.forward_stream(decode_rows_plan([row], BS, []))
        streams.append(stream)
    rest = model.last_layers(exit_at)
    if model.cpu_decode_step is not None:
        from ferry.models.cpu_decode_step import CPUDecodeStep

        rest.cpu_decode_step = CPUDecodeStep.build(rest)
    plan = decode_rows_plan(verify, BS, [0, 1, 2])
    hidden = target._run_model(plan, (torch.cat(streams), None), model=rest, kv_caches=target.kv_caches[exit_at:])
    logits = model.compute_logits(hidden)

    # The C++ step computes each row alone: the same bits. The layer-by-layer path's GEMMs may
    # round a 3-row batch differently from a 1-row one: within 1e-5 of the whole model's.
    atol = 0.0 if which == "gguf_cpp_step" else 1e-5
    torch.testing.assert_close(logits, whole, rtol=0, atol=atol)
    for (k, v), (k1, v1) in zip(target.kv_caches, whole_cache):
        torch.testing.assert_close(k, k1, rtol=0, atol=atol)
        torch.testing.assert_close(v, v1, rtol=0, atol=atol)


def test_last_layers_need_a_layer_on_each_side(smollm_gguf):
    model = smollm_gguf.model
    for bad in (0, len(model.layers)):
        with pytest.raises(ValueError, match="first layer"):
            model.last_layers(bad)


def _family_tokens(model_dir: str, **kwargs) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(EngineArgs(model=model_dir, load_format="dummy", device="cpu", dtype="float32", seed=1,
                                  num_kv_blocks=64, max_num_seqs=8, max_num_batched_tokens=32, **kwargs))  # fmt: skip
    prompts = [list(range(1, 40)), [7, 8, 9], list(range(50, 90)), [5] * 17]
    return ferry_greedy(engine, prompts, 30), engine


@pytest.mark.parametrize(
    "arch, architecture",
    [("mixtral", "MixtralForCausalLM"), ("deepseek_v2", "DeepseekV2ForCausalLM"),
     ("gemma2", "Gemma2ForCausalLM"), ("mistral_window", "MistralForCausalLM")],
)  # fmt: skip
def test_early_exit_on_other_families_is_token_exact(arch, architecture, tmp_path):
    """Mixture-of-experts layers (an early exit through MoE layers failed to build its config
    before), MLA's latent cache, Gemma 2's soft caps and sandwich norms, a sliding window shorter
    than the prompts (its blocks freed while the request runs): tiny dummy-weight models, chunked
    prompts, the layer-by-layer path; the tokens of the engine without speculation."""
    config = _tiny_config(arch)
    config.architectures = [architecture]
    config.save_pretrained(tmp_path)
    want, _ = _family_tokens(str(tmp_path))
    spec = {"method": "early_exit", "draft_layers": config.num_hidden_layers - 1, "num_speculative_tokens": 3,
            "draft_length": "fixed"}  # fmt: skip
    got, engine = _family_tokens(str(tmp_path), speculative_config=json.dumps(spec))
    assert got == want
    assert engine.core.proposer.draft_model.num_reused_rows > 0
