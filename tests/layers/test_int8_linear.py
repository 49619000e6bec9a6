"""Dynamic W8A8 int8 linear (oneDNN) and the SmoothQuant folding before it."""

import pytest
import torch
import torch.nn.functional as F

from ferry.layers.int8_linear import (
    int8_linear,
    int8_linear_available,
    pack_int8_weight,
    quantize_weight,
    weight_qmax,
)
from ferry.layers.linear import Linear
from ferry.layers.smoothquant import smoothing_factors
from ferry.models.config import ModelConfig
from ferry.models.llama import LlamaForCausalLM

needs_int8 = pytest.mark.skipif(not int8_linear_available(), reason="torch built without oneDNN int8 ops")


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def test_weight_quantization_error_is_half_a_step_per_channel():
    torch.manual_seed(0)
    w = torch.randn(64, 32) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different scale
    q, scale = quantize_weight(w)
    assert q.dtype == torch.int8 and q.abs().max().item() == 127
    err = (q.float() * scale[:, None] - w).abs().amax(dim=1)
    assert torch.all(err <= scale / 2 + 1e-7)


@needs_int8
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_close_to_fp64_for_any_batch(bias):
    torch.manual_seed(0)
    lin = Linear(96, 160, bias=bias)
    weight = lin.weight.detach().clone()
    lin.quantize_int8()
    assert lin.weight is None  # the int8 copy is the only one
    for m in (1, 5, 64, 300):
        x = torch.randn(m, 96)
        ref = F.linear(x.double(), weight.double(), lin.bias.double() if bias else None)
        got = lin(x)
        assert got.dtype == torch.float32 and got.shape == (m, 160)
        assert rel_err(got, ref) < 0.02
    assert lin(torch.randn(2, 3, 96)).shape == (2, 3, 160)
    assert lin(torch.empty(0, 96)).shape == (0, 160)


@needs_int8
def test_activation_scales_are_per_token():
    """One huge row (a prefill token with an outlier) must not cost the other rows their
    precision, as a per-tensor activation scale would."""
    torch.manual_seed(0)
    w = torch.randn(64, 128) * 0.05
    packed = pack_int8_weight(w)
    x = torch.randn(8, 128)
    x[3] *= 1000.0
    x[5] = 0.0
    got = int8_linear(x, packed, None)
    ref = F.linear(x.double(), w.double())
    for row in range(8):
        if row == 5:
            assert torch.count_nonzero(got[row]) == 0  # an all-zero row stays exactly zero, no NaN
        else:
            assert rel_err(got[row], ref[row]) < 0.02, row


def test_smoothing_factors_formula():
    act = torch.tensor([4.0, 1.0, 0.0])
    w = torch.tensor([[1.0, -9.0, 2.0], [-0.25, 1.0, 0.5]])  # column maxima 1, 9, 2
    s = smoothing_factors(act, w, alpha=0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 1.0 / 3.0, (1e-5) ** 0.5 / 2**0.5]))


def tiny_llama(tie: bool) -> LlamaForCausalLM:
    cfg = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128, hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=tie,
        attention_bias=False, qk_norm=False, sliding_window=None, bos_token_id=None, eos_token_ids=[0],
        dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, max_position=64)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
        for name, p in model.named_parameters():
            if "norm" in name:  # norm weights with outlier channels, as trained models have
                p.copy_(1.0 + torch.rand_like(p) * 4.0)
    model.init_rotary()
    return model.eval()


@pytest.mark.parametrize("tie", [True, False])
def test_smoothing_leaves_the_fp32_function_unchanged(tie):
    model = tiny_llama(tie)
    ids = list(range(3, 40))
    before = F.linear(model._forward_prompt(ids), model._lm_head_weight())
    embedding = model.embed_tokens.weight.detach().clone()
    head = model.smooth_for_int8(list(range(50, 90)), alpha=0.5)
    after = F.linear(model._forward_prompt(ids), head)
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert torch.equal(model.embed_tokens.weight, embedding)  # a tied head's scaling went to a copy
    assert not torch.allclose(model.norm.weight, torch.ones(64))


@needs_int8
def test_quantized_tiny_model_tracks_fp32():
    model = tiny_llama(tie=True)
    ids = list(range(3, 40))
    ref = model.compute_logits(model._forward_prompt(ids)).log_softmax(-1)
    model.quantize_linear_weights_int8(list(range(50, 90)))
    assert all(m.int8 is not None for m in model.modules() if isinstance(m, Linear))
    got = model.compute_logits(model._forward_prompt(ids)).log_softmax(-1)
    kl = (ref.exp() * (ref - got)).sum(-1).mean().item()
    # Without VNNI the weights have 7 bits (weight_qmax): twice the step, about 4x the KL.
    assert kl < (0.05 if weight_qmax() == 127 else 0.15)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9


@needs_int8
def test_int8_gemm_is_exact_on_the_quantized_operands():
    """oneDNN's int8 GEMM with the weight range this CPU gets (weight_qmax) returns exactly the
    integer products: on AVX2 without VNNI, full 8-bit weights saturate its int16 pair sums
    (measured here: 5-8% error), 7-bit ones do not."""
    from ferry.layers.int8_linear import quantize_per_token_reference

    torch.manual_seed(0)
    w, x = torch.randn(160, 96), torch.randn(300, 96) * 3.0
    packed = pack_int8_weight(w)
    q, sw = quantize_weight(w, weight_qmax())
    xq, sx = quantize_per_token_reference(x)
    exact = ((xq.double() - 128) @ q.double().T) * sw.double() * sx.double()
    assert rel_err(int8_linear(x, packed, None), exact) < 1e-6
