"""Attention for the whole package: one function on `scaled_dot_product_attention`, and the modules on it.

Downstream projects can lift these on their own:

    from zoo.blocks.attention import MultiHeadAttention, RotaryEmbedding, KVCache, attention

Shapes: B batch, H query heads, Hkv key/value heads (H % Hkv == 0), Tq/Tk query/key length, D head dim.
"""
from __future__ import annotations

import contextlib
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["attention", "sdpa_backend", "RotaryEmbedding", "KVCache", "MultiHeadAttention"]

Backend = Literal["auto", "flash", "efficient", "math", "cudnn"]


@contextlib.contextmanager
def sdpa_backend(backend: Backend = "auto"):
    """Restrict SDPA to one kernel family where the hardware offers several ("auto" lets torch pick)."""
    if backend == "auto":
        yield
        return
    from torch.nn.attention import SDPBackend, sdpa_kernel
    kinds = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}
    if backend not in kinds:
        raise ValueError(f"unknown SDPA backend {backend!r}; choose from auto, {', '.join(kinds)}")
    with sdpa_kernel(kinds[backend]):
        yield


def _allowed(q_pos: Tensor, k_pos: Tensor, causal: bool, window: int | None) -> Tensor | None:
    """(Tq, Tk) boolean mask of positions a query may see; None when everything is allowed."""
    if not causal and window is None:
        return None  # no (Tq, Tk) tensor at all: at 4k tokens it cost 128 MiB and 50% of the time (bench)
    allowed = None
    diff = q_pos[:, None] - k_pos[None, :]  # how far back each key is
    if causal:
        allowed = diff >= 0
    if window is not None:
        near = diff < window if causal else diff.abs() < window
        allowed = near if allowed is None else allowed & near
    return allowed


def attention(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, key_padding_mask: Tensor | None = None,
              attn_mask: Tensor | None = None, window: int | None = None, q_start: int | None = None,
              dropout_p: float = 0.0, scale: float | None = None) -> Tensor:
    """Multi-head attention on SDPA: q (B, H, Tq, D), k and v (B, Hkv, Tk, D) -> (B, H, Tq, D).

    causal: query i sees keys up to its own position. Queries are the last Tq positions of the keys
        (decoding with a cache) unless `q_start` says where they begin.
    key_padding_mask: (B, Tk) bool, True for real tokens. A query that sees no key at all
        (fully padded) returns zeros instead of NaN.
    attn_mask: extra (broadcastable to (B, H, Tq, Tk)) bool mask (True = attend) or additive float bias.
    window: sliding-window (local) attention; each query sees the `window` most recent keys
        (causal) or keys within `window` positions either side. Memory is linear in T for long sequences.
    """
    B, H, Tq, D = q.shape
    Tk, Hkv = k.shape[-2], k.shape[1]
    if H % Hkv:
        raise ValueError(f"{H} query heads are not a multiple of {Hkv} key/value heads")
    if window is not None and window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    q_start = Tk - Tq if q_start is None else q_start
    if (window is not None and Tq == Tk and q_start == 0 and Tq > 2 * window
            and key_padding_mask is None and attn_mask is None):
        return _local_attention(q, k, v, window=window, causal=causal, dropout_p=dropout_p, scale=scale)

    out_dtype = q.dtype
    if _short_cpu_training(q, k, v):
        q, k, v = q.float(), k.float(), v.float()
    if key_padding_mask is not None and key_padding_mask.shape != (B, Tk):
        raise ValueError(f"key_padding_mask must be (batch, keys) = {(B, Tk)}, got {tuple(key_padding_mask.shape)}")
    if key_padding_mask is not None and not torch.compiler.is_compiling() and bool(key_padding_mask.all()):
        # nothing is padded: without a mask SDPA keeps its fastest kernel (as transformers does)
        key_padding_mask = None
    # bool(): traced with a symbolic cache length, `and` would hand SDPA's is_causal a SymBool
    plain_causal = bool(causal and window is None and Tq == Tk and q_start == 0)
    mask = None
    if not plain_causal:
        q_pos = torch.arange(q_start, q_start + Tq, device=q.device)
        mask = _allowed(q_pos, torch.arange(Tk, device=q.device), causal, window)  # (Tq, Tk) or None
    if key_padding_mask is not None:
        pad = key_padding_mask.bool()[:, None, None, :]  # (B, 1, 1, Tk)
        mask = pad if mask is None else mask & pad
        if plain_causal:
            mask = mask & torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
            plain_causal = False
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            mask = attn_mask if mask is None else mask & attn_mask
        else:  # additive bias: fold the boolean part in as -inf
            bias = attn_mask.to(q.dtype)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        if plain_causal:
            causal_mask = torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
            mask = mask & causal_mask if mask.dtype == torch.bool else mask.masked_fill(~causal_mask, float("-inf"))
            plain_causal = False

    empty_rows = None
    if mask is not None and mask.dtype == torch.bool:
        # A row with no visible key makes softmax NaN (also in bf16 fused kernels): let it see
        # everything, then zero its output, so values and gradients stay finite.
        empty_rows = ~mask.any(dim=-1, keepdim=True)  # (..., Tq, 1)
        # traced (compile, export): always guard, since a data-dependent branch breaks the graph
        if torch.compiler.is_compiling() or bool(empty_rows.any()):
            mask = mask | empty_rows
        else:
            empty_rows = None
    # (CPU autocast would cast the fp32 inputs of the short-sequence training case back to bf16)
    with torch.autocast("cpu", enabled=False) if q.dtype != out_dtype else contextlib.nullcontext():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=plain_causal,
                                             scale=scale, enable_gqa=Hkv != H)
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
    return out.to(out_dtype)


def _short_cpu_training(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether to attend in fp32: CPU flash attention's bf16/fp16 *backward* is slow for short sequences
    (torch 2.14, this CPU: 32x12 heads x 128 tokens x head dim 32 took 90 ms in bf16 against 37 ms through
    fp32; at 512 tokens and more bf16 wins), and gradient steps of BERT-style models are exactly that."""
    return (q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16) and k.shape[-2] <= 256
            and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))


def _local_attention(q: Tensor, k: Tensor, v: Tensor, *, window: int, causal: bool, dropout_p: float,
                     scale: float | None) -> Tensor:
    """Sliding-window attention in blocks of `window` queries, each against its own and neighbouring key
    blocks, so time and memory grow linearly with T instead of quadratically."""
    B, H, T, D = q.shape
    w = window
    n_blocks = math.ceil(T / w)
    pad = n_blocks * w - T
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    Hkv = k.shape[1]
    qb = q.view(B, H, n_blocks, w, D)  # (B, H, nb, w, D)
    # Keys for block i: blocks i-1, i (and i+1 when not causal), padded with empty blocks at the edges.
    neighbours = (-1, 0) if causal else (-1, 0, 1)
    kb = k.view(B, Hkv, n_blocks, w, D)
    vb = v.view(B, Hkv, n_blocks, w, D)

    def gather(t):
        padded = F.pad(t, (0, 0, 0, 0, 1, 1))  # (B, Hkv, nb + 2, w, D)
        return torch.cat([padded[:, :, 1 + o:1 + o + n_blocks] for o in neighbours], dim=3)  # (B, Hkv, nb, n*w, D)

    kk, vv = gather(kb), gather(vb)
    q_pos = torch.arange(w, device=q.device) + w  # position within the (prev, cur, next) key span
    k_pos = torch.arange(len(neighbours) * w, device=q.device)
    mask = _allowed(q_pos, k_pos, causal, window)  # (w, n*w), same for every block
    # keys in the padding blocks before the start / after the end are not real
    block = torch.arange(n_blocks, device=q.device)[:, None]
    real = (block * w - w + k_pos[None, :] >= 0) & (block * w - w + k_pos[None, :] < T)  # (nb, n*w)
    mask = mask[None, :, :] & real[:, None, :]  # (nb, w, n*w)
    if Hkv != H:
        kk = kk.repeat_interleave(H // Hkv, dim=1)
        vv = vv.repeat_interleave(H // Hkv, dim=1)
    out = F.scaled_dot_product_attention(qb, kk, vv, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    return out.reshape(B, H, n_blocks * w, D)[:, :, :T]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (RoFormer), in the rotate-half layout of GPT-NeoX and LLaMA."""

    def __init__(self, head_dim: int, *, base: float = 10000.0, max_len: int = 4096):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
        self.head_dim, self.base = head_dim, base
        self._build(max_len)

    def _build(self, max_len: int, device=None):
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
                                        / self.head_dim))
        angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float32), inv_freq)  # (T, D/2)
        angles = torch.cat([angles, angles], dim=-1)  # (T, D)
        # non-persistent: derived from the config, so they never enter (or break) a checkpoint
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """x (B, H, T, D) at positions start..start+T-1."""
        T = x.shape[-2]
        if start + T > self.cos.shape[0]:
            self._build(max(2 * self.cos.shape[0], start + T), device=x.device)
        cos = self.cos[start:start + T].to(x.dtype)
        sin = self.sin[start:start + T].to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class KVCache:
    """Keys and values of earlier positions, preallocated, for incremental decoding; one per layer."""

    def __init__(self, batch: int, n_kv_heads: int, head_dim: int, max_len: int, *, device=None, dtype=None):
        shape = (batch, n_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store k, v (B, Hkv, T, D) after the cached ones; returns all keys and values so far."""
        end = self.length + k.shape[2]
        if end > self.max_len:
            raise RuntimeError(f"KV cache full: {end} positions > max_len {self.max_len}; allocate a larger cache")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]


class MultiHeadAttention(nn.Module):
    """Self-attention with fused QKV projection, grouped-query heads, RoPE, masks, KV cache and local windows.

    x (B, T, dim) -> (B, T, dim). `n_kv_heads` < `n_heads` gives grouped-query attention (1 = multi-query).
    """

    def __init__(self, dim: int, n_heads: int, *, n_kv_heads: int | None = None, bias: bool = True,
                 dropout: float = 0.0, causal: bool = False, window: int | None = None, rope: bool = False,
                 rope_base: float = 10000.0, max_len: int = 4096, backend: Backend = "auto"):
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if dim % n_heads:
            raise ValueError(f"dim {dim} is not divisible by n_heads {n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads {n_heads} is not a multiple of n_kv_heads {n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, dim // n_heads
        self.causal, self.window, self.dropout, self.backend = causal, window, dropout, backend
        self.qkv = nn.Linear(dim, (n_heads + 2 * n_kv_heads) * self.head_dim, bias=bias)
        self.proj = nn.Linear(dim, dim, bias=bias)
        self.rope = RotaryEmbedding(self.head_dim, base=rope_base, max_len=max_len) if rope else None

    def forward(self, x: Tensor, *, key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None,
                cache: KVCache | None = None) -> Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split([self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim,
                                     self.n_kv_heads * self.head_dim], dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, Hkv, T, D)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        start = cache.length if cache is not None else 0
        if self.rope is not None:
            q, k = self.rope(q, start), self.rope(k, start)
        if cache is not None:
            k, v = cache.append(k, v)
        with sdpa_backend(self.backend):
            y = attention(q, k, v, causal=self.causal, window=self.window, key_padding_mask=key_padding_mask,
                          attn_mask=attn_mask, q_start=start, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, dim)
