"""Every attention option against a plain materialised-softmax reference (which lives only here)."""
import math

import pytest
import torch

from zoo.blocks.attention import KVCache, MultiHeadAttention, RotaryEmbedding, attention

torch.manual_seed(0)


def reference(q, k, v, *, causal=False, key_padding_mask=None, window=None, q_start=None, attn_mask=None):
    """softmax(q k^T / sqrt(d) + mask) v, written out; fully masked rows give zeros."""
    B, H, Tq, D = q.shape
    Tk = k.shape[2]
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    v = v.repeat_interleave(H // v.shape[1], dim=1)
    start = Tk - Tq if q_start is None else q_start
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, Tq, Tk)
    allowed = torch.ones(B, H, Tq, Tk, dtype=torch.bool)
    for i in range(Tq):
        for j in range(Tk):
            p = start + i
            if causal and j > p:
                allowed[:, :, i, j] = False
            if window is not None and (p - j >= window if causal else abs(p - j) >= window):
                allowed[:, :, i, j] = False
    if key_padding_mask is not None:
        allowed &= key_padding_mask[:, None, None, :]
    if attn_mask is not None:
        allowed &= attn_mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return weights @ v


def qkv(B=2, H=4, Hkv=4, Tq=9, Tk=9, D=8, requires_grad=False):
    q = torch.randn(B, H, Tq, D, requires_grad=requires_grad)
    k = torch.randn(B, Hkv, Tk, D, requires_grad=requires_grad)
    v = torch.randn(B, Hkv, Tk, D, requires_grad=requires_grad)
    return q, k, v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Hkv", [4, 2, 1])
def test_masks_and_grouped_query(causal, Hkv):
    q, k, v = qkv(Hkv=Hkv)
    torch.testing.assert_close(attention(q, k, v, causal=causal), reference(q, k, v, causal=causal), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_padding_mask_with_fully_padded_row(causal):
    q, k, v = qkv()
    pad = torch.ones(2, 9, dtype=torch.bool)
    pad[0, 5:] = False
    pad[1, :] = False  # a sequence with no real token: zeros, not NaN
    out = attention(q, k, v, causal=causal, key_padding_mask=pad)
    torch.testing.assert_close(out, reference(q, k, v, causal=causal, key_padding_mask=pad), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


def test_fully_masked_rows_finite_in_bf16_with_gradients():
    q, k, v = (t.bfloat16().requires_grad_() for t in qkv())
    pad = torch.zeros(2, 9, dtype=torch.bool)
    out = attention(q, k, v, key_padding_mask=pad)
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all() and torch.isfinite(q.grad.float()).all()


class SdpaInputDtypes(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the dtype SDPA's kernels receive (after autocast has cast the inputs)."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.name() and "backward" not in func.name():
            self.dtypes.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_short_bf16_training_attends_in_fp32_and_returns_bf16():
    q, k, v = (t.bfloat16().requires_grad_() for t in qkv())
    with SdpaInputDtypes() as seen, torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v, causal=True)
    assert seen.dtypes == [torch.float32] and out.dtype == torch.bfloat16
    out.float().pow(2).sum().backward()
    grads = [t.grad for t in (q, k, v)]
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    reference(q32, k32, v32, causal=True).pow(2).sum().backward()
    for g, ref in zip(grads, (q32.grad, k32.grad, v32.grad)):
        assert g.dtype == torch.bfloat16
        torch.testing.assert_close(g.float(), ref, atol=3e-2, rtol=3e-2)
    with SdpaInputDtypes() as seen, torch.no_grad():
        attention(q, k, v)
    assert seen.dtypes == [torch.bfloat16], "inference keeps the bf16 kernel"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("T,window", [(9, 3), (40, 4), (37, 5)])
def test_sliding_window(causal, T, window):
    q, k, v = qkv(Tq=T, Tk=T, Hkv=2)  # T > 2 * window takes the blocked linear-memory path
    torch.testing.assert_close(attention(q, k, v, causal=causal, window=window),
                               reference(q, k, v, causal=causal, window=window), atol=1e-5, rtol=1e-5)


def test_boolean_attn_mask_and_decoding_offset():
    q, k, v = qkv(Tq=3, Tk=9)
    extra = torch.rand(1, 1, 3, 9) > 0.3
    torch.testing.assert_close(attention(q, k, v, causal=True, attn_mask=extra),
                               reference(q, k, v, causal=True, attn_mask=extra), atol=1e-5, rtol=1e-5)


def test_gradients_match_reference():
    q, k, v = qkv(Hkv=2, requires_grad=True)
    attention(q, k, v, causal=True).pow(2).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    reference(q, k, v, causal=True).pow(2).sum().backward()
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_errors():
    q, k, v = qkv(H=4, Hkv=3)
    with pytest.raises(ValueError, match="not a multiple"):
        attention(q, k, v)
    q, k, v = qkv()
    with pytest.raises(ValueError, match="key_padding_mask must be"):
        attention(q, k, v, key_padding_mask=torch.ones(2, 5, dtype=torch.bool))


def test_rotary_is_a_relative_position_encoding():
    rope = RotaryEmbedding(8)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    # <R(m) q, R(n) k> depends on m - n only
    a = (rope(q, start=3) * rope(k, start=1)).sum()
    b = (rope(q, start=10) * rope(k, start=8)).sum()
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert rope.cos.shape[0] == 4096
    rope(torch.randn(1, 1, 5000, 8))  # grows past its table instead of failing


@pytest.mark.parametrize("n_kv_heads,window", [(None, None), (2, None), (1, 4)])
def test_cached_decoding_equals_full_recomputation(n_kv_heads, window):
    mha = MultiHeadAttention(32, 4, n_kv_heads=n_kv_heads, causal=True, rope=True, window=window).eval()
    x = torch.randn(2, 11, 32)
    full = mha(x)
    cache = KVCache(2, n_kv_heads or 4, 8, max_len=16)
    parts = [mha(x[:, :6], cache=cache)] + [mha(x[:, i:i + 1], cache=cache) for i in range(6, 11)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="KV cache full"):
        mha(torch.randn(2, 6, 32), cache=cache)


def test_module_matches_reference_with_padding():
    mha = MultiHeadAttention(32, 4, n_kv_heads=2).eval()
    x = torch.randn(2, 7, 32)
    pad = torch.tensor([[1] * 7, [1] * 4 + [0] * 3], dtype=torch.bool)
    q, k, v = mha.qkv(x).split([32, 16, 16], dim=-1)
    q = q.view(2, 7, 4, 8).transpose(1, 2)
    k = k.view(2, 7, 2, 8).transpose(1, 2)
    v = v.view(2, 7, 2, 8).transpose(1, 2)
    want = mha.proj(reference(q, k, v, key_padding_mask=pad).transpose(1, 2).reshape(2, 7, 32))
    torch.testing.assert_close(mha(x, key_padding_mask=pad), want, atol=1e-5, rtol=1e-5)


def test_attention_block_compiles_without_graph_breaks():
    import zoo.accel
    mha = MultiHeadAttention(32, 4, causal=True, rope=True).eval()
    report = zoo.accel.explain(mha, torch.randn(2, 8, 32))
    assert report.graph_break_count == 0, report.break_reasons
    assert report.graph_count == 1
