"""The reference: Hugging Face transformers `generate` with static, left-padded batches."""

from __future__ import annotations

import os
import time

import torch


def load_hf_model(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None  # ignore EOS, like the ferry run
    return model


@torch.inference_mode()
def run_static_batches(
    model, requests: list[tuple[list[int], int]], batch_size: int, pad_token_id: int = 0
) -> tuple[float, int]:
    """Generate greedily for (prompt ids, output length) pairs in arrival-order batches.

    Each batch is left padded to its longest prompt and runs until its longest
    output, the way HF users batch; only the requested tokens are counted.
    Returns (seconds, useful output tokens).
    """
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
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_token_id,
        )
        assert out.shape[1] == width + new
        useful += sum(n for _, n in batch)
    return time.perf_counter() - t0, useful
