"""Train or fine-tune `transformer_lm` on a text file (character or byte level).

    python train_scripts/transformer_lm.py --data ../shared/data/tinyshakespeare/input.txt --steps 2000 --amp bf16
    python train_scripts/transformer_lm.py --eval-only --pretrained default --data ../shared/data/tinyshakespeare/input.txt

The last 10% of the text is the validation split; validation loss is in nats per token.
"""
from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

import zoo
from zoo.data.text import BlockDataset, ByteTokenizer, CharTokenizer, read_corpus
from zoo.train import Task, add_train_args, config_from_args, main_guard, run, setup_logging


class StridedBlocks(BlockDataset):
    """Validation: non-overlapping blocks covering the split, so every token is scored once."""

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.context

    def __getitem__(self, i: int):
        return super().__getitem__(i * self.context)


def build_task(cfg) -> Task:
    a = cfg.extra
    if cfg.data is None:
        raise ValueError("--data is required: a UTF-8 text file, e.g. ../shared/data/tinyshakespeare/input.txt")
    text = read_corpus(cfg.data)
    model_options = {k: a[k] for k in ("context", "dim", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden",
                                       "dropout", "window") if a.get(k) is not None}
    if not 0 < a["val_fraction"] < 1:
        raise ValueError(f"--val-fraction is the share of the corpus held out for validation (its end), between 0 "
                         f"and 1 exclusive; got {a['val_fraction']}")
    architecture = [f"--{k.replace('_', '-')}" for k in model_options if k != "dropout"]
    if cfg.pretrained and architecture:
        raise ValueError(f"--pretrained {cfg.pretrained} brings its own architecture; {', '.join(architecture)} "
                         "would be ignored: drop them, or train from scratch without --pretrained")
    if cfg.pretrained:
        model = zoo.load("transformer_lm", pretrained=cfg.pretrained,
                         **{k: v for k, v in model_options.items() if k == "dropout"})
        tokenizer = model.tokenizer
    else:
        tokenizer = CharTokenizer.from_text(text) if a["tokenizer"] == "char" else ByteTokenizer()
        model = zoo.load("transformer_lm", vocab_size=tokenizer.vocab_size, **model_options)
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    split = int(len(ids) * (1 - a["val_fraction"]))
    context = model.config.context
    train_ids, val_ids = ids[:split], ids[split:]

    def loss(m, batch):
        x, y = batch
        return F.cross_entropy(m(x).float().flatten(0, 1), y.flatten())

    def eval_step(m, batch):
        x, y = batch
        nll = F.cross_entropy(m(x).float().flatten(0, 1), y.flatten(), reduction="sum")
        return {"nll": nll, "tokens": torch.tensor(y.numel())}

    def summarize(s):
        val_loss = float(s["nll"] / s["tokens"])
        return {"val_loss": round(val_loss, 4), "val_ppl": round(float(torch.exp(torch.tensor(val_loss))), 3)}

    def after_eval(m, metrics, out, is_main):
        # eager: every new cache length would be a new graph for a compiled model
        with torch.compiler.set_stance("force_eager"):
            # prompted with the corpus's own first token: a corpus without newlines has no "\n" to start from
            sample = m.generate(torch.tensor([ids[:1].tolist()]), 200, temperature=0.8, seed=0)
        if is_main:
            (out / "sample.txt").write_text(tokenizer.decode(sample[0].tolist()))

    return Task(
        class_dim=-1,  # logits over the last dimension: --teacher can distil into it
        name="transformer_lm", model=model,
        train_data=BlockDataset(train_ids, context) if not cfg.eval_only else None,
        eval_data=StridedBlocks(val_ids, context),
        loss=loss, eval_step=eval_step, summarize=summarize, after_eval=after_eval,
        meta={"preprocessing": {"tokenizer": tokenizer.spec()},
              "dataset": f"{cfg.data} (first {1 - a['val_fraction']:.0%} train, last {a['val_fraction']:.0%} "
                         "validation, character level)" if a["tokenizer"] == "char" else cfg.data},
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_args(parser, lr=1e-3, weight_decay=0.1, warmup=100, batch_size=32, eval_every=250,
                   out="runs/transformer_lm")
    g = parser.add_argument_group("transformer_lm")
    g.add_argument("--tokenizer", choices=["char", "byte"], default="char")
    g.add_argument("--val-fraction", type=float, default=0.1)
    g.add_argument("--context", type=int)
    g.add_argument("--dim", type=int)
    g.add_argument("--n-layers", type=int)
    g.add_argument("--n-heads", type=int)
    g.add_argument("--n-kv-heads", type=int)
    g.add_argument("--mlp-hidden", type=int)
    g.add_argument("--dropout", type=float)
    g.add_argument("--window", type=int)
    setup_logging()
    return run(config_from_args(parser.parse_args(argv)), build_task)


if __name__ == "__main__":
    sys.exit(main_guard(main))
