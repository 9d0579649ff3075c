"""transformer_lm: a decoder-only language model on the shared efficient attention.

Pre-norm blocks (RMSNorm -> attention with RoPE -> RMSNorm -> SwiGLU), tied embeddings, and
`generate` with a KV cache. The tokenizer (character or byte level) travels in the weights'
preprocessing metadata.

The architecture is LLaMA's, so checkpoints of transformers' `LlamaForCausalLM` / `LlamaModel`
(config.json + safetensors/bin, from a folder or hf://) load through `convert_foreign`: grouped-query
attention, rope theta, tied or untied embeddings, rms_norm_eps. The RoPE layouts agree (both rotate
halves, GPT-NeoX style), so q/k rows are concatenated as they are, without a permutation. The folder's
tokenizer.json becomes `model.tokenizer`. `to_hf_state_dict` / `to_hf_config` map back.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.blocks.attention import KVCache, MultiHeadAttention
from zoo.blocks.layers import Dropout, RMSNorm, SwiGLU
from zoo.models.base import BATCH, Dynamic, ExportGraph, ZooModel, check_config, unwrap
from zoo.registry import register_model
from zoo.weights.loading import key_problems

__all__ = ["LMConfig", "TransformerLM", "to_hf_state_dict", "to_hf_config"]


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
    norm_eps: float = 1e-6  # RMSNorm epsilon (LLaMA checkpoints carry theirs as rms_norm_eps; 1e-5 is common)
    tokenizer: str | None = None  # a folder or Hub repo with a tokenizer.json (a LLaMA checkpoint's own);
    # None: the char/byte tokenizer in the weights' preprocessing metadata
    eos_token_id: int | tuple[int, ...] | None = None  # generate() stops a sequence at it (a LLaMA checkpoint's
    # generation_config.json / config.json value; several ids as Llama 3 has); None: the tokenizer's, else no stop
    pad_token_id: int | None = None  # what generate() writes after a sequence's EOS; None: the (first) EOS id

    def __post_init__(self):
        # (JSON and transformers configs give eos_token_id as a list: check_config makes it a tuple)
        check_config(self, vocab_size=">= 2", context=">= 1", dim=">= 1", n_layers=">= 1", n_heads=">= 1",
                     n_kv_heads=">= 1", mlp_hidden=">= 1", dropout="[0, 1)", window=">= 1", rope_base="> 0",
                     norm_eps="> 0", eos_token_id=">= 0", pad_token_id=">= 0")
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads {self.n_heads} must be divisible by n_kv_heads {self.n_kv_heads}")
        if self.dim % self.n_heads:
            raise ValueError(f"dim {self.dim} must be divisible by n_heads {self.n_heads}")
        if self.vocab_size < 2 or self.context < 1:
            raise ValueError("vocab_size must be >= 2 and context >= 1")


class Block(nn.Module):
    def __init__(self, c: LMConfig):
        super().__init__()
        self.norm1 = RMSNorm(c.dim, eps=c.norm_eps)
        # No dropout on attention probabilities: it forces SDPA off its fused kernel (a 3x slower step
        # on CPU, measured); residual and MLP dropout regularise enough.
        self.attn = MultiHeadAttention(c.dim, c.n_heads, n_kv_heads=c.n_kv_heads, bias=False,
                                       causal=True, window=c.window, rope=True, rope_base=c.rope_base,
                                       max_len=c.context)
        self.norm2 = RMSNorm(c.dim, eps=c.norm_eps)
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
        self.norm = RMSNorm(c.dim, eps=c.norm_eps)
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

    # ------------------------------------------------------------------ Hugging Face LLaMA checkpoints

    @classmethod
    def convert_foreign(cls, state_dict: dict[str, Tensor], folder: Path | None) -> tuple[dict, dict | None]:
        """A transformers LlamaForCausalLM / LlamaModel state dict (+ its config.json) -> (zoo state dict,
        zoo config dict). zoo's own keys without metadata (`torch.save(model.state_dict())`) pass through.
        What zoo's blocks cannot compute (rope scaling, biases, another activation, another head_dim) is
        refused naming the config key."""
        if "embed.weight" in state_dict:
            return state_dict, None
        config_file = folder / "config.json" if folder is not None else None
        if config_file is None or not config_file.is_file():
            raise ValueError("a Hugging Face LLaMA checkpoint needs its config.json beside the weights "
                             f"(none in {folder}); `LlamaForCausalLM(...).save_pretrained(folder)` writes one")
        hf_config = json.loads(config_file.read_text())
        config = _config_from_hf(hf_config, config_file)
        # the ids transformers' generate() stops at and pads with: generation_config.json's, else config.json's
        generation_file = folder / "generation_config.json"
        special = json.loads(generation_file.read_text()) if generation_file.is_file() else hf_config
        config["eos_token_id"], config["pad_token_id"] = special.get("eos_token_id"), special.get("pad_token_id")
        if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
            from zoo.data.tokenizers import tokenizer_spec  # a Hub cache snapshot -> owner/repo, else the folder
            config["tokenizer"] = tokenizer_spec(folder)
        prefix = "model." if any(k.startswith("model.") for k in state_dict) else ""  # LlamaModel has none
        key_map = {ours: [prefix + t for t in theirs] for ours, theirs in _hf_key_map(config["n_layers"]).items()}
        tied = config["tie_embeddings"]
        if not tied:
            key_map["lm_head.weight"] = ["lm_head.weight"]
        mapped, taken = {}, set()
        for ours, names in key_map.items():
            if all(n in state_dict for n in names):  # q, k, v (and gate, up) fused along the output rows
                mapped[ours] = torch.cat([state_dict[n] for n in names], 0) if len(names) > 1 else state_dict[names[0]]
                taken.update(names)
        if tied:
            taken.add("lm_head.weight")  # transformers ties it to the embedding, whatever the file holds
            if "embed.weight" in mapped:
                mapped["lm_head.weight"] = mapped["embed.weight"]
        missing = sorted({n for names in key_map.values() for n in names} - taken)
        # rotary inverse frequencies: a buffer older transformers saved, derived from the config
        unexpected = sorted(k for k in set(state_dict) - taken if not k.endswith("rotary_emb.inv_freq"))
        if missing or unexpected:
            problems = key_problems(missing=missing, unexpected=unexpected)
            raise ValueError(f"{folder}: not a LLaMA checkpoint transformer_lm can load ({problems}). "
                             "It loads the state dicts of transformers' LlamaForCausalLM and LlamaModel "
                             "(with tie_word_embeddings) and zoo's own keys")
        return mapped, config

    # ------------------------------------------------------------------ benchmarking

    bench_batch = 8

    def example_inputs(self, batch: int = 8) -> tuple[Tensor]:
        g = torch.Generator().manual_seed(0)  # deterministic, as the ZooModel contract asks
        return (torch.randint(0, self.config.vocab_size, (batch, self.config.context), generator=g),)

    def example_loss(self, idx: Tensor) -> Tensor:
        # next-token loss on the example batch itself
        return self.loss(idx[:, :-1], idx[:, 1:])

    # ------------------------------------------------------------------ export

    def export_graphs(self, batch: int = 2) -> dict[str, ExportGraph]:
        """Two graphs, for decoding with a KV cache outside Python: "model" reads a whole sequence (a prefill)
        and "decode" one new token per row after `past` cached positions; both give the keys and values
        (n_layers, B, kv_heads, positions, head_dim) to feed the next decode step. The RoPE table bounds
        the positions: seq <= context, past + 1 <= context."""
        c = self.config
        (idx,) = self.example_inputs(batch)
        seq = {0: BATCH, 1: Dynamic("seq", max=c.context)}
        graphs = {"model": ExportGraph(Prefill(self), (idx,), ("input_ids",), (seq,), ("logits", "keys", "values"))}
        if c.context >= 3:  # a past of at least 2 (a traced size of 1 would be specialised) and 1 new token
            past = max(2, c.context // 2)
            with torch.no_grad():
                _, keys, values = Prefill(self)(idx[:, :past])
            cache_dims = {1: BATCH, 3: Dynamic("past", max=c.context - 1)}
            graphs["decode"] = ExportGraph(DecodeStep(self), (idx[:, past:past + 1], keys, values),
                                           ("input_ids", "past_keys", "past_values"),
                                           ({0: BATCH}, cache_dims, cache_dims), ("logits", "keys", "values"))
        return graphs

    # ------------------------------------------------------------------ generation

    @property
    def tokenizer(self):
        """encode(str) -> ids and decode(ids) -> str: the checkpoint's own tokenizer.json (a LLaMA folder's,
        through transformers' fast tokenizer, the full one as `.hf`), else the char/byte tokenizer of zoo's
        weights."""
        if self.config.tokenizer is not None:
            if getattr(self, "_tokenizer", None) is None:
                self._tokenizer = HFTextTokenizer(load_hf_tokenizer(self.config.tokenizer))
            return self._tokenizer
        from zoo.data.text import tokenizer_from_spec
        meta = getattr(self, "pretrained_meta", None)
        spec = (meta.preprocessing.get("tokenizer") if meta else None)
        if spec is None:
            raise ValueError("this model carries no tokenizer (random weights?); pass token ids to generate()")
        return tokenizer_from_spec(spec)

    def _eos_ids(self, eos_token_id) -> tuple[int, ...]:
        """The ids generate() stops at: the argument, else the config's, else the checkpoint tokenizer's."""
        if eos_token_id == "auto":
            eos_token_id = self.config.eos_token_id
            if eos_token_id is None and self.config.tokenizer is not None:
                eos_token_id = self.tokenizer.hf.eos_token_id
        if eos_token_id is None:
            return ()
        return (int(eos_token_id),) if isinstance(eos_token_id, int) else tuple(int(i) for i in eos_token_id)

    @torch.no_grad()
    def generate(self, prompt: str | Tensor, max_new_tokens: int = 200, *, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
                 use_cache: bool = True, eos_token_id: int | list[int] | None | str = "auto",
                 pad_token_id: int | None = None) -> str | Tensor:
        """Sample a continuation. A str prompt returns str; a (B, T) id tensor returns ids (B, T + new).

        A sequence that produces an EOS id (`eos_token_id`; "auto": the config's, else the checkpoint tokenizer's,
        none for the char model; None: never stop) is finished: its later positions get `pad_token_id` (default
        the config's, else the first EOS id), and generation ends once every sequence has finished, so the
        result can be shorter than T + max_new_tokens. This is transformers' `generate` rule, token for token."""
        if temperature < 0 or (top_p is not None and not 0 < top_p <= 1) or (top_k is not None and top_k < 1):
            raise ValueError("need temperature >= 0, 0 < top_p <= 1, top_k >= 1")
        eos = self._eos_ids(eos_token_id)
        pad = pad_token_id if pad_token_id is not None else self.config.pad_token_id
        if pad is None and eos:
            pad = eos[0]
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
        eos_t = torch.tensor(eos, device=device, dtype=idx.dtype)
        unfinished = torch.ones(idx.shape[0], dtype=torch.bool, device=device)
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
            token = self._sample(logits.float(), temperature, top_k, top_p, generator)  # (B, 1)
            if eos:
                token = torch.where(unfinished[:, None], token, torch.full_like(token, pad))
                unfinished &= ~torch.isin(token[:, 0], eos_t)
            idx = torch.cat([idx, token], dim=1)
            if eos and not unfinished.any():
                break
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


# ---------------------------------------------------------------------- export graphs


class GrowingCache:
    """KVCache's interface over keys and values that are a graph's inputs: append concatenates instead of
    writing into a preallocated buffer, so an exported decode step is a pure function (past -> past + new)."""

    def __init__(self, k: Tensor | None = None, v: Tensor | None = None):
        self.k, self.v = k, v
        self.length = 0 if k is None else k.shape[2]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
        self.k, self.v, self.length = k, v, k.shape[2]
        return k, v


class Prefill(nn.Module):
    """input_ids (B, T) -> logits (B, T, vocab), keys and values (n_layers, B, kv_heads, T, head_dim)."""

    def __init__(self, lm: TransformerLM):
        super().__init__()
        self.lm = lm

    def forward(self, idx: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        caches = [GrowingCache() for _ in self.lm.blocks]
        logits = self.lm(idx, caches)
        return logits, torch.stack([c.k for c in caches]), torch.stack([c.v for c in caches])


class DecodeStep(nn.Module):
    """input_ids (B, 1) after P cached positions, keys and values (n_layers, B, kv_heads, P, head_dim) ->
    logits (B, 1, vocab), keys and values with P + 1 positions."""

    def __init__(self, lm: TransformerLM):
        super().__init__()
        self.lm = lm

    def forward(self, idx: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        caches = [GrowingCache(k, v) for k, v in zip(keys.unbind(0), values.unbind(0))]
        logits = self.lm(idx, caches)
        return logits, torch.stack([c.k for c in caches]), torch.stack([c.v for c in caches])


# ---------------------------------------------------------------------- LLaMA layout


def _hf_key_map(n_layers: int) -> dict[str, tuple[str, ...]]:
    """zoo key -> the LlamaModel keys it is made of (concatenated along dim 0, in order); LlamaForCausalLM
    puts `model.` before each and adds lm_head.weight."""
    keys = {"embed.weight": ("embed_tokens.weight",), "norm.weight": ("norm.weight",)}
    for i in range(n_layers):
        ours, theirs = f"blocks.{i}.", f"layers.{i}."
        keys.update({
            ours + "norm1.weight": (theirs + "input_layernorm.weight",),
            ours + "attn.qkv.weight": tuple(f"{theirs}self_attn.{n}_proj.weight" for n in "qkv"),
            ours + "attn.proj.weight": (theirs + "self_attn.o_proj.weight",),
            ours + "norm2.weight": (theirs + "post_attention_layernorm.weight",),
            # SwiGLU chunks gate first, then up
            ours + "mlp.up.weight": (theirs + "mlp.gate_proj.weight", theirs + "mlp.up_proj.weight"),
            ours + "mlp.down.weight": (theirs + "mlp.down_proj.weight",),
        })
    return keys


def _config_from_hf(hf: dict, source) -> dict:
    """LlamaConfig values (config.json) -> LMConfig fields; a value zoo cannot compute is an error naming it."""
    def refuse(key, value, why):
        raise ValueError(f"{source}: {key}={value!r} is not supported by transformer_lm ({why}); it loads LLaMA "
                         "checkpoints with default RoPE, no biases and SiLU (LlamaForCausalLM's defaults)")

    if hf.get("model_type", "llama") != "llama":
        refuse("model_type", hf.get("model_type"), "only the LLaMA architecture is mapped")
    if hf.get("hidden_act", "silu") != "silu":
        refuse("hidden_act", hf["hidden_act"], "the MLP is SwiGLU, SiLU-gated")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            refuse(key, hf[key], "the projections have no bias")
    # transformers < 5: rope_theta and rope_scaling at the top; 5.x: rope_parameters {rope_type, rope_theta, ...}
    if hf.get("rope_scaling") is not None:
        refuse("rope_scaling", hf["rope_scaling"], "zoo's RoPE has no scaling")
    rope = hf.get("rope_parameters") or {}
    if rope.get("rope_type", "default") != "default":
        refuse("rope_parameters.rope_type", rope["rope_type"], "zoo's RoPE has no scaling")
    extra = sorted(set(rope) - {"rope_type", "rope_theta"})
    if extra:
        refuse(f"rope_parameters.{extra[0]}", rope[extra[0]], "zoo's RoPE has no scaling or partial rotation")
    dim, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, dim // heads) or dim % heads:
        refuse("head_dim", hf.get("head_dim"),
               f"zoo's head width is hidden_size / num_attention_heads = {dim / heads:g}")
    kv_heads = hf.get("num_key_value_heads") or heads
    return {"vocab_size": hf["vocab_size"], "context": hf.get("max_position_embeddings", 2048), "dim": dim,
            "n_layers": hf["num_hidden_layers"], "n_heads": heads,
            "n_kv_heads": None if kv_heads == heads else kv_heads,
            "mlp_hidden": hf["intermediate_size"], "dropout": 0.0, "window": None,
            "rope_base": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),  # LlamaConfig's default is untied
            "norm_eps": float(hf.get("rms_norm_eps", 1e-6))}


def to_hf_state_dict(model: TransformerLM) -> dict[str, Tensor]:
    """The model's weights in transformers' LlamaForCausalLM layout (lm_head.weight included, a copy when tied,
    as LlamaForCausalLM.state_dict() has it). A torch.compile or DDP wrapper is looked through."""
    model = unwrap(model)
    c = model.config
    ours = model.state_dict()
    head_dim = c.dim // c.n_heads
    kv = (c.n_kv_heads or c.n_heads) * head_dim
    sizes = {"attn.qkv.weight": [c.dim, kv, kv], "mlp.up.weight": [c.mlp_hidden, c.mlp_hidden]}
    out = {}
    for key, theirs in _hf_key_map(c.n_layers).items():
        parts = ours[key].split(sizes[key.split(".", 2)[-1]], 0) if len(theirs) > 1 else (ours[key],)
        for name, part in zip(theirs, parts):
            out["model." + name] = part.clone()
    out["lm_head.weight"] = ours["lm_head.weight"].clone()
    return out


def to_hf_config(config: LMConfig) -> dict:
    """LlamaConfig keyword arguments for `config`: `LlamaForCausalLM(LlamaConfig(**to_hf_config(c)))` takes
    `to_hf_state_dict(model)`; the EOS and pad ids travel (None stays None, not LlamaConfig's default 2). A
    sliding window has no LLaMA equivalent and is refused."""
    if config.window is not None:
        raise ValueError(f"window={config.window}: LLaMA has no sliding-window attention; only full causal "
                         "transformer_lm models convert to LlamaForCausalLM")
    return {"vocab_size": config.vocab_size, "hidden_size": config.dim, "intermediate_size": config.mlp_hidden,
            "num_hidden_layers": config.n_layers, "num_attention_heads": config.n_heads,
            "num_key_value_heads": config.n_kv_heads or config.n_heads, "max_position_embeddings": config.context,
            "rope_theta": config.rope_base, "rms_norm_eps": config.norm_eps,
            "tie_word_embeddings": config.tie_embeddings, "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "pad_token_id": config.pad_token_id,
            "eos_token_id": list(config.eos_token_id) if isinstance(config.eos_token_id, tuple) else config.eos_token_id}


# ---------------------------------------------------------------------- tokenizer.json


class HFTextTokenizer:
    """A transformers fast tokenizer behind the encode/decode of zoo's char and byte tokenizers: encode adds
    the special tokens the tokenizer is configured to add (LLaMA's BOS), decode drops them. `.hf` is the
    tokenizer itself, for batches, padding and chat templates."""

    def __init__(self, hf):
        self.hf = hf

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)


def load_hf_tokenizer(spec: str):
    """A fast tokenizer from a folder's tokenizer.json (with its tokenizer_config.json when there is one) or
    a (cached) Hub repo id."""
    folder = Path(spec)
    if folder.is_dir() and not (folder / "tokenizer_config.json").is_file():
        if not (folder / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}; put the checkpoint's tokenizer there or "
                                    "load with tokenizer=None and pass token ids to generate()")
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    from zoo.data.tokenizers import load_tokenizer  # AutoTokenizer, with the errors users read
    return load_tokenizer(spec)
