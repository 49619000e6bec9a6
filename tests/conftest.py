"""Shared fixtures: the real SmolLM2 model is loaded once per test session."""

from __future__ import annotations

import os

import torch

# Triton kernels run on CPU tensors through Triton's interpreter when there is no GPU; the
# variable must be set before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from ferry.config import EngineArgs  # noqa: E402
from ferry.engine.llm_engine import LLMEngine
from ferry.worker.model_loading import load_model

torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def smollm():
    """(model, tokenizer, device, dtype, path) of the bundled SmolLM2 in fp32 on the CPU, its Q4_1
    tensors dequantized (`quantization="none"`): the HF-exact reference."""
    return load_model(EngineArgs(device="cpu", dtype="float32", quantization="none"))


@pytest.fixture(scope="session")
def make_engine(smollm):
    """Build an LLMEngine over the shared SmolLM2 weights with any engine args."""
    model, tokenizer, device, dtype, path = smollm

    def make(**kwargs) -> LLMEngine:
        kwargs.setdefault("num_kv_blocks", 256)
        return LLMEngine(
            EngineArgs(model=path, device="cpu", dtype="float32", **kwargs),
            model=model,
            tokenizer=tokenizer,
            device=device,
            dtype=dtype,
        )

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
