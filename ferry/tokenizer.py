"""Load the tokenizer of a checkpoint: a GGUF file's embedded vocabulary or an HF directory's files."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
import time

import transformers
from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# Files any one of which makes an HF directory's tokenizer loadable.
_HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def cache_root() -> str:
    """Where ferry keeps derived files: $FERRY_CACHE_DIR, else ~/.cache/ferry."""
    return os.environ.get("FERRY_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ferry")


def gguf_tokenizer_cache_dir(gguf_path: str) -> str:
    """The cache directory of a GGUF file's converted tokenizer.

    Keyed by the file's identity (path, size, mtime) rather than its content: hashing a
    multi-GB file would cost more than the conversion it saves. The transformers version is
    part of the key because the saved format is whatever that version writes.
    """
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(cache_root(), "tokenizers", hashlib.sha256(key.encode()).hexdigest())


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """Tokenizer for a `.gguf` file or an HF model directory.

    Returns None for a directory without tokenizer files: the engine then takes and returns
    token ids only (vLLM's skip_tokenizer_init).
    """
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"tokenizer path {path!r} must be a .gguf file or a Hugging Face model directory")
        return _load_gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    if not any(os.path.isfile(os.path.join(path, n)) for n in _HF_TOKENIZER_FILES):
        logger.warning("%s has no tokenizer files; requests must carry token ids", path)
        return None
    return AutoTokenizer.from_pretrained(path)


def _load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    cache_dir = gguf_tokenizer_cache_dir(path)
    if os.path.isdir(cache_dir):
        logger.debug("loading cached tokenizer of %s from %s", path, cache_dir)
        return AutoTokenizer.from_pretrained(cache_dir)

    start = time.perf_counter()
    # Converting the GGUF vocabulary and merges into a fast tokenizer takes seconds
    # (~4 s for SmolLM2's 49k tokens); loading the saved result takes ~0.1 s.
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    _fill_from_gguf_metadata(tok, path)
    logger.info("converted the tokenizer of %s in %.1f s", path, time.perf_counter() - start)
    _save_to_cache(tok, cache_dir)
    return tok


def _fill_from_gguf_metadata(tok: PreTrainedTokenizerBase, path: str) -> None:
    """Set the chat template and special tokens from GGUF metadata where transformers left them unset."""
    if tok.chat_template is not None and tok.eos_token is not None and tok.bos_token is not None:
        return
    from gguf import GGUFReader

    fields = GGUFReader(path).fields

    def value(key: str) -> object:
        f = fields.get(key)
        return None if f is None else f.contents()

    if tok.chat_template is None:
        tok.chat_template = value("tokenizer.chat_template")
    for role in ("eos", "bos"):
        token_id = value(f"tokenizer.ggml.{role}_token_id")
        if getattr(tok, f"{role}_token") is None and token_id is not None:
            setattr(tok, f"{role}_token", tok.convert_ids_to_tokens(int(token_id)))


def _save_to_cache(tok: PreTrainedTokenizerBase, cache_dir: str) -> None:
    """Save atomically: other processes (API server, gateway) may load the same model at once."""
    parent = os.path.dirname(cache_dir)
    tmp = None
    try:
        os.makedirs(parent, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=parent, prefix=".tmp-")
        tok.save_pretrained(tmp)
        os.rename(tmp, cache_dir)
        tmp = None
    except OSError as e:
        # Either another process cached it first (its copy is as good as ours), or the cache
        # is unwritable, which only costs time and must not stop the server.
        if not os.path.isdir(cache_dir):
            logger.warning("could not cache the tokenizer in %s: %s", cache_dir, e)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
