"""An engine core process loads no tokenizer at start (`build_engine_core(..., tokenizer=False)`): its EOS
id comes from the tokenizer's files, and structured output loads the tokenizer when first needed. Where
the files do not tell the EOS id, the tokenizer is loaded at start instead; a model without one has
no EOS of its tokenizer's and no structured output. (The server end: test_structured_output_server.py.)"""

from __future__ import annotations

import json

from ferry.config import EngineArgs
from ferry.engine.builder import _deferred_tokenizer


def test_the_eos_id_is_read_and_the_tokenizer_loaded_once_when_asked(tmp_path, smollm):
    smollm.tokenizer.save_pretrained(tmp_path)
    tokenizer, loader = _deferred_tokenizer(EngineArgs(model=str(tmp_path)), str(tmp_path))
    assert tokenizer is None and loader.eos_token_id == smollm.tokenizer.eos_token_id == 2
    first = loader()
    assert first.encode("Hello") == smollm.tokenizer.encode("Hello") and loader() is first


def test_an_eos_the_files_do_not_name_loads_the_tokenizer_at_start(tmp_path, smollm):
    smollm.tokenizer.save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    del config["eos_token"]
    config_path.write_text(json.dumps(config))
    tokenizer, loader = _deferred_tokenizer(EngineArgs(model=str(tmp_path)), str(tmp_path))
    assert loader is None and tokenizer.encode("Hello") == smollm.tokenizer.encode("Hello")


def test_the_tokenizer_flag_names_where_it_is_and_none_means_none(tmp_path, smollm):
    model_dir, tokenizer_dir = tmp_path / "model", tmp_path / "tokenizer"
    model_dir.mkdir()
    assert _deferred_tokenizer(EngineArgs(model=str(model_dir)), str(model_dir)) == (None, None)
    smollm.tokenizer.save_pretrained(tokenizer_dir)
    args = EngineArgs(model=str(model_dir), tokenizer=str(tokenizer_dir))
    tokenizer, loader = _deferred_tokenizer(args, str(model_dir))
    assert tokenizer is None and loader.path == str(tokenizer_dir) and loader.eos_token_id == 2
