"""Tasks users bring to a BERT classifier, against checkpoints transformers itself wrote (random small configs,
a tiny WordPiece tokenizer written here; no network): sentence pairs with token types, regression, multi-label;
the train script taking each from table columns with its metrics; a shallower student from a deeper checkpoint."""
import importlib.util
import logging
import math
from pathlib import Path

import pytest
import torch

import zoo
from zoo.data.tables import infer_problem, read_labelled_texts
from zoo.models.bert import to_hf_config

transformers = pytest.importorskip("transformers")
ROOT = Path(__file__).resolve().parents[1]
WORDS = ("a the film movie was is great awful lovely boring plot actors good bad not very it and of "
         "to story music long short fun dull cat dog sat on mat").split()
PAIRS = [("the film was great", "it is a good movie"), ("the plot was dull", "a lovely story"),
         ("the cat sat on the mat", "a dog sat"), ("very long and very boring", "not fun")]


def tokenizer(folder: Path):
    """A BertTokenizerFast from a vocab.txt written here: [PAD]=0 ... then the words."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]) + "\n")
    tok = transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt"), do_lower_case=True)
    tok.save_pretrained(folder)
    return tok


def hf_classifier(folder: Path, seed: int = 0, layers: int = 2, cls=None, **kw):
    """transformers' own model (eval mode) saved with its tokenizer into `folder`."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=40, **kw)
    hf = (cls or transformers.BertForSequenceClassification)(config).eval()
    hf.save_pretrained(folder)
    return hf, tokenizer(folder)


def logits_of(hf, enc):
    with torch.no_grad():
        return hf(**enc).logits


def test_sentence_pairs_match_transformers_with_token_types(tmp_path):
    hf, tok = hf_classifier(tmp_path, num_labels=3)
    model = zoo.load("bert_cls", pretrained=tmp_path)
    enc = tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt")
    assert int(enc["token_type_ids"].max()) == 1  # the second sentences are type 1
    want = logits_of(hf, enc)
    assert not torch.allclose(want, logits_of(hf, {**enc, "token_type_ids": torch.zeros_like(enc["input_ids"])}))
    with torch.no_grad():
        ours = model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)
    results = model.predict(PAIRS)
    for r, row in zip(results, want.softmax(-1)):
        assert list(r["probs"].values()) == pytest.approx(row.tolist(), abs=1e-4)
        assert r["label"] == str(int(row.argmax()))
    # single texts still work, and are not pairs
    text = model.predict(["the film was great"])[0]
    assert text["probs"] != results[0]["probs"] and model.predict("the film was great") == text
    with pytest.raises(TypeError, match="all strings or all"):
        model.predict([PAIRS[0], "a film"])
    with pytest.raises(ValueError, match="pair 0 has 3 parts"):
        model.predict([("a", "b", "c")])
    with pytest.raises(ValueError, match="text 0 is empty"):
        model.predict([("a film", "  ")])


def test_pairs_through_zoo_predict_adapter(tmp_path):
    from zoo.predict import run
    hf_classifier(tmp_path, num_labels=2)
    model = zoo.load("bert_cls", pretrained=tmp_path)
    result, text = run("bert_cls", model, [f"{a} ||| {b}" for a, b in PAIRS], {"pair_separator": " ||| "})
    assert [r["label"] for r in result] == [r["label"] for r in model.predict(PAIRS)] and len(text.splitlines()) == 4
    with pytest.raises(ValueError, match="is not in 'a film'"):
        run("bert_cls", model, ["a film"], {"pair_separator": "|||"})


def test_roberta_and_distilbert_pairs_take_no_token_types(tmp_path):
    """RoBERTa (one token type) and DistilBERT (none) get pairs as their own tokenizers make them; the logits
    are those of transformers' model on the same ids, without token types."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>", *WORDS])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<s>", eos_token="</s>",
                                               pad_token="<pad>", unk_token="<unk>", cls_token="<s>",
                                               sep_token="</s>", model_input_names=["input_ids", "attention_mask"])
    torch.manual_seed(0)
    configs = {"roberta": transformers.RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=64,
                                                     max_position_embeddings=42, type_vocab_size=1, pad_token_id=1),
               "distilbert": transformers.DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4,
                                                           hidden_dim=64, max_position_embeddings=40, pad_token_id=1)}
    for arch, config in configs.items():
        folder = tmp_path / arch
        hf = transformers.AutoModelForSequenceClassification.from_config(config).eval()
        hf.save_pretrained(folder)
        tok.save_pretrained(folder)
        model = zoo.load("bert_cls", pretrained=folder)
        enc = tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt")
        assert "token_type_ids" not in enc and int((enc["input_ids"] == 2).sum(1).min()) >= 3  # </s></s> between
        want = logits_of(hf, enc).softmax(-1)
        got = torch.tensor([list(r["probs"].values()) for r in model.predict(PAIRS)])
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_regression_checkpoint_predicts_floats_and_mse(tmp_path):
    hf, tok = hf_classifier(tmp_path, num_labels=1, problem_type="regression")
    model = zoo.load("bert_cls", pretrained=tmp_path)
    assert model.config.problem == "regression" and model.config.num_classes == 1
    enc = tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt")
    want = logits_of(hf, enc)
    values = model.predict(PAIRS)
    assert all(isinstance(v, float) for v in values)
    torch.testing.assert_close(torch.tensor(values), want[:, 0], atol=1e-4, rtol=0)
    labels = torch.tensor([0.5, 1.0, 2.0, 4.5])
    with torch.no_grad():
        hf_loss = hf(**enc, labels=labels).loss
        ours = model.loss(model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]), labels)
    torch.testing.assert_close(ours, hf_loss, atol=1e-4, rtol=1e-4)
    # num_classes=1 alone means regression (transformers' rule), and round-trips through zoo.save / zoo.load
    fresh = zoo.load("bert_cls", pretrained=tmp_path, num_classes=1)
    assert fresh.config.problem == "regression"
    zoo.save(model, tmp_path / "reg.safetensors")
    again = zoo.load("bert_cls", pretrained=tmp_path / "reg.safetensors")
    assert again.config.problem == "regression" and again.predict(PAIRS) == values
    assert to_hf_config(model.config)["problem_type"] == "regression"
    assert zoo.load("bert_cls", variant="minilm-l6", layers=1, vocab_size=64, num_classes=1).config.problem == "regression"


def test_multi_label_checkpoint_thresholds_and_bce(tmp_path):
    hf, tok = hf_classifier(tmp_path, num_labels=4, problem_type="multi_label_classification")
    model = zoo.load("bert_cls", pretrained=tmp_path)
    assert model.config.problem == "multi_label"
    texts = [a for a, _ in PAIRS]
    enc = tok(texts, padding=True, return_tensors="pt")
    want = logits_of(hf, enc)
    with torch.no_grad():
        torch.testing.assert_close(model(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]), want,
                                   atol=1e-4, rtol=1e-4)
        labels = torch.tensor([[1, 0, 1, 0], [0, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.float)
        torch.testing.assert_close(model.loss(model(enc["input_ids"], enc["attention_mask"]), labels),
                                   hf(**enc, labels=labels).loss, atol=1e-4, rtol=1e-4)
    probs = want.sigmoid()
    for threshold in (0.5, float(probs.median())):
        results = model.predict(texts, threshold=threshold)
        for r, row in zip(results, probs):
            assert r["labels"] == [str(i) for i, p in enumerate(row) if p > threshold]
            assert list(r["probs"].values()) == pytest.approx(row.tolist(), abs=1e-4)
    with pytest.raises(ValueError, match="threshold 1.5"):
        model.predict(texts, threshold=1.5)
    zoo.save(model, tmp_path / "ml.safetensors")
    assert zoo.load("bert_cls", pretrained=tmp_path / "ml.safetensors").config.problem == "multi_label"
    assert to_hf_config(model.config)["problem_type"] == "multi_label_classification"
    # transformers reads the problem back from the config zoo writes
    assert transformers.AutoConfig.for_model(**to_hf_config(model.config)).problem_type == "multi_label_classification"


# ---------------------------------------------------------------------------------------- the train script

def script():
    spec = importlib.util.spec_from_file_location("train_script_bert_cls_tasks", ROOT / "train_scripts" / "bert_cls.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_table(path: Path, header: list[str], rows: list[list[str]]):
    import csv
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, delimiter="\t" if path.suffix == ".tsv" else ",",
                            **({"quoting": csv.QUOTE_NONE, "escapechar": "\\"} if path.suffix == ".tsv" else {}))
        writer.writerow(header)
        writer.writerows(rows)
    return path


def train(tmp_path, data: Path, *flags: str, name="run"):
    folder = tmp_path / "hf"
    if not (folder / "config.json").is_file():
        hf_classifier(folder, cls=transformers.BertModel)
    argv = ["--data", str(data), "--eval", str(data), "--pretrained", str(folder), "--steps", "3",
            "--batch-size", "4", "--warmup", "1", "--lr", "1e-3", "--workers", "0", "--log-every", "1",
            "--out", str(tmp_path / name), *flags]
    return script().main(argv)


def test_train_script_on_sentence_pairs(tmp_path):
    rows = [[a, b, str(i % 2)] for i, (a, b) in enumerate(PAIRS * 3)]
    data = write_table(tmp_path / "pairs.tsv", ["sentence1", "sentence2", "label"], rows)
    metrics = train(tmp_path, data, "--text-column", "sentence1", "--text-pair-column", "sentence2",
                    "--keep-best", "accuracy")
    assert {"accuracy", "macro_f1"} <= set(metrics) and sum(map(sum, metrics["confusion"])) == 12
    model = zoo.load("bert_cls", pretrained=tmp_path / "run" / "model.safetensors")
    assert model.pretrained_meta.preprocessing["text_pair_column"] == "sentence2"
    assert model.predict(PAIRS[:1])[0]["label"] in ("0", "1")
    with pytest.raises(ValueError, match=r"no column 'premise'; its columns are 'sentence1', 'sentence2', 'label'"):
        train(tmp_path, data, "--text-column", "sentence1", "--text-pair-column", "premise", name="bad")


def test_train_script_regression_from_float_labels(tmp_path):
    rows = [[a, b, f"{(i * 1.37) % 5:.2f}"] for i, (a, b) in enumerate(PAIRS * 3)]
    data = write_table(tmp_path / "sts.csv", ["s1", "s2", "score"], rows)
    metrics = train(tmp_path, data, "--text-column", "s1", "--text-pair-column", "s2", "--label-column", "score",
                    "--keep-best", "spearman")
    assert {"mse", "pearson", "spearman"} <= set(metrics)
    assert all(math.isfinite(metrics[k]) and -1 <= metrics[k] <= 1 for k in ("pearson", "spearman"))
    model = zoo.load("bert_cls", pretrained=tmp_path / "run" / "model.safetensors")
    assert model.config.problem == "regression" and isinstance(model.predict(PAIRS[:1])[0], float)


def test_train_script_multi_label_from_comma_lists(tmp_path):
    labels = ["pos,fun", "neg", "pos", "neg,dull", "fun", "dull,neg"]
    rows = [[text, label] for text, label in zip([a for a, _ in PAIRS] * 2, labels * 2)]
    data = write_table(tmp_path / "ml.csv", ["sentence", "label"], rows)
    metrics = train(tmp_path, data, "--keep-best", "micro_f1")
    assert {"micro_f1", "macro_f1", "subset_accuracy"} <= set(metrics)
    model = zoo.load("bert_cls", pretrained=tmp_path / "run" / "model.safetensors")
    assert model.config.problem == "multi_label" and model.labels == ["dull", "fun", "neg", "pos"]
    assert set(model.predict(["a fun film"])[0]["labels"]) <= {"dull", "fun", "neg", "pos"}


def test_train_script_refuses_mixed_labels(tmp_path):
    data = write_table(tmp_path / "mixed.csv", ["sentence", "label"], [["a film", "a,b"], ["the plot", "0.5"]])
    with pytest.raises(ValueError, match="mixes comma lists .* with fractional numbers"):
        train(tmp_path, data, name="mixed")
    data = write_table(tmp_path / "mixed2.csv", ["sentence", "label"], [["a film", "pos"], ["the plot", "0.5"]])
    with pytest.raises(ValueError, match="mixes fractional numbers .* with text labels"):
        train(tmp_path, data, name="mixed2")
    data = write_table(tmp_path / "nan.csv", ["sentence", "label"], [["a film", "0.5"], ["the plot", "x"]])
    with pytest.raises(ValueError, match=r"label 1 \('x'\) is not a finite number"):
        train(tmp_path, data, "--problem", "regression", name="nan")


def test_label_kinds_and_pair_reading(tmp_path):
    assert infer_problem(["0", "1", "2"]) == "single_label"
    assert infer_problem(["pos", "neg"]) == "single_label"
    assert infer_problem(["3.8", "5", "0.2"]) == "regression"
    assert infer_problem(["a,b", "c"]) == "multi_label"
    path = write_table(tmp_path / "p.tsv", ["q", "a", "label"], [["one", "two", "1"]])
    assert read_labelled_texts(path, "q", "label", "a") == ([("one", "two")], ["1"])


def test_regression_metrics_sum_over_batches_like_one_pass():
    """Spearman over the whole set from per-batch buffers (as the trainer sums them), with ties."""
    module = script()
    step, summarize = module.regression_metrics(6)
    pred = torch.tensor([0.1, 0.4, 0.4, 0.9, 0.3, 0.2])
    target = torch.tensor([1.0, 2.0, 3.0, 3.0, 0.5, 0.1])
    parts = [step(pred[i].unsqueeze(-1), target[i], i) for i in (torch.tensor([4, 0]), torch.tensor([5, 1, 3]),
                                                                    torch.tensor([2]))]
    sums = {k: sum(p[k] for p in parts) for k in parts[0]}
    metrics = summarize(sums)
    # reference values (scipy.stats.spearmanr / pearsonr on these numbers)
    assert metrics["spearman"] == pytest.approx(0.7794, abs=1e-4)
    assert metrics["pearson"] == pytest.approx(0.7365, abs=1e-4)
    sums["seen"][0] = 2
    with pytest.raises(RuntimeError, match="other than once"):
        summarize(sums)


# ---------------------------------------------------------------------------------------- a shallower student

def test_first_layers_of_a_deeper_checkpoint(tmp_path, caplog):
    hf, tok = hf_classifier(tmp_path, layers=4, cls=transformers.BertModel)
    with caplog.at_level(logging.INFO, logger="zoo.models.bert"):
        model = zoo.load("bert_cls", pretrained=tmp_path, layers=2, num_classes=2)
    assert len(model.bert.layers) == 2 and model.config.layers == 2
    assert any("kept the first 2 of its 4 encoder layers" in r.getMessage() and "2 layer(s) dropped" in r.getMessage()
               for r in caplog.records)
    hf.encoder.layer = hf.encoder.layer[:2]
    enc = tok([a for a, _ in PAIRS], [b for _, b in PAIRS], padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden, pooled = model.forward_features(enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
        want = hf(**enc)
    keep = enc["attention_mask"].bool()
    torch.testing.assert_close(hidden[keep], want.last_hidden_state[keep], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pooled, want.pooler_output, atol=1e-4, rtol=1e-4)
    # zoo's own weights too, and the train script's --layers
    zoo.save(zoo.load("bert_cls", pretrained=tmp_path, num_classes=2), tmp_path / "deep.safetensors")
    assert len(zoo.load("bert_cls", pretrained=tmp_path / "deep.safetensors", layers=3).bert.layers) == 3
    data = write_table(tmp_path / "t.tsv", ["sentence", "label"], [[a, str(i % 2)] for i, (a, _) in enumerate(PAIRS * 2)])
    train(tmp_path, data, "--layers", "1", name="student")
    assert zoo.load("bert_cls", pretrained=tmp_path / "student" / "model.safetensors").config.layers == 1
