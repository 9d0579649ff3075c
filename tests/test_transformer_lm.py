"""transformer_lm: cached decoding equals recomputation, generation options, the shipped weights."""
from pathlib import Path

import pytest
import torch

import zoo

from .conftest import assert_eval_only_reproduces

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt"


def tiny(**kw):
    return zoo.load("transformer_lm", **{**dict(vocab_size=20, context=32, dim=32, n_layers=2, n_heads=4,
                                                  mlp_hidden=48, dropout=0.0), **kw})


@pytest.mark.parametrize("options", [{}, {"n_kv_heads": 1}, {"window": 8}])
def test_cached_logits_equal_full_recomputation(options):
    model = tiny(**options)
    idx = torch.randint(0, 20, (2, 20))
    full = model(idx)
    caches = model.new_caches(2, 32)
    stepwise = torch.cat([model(idx[:, :12], caches)] + [model(idx[:, i:i + 1], caches) for i in range(12, 20)], 1)
    torch.testing.assert_close(stepwise, full, atol=1e-5, rtol=1e-5)


def test_greedy_generation_same_with_and_without_cache_past_the_context():
    model = tiny()
    prompt = torch.randint(0, 20, (1, 5))
    a = model.generate(prompt, 40, temperature=0, use_cache=True)  # 45 > context 32: the cache restarts
    b = model.generate(prompt, 40, temperature=0, use_cache=False)
    assert a.shape == (1, 45)
    assert torch.equal(a[:, :37], b[:, :37]), "identical until the context window is exceeded"


def test_sampling_options_and_errors():
    model = tiny()
    prompt = torch.zeros(1, 1, dtype=torch.long)
    a = model.generate(prompt, 10, top_k=5, top_p=0.9, seed=1)
    assert torch.equal(a, model.generate(prompt, 10, top_k=5, top_p=0.9, seed=1))
    with pytest.raises(ValueError, match="top_p"):
        model.generate(prompt, 2, top_p=1.5)
    with pytest.raises(ValueError, match="carries no tokenizer"):
        model.generate("hi", 2)


def test_shipped_weights_generate_text_offline():
    model = zoo.load("transformer_lm", pretrained=True)
    meta = model.pretrained_meta
    assert meta.metrics["val_loss"] <= 1.55
    text = model.generate("ROMEO:", 50, temperature=0.8, seed=0)
    assert text.startswith("ROMEO:") and len(text) == 56
    with pytest.raises(ValueError, match="not in the model's vocabulary"):
        model.generate("ROMEO: ☃", 5)


@pytest.mark.skipif(not CORPUS.is_file(), reason="../shared/data/tinyshakespeare is not beside this checkout")
def test_shipped_validation_loss_is_reproduced_by_eval_only():
    shipped = zoo.load("transformer_lm", pretrained=True).pretrained_meta
    # the shipped run evaluated under bf16; in fp32 within 0.01 nats
    assert_eval_only_reproduces("transformer_lm.py", ["--data", str(CORPUS)], shipped, {"val_loss": 0.01},
                                default_amp="bf16")
