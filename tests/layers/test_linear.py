import pytest
import torch
import torch.nn.functional as F

from ferry.layers.linear import Linear, onednn_packing_available


@pytest.mark.skipif(not onednn_packing_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_fp64_reference_for_any_batch(bias):
    torch.manual_seed(0)
    lin = Linear(96, 160, bias=bias)
    lin.pack()
    assert lin.packed is not None
    for m in (1, 5, 64, 300):
        x = torch.randn(m, 96)
        ref = F.linear(x.double(), lin.weight.double(), lin.bias.double() if bias else None)
        got = lin(x)
        assert got.dtype == torch.float32 and got.shape == (m, 160)
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not onednn_packing_available(), reason="torch built without oneDNN")
def test_repacking_follows_weight_changes():
    lin = Linear(8, 4, bias=False)
    lin.pack()
    with torch.no_grad():
        lin.weight.zero_()
    lin.pack()
    assert lin(torch.ones(2, 8)).abs().max().item() == 0.0
