"""Shared layers in zoo.blocks.layers."""
import math

import pytest
import torch
import torch.nn.functional as F

from zoo.blocks.layers import Dropout


@pytest.mark.parametrize("p,dtype,compiled", [(0.1, torch.float32, False), (0.5, torch.float32, False),
                                               (0.9, torch.float32, False), (0.1, torch.bfloat16, False),
                                               (0.1, torch.float32, True)])
def test_dropout_drops_at_rate_p_and_keeps_the_expectation(p, dtype, compiled):
    torch.manual_seed(0)
    n = 1_000_000
    x = torch.ones(n, dtype=dtype)
    dropout = Dropout(p).train()
    y = (torch.compile(dropout) if compiled else dropout)(x)
    assert y.dtype == dtype and y.shape == x.shape
    dropped = (y == 0).float().mean().item()
    assert abs(dropped - p) < 5 * math.sqrt(p * (1 - p) / n)  # five standard errors of a Bernoulli(p) rate
    kept = y[y != 0].float()
    torch.testing.assert_close(kept, torch.full_like(kept, 1 / (1 - round(p * 65536) / 65536)).to(dtype).float())
    # every 16-bit lane is random: a drop rate measured per lane position (4 lanes per 64-bit word) matches p
    for lane in range(4):
        rate = (y[lane::4] == 0).float().mean().item()
        assert abs(rate - p) < 5 * math.sqrt(p * (1 - p) / (n / 4))


def test_dropout_gradient_is_the_same_mask_and_seeded_runs_repeat():
    x = torch.randn(64, 33, requires_grad=True)
    torch.manual_seed(3)
    y = Dropout(0.3).train()(x)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad * x.detach(), y.detach())  # d/dx (x * mask * scale) = mask * scale
    torch.manual_seed(3)
    assert torch.equal(Dropout(0.3).train()(x), y)


def test_dropout_edge_cases_match_torch():
    x = torch.randn(5, 7)
    assert torch.equal(Dropout(0.4).eval()(x), x)
    assert torch.equal(Dropout(0.0).train()(x), x)
    assert torch.equal(Dropout(1.0).train()(x), F.dropout(x, 1.0))
    with pytest.raises(ValueError, match="between 0 and 1"):
        Dropout(1.5)
