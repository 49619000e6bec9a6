"""`ferry serve --enable-lora --lora-modules`: an adapter is a model of its own on the OpenAI API.

The adapter is written in PEFT's format from its specification (ferry/bench/lora.py: adapter_config.json,
and `base_model.model.<module>.lora_A/B.weight` in adapter_model.safetensors) for the bundled SmolLM2."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import engine_over
from server_utils import ServerProcess

from ferry import SamplingParams
from ferry.bench.lora import write_random_adapter
from ferry.core.block_hash import hash_prompt_blocks, lora_hash_key
from ferry.core.request import Request
from ferry.gateway.kv_index import KVMirrors
from ferry.gateway.replicas import Worker
from ferry.models.lora_adapters import read_peft_adapter


@pytest.mark.slow
def test_an_adapter_is_served_as_its_own_model(smollm_gguf, tmp_path):
    """/v1/models lists the adapter with the base model as parent; a completion naming it runs under
    it (the offline engine's tokens with the same adapter, not the base model's) and reports its
    name; the base model's answer is unchanged beside it."""
    adapter = tmp_path / "tuned"
    write_random_adapter(adapter, smollm_gguf.model.config, rank=2, targets=("q_proj", "v_proj"), seed=7, b_scale=0.5)
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=12, temperature=0)
    engine = engine_over(smollm_gguf, enable_lora=True, lora_modules=[f"tuned={adapter}"])
    try:
        engine.add_request("base", prompt, params)
        engine.add_request("tuned", prompt, params, lora_request="tuned")
        offline = {}
        while engine.has_unfinished_requests():
            offline.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
    finally:
        engine.runner.remove_lora("tuned")  # the session's shared model, as it was
    assert offline["tuned"] != offline["base"]
    server = ServerProcess("--max-model-len", "256", "--served-model-name", "smol", "--enable-lora",
                           "--lora-modules", f"tuned={adapter}", "--max-loras", "2")  # fmt: skip
    try:
        models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["parent"]) for m in models] == [("smol", None), ("tuned", "smol")]
        assert models[1]["root"] == str(adapter)
        answers = {}
        for model in ("smol", "tuned"):
            body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
            r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model
            answers[model] = r.json()["choices"][0]["text"]
        assert answers == {"smol": offline["base"], "tuned": offline["tuned"]}
        r = httpx.post(server.url + "/v1/completions", json={"model": "tuned2", "prompt": prompt}, timeout=30)
        assert r.status_code == 404
        # A gateway hashes an adapter request's blocks as the worker does: /ferry/info gives the
        # adapter's digest under a fingerprint of its name (the name itself is not published there).
        info = httpx.get(server.url + "/ferry/info", timeout=30).json()
        assert "tuned" not in json.dumps(info["lora_digests"])
        mirrors = KVMirrors([], 1.0, subscribe=False, forget=lambda url: None)
        worker = Worker(server.url, info=info)
        ids = list(range(100, 140))
        key = lora_hash_key("tuned", read_peft_adapter("tuned", str(adapter), 16).digest)
        as_worker = Request("r", ids, SamplingParams(), block_size=16, lora_key=key, max_tokens=1).block_hashes
        assert mirrors.block_hashes(ids, 16, None, "tuned", worker) == as_worker
        assert mirrors.block_hashes(ids, 16, None, "smol", worker) == hash_prompt_blocks(ids, 16) != as_worker
        # A worker not described yet, or with no digest for the name: routed by load, not by the
        # base model's hashes (which would credit blocks the adapter cannot use).
        assert mirrors.block_hashes(ids, 16, None, "tuned", Worker(server.url)) == []
        assert mirrors.block_hashes(ids, 16, None, "tuned", Worker(server.url, info={**info, "lora_digests": {}})) == []
    finally:
        server.stop()
