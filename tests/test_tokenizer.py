"""ferry.tokenizer against transformers' own GGUF tokenizer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import transformers
from conftest import write_own_code_tokenizer
from transformers import AutoTokenizer

import ferry.tokenizer as ferry_tokenizer
from ferry.models.paths import default_model_path
from ferry.tokenizer import (
    backend_tokenizer_from_files,
    eos_token_id_from_files,
    gguf_tokenizer_cache_dir,
    has_tokenizer,
    load_tokenizer,
)

TEXT = "Hello, world!"


@pytest.fixture(scope="module")
def reference():
    path = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


class _SpyAutoTokenizer:
    """Records what ferry asks AutoTokenizer to load, and loads it."""

    calls: list[tuple[str, dict]] = []

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        cls.calls.append((str(path), kwargs))
        return AutoTokenizer.from_pretrained(path, **kwargs)


def test_gguf_tokenizer_matches_transformers_and_is_cached(tmp_path, monkeypatch, reference) -> None:
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(transformers, "AutoTokenizer", _SpyAutoTokenizer)  # ferry imports it when loading
    _SpyAutoTokenizer.calls = []
    path = default_model_path()
    cache_dir = gguf_tokenizer_cache_dir(path)
    assert cache_dir.startswith(str(tmp_path / "tokenizers"))
    assert not os.path.exists(cache_dir)

    cold = load_tokenizer(path)
    assert _SpyAutoTokenizer.calls[-1][1].get("gguf_file") == os.path.basename(path)
    assert os.path.isfile(os.path.join(cache_dir, "tokenizer.json"))

    calls = len(_SpyAutoTokenizer.calls)
    warm = load_tokenizer(path)
    # The second load reads the cache as the generic fast tokenizer it was saved as, not through
    # AutoTokenizer (whose config lookup imports torch) and not from the GGUF.
    assert len(_SpyAutoTokenizer.calls) == calls and type(warm) is transformers.PreTrainedTokenizerFast

    expected = reference(TEXT).input_ids
    for tok in (cold, warm):
        ids = tok(TEXT).input_ids
        assert ids == expected == [19556, 28, 905, 17]
        assert tok.decode(ids) == reference.decode(expected) == TEXT
        assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
        assert tok.bos_token_id == 1
        rendered = tok.apply_chat_template(
            [{"role": "user", "content": "What is 2+2?"}], tokenize=False, add_generation_prompt=True
        )
        assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in rendered
        assert rendered.endswith("<|im_start|>assistant\n")


def test_cache_key_follows_file_identity(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path))
    f = tmp_path / "m.gguf"
    f.write_bytes(b"a")
    first = gguf_tokenizer_cache_dir(str(f))
    assert gguf_tokenizer_cache_dir(str(f)) == first
    os.utime(f, ns=(0, 12345))
    assert gguf_tokenizer_cache_dir(str(f)) != first


def test_chat_template_filled_from_gguf_metadata(tmp_path, reference) -> None:
    """When transformers leaves the template unset, it comes from the GGUF's tokenizer.chat_template."""
    reference.save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    tok.chat_template = None
    ferry_tokenizer._fill_from_gguf_metadata(tok, default_model_path())
    assert tok.chat_template == reference.chat_template
    assert "<|im_start|>" in tok.chat_template


def test_hf_directory_tokenizer(tmp_path, reference) -> None:
    reference.save_pretrained(tmp_path)
    tok = load_tokenizer(str(tmp_path))
    assert tok(TEXT).input_ids == reference(TEXT).input_ids
    assert tok.chat_template == reference.chat_template


def test_a_tokenizer_that_is_its_own_code_needs_trust_remote_code(tmp_path, reference) -> None:
    """vLLM's --trust-remote-code: a tokenizer_config.json whose auto_map names the directory's own
    Python file loads with that code only when the flag is given; refused, with the flag named, else."""
    config = write_own_code_tokenizer(reference, tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    with pytest.raises(ValueError, match="--trust-remote-code"):
        load_tokenizer(str(tmp_path))
    tok = load_tokenizer(str(tmp_path), trust_remote_code=True)
    assert type(tok).__name__ == "FerryTestTokenizerFast"
    assert tok.encode(TEXT) == reference.encode(TEXT.upper()) != reference.encode(TEXT)
    # A class transformers has, with an auto_map beside it: without the flag, transformers' own class.
    config["tokenizer_class"] = type(reference).__name__
    config_path.write_text(json.dumps(config))
    assert load_tokenizer(str(tmp_path)).encode(TEXT) == reference.encode(TEXT)


def test_hf_directory_without_tokenizer_returns_none(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    assert load_tokenizer(str(tmp_path)) is None


def test_bad_tokenizer_paths(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "missing"))
    other = tmp_path / "vocab.txt"
    other.write_text("x")
    with pytest.raises(ValueError, match=".gguf file or a Hugging Face model directory"):
        load_tokenizer(str(other))


def test_eos_token_id_from_files_agrees_with_the_loaded_tokenizer(tmp_path, reference) -> None:
    """An engine core reads the tokenizer's EOS id from its files (it loads no tokenizer at start):
    the same id transformers gives, however the files name it; where they do not say for certain,
    LookupError (the core loads the tokenizer then)."""
    reference.save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())

    def agreed() -> int:
        expected = load_tokenizer(str(tmp_path)).eos_token_id
        assert eos_token_id_from_files(str(tmp_path)) == expected
        return expected

    assert agreed() == reference.eos_token_id == 2  # <|im_end|>, an added token
    config["eos_token"] = "<|endoftext|>"
    config_path.write_text(json.dumps(config))
    assert agreed() == 0
    config["eos_token"] = "Hello"  # a plain vocabulary entry, not an added token
    config_path.write_text(json.dumps(config))
    assert agreed() == reference.convert_tokens_to_ids("Hello") > 2

    special_map = tmp_path / "special_tokens_map.json"
    special_map.write_text(json.dumps({"eos_token": {"content": "Hello", "special": True}}))  # (AddedToken's form)
    assert agreed() == reference.convert_tokens_to_ids("Hello")
    special_map.write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(LookupError, match="no single EOS token"):  # which file wins is the version's
        eos_token_id_from_files(str(tmp_path))
    special_map.unlink()
    config["eos_token"] = "never-a-token"
    config_path.write_text(json.dumps(config))
    with pytest.raises(LookupError, match="not in"):
        eos_token_id_from_files(str(tmp_path))
    del config["eos_token"]  # a tokenizer class may default one
    config_path.write_text(json.dumps(config))
    with pytest.raises(LookupError, match="no single EOS token"):
        eos_token_id_from_files(str(tmp_path))
    config["eos_token"] = "<|im_end|>"
    config_path.write_text(json.dumps(config))
    (tmp_path / "added_tokens.json").write_text("{}")
    with pytest.raises(LookupError, match="added_tokens.json"):
        eos_token_id_from_files(str(tmp_path))


def test_eos_token_id_from_files_of_no_tokenizer_and_of_files(tmp_path) -> None:
    """A directory without tokenizer files has no EOS of its own; a file (a GGUF's EOS is its metadata's,
    read by the engine builder) is not for this reader."""
    assert not has_tokenizer(str(tmp_path)) and eos_token_id_from_files(str(tmp_path)) is None
    assert has_tokenizer(default_model_path())
    with pytest.raises(LookupError):
        eos_token_id_from_files(default_model_path())


def test_the_backend_read_from_tokenizer_json_is_what_transformers_runs(tmp_path, reference, monkeypatch) -> None:
    """An engine core builds llguidance's tokenizer from tokenizer.json (no transformers import): for
    the bundled GGUF's converted tokenizer, llguidance's view is the same token for token as through
    transformers. Where transformers might run another tokenizer than the file's, LookupError."""
    import llguidance
    import llguidance.hf

    path = default_model_path()
    load_tokenizer(path)  # (converted and cached, as the API process does at start)
    backend = backend_tokenizer_from_files(path)
    ours = llguidance.LLTokenizer(backend.to_str(), n_vocab=49152, eos_token=[2])
    theirs = llguidance.hf.from_tokenizer(reference, n_vocab=49152, eos_token=[2])
    assert all(ours.decode_bytes([i]) == theirs.decode_bytes([i]) for i in range(49152))
    assert all(ours.is_special_token(i) == theirs.is_special_token(i) for i in range(49152))
    for text in (TEXT, ' {"a": [1, 2.5]}', "<|im_end|> über\n\n  x"):
        assert ours.tokenize_str(text) == theirs.tokenize_str(text)

    reference.save_pretrained(tmp_path)
    assert backend_tokenizer_from_files(str(tmp_path)).to_str() == backend.to_str()
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())

    def refused(match: str, **changes) -> None:
        config_path.write_text(json.dumps({**config, **changes}))
        with pytest.raises(LookupError, match=match):
            backend_tokenizer_from_files(str(tmp_path))

    refused("may change tokenizer.json", tokenizer_class="LlamaTokenizerFast")
    refused("may change tokenizer.json", split_special_tokens=True)
    refused("its own code", auto_map={"AutoTokenizer": ["own.OwnTokenizer", None]})
    refused("fast_tokenizer_files", fast_tokenizer_files=["tokenizer.json"])
    refused("adds tokens", added_tokens_decoder={"49152": {"content": "<|extra|>", "special": True}})
    refused("special tokens", pad_token="<|pad|>")
    refused("special tokens", extra_special_tokens=["<|tool|>"])
    with pytest.raises(LookupError, match="no tokenizer.json"):
        backend_tokenizer_from_files(str(tmp_path / "missing"))
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "empty-cache"))
    with pytest.raises(LookupError, match="no tokenizer.json"):  # a GGUF not converted yet
        backend_tokenizer_from_files(path)


def test_saved_tokenizers_load_without_torch(tmp_path, reference, monkeypatch) -> None:
    """The API process loads the tokenizer while the engine core starts: a converted GGUF's (from
    the cache) and an HF directory's must not import torch (~1-2.5 s, and memory the API process has
    no use for), and they tokenize as transformers does."""
    monkeypatch.setenv("FERRY_CACHE_DIR", str(tmp_path / "cache"))
    env = dict(os.environ)
    hf_dir = tmp_path / "hf"
    reference.save_pretrained(hf_dir)
    expected = reference("Hi").input_ids
    ferry_tokenizer.load_tokenizer(default_model_path())  # converts the GGUF's, and caches it
    gguf = "from ferry.models.paths import default_model_path as p; from ferry.tokenizer import load_tokenizer; "
    for source in (
        gguf + "t = load_tokenizer(p())",
        f"from ferry.tokenizer import load_tokenizer; t = load_tokenizer({str(hf_dir)!r})",
    ):
        check = source + "; import sys; print(t('Hi').input_ids); print('torch' in sys.modules)"
        out = subprocess.run([sys.executable, "-c", check], env=env, check=True, capture_output=True, text=True)
        assert out.stdout.split() == [str(expected).replace(" ", ""), "False"], out.stdout


def test_token_bytes_join_back_to_the_text(reference) -> None:
    """OpenAI's logprob `bytes`: a token holding part of a UTF-8 character gives that part. SmolLM2's
    byte-level BPE (GPT-2's alphabet), its added tokens, and a SentencePiece vocabulary's <0xNN>
    byte fallback."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel

    for text in ("\U0001f642 and 日本語, é", " hello world"):
        ids = reference.encode(text, add_special_tokens=False)
        pieces = [ferry_tokenizer.token_bytes(reference, i) for i in ids]
        assert b"".join(pieces) == text.encode(), pieces
    assert any(reference.decode([i]) == "\ufffd" for i in reference.encode("\U0001f642"))  # a split character
    assert ferry_tokenizer.token_bytes(reference, reference.convert_tokens_to_ids("<|im_end|>")) == b"<|im_end|>"

    vocab = {"<unk>": 0, "<0xF0>": 1, "<0x9F>": 2, "\u2581hi": 3}
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    spm = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    assert [ferry_tokenizer.token_bytes(spm, i) for i in (1, 2, 3)] == [b"\xf0", b"\x9f", b" hi"]
