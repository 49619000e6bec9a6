"""SmoothQuant-style smoothing before int8 quantization (`--quantization int8`).

Per-token int8 activations lose most of their precision to a few input
channels that are much larger than the rest (RMSNorm weights and the
residual stream create them). SmoothQuant (Xiao et al., 2023) divides each
input channel j of a linear by s_j and multiplies the weight's column j by
s_j, which leaves the product unchanged in exact arithmetic but moves the
outliers from the activations into the weights, where per-channel weight
scales absorb them:
    s_j = max|X_j| ** alpha / max|W[:, j]| ** (1 - alpha).
The division is folded into whatever produces X (an RMSNorm's weight, or the
rows of the up projection before SiLU-and-mul), so it costs nothing at run
time. max|X_j| comes from one fp32 forward pass over a built-in calibration
text when the model is loaded.

On SmolLM2-135M (teacher-forced over 1,000 tokens of DESIGN.md, against fp32)
alpha = 0.5 cuts the KL divergence of int8 from 0.049 to 0.015 and keeps
perplexity within ~1%; see `ferry bench quant`.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import nn

DEFAULT_ALPHA = 0.5

# Served traffic is chat: prose, lists, code and numbers, in the model's chat template.
CALIBRATION_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Answer clearly, and show your reasoning when asked."},
    {
        "role": "user",
        "content": "Explain how a paged KV cache works in an LLM inference server, then write a Python "
        "function that splits a list into chunks of n items, and list three facts about the Moon.",
    },
    {
        "role": "assistant",
        "content": "A paged KV cache stores the keys and values of each sequence in fixed-size blocks, "
        "like pages of virtual memory. A block table maps every sequence to its blocks, so memory is "
        "allocated on demand, freed without fragmentation, and shared between requests with a common "
        'prefix.\n\n```python\ndef chunks(items, n):\n    if n < 1:\n        raise ValueError("n must be '
        '>= 1")\n    return [items[i : i + n] for i in range(0, len(items), n)]\n```\n\nThree facts about '
        "the Moon:\n1. Its mean distance from Earth is about 384,400 km.\n2. It always shows the same "
        "face to Earth, because it is tidally locked.\n3. Twelve astronauts walked on it between 1969 and "
        "1972, during the Apollo program.",
    },
    {
        "role": "user",
        "content": "Translate 'The weather is lovely today' into French and German. Then: if a train "
        "leaves at 14:35 and the trip takes 2 h 50 min, when does it arrive? Finally, summarise the plot "
        "of Romeo and Juliet in two sentences.",
    },
    {
        "role": "assistant",
        "content": "French: « Il fait très beau aujourd'hui. » German: „Das Wetter ist heute herrlich.“\n"
        "14:35 + 2:50 = 17:25, so the train arrives at 17:25.\nTwo young lovers from feuding families in "
        "Verona marry in secret. A chain of misunderstandings leads both to take their own lives, which "
        "finally reconciles their families.",
    },
]


def calibration_token_ids(tokenizer, vocab_size: int, max_tokens: int = 1024) -> list[int]:
    """The calibration text in the model's chat template (plain text without one); seeded
    random ids when there is no tokenizer at all (tiny test configs)."""
    if tokenizer is None:
        g = torch.Generator().manual_seed(0)
        return torch.randint(0, vocab_size, (256,), generator=g).tolist()
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(CALIBRATION_MESSAGES, tokenize=True)
        if hasattr(ids, "input_ids"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
    else:
        ids = tokenizer.encode("\n\n".join(m["content"] for m in CALIBRATION_MESSAGES))
    return [i for i in ids if 0 <= i < vocab_size][:max_tokens]


@contextmanager
def record_input_absmax(modules: dict[str, nn.Module]) -> Iterator[dict[str, torch.Tensor]]:
    """Within the block, record max |x_j| over all tokens of each module's input channels."""
    stats: dict[str, torch.Tensor] = {}

    def make_hook(name: str):
        def hook(_module, inputs, _output):
            x = inputs[0].detach()
            a = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            stats[name] = torch.maximum(stats[name], a) if name in stats else a

        return hook

    handles = [m.register_forward_hook(make_hook(name)) for name, m in modules.items()]
    try:
        yield stats
    finally:
        for h in handles:
            h.remove()


def smoothing_factors(act_absmax: torch.Tensor, weight: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> torch.Tensor:
    """s_j for a linear with weight [out, in] whose input channels reach act_absmax [in]."""
    return smoothing_factors_from_maxima(act_absmax, weight_column_absmax(weight), alpha)


def weight_column_absmax(weight: torch.Tensor) -> torch.Tensor:
    """max_i |W[i, j]| of a weight [out, in], in fp32 (under tensor parallelism, of this rank's rows;
    the model reduces them over ranks to smooth each shard as one rank would)."""
    return weight.detach().float().abs().amax(dim=0)


def smoothing_factors_from_maxima(act_absmax: torch.Tensor, w_absmax: torch.Tensor, alpha: float) -> torch.Tensor:
    a = act_absmax.float().clamp_min(1e-5)
    w = w_absmax.float().clamp_min(1e-5)
    return (a.pow(alpha) / w.pow(1.0 - alpha)).clamp_min(1e-5)
