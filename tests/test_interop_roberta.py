"""bert_cls as RoBERTa and DistilBERT: checkpoints written by transformers' own classes (random small configs,
no network) load with the architecture read from config.json, give the peer model's encoder output and
logits, go back with `to_hf_state_dict` (strict), and classify text with the tokenizer saved in the folder."""
import json
import logging
import warnings

import pytest
import torch

import zoo
from zoo.models.bert import to_hf_config, to_hf_state_dict

transformers = pytest.importorskip("transformers")

VOCAB = 120


def roberta_config(**kw):
    # RoBERTa's own conventions: one token type, <pad> = 1, positions offset by pad + 1 (42 rows: 40 tokens)
    kw = {"vocab_size": VOCAB, "type_vocab_size": 1, "pad_token_id": 1, "layer_norm_eps": 1e-5, **kw}
    return transformers.RobertaConfig(hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=96, max_position_embeddings=42, **kw)


def distilbert_config(**kw):
    return transformers.DistilBertConfig(**{"vocab_size": VOCAB, **kw}, dim=48, n_layers=2, n_heads=4,
                                         hidden_dim=96, max_position_embeddings=40)


CONFIGS = {"Roberta": roberta_config, "DistilBert": distilbert_config}
CLASSES = [f"{arch}{task}" for arch in CONFIGS for task in ("Model", "ForSequenceClassification", "ForMaskedLM")]
NO_POOLER = {"RobertaForMaskedLM", "DistilBertModel", "DistilBertForMaskedLM"}


def hf_model(name: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    arch = "DistilBert" if name.startswith("DistilBert") else "Roberta"
    return getattr(transformers, name)(CONFIGS[arch](**kw)).eval()


def encoder(hf):
    return getattr(hf, "roberta", None) or getattr(hf, "distilbert", None) or hf


def batch(pad: int, lengths=(9, 5, 1)):
    """Token ids padded with `pad`: rows right-padded, and the second row left-padded as well (RoBERTa's
    positions count real tokens, so they must not start at the row's first column)."""
    g = torch.Generator().manual_seed(0)
    T = max(lengths)
    ids = torch.randint(5, VOCAB, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    mask[1] = mask[1].roll(2)  # [0, 0, 1, 1, 1, 1, 1, 0, 0]
    ids[mask == 0] = pad
    return ids, mask


def pad_of(hf) -> int:
    return hf.config.pad_token_id


def assert_same_encoder(model, hf):
    ids, mask = batch(pad_of(hf))
    with torch.no_grad():
        hidden, pooled = model.forward_features(ids, mask)
        want = encoder(hf)(input_ids=ids, attention_mask=mask)
    keep = mask.bool()  # padded positions are not part of the contract
    torch.testing.assert_close(hidden[keep], want.last_hidden_state[keep], atol=1e-4, rtol=1e-4)
    if getattr(want, "pooler_output", None) is not None:
        torch.testing.assert_close(pooled, want.pooler_output, atol=1e-4, rtol=1e-4)


def load_quietly(spec, **kw):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = zoo.load("bert_cls", pretrained=spec, **kw)
    return model, [str(w.message) for w in record]


@pytest.mark.parametrize("name", CLASSES)
def test_transformers_roberta_and_distilbert_classes_load_with_equal_outputs(name, tmp_path, caplog):
    hf = hf_model(name, num_labels=3)
    hf.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="zoo.models.bert"):
        model, messages = load_quietly(tmp_path, num_classes=3)
    assert model.config.arch == ("distilbert" if name.startswith("DistilBert") else "roberta")
    assert model.config.pad_token_id == pad_of(hf)
    assert model.config.type_vocab_size == (0 if model.config.arch == "distilbert" else 1)
    assert_same_encoder(model, hf)
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    if name.endswith("ForMaskedLM"):  # one log line naming the masked-LM head
        head = "lm_head.dense.weight" if name.startswith("Roberta") else "vocab_transform.weight"
        assert len(dropped) == 1 and head in dropped[0], dropped
    else:
        assert not dropped
    pooler_warnings = [m for m in messages if "pooler initialised" in m]
    assert len(pooler_warnings) == (name in NO_POOLER)
    head_warnings = [m for m in messages if "head re-initialised" in m]
    if name.endswith("ForSequenceClassification"):  # its own 3-class head loads: no new head, equal logits
        assert not head_warnings and model.config.num_classes == 3
        ids, mask = batch(pad_of(hf))
        with torch.no_grad():
            torch.testing.assert_close(model(ids, mask), hf(input_ids=ids, attention_mask=mask).logits,
                                       atol=1e-4, rtol=1e-4)
    else:
        assert len(head_warnings) == 1 and "head.weight" in head_warnings[0]


def test_roberta_positions_count_real_tokens_from_pad_plus_one(tmp_path):
    hf = hf_model("RobertaModel", seed=1)
    hf.save_pretrained(tmp_path)
    model, _ = load_quietly(tmp_path, num_classes=2)
    ids, _ = batch(1)
    from transformers.models.roberta.modeling_roberta import RobertaEmbeddings
    want = RobertaEmbeddings.create_position_ids_from_input_ids(ids, padding_idx=1)
    emb = model.bert.embeddings
    with torch.no_grad():
        ours = emb.norm(emb.word(ids) + emb.position(want) + emb.token_type(torch.zeros_like(ids)))
        torch.testing.assert_close(emb(ids, None), ours)
    # 42 position rows hold 40 tokens: the first two are the padding's
    assert model.config.max_length == 40
    model(torch.full((1, 40), 7))
    with pytest.raises(ValueError, match="longer than the model's 40 positions"):
        model(torch.full((1, 41), 7))


@pytest.mark.parametrize("arch", ["Bert", "Roberta", "DistilBert"])
def test_to_hf_state_dict_back_into_transformers_strictly(arch, tmp_path):
    torch.manual_seed(2)
    if arch == "Bert":
        from .test_bert import small_hf_config
        config = small_hf_config(num_labels=3)
    else:
        config = CONFIGS[arch](num_labels=3)
    hf = getattr(transformers, f"{arch}ForSequenceClassification")(config).eval()
    hf.save_pretrained(tmp_path)
    model, _ = load_quietly(tmp_path)
    torch.manual_seed(3)
    with torch.no_grad():  # move the weights, so that equal outputs are not the checkpoint's by chance
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    hf_config = transformers.AutoConfig.for_model(**to_hf_config(model.config))
    assert type(hf_config) is type(config)
    ids, mask = batch(config.pad_token_id)

    fresh = getattr(transformers, f"{arch}ForSequenceClassification")(hf_config).eval()
    fresh.load_state_dict(to_hf_state_dict(model), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=ids, attention_mask=mask).logits, model(ids, mask),
                                   atol=1e-4, rtol=1e-4)
    base = getattr(transformers, f"{arch}Model")(hf_config).eval()
    base.load_state_dict(to_hf_state_dict(model, base_model=True), strict=True)
    with torch.no_grad():
        hidden, pooled = model.forward_features(ids, mask)
        want = base(input_ids=ids, attention_mask=mask)
    keep = mask.bool()
    torch.testing.assert_close(want.last_hidden_state[keep], hidden[keep], atol=1e-4, rtol=1e-4)
    if arch != "DistilBert":  # the base models' tanh pooler is ours
        torch.testing.assert_close(want.pooler_output, pooled, atol=1e-4, rtol=1e-4)


def test_zoo_save_and_load_keeps_the_arch(tmp_path):
    hf = hf_model("RobertaForSequenceClassification", seed=4, num_labels=2)
    hf.save_pretrained(tmp_path / "hf")
    model, _ = load_quietly(tmp_path / "hf")
    zoo.save(model, tmp_path / "roberta.safetensors")
    again, messages = load_quietly(tmp_path / "roberta.safetensors")
    assert again.config == model.config and not messages
    ids, mask = batch(1)
    with torch.no_grad():
        torch.testing.assert_close(again(ids, mask), model(ids, mask))


def _roberta_tokenizer():
    """A byte-level BPE trained here (RoBERTa's special tokens, <pad> = 1) in transformers' RobertaTokenizer."""
    from tokenizers import ByteLevelBPETokenizer
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["a gripping , beautifully acted film", "a waste of two hours"] * 3, vocab_size=300,
                            min_frequency=1, special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                            show_progress=False)
    model = json.loads(bpe._tokenizer.to_str())["model"]
    return transformers.RobertaTokenizer(vocab=model["vocab"], merges=[tuple(m) if isinstance(m, list) else
                                                                       tuple(m.split()) for m in model["merges"]])


def _distilbert_tokenizer():
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "film", "waste", "of", "two", "hours", "grip",
             "##ping", ",", "beautiful", "##ly", "acted"]
    return transformers.DistilBertTokenizerFast(vocab={w: i for i, w in enumerate(words)})


@pytest.mark.parametrize("arch", ["Roberta", "DistilBert"])
def test_predict_on_text_with_the_folders_own_tokenizer(arch, tmp_path):
    from zoo.predict import run
    tok = _roberta_tokenizer() if arch == "Roberta" else _distilbert_tokenizer()
    torch.manual_seed(5)
    config = CONFIGS[arch](num_labels=2, vocab_size=len(tok), pad_token_id=tok.pad_token_id)
    hf = getattr(transformers, f"{arch}ForSequenceClassification")(config).eval()
    hf.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, _ = load_quietly(tmp_path)
    assert model.config.tokenizer == str(tmp_path.resolve())
    texts = ["a gripping , beautifully acted film", "a waste of two hours", "film"]
    results, text = run("bert_cls", model, texts, {})
    assert [r["text"] for r in results] == texts and len(text.splitlines()) == 3
    enc = tok(texts, padding=True, return_tensors="pt")
    assert "token_type_ids" not in enc  # neither architecture has token types in its tokenizer's output
    with torch.no_grad():
        want = hf(**enc).logits.softmax(-1)
    for r, row in zip(results, want):
        assert [r["probs"][label] for label in model.labels] == pytest.approx(row.tolist(), abs=1e-4)
    # longer than the positions: truncated to what the position table covers (RoBERTa: 2 rows fewer)
    with pytest.warns(UserWarning, match=f"longer than {model.config.max_length} tokens were truncated"):
        model.predict(" ".join(["a waste of two hours"] * 12))


def test_roberta_that_does_not_fit_is_an_error_naming_the_keys(tmp_path):
    hf = hf_model("RobertaForSequenceClassification", seed=6)
    hf.config.to_json_file(tmp_path / "config.json")
    sd = hf.state_dict()
    del sd["classifier.dense.bias"], sd["roberta.encoder.layer.1.output.dense.weight"]
    sd["roberta.encoder.layer.0.adapter.weight"] = torch.zeros(3)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        zoo.load("bert_cls", pretrained=tmp_path)
    message = str(err.value)
    for key in ("classifier.dense.bias", "roberta.encoder.layer.1.output.dense.weight",
                "roberta.encoder.layer.0.adapter.weight"):
        assert key in message
    assert "RobertaModel and every RobertaFor* class" in message  # what would load instead
    with pytest.raises(ValueError, match="DistilBERT has no token types"):
        zoo.load("bert_cls", arch="distilbert", type_vocab_size=2)


def test_xlm_roberta_is_roberta(tmp_path):
    torch.manual_seed(7)
    config = transformers.XLMRobertaConfig(**roberta_config(num_labels=2).to_diff_dict())
    hf = transformers.XLMRobertaForSequenceClassification(config).eval()
    hf.save_pretrained(tmp_path)
    model, messages = load_quietly(tmp_path)
    assert model.config.arch == "roberta" and not messages
    ids, mask = batch(1)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask), hf(input_ids=ids, attention_mask=mask).logits,
                                   atol=1e-4, rtol=1e-4)


def test_fine_tuning_script_from_a_roberta_folder(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    tok = _roberta_tokenizer()
    torch.manual_seed(8)
    transformers.RobertaForMaskedLM(roberta_config(vocab_size=len(tok))).save_pretrained(tmp_path / "hf")
    tok.save_pretrained(tmp_path / "hf")
    rows = ["sentence\tlabel"] + [f"{t}\t{label}" for t, label in [("a gripping film", 1), ("a waste of two hours", 0)]
                                  * 8]
    (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n")
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(root / "train_scripts" / "bert_cls.py"), "--data",
                             str(tmp_path / "train.tsv"), "--pretrained", str(tmp_path / "hf"), "--num-classes", "2",
                             "--steps", "2", "--batch-size", "4", "--workers", "0", "--out", str(tmp_path / "run")],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    model = zoo.load("bert_cls", pretrained=tmp_path / "run" / "model.safetensors")
    assert model.config.arch == "roberta" and model.predict("a gripping film")["label"] in model.labels
