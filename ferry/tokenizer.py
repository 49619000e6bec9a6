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
    from importlib.metadata import version  # (not transformers.__version__: its import is ~1 s)

    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{version('transformers')}"
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
    """load_tokenizer(path).eos_token_id for an HF directory, read from its files without loading the
    tokenizer: an engine core process reads this at start instead of importing transformers (~1 s of a
    5 s start, and ~70 MB) for a tokenizer its API process already runs. The EOS token is named by
    tokenizer_config.json (and special_tokens_map.json, where it agrees) and found in tokenizer.json.
    None for a directory without tokenizer files. Raises LookupError where the files do not say for
    certain (no tokenizer.json, no EOS named: a tokenizer class may default one; its own code), and
    for anything but a directory (a GGUF's EOS is its metadata's), so the caller loads the tokenizer."""
    if not os.path.isdir(path):
        raise LookupError(f"{path} is not a tokenizer directory")
    if not has_tokenizer(path):
        return None  # no tokenizer at all (load_tokenizer returns None)
    config = _read_json(os.path.join(path, "tokenizer_config.json"))
    _check_no_own_code_or_slow_files(path, config)
    name, legacy = _token_content(config.get("eos_token")), _token_content(
        _read_json(os.path.join(path, "special_tokens_map.json")).get("eos_token"))  # fmt: skip
    # transformers reads special_tokens_map.json only for some tokenizer_config.json files (which varies
    # by version), over the config's own: believed only where both agree or the map names none.
    if not isinstance(name, str) or legacy not in (None, name):
        raise LookupError(f"the tokenizer files in {path} name no single EOS token")
    token_id = _read_tokenizer_json(path).token_to_id(name)  # (an added token's, or the vocabulary's)
    if token_id is None:
        raise LookupError(f"the EOS token {name!r} is not in {path}/tokenizer.json")
    return token_id


# Tokenizer classes that run tokenizer.json as it is (model-specific ones may rewrite its normalizer,
# pre-tokenizer or post-processor when they load it).
_GENERIC_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def backend_tokenizer_from_files(path: str):
    """The `tokenizers.Tokenizer` transformers would run for `path` (padding and truncation off), read
    straight from tokenizer.json, without transformers: for structured output in an engine core, which
    loads no tokenizer at start (llguidance needs only this). `path`: an HF directory, or a GGUF whose
    tokenizer a first load has converted (cached). Raises LookupError wherever transformers might make
    another of it: a model-specific tokenizer class, special or added tokens tokenizer.json lacks,
    split special tokens, its own code; the caller loads the tokenizer with transformers then."""
    directory = path
    if os.path.isfile(path) and path.endswith(".gguf"):
        directory = gguf_tokenizer_cache_dir(path)
    if not os.path.isfile(os.path.join(directory, "tokenizer.json")):
        raise LookupError(f"no tokenizer.json in {directory}")
    config = _read_json(os.path.join(directory, "tokenizer_config.json"))
    _check_no_own_code_or_slow_files(directory, config)
    if config.get("tokenizer_class") not in _GENERIC_TOKENIZER_CLASSES or config.get("split_special_tokens"):
        raise LookupError(f"{directory}'s tokenizer class {config.get('tokenizer_class')!r} may change tokenizer.json")
    tokenizer = _read_tokenizer_json(directory)
    added = {(str(i), t.content) for i, t in tokenizer.get_added_tokens_decoder().items()}
    decoder = config.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict) or any(
        not isinstance(t, dict) or (str(i), t.get("content")) not in added for i, t in decoder.items()
    ):
        raise LookupError(f"{directory}/tokenizer_config.json adds tokens its tokenizer.json lacks")
    contents = {content for _, content in added}
    named = [_token_content(v) for k, v in config.items() if k.endswith("_token")]  # (add_bos_token: a bool)
    for key in ("additional_special_tokens", "extra_special_tokens"):
        extra = config.get(key) or []
        named += [_token_content(v) for v in (extra.values() if isinstance(extra, dict) else extra)]
    if any(isinstance(n, str) and n not in contents for n in named):
        raise LookupError(f"{directory}'s special tokens are not all among tokenizer.json's added tokens")
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def _read_tokenizer_json(directory: str):
    """The directory's tokenizer.json as a `tokenizers.Tokenizer` (Rust; ~0.15 s for a 49k vocabulary)."""
    file = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(file):
        raise LookupError(f"no {file}")
    import tokenizers

    try:
        return tokenizers.Tokenizer.from_file(file)
    except Exception as e:  # (tokenizers raises its own exception types for a malformed file)
        raise LookupError(f"cannot read {file}: {e}") from e


def _check_no_own_code_or_slow_files(directory: str, config: dict) -> None:
    if "AutoTokenizer" in (config.get("auto_map") or {}):
        raise LookupError(f"the tokenizer of {directory} is its own code")
    if os.path.isfile(os.path.join(directory, "added_tokens.json")):  # (a slow tokenizer's extra ids)
        raise LookupError(f"{directory} has added_tokens.json")
    if "fast_tokenizer_files" in config:  # (versioned tokenizer files: another tokenizer.json may be read)
        raise LookupError(f"{directory}'s tokenizer_config.json names fast_tokenizer_files")


def _token_content(entry: object) -> object:
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
