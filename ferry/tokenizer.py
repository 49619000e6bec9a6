"""Load the tokenizer of a checkpoint: a GGUF file's embedded vocabulary or an HF directory's files."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# transformers is imported where a tokenizer is loaded, not here: the API process imports this module
# at start (its tokenizer loads in a thread while the engine core starts), and the import is ~1 s.

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
    import transformers

    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return os.path.join(cache_root(), "tokenizers", hashlib.sha256(key.encode()).hexdigest())


def load_tokenizer(path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase | None:
    """Tokenizer for a `.gguf` file or an HF model directory.

    Returns None for a directory without tokenizer files: the engine then takes and returns
    token ids only (vLLM's skip_tokenizer_init). `trust_remote_code` (vLLM's --trust-remote-code):
    a directory whose tokenizer_config.json maps AutoTokenizer to its own Python file (`auto_map`)
    is loaded with that code, which runs in this process; without it such a tokenizer is refused.
    ferry's models are its own code: no checkpoint's modelling code ever runs.
    """
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"tokenizer path {path!r} must be a .gguf file or a Hugging Face model directory")
        return _load_gguf_tokenizer(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"tokenizer path {path!r} does not exist")
    if not has_tokenizer(path):
        logger.warning("%s has no tokenizer files; requests must carry token ids", path)
        return None
    return _load_saved(path, trust_remote_code)


def has_tokenizer(path: str) -> bool:
    """Whether load_tokenizer(path) returns a tokenizer rather than None (its files exist), without
    loading it."""
    if os.path.isfile(path):
        return path.endswith(".gguf")
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, n)) for n in _HF_TOKENIZER_FILES)


def eos_token_id_from_files(path: str) -> int | None:
    """load_tokenizer(path).eos_token_id, read from the tokenizer's files without loading it: an engine
    core process reads this at start instead of importing transformers (~1 s of a 5 s start, and ~70 MB)
    for a tokenizer its API process already runs.

    A `.gguf` file's tokenizer is converted with its metadata's EOS id (`tokenizer.ggml.eos_token_id`,
    which the checkpoint's config already lists): None here. A directory's EOS token is named by
    tokenizer_config.json (or special_tokens_map.json) and found in tokenizer.json. Raises LookupError
    where the files do not say for certain (no tokenizer.json, no EOS named: a tokenizer class may
    default one), so the caller loads the tokenizer instead."""
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            return None
        raise LookupError(f"{path} is not a tokenizer ferry reads without loading it")
    if not has_tokenizer(path):
        return None  # no tokenizer at all (load_tokenizer returns None)
    if os.path.isfile(os.path.join(path, "added_tokens.json")):  # (a slow tokenizer's extra ids)
        raise LookupError(f"{path} has added_tokens.json")
    name, legacy = (_eos_named_in(os.path.join(path, f)) for f in ("tokenizer_config.json", "special_tokens_map.json"))
    # transformers reads special_tokens_map.json only for some tokenizer_config.json files (which varies
    # by version), over the config's own: believed only where both agree or the map names none.
    if not isinstance(name, str) or legacy not in (None, name):
        raise LookupError(f"the tokenizer files in {path} name no single EOS token")
    spec = _read_json(os.path.join(path, "tokenizer.json"))
    for added in spec.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == name and isinstance(added.get("id"), int):
            return added["id"]
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict) and isinstance(vocab.get(name), int):
        return vocab[name]
    if isinstance(vocab, list):  # Unigram: [piece, score] pairs, ids in order
        ids = [i for i, piece in enumerate(vocab) if isinstance(piece, list) and piece and piece[0] == name]
        if ids:
            return ids[0]
    raise LookupError(f"the EOS token {name!r} is not in {path}/tokenizer.json")


def _eos_named_in(path: str) -> object:
    entry = _read_json(path).get("eos_token")
    return entry.get("content") if isinstance(entry, dict) else entry  # (an AddedToken's dict)


def _read_json(path: str) -> dict:
    """A JSON file's top-level object; {} where the file is missing or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise LookupError(f"cannot read {path}: {e}") from e
    return value if isinstance(value, dict) else {}


def _load_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    cache_dir = gguf_tokenizer_cache_dir(path)
    if os.path.isdir(cache_dir):
        logger.debug("loading cached tokenizer of %s from %s", path, cache_dir)
        return _load_saved(cache_dir)
    from transformers import AutoTokenizer  # importing it imports torch (its config lookup)

    start = time.perf_counter()
    # Converting the GGUF vocabulary and merges into a fast tokenizer takes seconds
    # (~4 s for SmolLM2's 49k tokens); loading the saved result takes ~0.1 s.
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    _fill_from_gguf_metadata(tok, path)
    logger.info("converted the tokenizer of %s in %.1f s", path, time.perf_counter() - start)
    _save_to_cache(tok, cache_dir)
    return tok


def _load_saved(directory: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """A tokenizer saved by transformers (an HF model directory, or a converted GGUF's cache), by
    the class its tokenizer_config.json names, looked up on transformers directly, as AutoTokenizer
    does first: AutoTokenizer itself imports transformers' config machinery, which imports torch
    (~2.5 s where torch is not loaded yet: the API process, whose tokenizer this is, never loads it).
    A file that names no class transformers has goes through AutoTokenizer."""
    import transformers

    try:
        with open(os.path.join(directory, "tokenizer_config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    name, own_code = config.get("tokenizer_class"), "AutoTokenizer" in (config.get("auto_map") or {})
    if own_code and trust_remote_code:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory, trust_remote_code=True)
    if isinstance(name, str) and name:
        # AutoTokenizer prefers a class's fast twin (in transformers 5 most names are one class).
        for candidate in (name if name.endswith("Fast") else name + "Fast", name):
            cls = getattr(transformers, candidate, None)
            if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
                return cls.from_pretrained(directory)
    if own_code:  # and a class transformers does not have: only its own code can load it
        raise ValueError(f"the tokenizer of {directory} is its own Python code (tokenizer_config.json's auto_map); "
                         "run it with --trust-remote-code if you trust it")  # fmt: skip
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


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


# -- a token's own bytes --------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spelling:
    """How a tokenizer's pieces spell bytes, read once per tokenizer."""

    mode: str  # "byte_level" (GPT-2's alphabet), "byte_fallback" (SentencePiece's <0xNN>) or ""
    added: dict[int, bytes]  # added (special) tokens: their text


_SPELLINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> _Spelling


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the printable character that stands for each byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(kept)
    n = 0
    for b in range(256):
        if b not in kept:
            kept.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(kept, chars)}


_BYTE_OF_CHAR = _bytes_to_unicode()


def _spelling(tokenizer: PreTrainedTokenizerBase) -> _Spelling:
    """Read from the tokenizer's decoder alone (not its whole JSON: tens of MB for a large vocabulary)
    and its added tokens (transformers builds that dict anew on every access), once."""
    known = _SPELLINGS.get(tokenizer)
    if known is not None:
        return known
    mode = ""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if decoder is not None:
        spec = json.loads(decoder.__getstate__())
        kinds = {d.get("type") for d in spec.get("decoders", [spec]) if isinstance(d, dict)}
        mode = "byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds else ""
    added = {i: t.content.encode() for i, t in tokenizer.added_tokens_decoder.items()}
    known = _SPELLINGS[tokenizer] = _Spelling(mode, added)
    return known


def token_bytes(tokenizer: PreTrainedTokenizerBase, token_id: int) -> bytes | None:
    """The bytes token `token_id` stands for, as OpenAI's logprobs report them: a token that holds
    part of a UTF-8 character gives that part (its decoded text is U+FFFD), so that a client can
    join the pieces back. None where the tokenizer's pieces do not spell bytes (the caller then
    encodes the decoded text)."""
    spelling = _spelling(tokenizer)
    added = spelling.added.get(token_id)
    if added is not None:
        return added
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if not isinstance(piece, str):
        return None
    mode = spelling.mode
    if mode == "byte_level":
        try:
            return bytes(_BYTE_OF_CHAR[c] for c in piece)
        except KeyError:  # not in the byte-level alphabet: spelt some other way
            return None
    if mode == "byte_fallback":
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()
    return None
