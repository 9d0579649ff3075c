"""transformer_lm: a decoder-only language model on the shared efficient attention.

Pre-norm blocks (RMSNorm -> attention with RoPE -> RMSNorm -> SwiGLU), tied embeddings, and
`generate` with a KV cache. The tokenizer (character or byte level) travels in the weights'
preprocessing metadata.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.blocks.attention import KVCache, MultiHeadAttention
from zoo.blocks.layers import Dropout, RMSNorm, SwiGLU
from zoo.models.base import ZooModel
from zoo.registry import register_model

__all__ = ["LMConfig", "TransformerLM"]


@dataclass(frozen=True)
class LMConfig:
    vocab_size: int = 65  # 65 distinct characters in Tiny Shakespeare; 256 for byte level
    context: int = 256  # longest sequence seen in training; RoPE tables cover it
    dim: int = 384
    n_layers: int = 6
    n_heads: int = 6
    n_kv_heads: int | None = None  # fewer than n_heads: grouped-query attention, a smaller KV cache
    mlp_hidden: int = 1024  # SwiGLU hidden width (about 8/3 * dim, rounded)
    dropout: float = 0.1
    window: int | None = None  # sliding-window attention span; None = full causal attention
    rope_base: float = 10000.0
    tie_embeddings: bool = True  # output projection shares the token embedding (fewer params, better at this size)

    def __post_init__(self):
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must be divisible by n_heads {self.n_heads}")
        if self.vocab_size < 2 or self.context < 1:
            raise ValueError("vocab_size must be >= 2 and context >= 1")


class Block(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.norm1 = RMSNorm(c.dim)
        # No dropout on attention probabilities: it forces SDPA off its fused kernel (a 3x slower step
        # on CPU, measured); residual and MLP dropout regularise enough.
        self.attn = MultiHeadAttention(c.dim, c.n_heads, n_kv_heads=c.n_kv_heads, bias=False,
                                       causal=True, window=c.window, rope=True, rope_base=c.rope_base,
                                       max_len=c.context)
        self.norm2 = RMSNorm(c.dim)
        self.mlp = SwiGLU(c.dim, c.mlp_hidden, dropout=c.dropout)
        self.dropout = Dropout(c.dropout)

    def forward(self, x: Tensor, cache: KVCache | None = None) -> Tensor:
        x = x + self.dropout(self.attn(self.norm1(x), cache=cache))
        return x + self.mlp(self.norm2(x))


@register_model("transformer_lm", config=LMConfig, weights={"tinyshakespeare": "transformer_lm.tinyshakespeare.safetensors"},
                default="tinyshakespeare", description="Decoder-only Transformer LM (RoPE, SwiGLU, "
                "RMSNorm, GQA, sliding-window) with KV-cached generation")
class TransformerLM(ZooModel):
    """Decoder-only Transformer language model."""

    def __init__(self, config: LMConfig = LMConfig()):
        super().__init__()
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.dim)
        self.dropout = Dropout(c.dropout)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.norm = RMSNorm(c.dim)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        self.reset_parameters()
        if c.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def reset_parameters(self):
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)
        for name, p in self.named_parameters():
            if p.dim() >= 2:
                std = 0.02 / math.sqrt(2 * self.config.n_layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    @property
    def checkpoint_blocks(self) -> list[nn.Module]:
        return list(self.blocks)

    def forward(self, idx: Tensor, caches: list[KVCache] | None = None) -> Tensor:
        """idx (B, T) token ids -> logits (B, T, vocab)."""
        x = self.dropout(self.embed(idx))  # (B, T, dim)
        for i, block in enumerate(self.blocks):
            x = block(x, cache=caches[i] if caches is not None else None)
        return self.lm_head(self.norm(x))

    def loss(self, idx: Tensor, targets: Tensor) -> Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def new_caches(self, batch: int, max_len: int, device=None, dtype=None) -> list[KVCache]:
        c = self.config
        head_dim = c.dim // c.n_heads
        return [KVCache(batch, c.n_kv_heads or c.n_heads, head_dim, max_len, device=device,
                        dtype=dtype or self.embed.weight.dtype) for _ in range(c.n_layers)]

    # ------------------------------------------------------------------ benchmarking

    bench_batch = 8

    def example_inputs(self, batch: int = 8) -> tuple[Tensor]:
        g = torch.Generator().manual_seed(0)  # deterministic, as the ZooModel contract asks
        return (torch.randint(0, self.config.vocab_size, (batch, self.config.context), generator=g),)

    def example_loss(self, idx: Tensor) -> Tensor:
        # next-token loss on the example batch itself
        return self.loss(idx[:, :-1], idx[:, 1:])

    # ------------------------------------------------------------------ generation

    @property
    def tokenizer(self):
        from zoo.data.text import tokenizer_from_spec
        meta = getattr(self, "pretrained_meta", None)
        spec = (meta.preprocessing.get("tokenizer") if meta else None)
        if spec is None:
            raise ValueError("this model carries no tokenizer (random weights?); pass token ids to generate()")
        return tokenizer_from_spec(spec)

    @torch.no_grad()
    def generate(self, prompt: str | Tensor, max_new_tokens: int = 200, *, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 use_cache: bool = True) -> str | Tensor:
        """Sample a continuation. A str prompt returns str; a (B, T) id tensor returns ids (B, T + new)."""
        if temperature < 0 or (top_p is not None and not 0 < top_p <= 1) or (top_k is not None and top_k < 1):
            raise ValueError("need temperature >= 0, 0 < top_p <= 1, top_k >= 1")
        as_text = isinstance(prompt, str)
        device = self.embed.weight.device
        if as_text:
            if not prompt:
                raise ValueError("prompt is empty; give at least one character")
            idx = torch.tensor([self.tokenizer.encode(prompt)], device=device)
        else:
            idx = prompt.to(device)
        generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        was_training = self.training
        self.eval()
        context = self.config.context
        caches, fed = None, 0  # `fed`: tokens of idx already in the caches
        for _ in range(max_new_tokens):
            if not use_cache:
                logits = self(idx[:, -context:])[:, -1]
            else:
                if caches is None or fed >= context:
                    # (re)start from the last half context once the cache has seen `context` positions
                    keep = idx[:, -(context // 2 or 1):] if caches is not None else idx[:, -context:]
                    caches = self.new_caches(idx.shape[0], context, device)
                    logits, fed = self(keep, caches)[:, -1], keep.shape[1]
                else:
                    logits, fed = self(idx[:, -1:], caches)[:, -1], fed + 1
            idx = torch.cat([idx, self._sample(logits.float(), temperature, top_k, top_p, generator)], dim=1)
        self.train(was_training)
        return self.tokenizer.decode(idx[0].tolist()) if as_text else idx

    @staticmethod
    def _sample(logits: Tensor, temperature: float, top_k, top_p, generator) -> Tensor:
        if temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits / temperature
        if top_k is not None:
            kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p is not None:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_logits.softmax(-1) > top_p  # keep the smallest set reaching top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)
