import pytest
import torch
import torch.nn.functional as F

from ferry.layers.linear import Linear, onednn_packing_available


@pytest.mark.skipif(not onednn_packing_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_fp64_reference_for_any_batch(bias):
    torch.manual_seed(0)
    lin = Linear(96, 160, bias=bias)
    weight = lin.weight.detach().clone()
    lin.pack()
    assert lin.packed is not None
    for m in (1, 5, 64, 300):
        x = torch.randn(m, 96)
        ref = F.linear(x.double(), weight.double(), lin.bias.double() if bias else None)
        got = lin(x)
        assert got.dtype == torch.float32 and got.shape == (m, 160)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_packing_available(), reason="torch built without oneDNN")
def test_packing_keeps_one_copy_of_the_weight():
    """The packed copy replaces the float weight (one copy of each weight in memory); packing
    again is a no-op, and quantizing a packed layer is a clear error, not a silent fp32 copy."""
    lin = Linear(8, 4, bias=False)
    weight = lin.weight.detach().clone()
    x = torch.randn(2, 8)
    expected = lin(x)
    lin.pack()
    assert lin.weight is None and [p for p in lin.parameters()] == []
    assert torch.equal(lin.float_weight(), weight)  # recoverable from the packed copy
    packed = lin.packed
    lin.pack()
    assert lin.packed is packed
    torch.testing.assert_close(lin(x), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="already packed or quantized"):
        lin.quantize_int8()
