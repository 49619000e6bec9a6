"""A checkpoint's sampling defaults: the fields of its `generation_config.json` that vLLM applies.

vLLM's `--generation-config auto` (its default) makes the model's own temperature, top_p, top_k,
min_p and repetition_penalty the defaults of requests that leave them unset, so a Qwen or Llama
checkpoint samples as its authors tuned it; `vllm` keeps the library's defaults (temperature 1,
...), and a directory reads the file there instead. GGUF files carry no such file. The file's
max_new_tokens becomes `max_tokens`, which caps every request's, as vLLM's get_max_tokens does (the
smallest of the request's, the room left in the context and this one). vLLM's
--override-generation-config '{"temperature": 0.5}' sets fields over the file's (or over none).
"""

from __future__ import annotations

import json
import logging
import math
import os

logger = logging.getLogger(__name__)

# generation_config.json's name -> SamplingParams' (vLLM's list: get_diff_sampling_param).
_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
_INTEGERS = ("top_k", "max_tokens")


def sampling_defaults(model_path: str, generation_config: str = "auto",
                      override: dict | None = None) -> dict[str, float | int]:  # fmt: skip
    """The sampling defaults `generation_config` names: "auto" (the model directory's file), "vllm"
    (none), or a directory holding a generation_config.json; `override` (vLLM's
    --override-generation-config) sets fields over them, in the file's names. ValueError for a
    value that is none of these, a file that is not JSON, or an override field not read here."""
    gen, path = _read(model_path, generation_config), "--override-generation-config"
    if gen is not None:
        gen, path = gen
    if override:
        unknown = sorted(set(override) - set(_FIELDS))
        if unknown:
            raise ValueError(f"--override-generation-config: {', '.join(map(repr, unknown))} not read; it takes "
                             f"{', '.join(_FIELDS)}")  # fmt: skip
        gen = {**(gen if isinstance(gen, dict) else {}), **override}
    out: dict[str, float | int] = {}
    for name, field in _FIELDS.items():
        value = gen.get(name) if isinstance(gen, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out[field] = int(value) if field in _INTEGERS else float(value)
        elif override and name in override:
            raise ValueError(f"--override-generation-config: {name} must be a finite number, got {value!r}")
    if out:
        logger.info("sampling defaults from %s (requests that leave them unset; --generation-config vllm: "
                    "none): %s", path, out)  # fmt: skip
    return out


def _read(model_path: str, generation_config: str) -> tuple[object, str] | None:
    """(the generation_config.json's content, its path), or None where there is none to read."""
    if generation_config == "vllm":
        return None
    directory = model_path if generation_config == "auto" else generation_config
    if generation_config != "auto" and not os.path.isdir(directory):
        raise ValueError(f"--generation-config must be auto, vllm or a directory, got {generation_config!r}")
    path = os.path.join(directory, "generation_config.json") if os.path.isdir(directory) else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return json.load(f), path
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a JSON generation config ({e})") from None
