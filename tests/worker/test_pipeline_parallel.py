"""Pipeline parallelism on the CPU: the layers split over real processes (gloo), micro-batches in flight
so that the stages overlap, and the tokens of one process."""

from __future__ import annotations

import os

import pytest
import torch
from test_hf_parity import ferry_greedy

from ferry.config import EngineArgs
from ferry.engine.llm_engine import LLMEngine
from ferry.models.config import ModelConfig
from ferry.sampling_params import PoolingParams, SamplingParams
from ferry.worker.pipeline_partition import (
    PARTITION_ENV,
    balanced_partition,
    layer_partition,
    measure_layer_costs,
    partition_from_counts,
)
from tests.conftest import assert_no_blocks_referenced, run_to_completion
from tests.worker.test_tensor_parallel import (  # noqa: F401  (fixtures)
    CONFIG,
    PROMPTS,
    mla_checkpoint,
    moe_checkpoint,
    write_checkpoint,
)

# More requests than one micro-batch takes: the two stages each get a share.
MANY = PROMPTS + [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8], list(range(100, 140)), [11] * 9, [42, 43]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama-4"), {**CONFIG, "num_hidden_layers": 4})


def engine_for(path: str, tp: int = 1, pp: int = 1, **kwargs) -> LLMEngine:
    kwargs = {"num_kv_blocks": 96, "block_size": 4, "max_num_batched_tokens": 16, **kwargs}
    return LLMEngine(EngineArgs(model=path, device="cpu", dtype="float32", tensor_parallel_size=tp,
                                pipeline_parallel_size=pp, **kwargs))  # fmt: skip


def generate(path: str, tp: int = 1, pp: int = 1, prompts=MANY, **kwargs) -> tuple[list[list[int]], dict]:
    """Greedy tokens and what rank 0's engine saw: its layers, the most micro-batches in flight."""
    engine = engine_for(path, tp, pp, **kwargs)
    try:
        tokens = ferry_greedy(engine, prompts, 10)  # (asserts that no block stays referenced)
        seen = {"layers": len(engine.model.layers), "max_in_flight": engine.core.max_in_flight,
                "ranges": engine.tp_workers.layer_ranges if engine.tp_workers else None,
                "preemptions": engine.get_stats().num_preemptions}  # fmt: skip
        return tokens, seen
    finally:
        workers = engine.tp_workers.procs if engine.tp_workers else []
        engine.shutdown()
        assert all(not p.is_alive() for p in workers)


def test_pp2_matches_pp1_greedy_with_the_stages_overlapping(checkpoint, monkeypatch):
    monkeypatch.setenv(PARTITION_ENV, "1,3")  # uneven on purpose: rank 0 holds one layer, the next three
    ref, _ = generate(checkpoint)
    got, seen = generate(checkpoint, pp=2)
    assert got == ref and len(set(map(tuple, ref))) == len(MANY)
    assert seen["ranges"] == [(0, 1), (1, 4)] and seen["layers"] == 1
    assert seen["max_in_flight"] == 2  # a micro-batch per stage at once


def test_tp2_pp2_matches_pp1_greedy(checkpoint):
    """Four processes: two stages of two tensor-parallel ranks each."""
    ref, _ = generate(checkpoint, prompts=PROMPTS)
    got, seen = generate(checkpoint, tp=2, pp=2, prompts=PROMPTS)
    assert got == ref
    assert seen["max_in_flight"] == 2 and sum(b - a for a, b in seen["ranges"]) == 4


def test_moe_pp2_matches_pp1_greedy(moe_checkpoint):  # noqa: F811 (the imported fixture)
    ref, _ = generate(moe_checkpoint, prompts=PROMPTS)
    got, seen = generate(moe_checkpoint, pp=2, prompts=PROMPTS)
    assert got == ref and seen["ranges"] == [(0, 1), (1, 2)]


def test_mla_pp2_matches_pp1_greedy(mla_checkpoint):  # noqa: F811 (the imported fixture)
    """DeepSeek-V2: latent attention; stage 0 holds the dense layer 0, stage 1 the MoE layer 1."""
    ref, _ = generate(mla_checkpoint, prompts=PROMPTS)
    got, _ = generate(mla_checkpoint, pp=2, prompts=PROMPTS)
    assert got == ref


def test_pp3_preemption_and_abort_in_flight(checkpoint):
    """A cache too small for every request at once preempts requests whose steps are in flight: their
    tokens from those steps are dropped (with three micro-batches in flight a preempted request is
    readmitted before its old step returns, so a kept token would be computed twice), and a request
    aborted while in flight gets nothing more; the others get PP=1's tokens and no block stays
    referenced."""
    prompts = MANY[:6]
    ref, _ = generate(checkpoint, prompts=prompts)
    engine = engine_for(checkpoint, pp=3, num_kv_blocks=14)
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        engine.add_request("victim", {"prompt_token_ids": [9, 8, 7, 6, 5]}, params)
        outputs = []
        for _ in range(100):  # the victim is in the step left in flight every other step
            if any(r.request_id == "victim" for s in engine.core._in_flight for r, _ in s.sched.scheduled):
                break
            outputs += engine.step()
        else:
            raise AssertionError("the victim never was in flight")
        victim = engine.scheduler.requests["victim"]
        tokens_at_abort = len(victim.output_token_ids)
        engine.abort_request("victim")
        done = {o.request_id: o for o in outputs if o.finished}
        done.update(run_to_completion(engine))
        assert "victim" not in done and len(victim.output_token_ids) == tokens_at_abort
        assert [done[str(i)].outputs[0].token_ids for i in range(len(prompts))] == ref
        assert engine.get_stats().num_preemptions > 0
        assert_no_blocks_referenced(engine)
    finally:
        engine.shutdown()


def test_a_request_readmitted_before_its_old_step_returns_drops_that_steps_token(checkpoint):
    """Preempted while its decode step is in flight, then readmitted (a prefill of everything it has)
    before that step comes back: the old step's token is dropped, else it would come twice (the new
    prefill samples the same position)."""
    prompts = PROMPTS[:2]
    ref, _ = generate(checkpoint, prompts=prompts)
    engine = engine_for(checkpoint, pp=2)
    engine.core.micro_batches = 3  # room for a micro-batch that readmits it while its old one is out
    try:
        params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        for i, ids in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, params)
        outputs = []
        for _ in range(100):  # until request 1 is decoding in a step left in flight
            steps = engine.core._in_flight
            r = engine.scheduler.requests.get("1")
            if r is not None and r.num_output_tokens and any(q is r for s in steps for q, _ in s.sched.scheduled):
                break
            outputs += engine.step()
        else:
            raise AssertionError("request 1 never was in flight while decoding")
        engine.scheduler.running.remove(r)
        engine.scheduler._preempt(r)  # as the scheduler does when blocks run out
        outputs += engine.step()  # readmits it (a prefill), then applies the old step
        assert r.num_preemptions == 1 and any(q is r for s in engine.core._in_flight for q, _ in s.sched.scheduled)
        done = {o.request_id: o for o in outputs if o.finished}
        done.update(run_to_completion(engine))
        assert [done[str(i)].outputs[0].token_ids for i in range(len(prompts))] == ref
    finally:
        engine.shutdown()


def test_pp2_prompt_logprobs_and_embeddings(checkpoint):
    """What reads the final hidden states on rank 0 (prompt logprobs, pooling) gets the last stage's."""

    def run(pp: int):
        engine = engine_for(checkpoint, pp=pp)
        try:
            engine.add_request("lp", {"prompt_token_ids": PROMPTS[2]},
                               SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))  # fmt: skip
            engine.add_request("emb", {"prompt_token_ids": PROMPTS[2]},
                               SamplingParams(max_tokens=1, pooling=PoolingParams(pooling_type="mean")))  # fmt: skip
            done = run_to_completion(engine)
            assert_no_blocks_referenced(engine)
            prompt = PROMPTS[2]
            lps = [entry[prompt[i]].logprob for i, entry in enumerate(done["lp"].prompt_logprobs) if i > 0]
            return lps, done["emb"].embedding
        finally:
            engine.shutdown()

    (lp1, emb1), (lp2, emb2) = run(1), run(2)
    assert len(lp1) == len(PROMPTS[2]) - 1
    torch.testing.assert_close(torch.tensor(lp2), torch.tensor(lp1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(emb2), torch.tensor(emb1), rtol=1e-5, atol=1e-6)


# -- the partition --------------------------------------------------------------


def test_balanced_partition_minimises_the_slowest_stage():
    assert balanced_partition([1.0] * 8, 2) == [(0, 4), (4, 8)]
    assert balanced_partition([1.0] * 8, 2, first_extra=2.0) == [(0, 3), (3, 8)]  # stage 0 also runs the head
    assert balanced_partition([2.0, 2.0, 2.0, 6.0] + [1.0] * 6, 3) == [(0, 3), (3, 4), (4, 10)]
    assert balanced_partition([5.0, 1.0, 1.0, 1.0], 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    with pytest.raises(ValueError):
        balanced_partition([1.0, 1.0], 3)


def test_partition_from_counts_and_its_errors(monkeypatch):
    assert partition_from_counts("10,14", 24, 2) == [(0, 10), (10, 24)]
    for bad in ("10,13", "24", "0,24", "a,b"):
        with pytest.raises(ValueError, match=PARTITION_ENV):
            partition_from_counts(bad, 24, 2)
    cfg = _config(num_hidden_layers=6)
    monkeypatch.setenv(PARTITION_ENV, "2,4")
    assert layer_partition(cfg, 2, torch.device("cpu"), torch.float32) == [(0, 2), (2, 6)]
    with pytest.raises(ValueError, match="exceeds the model's 6 layers"):
        layer_partition(cfg, 7, torch.device("cpu"), torch.float32)


def _config(**overrides) -> ModelConfig:
    fields = dict(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=128,
                  num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256, tie_word_embeddings=True,
                  attention_bias=False, qk_norm=False, sliding_window=None, bos_token_id=None, eos_token_ids=[],
                  dtype="float32")  # fmt: skip
    return ModelConfig(**{**fields, **overrides})


def test_measured_costs_tell_layer_kinds_and_the_head_apart():
    """Layers of one kind are measured once; a layer with 32 experts (top 8) costs more than a dense
    one of the same width, and a 49k-token head more than a SmolLM2-sized layer."""
    moe = _config(hidden_size=256, intermediate_size=256, num_experts=32, num_experts_per_tok=8,
                  moe_intermediate_size=512, moe_layers=(2, 3))  # fmt: skip
    costs, head = measure_layer_costs(moe, torch.device("cpu"), torch.float32)
    assert costs[0] == costs[1] and costs[2] == costs[3] and costs[2] > costs[0] > 0 and head > 0
    smol = _config(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                   num_key_value_heads=3, head_dim=64, num_hidden_layers=30)  # fmt: skip
    costs, head = measure_layer_costs(smol, torch.device("cpu"), torch.float32)
    assert head > costs[0]
    # Stage 0 also runs that head: it takes fewer of SmolLM2's 30 layers (the bundled model's shape; its
    # two-stage serving is test_serve_with_two_stages).
    (first, cut), (_, last) = balanced_partition(costs, 2, head)
    assert first == 0 and last == 30 and cut < 15


def test_serve_with_two_stages(tmp_path):
    """`ferry serve --pipeline-parallel-size 2`: concurrent requests (streamed and not) get the tokens of
    one process, and stopping the server ends the later stage's process too."""
    import concurrent.futures
    import subprocess

    import openai
    from server_utils import ServerProcess

    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "def fib(n):"]
    engine = engine_for(None, enforce_eager=True, num_kv_blocks=64, block_size=16)
    try:
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        done = run_to_completion(engine)
        ref = [done[str(i)].outputs[0].text for i in range(len(prompts))]
    finally:
        engine.shutdown()
    server = ServerProcess("--pipeline-parallel-size", "2", "--served-model-name", "smol", "--max-model-len", "512")
    try:
        core = server.core_pid()
        stages = subprocess.run(["pgrep", "-P", str(core)], capture_output=True, text=True).stdout.split()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kwargs = dict(model="smol", max_tokens=16, temperature=0, extra_body={"ignore_eos": True})

        def ask(i: int) -> str:
            if i % 2:
                chunks = client.completions.create(prompt=prompts[i], stream=True, **kwargs)
                return "".join(c.choices[0].text for c in chunks if c.choices)
            return client.completions.create(prompt=prompts[i], **kwargs).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(ask, range(len(prompts)))) == ref
    finally:
        assert server.stop() == 0, server.logs()
    assert stages and not any(os.path.exists(f"/proc/{pid}") for pid in stages)
