"""LoRA adapters (layers/lora.py, models/lora_adapters.py): PEFT's own files and outputs are the reference.

A tiny random Llama and two adapters PEFT writes (every projection at rank 4; q/v only at rank 8 with
rsLoRA and a per-module alpha), their LoRA weights random (PEFT starts B at zero) and scaled up so
that each adapter changes the greedy tokens."""

from __future__ import annotations

import json

import pytest
import torch

from ferry import LLM, EngineArgs, LoRARequest, SamplingParams
from ferry.core.block_hash import lora_hash_key
from ferry.core.request import RequestStatus
from ferry.engine.messages import LoRAInUseError, LoRANotLoadedError
from ferry.layers.linear import Linear
from ferry.models.lora_adapters import read_peft_adapter
from ferry.worker.model_loading import load_model

peft = pytest.importorskip("peft")

MAX_TOKENS = 8
ADAPTERS = {
    "every": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ),  # fmt: skip
    "qv": dict(
        r=8, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "v_proj"], alpha_pattern={"v_proj": 4}
    ),  # fmt: skip
}


def greedy(model, ids: list[int]) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS,
                         pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """(base model dir, {adapter: dir}, prompts, {None or adapter: HF's greedy tokens per prompt})."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   initializer_range=0.2, tie_word_embeddings=False)  # fmt: skip
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("lora")
    hf.save_pretrained(root / "base")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 19, 40)]
    expected = {None: [greedy(hf, p) for p in prompts]}
    dirs = {}
    for name, kw in ADAPTERS.items():
        model = peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, **kw))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.mul_(3)
        dirs[name] = root / name
        model.save_pretrained(dirs[name])
        expected[name] = [greedy(model, p) for p in prompts]
        hf = model.unload()  # the base model again, without the adapter's layers
    assert expected["every"] != expected[None] and expected["qv"] != expected[None]
    return root / "base", dirs, prompts, expected


def lora_llm(setup, **kwargs) -> LLM:
    base, dirs, _, _ = setup
    kwargs.setdefault("lora_modules", [f"{n}={d}" for n, d in dirs.items()])
    return LLM(str(base), device="cpu", dtype="float32", enable_lora=True, num_kv_blocks=64, **kwargs)


def run(llm: LLM, prompts, adapters) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=adapters)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("stacked", [True, False])
def test_each_adapter_alone_and_all_batched_give_peft_tokens(lora_setup, stacked, monkeypatch):
    """Greedy tokens equal PEFT's per adapter and for the base model, one request at a time and
    in one batch mixing the base model and both adapters (each row its own adapter's update), the
    mixed steps run stacked (all adapters' ranks at once, masked per row) or adapter by adapter."""
    import ferry.layers.lora

    monkeypatch.setattr(ferry.layers.lora, "STACKED_MAX_RANK", 256 if stacked else 0)
    _, _, prompts, expected = lora_setup
    llm = lora_llm(lora_setup, max_loras=2)
    for name in (None, "every", "qv"):
        assert [run(llm, [p], LoRARequest(name) if name else None)[0] for p in prompts] == expected[name]
    mix = [(p, name) for name in (None, "every", "qv") for p in prompts]
    got = run(llm, [p for p, _ in mix], [LoRARequest(n) if n else None for _, n in mix])
    assert got == [expected[n][i % len(prompts)] for i, (_, n) in enumerate(mix)]


def test_prefix_cache_is_kept_apart_per_adapter(lora_setup):
    """The same prompt under another adapter, or none, computes its own K/V: no cached tokens; the
    same adapter again hits its blocks (and still gives PEFT's tokens)."""
    _, _, prompts, expected = lora_setup
    llm = lora_llm(lora_setup)
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0)
    prompt = {"prompt_token_ids": prompts[2]}  # 40 tokens: two full blocks

    def cached(lora):
        out = llm.generate(prompt, params, use_tqdm=False, lora_request=lora)[0]
        return out.num_cached_tokens, list(out.outputs[0].token_ids)

    assert cached(LoRARequest("every")) == (0, expected["every"][2])
    assert cached(None) == (0, expected[None][2])
    assert cached(LoRARequest("qv")) == (0, expected["qv"][2])
    assert cached(LoRARequest("every")) == (32, expected["every"][2])


def test_max_loras_bounds_the_adapters_running_together(lora_setup):
    """--max-loras 1: requests of the other adapter wait until the running one's finish, while base
    requests join any batch; every request ends with PEFT's tokens."""
    _, _, prompts, expected = lora_setup
    llm = lora_llm(lora_setup, max_loras=1)
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0)
    order = [("every", 0), ("qv", 1), (None, 2), ("every", 1), ("qv", 2)]
    for i, (name, p) in enumerate(order):
        engine.add_request(str(i), {"prompt_token_ids": prompts[p]}, params, lora_request=name)
    done, seen_both_waiting = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        running = engine.scheduler.running
        assert len({r.lora_slot for r in running if r.lora_slot >= 0}) <= 1
        waiting = [r for r in engine.scheduler.requests.values() if r.status == RequestStatus.WAITING]
        seen_both_waiting |= any(r.lora_slot >= 0 for r in waiting)
    assert seen_both_waiting  # the bound held something back
    assert done == {str(i): expected[name][p] for i, (name, p) in enumerate(order)}


def test_adapters_load_on_first_use_and_unknown_names_are_refused(lora_setup):
    """LLM.generate with a LoRARequest carrying a path loads it once; a name never loaded is a
    ValueError naming `model`; an engine without enable_lora refuses adapters."""
    base, dirs, prompts, expected = lora_setup
    llm = lora_llm(lora_setup, lora_modules=None)
    assert llm.llm_engine.list_loras() == []
    assert run(llm, prompts[:1], LoRARequest("qv", 1, str(dirs["qv"]))) == expected["qv"][:1]
    assert llm.llm_engine.list_loras() == ["qv"]
    with pytest.raises(ValueError, match="already loaded from"):  # one name, other weights: never mixed up
        run(llm, prompts[:1], LoRARequest("qv", 1, str(dirs["every"])))
    with pytest.raises(ValueError, match="no LoRA adapter named 'nope'") as e:
        run(llm, prompts[:1], LoRARequest("nope"))
    assert e.value.param == "model"
    with pytest.raises(ValueError, match="needs --enable-lora"):
        EngineArgs(model=str(base), lora_modules=[f"qv={dirs['qv']}"])
    for bad, why in ((["x"], "name=path"), (["a=b", "a=c"], "twice"), (['{"name": "a"}'], "non-empty")):
        with pytest.raises(ValueError, match=why):
            EngineArgs(model=str(base), enable_lora=True, lora_modules=bad)
    for refused, why in (({"pipeline_parallel_size": 2}, "pipeline"), ({"quantization": "int8"}, "SmoothQuant"),
                         ({"speculative_config": {"method": "early_exit", "num_speculative_tokens": 2,
                                                  "draft_layers": 1}}, "early-exit")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            EngineArgs(model=str(base), enable_lora=True, **refused)


def test_adapters_unload_once_idle_and_max_cpu_loras_bounds_the_loaded(lora_setup):
    """remove_lora is refused while a request runs (or waits) under the adapter, then frees its slot
    for another; a load past max_cpu_loras is refused, the model unchanged; a name unloaded is
    refused for new requests, and loads again (from elsewhere too)."""
    base, dirs, prompts, expected = lora_setup
    llm = lora_llm(lora_setup, lora_modules=[f"qv={dirs['qv']}"], max_cpu_loras=1)
    engine = llm.llm_engine
    with pytest.raises(ValueError, match="max_cpu_loras"):
        EngineArgs(model=str(base), enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="1 LoRA adapters are loaded, the most --max-cpu-loras allows"):
        engine.add_lora(LoRARequest("every", 2, str(dirs["every"])))
    assert engine.list_loras() == ["qv"]
    engine.add_request("r", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4), lora_request="qv")
    with pytest.raises(LoRAInUseError, match=r"1 request\(s\) still run under LoRA adapter 'qv'") as e:
        engine.remove_lora("qv")
    assert e.value.param == "lora_name"
    while engine.has_unfinished_requests():
        engine.step()
    engine.remove_lora("qv")
    assert engine.list_loras() == [] and "qv" not in engine.core.info.lora_digests
    with pytest.raises(ValueError, match="no LoRA adapter named 'qv'"):
        run(llm, prompts[:1], "qv")
    with pytest.raises(LoRANotLoadedError, match="no LoRA adapter named 'qv' is loaded"):
        engine.remove_lora("qv")
    assert run(llm, prompts[:1], LoRARequest("every", 2, str(dirs["every"]))) == expected["every"][:1]
    # In place (vLLM's load_inplace): refused while a request runs under it; a version that does not
    # load leaves the old one; one that does replaces it.
    engine.add_request("r2", {"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4), lora_request="every")
    with pytest.raises(LoRAInUseError, match="still run under LoRA adapter 'every'"):
        engine.core.add_lora("every", str(dirs["qv"]), replace=True)
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ValueError, match="cannot read LoRA adapter 'every'"):
        engine.core.add_lora("every", str(base), replace=True)  # the base model's directory: no adapter there
    assert run(llm, prompts[:1], "every") == expected["every"][:1]
    assert engine.core.add_lora("every", str(dirs["qv"]), replace=True) and engine.list_loras() == ["every"]
    assert run(llm, prompts[:1], "every") == expected["qv"][:1]
    engine.remove_lora("every")
    assert run(llm, prompts[:1], LoRARequest("qv", 1, str(dirs["every"]))) == expected["every"][:1]  # a new qv
    assert run(llm, prompts[:1], None) == expected[None][:1]


def _rewrite_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return dst


def test_bad_adapters_are_refused_and_leave_the_model_untouched(lora_setup, tmp_path):
    """A rank above --max-lora-rank, DoRA, trained biases, an adapter of another model's shapes, a
    directory without weights: each a ValueError saying why, and no layer of the model changed."""
    import transformers

    base, dirs, _, _ = lora_setup
    loaded = load_model(EngineArgs(model=str(base), device="cpu", dtype="float32"))
    from ferry.worker.model_runner import ModelRunner

    runner = ModelRunner.create(EngineArgs(model=str(base), device="cpu", dtype="float32", enable_lora=True), loaded)
    with pytest.raises(ValueError, match="rank 8, above --max-lora-rank 4"):
        runner.add_lora(read_peft_adapter("qv", str(dirs["qv"]), max_rank=4))
    for changes, why in (({"use_dora": True}, "DoRA"), ({"bias": "all"}, "biases"),
                         ({"modules_to_save": ["lm_head"]}, "modules_to_save")):  # fmt: skip
        with pytest.raises(ValueError, match=why):
            read_peft_adapter("x", str(_rewrite_config(dirs["every"], tmp_path / why, **changes)), 16)
    with pytest.raises(ValueError, match="no adapter_model.safetensors"):
        (tmp_path / "empty").mkdir()
        (tmp_path / "empty" / "adapter_config.json").write_text("{}")
        read_peft_adapter("x", str(tmp_path / "empty"), 16)
    # An adapter trained on a wider model: its first modules fit nowhere here.
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    other = peft.get_peft_model(transformers.AutoModelForCausalLM.from_config(cfg),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "down_proj"]))  # fmt: skip
    other.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="an adapter of another model"):
        runner.add_lora(read_peft_adapter("other", str(tmp_path / "other"), 16))
    assert runner.loras == {}
    assert all(m.lora is None for m in loaded.model.modules() if isinstance(m, Linear))
    assert runner.add_lora(read_peft_adapter("every", str(dirs["every"]), 16)) == 0
    with pytest.raises(ValueError, match="already loaded"):
        runner.add_lora(read_peft_adapter("every", str(dirs["every"]), 16))
    key = runner.loras["every"].key
    runner.remove_lora("every")
    assert all(m.lora is None for m in loaded.model.modules() if isinstance(m, Linear))
    # Block hashes mix in the adapter's name and files: the same files, the same key; another
    # adapter under that name (a new version, another worker's), another key.
    assert key == lora_hash_key("every", read_peft_adapter("every", str(dirs["every"]), 16).digest)
    assert lora_hash_key("every", read_peft_adapter("every", str(dirs["qv"]), 16).digest) != key
