import math

import pytest
import torch

from ferry.layers.rotary import RotaryEmbedding, rope_inv_freq

CASES = [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    # DeepSeek's: mscale and mscale_all_dim (their ratio scales cos/sin), an unequal pair to see it
    {
        "rope_type": "yarn",
        "factor": 40.0,
        "original_max_position_embeddings": 1024,
        "mscale": 1.0,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "truncate": False},
    {"rope_type": "dynamic", "factor": 2.0},
]


@pytest.mark.parametrize("scaling", CASES, ids=lambda c: "-".join(map(str, (c or {"default": 1}).values())))
def test_inv_freq_matches_transformers(scaling):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = LlamaConfig(
        hidden_size=256,
        num_attention_heads=4,
        max_position_embeddings=4096 if scaling else 2048,
        rope_theta=10000.0,
        rope_scaling=dict(scaling) if scaling else None,
    )
    ours, scale = rope_inv_freq(64, 10000.0, scaling, cfg.max_position_embeddings)
    if scaling is None:
        ref = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
        ref_scale = 1.0
    elif scaling["rope_type"] == "dynamic":
        # HF grows the base only once a sequence is longer than the original context;
        # we apply it for the longest sequence up front (no re-rotation of cached keys).
        ref, ref_scale = ROPE_INIT_FUNCTIONS["dynamic"](cfg, "cpu", seq_len=cfg.max_position_embeddings)
    else:
        ref, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


@pytest.mark.parametrize("rope_type", ["dynamic", "yarn"])
def test_a_context_past_the_trained_one_stretches_from_the_trained_length(rope_type):
    """Served 4x past max_position_embeddings (the default context of such a config): dynamic NTK
    takes its base for the served length, and YaRN without original_max_position_embeddings ramps
    from max_position_embeddings, both as transformers computes them, not from the table's length."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": rope_type, "factor": 4.0}
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=4096, rope_theta=10000.0,
                      rope_scaling=dict(scaling))  # fmt: skip
    ours, scale = rope_inv_freq(64, 10000.0, scaling, 16384, trained_len=4096)
    ref, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](
        cfg, "cpu", **({"seq_len": 16384} if rope_type == "dynamic" else {})
    )
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)
    stretched_from_the_table = rope_inv_freq(64, 10000.0, scaling, 16384)[0]
    assert not torch.allclose(ours, stretched_from_the_table)


def test_deepseek_softmax_scale_takes_mscale_all_dim_squared():
    from ferry.layers.rotary import attention_scale, yarn_mscale

    yarn = {"rope_type": "yarn", "factor": 40.0, "mscale": 0.707, "mscale_all_dim": 0.707}
    assert attention_scale(192, yarn) == pytest.approx(192**-0.5 * (0.1 * 0.707 * math.log(40) + 1) ** 2)
    assert attention_scale(192, None) == attention_scale(192, {"rope_type": "yarn", "factor": 40.0}) == 192**-0.5
    assert yarn_mscale(1.0, 0.707) == 1.0


def test_rotation_preserves_norm_and_relative_position():
    rot = RotaryEmbedding(16, 64, 10000.0, None)
    q = torch.randn(1, 2, 16)
    k = torch.randn(1, 1, 16)

    # <R(m) q, R(n) k> depends only on m - n.
    def score(m, n):
        qm, _ = rot(torch.tensor([m]), q, k)
        _, kn = rot(torch.tensor([n]), q, k)
        return (qm[0, 0] * kn[0, 0]).sum()

    assert score(10, 7).item() == pytest.approx(score(5, 2).item(), rel=1e-5)
    qr, _ = rot(torch.tensor([13]), q, k)
    assert qr.norm().item() == pytest.approx(q.norm().item(), rel=1e-5)
