"""An engine core process loads no tokenizer at start (`build_engine_core(..., tokenizer=False)`): its EOS
id comes from the tokenizer's files (a GGUF's from its metadata), and structured output loads the
tokenizer when first needed, from tokenizer.json where transformers would run it as it is. Where the
files do not tell the EOS id, the tokenizer is loaded at start instead; a model without one has no EOS
of its tokenizer's and no structured output. (The server end: test_structured_output_server.py.)"""

from __future__ import annotations

import json

import pytest
import tokenizers

import ferry.engine.builder as builder
from ferry.config import EngineArgs
from ferry.engine.builder import _deferred_tokenizer, build_engine_core
from ferry.engine.messages import EngineCoreRequest
from ferry.models.paths import default_model_path
from ferry.sampling_params import SamplingParams, StructuredOutputsParams
from ferry.worker.model_loading import LoadedModel

TINY = {  # a tiny random-weight model with the bundled tokenizer's vocabulary; config.json's EOS: 0
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "vocab_size": 49152, "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": True, "eos_token_id": 0,
}  # fmt: skip


def unloaded(path: str) -> LoadedModel:
    return LoadedModel(None, None, None, None, path)


def test_a_directory_eos_is_read_and_the_tokenizer_loaded_once_from_its_json(tmp_path, smollm):
    smollm.tokenizer.save_pretrained(tmp_path)
    loaded, loader = _deferred_tokenizer(EngineArgs(model=str(tmp_path)), unloaded(str(tmp_path)))
    assert loaded.tokenizer is None and loader.eos_token_id == smollm.tokenizer.eos_token_id == 2
    first = loader()
    assert isinstance(first, tokenizers.Tokenizer) and loader() is first  # tokenizer.json, read by tokenizers
    assert first.encode("Hello, world!").ids == smollm.tokenizer.encode("Hello, world!")


def test_a_gguf_eos_is_its_metadatas(smollm):
    loaded, loader = _deferred_tokenizer(EngineArgs(), unloaded(default_model_path()))
    assert loaded.tokenizer is None and loader.eos_token_id == smollm.tokenizer.eos_token_id == 2


def test_an_eos_the_files_do_not_name_loads_the_tokenizer_at_start(tmp_path, smollm):
    smollm.tokenizer.save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["eos_token"]
    config_path.write_text(json.dumps(config))
    loaded, loader = _deferred_tokenizer(EngineArgs(model=str(tmp_path)), unloaded(str(tmp_path)))
    assert loader is None and loaded.tokenizer.encode("Hello") == smollm.tokenizer.encode("Hello")


def test_the_tokenizer_flag_names_where_it_is_and_none_means_none(tmp_path, smollm):
    model_dir, tokenizer_dir = tmp_path / "model", tmp_path / "tokenizer"
    model_dir.mkdir()
    assert _deferred_tokenizer(EngineArgs(model=str(model_dir)), unloaded(str(model_dir)))[1] is None
    smollm.tokenizer.save_pretrained(tokenizer_dir)
    args = EngineArgs(model=str(model_dir), tokenizer=str(tokenizer_dir))
    loaded, loader = _deferred_tokenizer(args, unloaded(str(model_dir)))
    assert loaded.tokenizer is None and loader.path == str(tokenizer_dir) and loader.eos_token_id == 2


def test_a_tokenizer_that_fails_to_load_fails_each_later_grammar_at_once(tmp_path, smollm, monkeypatch):
    """A model-specific class (not read from tokenizer.json) whose load then fails (its files gone, here):
    each later grammar is refused with the reason, without loading again."""
    smollm.tokenizer.save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tokenizer_class": "GPT2TokenizerFast"}))
    calls = []

    def gone(*args):
        calls.append(args)
        raise OSError("the tokenizer's files are gone")

    monkeypatch.setattr(builder, "load_tokenizer", gone)
    loaded, loader = _deferred_tokenizer(EngineArgs(model=str(tmp_path)), unloaded(str(tmp_path)))
    assert loaded.tokenizer is None and loader.eos_token_id == 2 and not calls
    for _ in range(2):
        with pytest.raises(ValueError, match="did not load: the tokenizer's files are gone"):
            loader()
    assert len(calls) == 1


def test_a_core_without_a_tokenizer_stops_at_the_tokenizers_eos_and_follows_grammars(tmp_path, smollm):
    """The whole core on an HF directory whose tokenizer's EOS (2) is not its config's (0)."""
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    smollm.tokenizer.save_pretrained(tmp_path)
    args = EngineArgs(model=str(tmp_path), load_format="dummy", device="cpu", num_kv_blocks=64)
    core = build_engine_core(args, tokenizer=False)
    try:
        assert core.tokenizer is None and core.eos_token_ids == {0, 2} and core.info.eos_token_ids == [0, 2]
        choice = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
            choice=["yes", "no"]))  # fmt: skip
        core.add_request(EngineCoreRequest("pick", [1, 2, 3, 4], choice, 8))
        # <|im_end|> (2) made the likeliest token: the request ends there, the tokenizer's EOS, not config.json's.
        ending = SamplingParams(temperature=0.0, max_tokens=8, logit_bias={2: 100.0})
        core.add_request(EngineCoreRequest("eos", [5, 6, 7], ending, 8))
        outs = {}
        while core.has_unfinished_requests():
            for out in core.step():
                outs.setdefault(out.request_id, []).append(out)
        picked = [t for out in outs["pick"] for t in out.new_token_ids]
        assert smollm.tokenizer.decode(picked) in ("yes", "no") and outs["pick"][-1].finish_reason == "stop"
        assert [t for out in outs["eos"] for t in out.new_token_ids] == [2]
        assert outs["eos"][-1].finish_reason == "stop" and outs["eos"][-1].stop_token
        assert isinstance(core.grammars.load_tokenizer(), tokenizers.Tokenizer)
    finally:
        core.shutdown()
