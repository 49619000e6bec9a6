"""The reference: Hugging Face transformers `generate` with static, left-padded batches."""

from __future__ import annotations

import json
import os
import time

import torch

from ferry.bench.hardware import synchronize


def load_hf_model(
    path: str,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    *,
    dummy_config=None,
    seed: int = 0,
):
    """HF's model for a GGUF file or HF directory, on `device` in `dtype`.

    `dummy_config` (ferry's ModelConfig of a `--load-format dummy` run): build the architecture
    from the config alone (`from_config`) and give it ferry's own random weights, the same
    tensors ferry runs (on the same device), so both compute the same function.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    device = torch.device(device)
    gguf = {"gguf_file": os.path.basename(path)} if path.endswith(".gguf") else {}
    directory = os.path.dirname(path) if gguf else path
    if dummy_config is not None:
        from ferry.models.dummy_weights import iter_dummy_weights

        config = _hf_config(AutoConfig, directory, gguf)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        params = model.state_dict()
        with torch.no_grad():
            for name, tensor in iter_dummy_weights(dummy_config, seed, device):
                params[name].copy_(tensor)
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **gguf).to(device)
    model.eval()
    model.generation_config.eos_token_id = None  # ignore EOS, like the ferry run
    return model


# config.json files written by hand (tests, sketches) may lack `model_type`, which AutoConfig needs.
_MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


def _hf_config(auto_config, directory: str, gguf: dict):
    if gguf:
        return auto_config.from_pretrained(directory, **gguf)
    with open(os.path.join(directory, "config.json")) as f:
        d = json.load(f)
    if "model_type" not in d:
        d["model_type"] = _MODEL_TYPES[d["architectures"][0]]
    return auto_config.for_model(**d)


@torch.inference_mode()
def run_static_batches(
    model, requests: list[tuple[list[int], int]], batch_size: int, pad_token_id: int = 0
) -> tuple[float, int]:
    """Generate greedily for (prompt ids, output length) pairs in arrival-order batches.

    Each batch is left padded to its longest prompt and runs until its longest
    output, the way HF users batch; only the requested tokens are counted.
    Returns (seconds, useful output tokens).
    """
    device = model.device
    synchronize(device)
    t0 = time.perf_counter()
    useful = 0
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (p, _) in enumerate(batch):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        new = max(n for _, n in batch)
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
        assert out.shape[1] == width + new
        useful += sum(n for _, n in batch)
    synchronize(device)
    return time.perf_counter() - t0, useful
