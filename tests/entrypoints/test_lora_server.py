"""`ferry serve --enable-lora --lora-modules`: an adapter is a model of its own on the OpenAI API.

The adapter is written in PEFT's format from its specification (ferry/bench/lora.py: adapter_config.json,
and `base_model.model.<module>.lora_A/B.weight` in adapter_model.safetensors) for the bundled SmolLM2."""

from __future__ import annotations

import json

import httpx
import pytest
from conftest import engine_over
from server_utils import ServerProcess, wait_for

from ferry import LoRARequest, SamplingParams
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
    adapter, dyn = tmp_path / "tuned", tmp_path / "dyn"
    write_random_adapter(adapter, smollm_gguf.model.config, rank=2, targets=("q_proj", "v_proj"), seed=7, b_scale=0.5)
    write_random_adapter(dyn / "v2", smollm_gguf.model.config, rank=4, targets=("o_proj",), seed=8, b_scale=0.5)
    prompt = "The capital of France is"
    params = SamplingParams(max_tokens=12, temperature=0)
    engine = engine_over(smollm_gguf, enable_lora=True, lora_modules=[f"tuned={adapter}"], max_cpu_loras=2)
    try:
        engine.add_request("base", prompt, params)
        engine.add_request("tuned", prompt, params, lora_request="tuned")
        engine.add_request("v2", prompt, params, lora_request=LoRARequest("v2", 2, str(dyn / "v2")))
        offline = {}
        while engine.has_unfinished_requests():
            offline.update({o.request_id: o.outputs[0].text for o in engine.step() if o.finished})
    finally:
        for name in engine.list_loras():
            engine.runner.remove_lora(name)  # the session's shared model, as it was
    assert len({offline["tuned"], offline["v2"], offline["base"]}) == 3
    server = ServerProcess("--max-model-len", "256", "--served-model-name", "smol", "--enable-lora",
                           "--lora-modules", f"tuned={adapter}", "--max-loras", "2", "--max-cpu-loras", "2",
                           "--allow-runtime-lora-updating", str(dyn))  # fmt: skip
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
        check_runtime_updating(server, dyn, adapter, prompt, offline)
    finally:
        server.stop()


def check_runtime_updating(server: ServerProcess, dyn, outside, prompt: str, offline: dict) -> None:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's): an adapter loaded from a directory
    under --allow-runtime-lora-updating's serves as its own model at once; paths elsewhere, a
    second load of a name, or more than --max-cpu-loras adapters are refused; unloading waits for
    its requests (409 meanwhile), then the name is gone everywhere."""

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url + path, json=body, timeout=60)

    (dyn / "escape").symlink_to(outside, target_is_directory=True)
    (dyn / "broken").mkdir()
    (dyn / "broken" / "adapter_config.json").write_text('{"r": "not a rank"')
    r = post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(dyn / "broken")})
    assert r.status_code == 400 and "cannot read LoRA adapter 'x'" in r.text, r.text
    assert httpx.get(server.url + "/health").status_code == 200
    for body, status, why in (({"lora_name": "x", "lora_path": str(outside)}, 400, "not under a directory"),
                              ({"lora_name": "x", "lora_path": str(dyn / "escape")}, 400, "not under a directory"),
                              ({"lora_name": "x", "lora_path": str(dyn / "v2" / "..")}, 400, "no adapter_config"),
                              ({"lora_name": "smol", "lora_path": str(dyn / "v2")}, 400, "base model's name"),
                              ({"lora_name": "x"}, 400, "lora_path"),
                              ({"lora_name": "x", "lora_path": str(dyn) + "\0"}, 400, "NUL")):  # fmt: skip
        r = post("/v1/load_lora_adapter", body)
        assert r.status_code == status and why in r.text, (body, r.text)
    r = post("/v1/load_lora_adapter", {"lora_name": "v2", "lora_path": str(dyn / "v2")})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'v2' added successfully."
    assert [m["id"] for m in httpx.get(server.url + "/v1/models").json()["data"]] == ["smol", "tuned", "v2"]
    body = {"model": "v2", "prompt": prompt, "max_tokens": 12, "temperature": 0}
    assert post("/v1/completions", body).json()["choices"][0]["text"] == offline["v2"]
    assert (
        "already been loaded" in post("/v1/load_lora_adapter", {"lora_name": "v2", "lora_path": str(dyn / "v2")}).text
    )
    r = post("/v1/load_lora_adapter", {"lora_name": "v3", "lora_path": str(dyn / "v2")})
    assert r.status_code == 400 and "--max-cpu-loras" in r.text  # two loaded: tuned and v2
    assert r.json()["error"]["param"] == "lora_name"  # (the core's own, carried across with its class)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={**body, "max_tokens": 240, "ignore_eos": True, "stream": True}) as running:  # fmt: skip
        lines = running.iter_lines()  # held: a generator dropped would close the stream
        next(lines)  # its first token is out: it runs under v2
        r = post("/v1/unload_lora_adapter", {"lora_name": "v2"})
        assert r.status_code == 409 and "still run under" in r.text and r.json()["error"]["param"] == "lora_name"
    wait_for(lambda: server.metric("ferry:num_requests_running") + server.metric("ferry:num_requests_waiting") == 0,
             "the stream closed early to be aborted")  # fmt: skip
    r = post("/v1/unload_lora_adapter", {"lora_name": "v2"})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'v2' removed successfully."
    assert post("/v1/completions", body).status_code == 404
    assert post("/v1/unload_lora_adapter", {"lora_name": "v2"}).status_code == 404
    assert len(httpx.get(server.url + "/ferry/info").json()["lora_digests"]) == 1  # tuned's only
    r = post("/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": str(dyn / "broken"), "load_inplace": True})
    assert r.status_code == 400 and "cannot read" in r.text  # the old version still serves
    assert post("/v1/completions", {**body, "model": "tuned"}).json()["choices"][0]["text"] == offline["tuned"]
    r = post("/v1/load_lora_adapter", {"lora_name": "tuned", "lora_path": str(dyn / "v2"), "load_inplace": True})
    assert r.status_code == 200  # tuned is v2's weights now
    assert post("/v1/completions", {**body, "model": "tuned"}).json()["choices"][0]["text"] == offline["v2"]


def test_runtime_lora_updating_needs_its_directories(tmp_path, monkeypatch):
    """vLLM's environment variable alone is refused with the flag named (ferry reads adapters only
    from directories it is given); the flag needs --enable-lora and existing directories, which it
    keeps resolved."""
    import argparse

    from ferry import EngineArgs
    from ferry.entrypoints.openai.serve_command import check_runtime_lora_updating

    lora = EngineArgs(enable_lora=True)
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    with pytest.raises(ValueError, match="--allow-runtime-lora-updating DIR"):
        check_runtime_lora_updating(argparse.Namespace(allow_runtime_lora_updating=None), lora)
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for dirs, engine_args, why in (([str(tmp_path)], EngineArgs(), "needs --enable-lora"),
                                   ([str(tmp_path / "none")], lora, "not a directory")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            check_runtime_lora_updating(argparse.Namespace(allow_runtime_lora_updating=dirs), engine_args)
    args = argparse.Namespace(allow_runtime_lora_updating=[str(tmp_path / "link")])
    check_runtime_lora_updating(args, lora)
    assert args.allow_runtime_lora_updating == [str((tmp_path / "real").resolve())]
