"""The whole engine with the Triton backend (interpreted on the CPU) against the torch backend.

A tiny random-weight Llama (GQA) runs mixed steps: decode rows next to prefill chunks,
chunked prefill, prefix-cache hits and blocks of 4 tokens, so every path of the kernels
(store, split-KV decode, prefix + chunk prefill) is taken inside real engine steps.
"""

from __future__ import annotations

import pytest
import torch

from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.sampling_params import SamplingParams
from tests.conftest import assert_no_blocks_referenced, run_to_completion, tiny_llama

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama()


def run(model, backend: str, prompts, max_tokens=6, **kwargs):
    args = EngineArgs(model="tiny", device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                      max_num_batched_tokens=24, attention_backend=backend, **kwargs)  # fmt: skip
    engine = LLMEngine(args, model=model, tokenizer=None, device=torch.device("cpu"), dtype=torch.float32)
    assert engine.runner.attn_backend.name == backend
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done = run_to_completion(engine)
    assert_no_blocks_referenced(engine)
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))], engine


def test_triton_backend_matches_torch_in_mixed_steps(tiny_model):
    shared = list(range(10, 30))  # 5 full blocks, cached after the first request
    prompts = [shared + [40, 41, 42], list(range(50, 59)), shared + [60], [7], shared + list(range(70, 89))]
    ref, _ = run(tiny_model, "torch", prompts)
    got, engine = run(tiny_model, "triton", prompts)
    assert got == ref
    assert engine.kv.prefix_hits > 0  # some prefills attended to a cached prefix


def test_unknown_or_unusable_backend_is_a_clear_error(tiny_model):
    with pytest.raises(ValueError, match="attention_backend"):
        EngineArgs(attention_backend="xformers")
    with pytest.raises(ValueError, match="flashinfer"):
        run(tiny_model, "flashinfer", [[1, 2, 3]])


def test_graph_path_padding_writes_and_reads_nothing(tiny_model):
    """The CUDA-graph decode path (static buffers, batch padded to a captured size, padded rows
    with slot -1 and length 0), run eagerly on the CPU: same tokens and same KV cache contents
    as the torch backend, so the padded rows wrote nowhere."""
    from ferry.worker.cuda_graphs import CUDAGraphRunner, graph_batch_sizes

    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]
    assert graph_batch_sizes(256)[-3:] == [224, 240, 256]
    prompts = [list(range(10, 19)), list(range(30, 35)), [3, 4, 5, 6, 7, 8, 9]]  # 3 decode rows -> graph of 4
    ref, ref_engine = run(tiny_model, "torch", prompts, max_tokens=8)

    args = EngineArgs(model="tiny", device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
                      max_num_batched_tokens=24, attention_backend="triton")  # fmt: skip
    engine = LLMEngine(args, model=tiny_model, tokenizer=None, device=torch.device("cpu"), dtype=torch.float32)
    runner = engine.runner
    runner.graphs = CUDAGraphRunner(runner.model, runner.attn_backend, runner.kv_caches, runner.block_size,
                                    runner.device, max_num_seqs=8, max_model_len=64, use_graphs=False)  # fmt: skip
    replays = []
    run_graph = runner.graphs.run
    runner.graphs.run = lambda plan: replays.append(plan.num_decodes) or run_graph(plan)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": ids}, params)
    done = run_to_completion(engine)
    assert [done[str(i)].outputs[0].token_ids for i in range(3)] == ref
    assert 3 in replays  # decode-only steps of 3 rows went through the padded path
    for (k, v), (rk, rv) in zip(runner.kv_caches, ref_engine.runner.kv_caches):
        torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v, rv, rtol=1e-5, atol=1e-5)

    # Dropping the engine frees its runner (and so the KV cache and graph pool on a GPU) at
    # once: the graph runner's back-reference makes no cycle for the collector to find later.
    import gc
    import weakref

    del runner.graphs.run  # this test's wrapper: a cycle through the graph runner of its own making
    run_graph = None
    kv_cache = weakref.ref(runner.kv_caches[0][0])
    gc.collect()
    gc.disable()
    try:
        del runner, engine
        assert kv_cache() is None
    finally:
        gc.enable()
