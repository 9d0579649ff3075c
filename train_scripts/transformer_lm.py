"""Train or fine-tune `transformer_lm` on a text file (character, byte or BPE level) or a prepared corpus.

    python train_scripts/transformer_lm.py --data ../shared/data/tinyshakespeare/input.txt --steps 2000 --amp auto
    python train_scripts/transformer_lm.py --eval-only --pretrained default --data ../shared/data/tinyshakespeare/input.txt
    python train_scripts/transformer_lm.py --data corpus.txt --tokenizer bpe --vocab-size 4096 --steps 2000

A corpus larger than memory is tokenised once into memory-mapped token files, then trained from them:

    python train_scripts/transformer_lm.py prepare --data corpus.txt --tokenizer bpe --vocab-size 4096 --out tokens/
    python train_scripts/transformer_lm.py --data tokens/ --steps 20000

The last 10% of the tokens are the validation split (--val-fraction); a BPE tokenizer learns from the first
90% of the text only, and travels in the saved weights like the char and byte ones. Validation loss is in
nats per token (not comparable across tokenizers).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import zoo
from zoo.data.corpus import VAL_FRACTION, ShuffledBatches, check_val_fraction, new_tokenizer, open_prepared, prepare
from zoo.data.text import BlockDataset, read_corpus
from zoo.train import Task, add_train_args, config_from_args, main_guard, run, setup_logging


class StridedBlocks(BlockDataset):
    """Validation: non-overlapping blocks covering the split, so every token is scored once."""

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.context

    def __getitem__(self, i: int):
        return super().__getitem__(i * self.context)


def spec_of(tokenizer) -> dict:
    """The char/byte/bpe tokenizer's spec; {} for a checkpoint's own tokenizer.json (a LLaMA folder's)."""
    return tokenizer.spec() if hasattr(tokenizer, "spec") else {}


def level(tokenizer) -> str:
    """How the saved weights' dataset line names the tokenizer."""
    return {"char": "character level", "byte": "byte level", "bpe": f"byte-level BPE of {tokenizer.vocab_size} "
            "tokens"}.get(spec_of(tokenizer).get("kind"), "the checkpoint's tokenizer")


def prepared_data(folder: str, a: dict, model):
    """(tokenizer, train ids, val ids, batch sampler, what was read) from a `prepare`d folder, refusing
    flags that disagree with how it was made."""
    corpus = open_prepared(folder)
    meta, kind = corpus.meta, corpus.meta["tokenizer"]["kind"]
    again = "or prepare the corpus again into another folder"
    if a["tokenizer"] not in (None, kind):
        raise ValueError(f"{folder} holds {kind} tokens, not {a['tokenizer']}: drop --tokenizer, {again}")
    if a["vocab_size"] is not None and kind != "bpe":
        raise ValueError(f"--vocab-size applies to --tokenizer bpe only; {folder} holds {kind} tokens")
    if a["vocab_size"] not in (None, meta["vocab_size"]):
        raise ValueError(f"{folder} was prepared with --vocab-size {meta['vocab_size']}, not {a['vocab_size']}: "
                         f"drop --vocab-size, {again}")
    if a["val_fraction"] not in (None, meta["val_fraction"]):
        raise ValueError(f"{folder} was split with --val-fraction {meta['val_fraction']}, not "
                         f"{a['val_fraction']}: drop --val-fraction, {again}")
    tokenizer = corpus.tokenizer
    if model is not None and spec_of(model.tokenizer) != tokenizer.spec():
        raise ValueError(f"{folder} was tokenised with another tokenizer than --pretrained's; train from the text "
                         "file instead, which the model's own tokenizer reads")
    dataset = (f"{meta['source']['path']} (sha256 {meta['source']['sha256']}) prepared into {folder}: "
               f"{meta['split']}, {level(tokenizer)}")
    # ShuffledBatches: the shared sampler's list of every start position would not fit beside a large corpus
    return tokenizer, corpus.train, corpus.val, ShuffledBatches, dataset


def text_data(path: str, a: dict, model):
    """(tokenizer, train ids, val ids, batch sampler, what was read) from a text file, read whole."""
    val_fraction = a["val_fraction"] or VAL_FRACTION
    if model is None:
        tokenizer = new_tokenizer(a["tokenizer"] or "char", path, vocab_size=a["vocab_size"], val_fraction=val_fraction)
    else:
        tokenizer = model.tokenizer
        kind = spec_of(tokenizer).get("kind")
        if a["tokenizer"] not in (None, kind):
            raise ValueError(f"--pretrained weights bring their own tokenizer ({kind or 'the checkpoint'}'s), not "
                             f"{a['tokenizer']}: drop --tokenizer")
    ids = torch.tensor(tokenizer.encode(read_corpus(path)), dtype=torch.long)
    split = int(len(ids) * (1 - val_fraction))
    dataset = f"{path} (first {1 - val_fraction:.0%} train, last {val_fraction:.0%} validation, {level(tokenizer)})"
    return tokenizer, ids[:split], ids[split:], None, dataset


def build_task(cfg) -> Task:
    a = cfg.extra
    if cfg.data is None:
        raise ValueError("--data is required: a UTF-8 text file, e.g. ../shared/data/tinyshakespeare/input.txt, "
                         "or a folder made by `transformer_lm.py prepare`")
    model_options = {k: a[k] for k in ("context", "dim", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden",
                                       "dropout", "window") if a.get(k) is not None}
    if a["val_fraction"] is not None:
        check_val_fraction(a["val_fraction"])
    architecture = [f"--{k.replace('_', '-')}" for k in model_options if k != "dropout"]
    architecture += ["--vocab-size"] if a["vocab_size"] is not None else []
    if cfg.pretrained and architecture:
        raise ValueError(f"--pretrained {cfg.pretrained} brings its own architecture; {', '.join(architecture)} "
                         "would be ignored: drop them, or train from scratch without --pretrained")
    model = None
    if cfg.pretrained:
        model = zoo.load("transformer_lm", pretrained=cfg.pretrained,
                         **{k: v for k, v in model_options.items() if k == "dropout"})
    data = prepared_data if Path(cfg.data).is_dir() else text_data
    tokenizer, train_ids, val_ids, batch_sampler, dataset = data(cfg.data, a, model)
    if model is None:
        model = zoo.load("transformer_lm", vocab_size=tokenizer.vocab_size, **model_options)
    context = model.config.context

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
            sample = m.generate(torch.tensor([train_ids[:1].tolist()]), 200, temperature=0.8, seed=0)
        if is_main:
            (out / "sample.txt").write_text(tokenizer.decode(sample[0].tolist()))

    return Task(
        class_dim=-1,  # logits over the last dimension: --teacher can distil into it
        name="transformer_lm", model=model,
        train_data=BlockDataset(train_ids, context) if not cfg.eval_only else None,
        eval_data=StridedBlocks(val_ids, context), batch_sampler=batch_sampler,
        loss=loss, eval_step=eval_step, summarize=summarize, after_eval=after_eval,
        meta={"preprocessing": {"tokenizer": tokenizer.spec()}, "dataset": dataset},
    )


def add_tokenizer_args(g) -> None:
    g.add_argument("--tokenizer", choices=["char", "byte", "bpe"],
                   help="char (the default for a text file): one id per distinct character; byte: UTF-8 bytes, "
                        "any text; bpe: byte-level BPE learned from the training text, needs --vocab-size. "
                        "A prepared folder brings its own")
    g.add_argument("--vocab-size", type=int, metavar="N",
                   help="--tokenizer bpe: tokens to learn, 257 (the 256 bytes and one merge) up to what the "
                        "corpus repeats, e.g. 4096")
    g.add_argument("--val-fraction", type=float,
                   help=f"the end of the corpus held out for validation (default {VAL_FRACTION}; a prepared "
                        "folder brings its own)")


def prepare_main(argv) -> None:
    parser = argparse.ArgumentParser(
        prog="transformer_lm.py prepare",
        description="Tokenise a UTF-8 text file once, in pieces (memory stays bounded), into DIR/train.bin and "
                    "DIR/val.bin (token ids, uint16 when the vocabulary fits, else uint32; np.memmap-able) and "
                    "DIR/meta.json (tokenizer, dtype, token counts, the source's sha256, the split). "
                    "Train from it with --data DIR.")
    parser.add_argument("--data", required=True, help="the corpus: a UTF-8 text file")
    parser.add_argument("--out", required=True, metavar="DIR", help="the folder to write: a new or empty one")
    add_tokenizer_args(parser)
    a = parser.parse_args(argv)
    meta = prepare(a.data, a.out, tokenizer=a.tokenizer or "char", vocab_size=a.vocab_size,
                   val_fraction=VAL_FRACTION if a.val_fraction is None else a.val_fraction)
    print(f"{a.out}: {meta['tokens']['train']} training and {meta['tokens']['val']} validation tokens "
          f"({meta['dtype']}, vocabulary {meta['vocab_size']})")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prepare"]:
        return prepare_main(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="prepare: see `transformer_lm.py prepare --help`")
    add_train_args(parser, lr=1e-3, weight_decay=0.1, warmup=100, batch_size=32, eval_every=250,
                   out="runs/transformer_lm")
    g = parser.add_argument_group("transformer_lm")
    add_tokenizer_args(g)
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
