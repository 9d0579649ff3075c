"""bert_cls loads every layout transformers writes for BERT, checkpoints written by transformers itself
(random small configs, no network): the eight Bert* classes, with and without the `bert.` prefix,
.safetensors / .bin / sharded, from a folder and from hf:// (an offline local cache); and the generic
torch.compile / DDP key prefixes."""
import json
import logging
import warnings

import pytest
import torch

import zoo

from .test_bert import batch, small_hf_config  # the same tiny config and padded batch

transformers = pytest.importorskip("transformers")

CLASSES = ["BertModel", "BertForPreTraining", "BertForMaskedLM", "BertForNextSentencePrediction",
           "BertForSequenceClassification", "BertForTokenClassification", "BertForQuestionAnswering",
           "BertForMultipleChoice"]
NO_POOLER = {"BertForMaskedLM", "BertForTokenClassification", "BertForQuestionAnswering"}


def hf_model(name: str, seed: int = 0, **kw):
    torch.manual_seed(seed)
    return getattr(transformers, name)(small_hf_config(**kw)).eval()


def encoder(hf):
    return hf if isinstance(hf, transformers.BertModel) else hf.bert


def assert_same_encoder(model, hf):
    ids, mask, types = batch()
    with torch.no_grad():
        hidden, pooled = model.forward_features(ids, mask, types)
        want = encoder(hf)(input_ids=ids, attention_mask=mask, token_type_ids=types)
    keep = mask.bool()  # padded positions are not part of the contract
    torch.testing.assert_close(hidden[keep], want.last_hidden_state[keep], atol=1e-4, rtol=1e-4)
    if want.pooler_output is not None:
        torch.testing.assert_close(pooled, want.pooler_output, atol=1e-4, rtol=1e-4)


def load_quietly(spec, caplog=None, **kw):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        model = zoo.load("bert_cls", pretrained=spec, **kw)
    return model, [str(w.message) for w in record]


@pytest.mark.parametrize("name", CLASSES)
def test_every_transformers_bert_class_loads_with_equal_encoder_output(name, tmp_path, caplog):
    hf = hf_model(name, num_labels=3)
    hf.save_pretrained(tmp_path)
    with caplog.at_level(logging.INFO, logger="zoo.models.bert"):
        model, messages = load_quietly(tmp_path, num_classes=3)
    assert model.config.num_classes == 3 and model(*batch()).shape == (3, 3)
    assert_same_encoder(model, hf)
    sd = set(hf.state_dict())
    other_heads = sorted(k for k in sd if k.startswith(("cls.", "qa_outputs."))
                         or (k.startswith("classifier.") and name != "BertForSequenceClassification"))
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    if other_heads:  # one log line, naming every dropped key
        assert len(dropped) == 1 and all(k in dropped[0] for k in other_heads if "decoder" not in k), dropped
    else:
        assert not dropped
    pooler_warnings = [m for m in messages if "pooler initialised" in m]
    if name in NO_POOLER:
        assert len(pooler_warnings) == 1 and "bert.pooler.weight" in pooler_warnings[0]
    else:
        assert not pooler_warnings
    head_warnings = [m for m in messages if "head re-initialised" in m]
    if name == "BertForSequenceClassification":  # its own 3-class head loads: no new head, equal logits
        assert not head_warnings
        ids, mask, types = batch()
        with torch.no_grad():
            torch.testing.assert_close(model(ids, mask, types), hf(input_ids=ids, attention_mask=mask,
                                                                   token_type_ids=types).logits, atol=1e-4, rtol=1e-4)
    else:
        assert len(head_warnings) == 1 and "head.weight" in head_warnings[0]
        assert torch.isfinite(model.head.weight).all()


def test_sequence_classifier_without_num_classes_keeps_its_head(tmp_path):
    hf = hf_model("BertForSequenceClassification", seed=3, num_labels=4)
    hf.save_pretrained(tmp_path)
    model, messages = load_quietly(tmp_path)
    assert model.config.num_classes == 4 and not messages
    # a different num_classes: a new head, named in the warning; the encoder still loads
    model, messages = load_quietly(tmp_path, num_classes=2)
    assert any("head re-initialised" in m and "head.weight" in m for m in messages)
    assert_same_encoder(model, hf)


def test_encoder_without_the_bert_prefix(tmp_path):
    # a task model's encoder saved on its own (keys without `bert.`), and a bare BertModel's keys with it
    hf = hf_model("BertForPreTraining", seed=4)
    hf.bert.save_pretrained(tmp_path / "bare")
    model, _ = load_quietly(tmp_path / "bare", num_classes=3)
    assert_same_encoder(model, hf)
    base = hf_model("BertModel", seed=5)
    base.config.to_json_file(tmp_path / "config.json")
    torch.save({f"bert.{k}": v for k, v in base.state_dict().items()}, tmp_path / "pytorch_model.bin")
    model, _ = load_quietly(tmp_path, num_classes=3)
    assert_same_encoder(model, base)


def test_pickle_bin_layout(tmp_path):
    # what transformers before 5.x wrote by default: pytorch_model.bin
    hf = hf_model("BertForMaskedLM", seed=6)
    hf.config.to_json_file(tmp_path / "config.json")
    torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    model, _ = load_quietly(tmp_path, num_classes=3)
    assert_same_encoder(model, hf)


def test_sharded_safetensors_and_bin(tmp_path):
    hf = hf_model("BertForPreTraining", seed=7)
    hf.save_pretrained(tmp_path / "st", max_shard_size="50KB")
    assert (tmp_path / "st" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "st").glob("model-*.safetensors"))) > 1
    model, _ = load_quietly(tmp_path / "st", num_classes=3)
    assert_same_encoder(model, hf)
    model, _ = load_quietly(tmp_path / "st" / "model.safetensors.index.json", num_classes=3)  # the index by path
    assert_same_encoder(model, hf)

    # the sharded .bin layout of transformers 4.x, split with huggingface_hub's own helper
    from huggingface_hub import split_torch_state_dict_into_shards
    folder = tmp_path / "bin"
    folder.mkdir()
    hf.config.to_json_file(folder / "config.json")
    sd = {k: v.contiguous() for k, v in hf.state_dict().items() if k != "cls.predictions.decoder.weight"}
    split = split_torch_state_dict_into_shards(sd, filename_pattern="pytorch_model{suffix}.bin",
                                               max_shard_size="50KB")
    assert split.is_sharded
    for file, keys in split.filename_to_tensors.items():
        torch.save({k: sd[k] for k in keys}, folder / file)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": split.metadata, "weight_map": split.tensor_to_filename}))
    model, _ = load_quietly(folder, num_classes=3)
    assert_same_encoder(model, hf)

    # a shard gone: an error naming the file
    next(folder.glob("pytorch_model-00001-*.bin")).unlink()
    with pytest.raises(FileNotFoundError, match="pytorch_model-00001"):
        zoo.load("bert_cls", pretrained=folder)


def test_hub_uri_offline_from_local_cache_sharded(tmp_path, offline_hub):
    hf = hf_model("BertForPreTraining", seed=8)
    hf.save_pretrained(tmp_path / "saved", max_shard_size="50KB")
    offline_hub.publish("someone/tiny-bert", tmp_path / "saved")
    model, _ = load_quietly("hf://someone/tiny-bert", num_classes=3)
    assert_same_encoder(model, hf)
    assert model.config.tokenizer == "someone/tiny-bert"  # portable: the repo id, not the cache path


def test_what_does_not_fit_is_an_error_naming_the_keys(tmp_path):
    hf = hf_model("BertForSequenceClassification", seed=9)
    hf.config.to_json_file(tmp_path / "config.json")
    sd = hf.state_dict()
    sd["bert.encoder.layer.0.extra.weight"] = torch.zeros(3)
    del sd["bert.encoder.layer.1.output.dense.bias"]
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError) as err:
        zoo.load("bert_cls", pretrained=tmp_path)
    message = str(err.value)
    assert "bert.encoder.layer.0.extra.weight" in message and "bert.encoder.layer.1.output.dense.bias" in message
    assert "BertModel and every BertFor* class" in message  # what would load instead
    # a checkpoint of another model type says what loads
    config = json.loads((tmp_path / "config.json").read_text())
    config["model_type"] = "albert"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="model_type 'bert', 'roberta', 'xlm-roberta', 'distilbert'\\) load"):
        zoo.load("bert_cls", pretrained=tmp_path)
    # BERT's keys under another supported model_type: the error says whose keys they are
    config["model_type"] = "roberta"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"keys are a Bert checkpoint's \(bert\.\*\): is config.json's model_type "
                                         "'roberta' right"):
        zoo.load("bert_cls", pretrained=tmp_path)


@pytest.mark.parametrize("wrap", ["_orig_mod.", "module.", "module._orig_mod."])
def test_compile_and_ddp_prefixes_on_a_transformers_checkpoint(wrap, tmp_path, caplog):
    hf = hf_model("BertForSequenceClassification", seed=10, num_labels=3)
    hf.config.to_json_file(tmp_path / "config.json")
    if wrap == "_orig_mod.":  # the keys torch.compile's wrapper really has (compilation is lazy: nothing runs)
        sd = torch.compile(hf).state_dict()
        assert all(k.startswith("_orig_mod.") for k in sd)
    else:
        sd = {wrap + k: v for k, v in hf.state_dict().items()}
    torch.save(sd, tmp_path / "pytorch_model.bin")
    with caplog.at_level(logging.INFO, logger="zoo.weights.specs"):
        model, _ = load_quietly(tmp_path)
    lines = [r.getMessage() for r in caplog.records if "wrapper prefix" in r.getMessage()]
    assert len(lines) == 1 and repr(wrap) in lines[0]
    ids, mask, types = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask, types), hf(input_ids=ids, attention_mask=mask,
                                                               token_type_ids=types).logits, atol=1e-4, rtol=1e-4)


def test_compiled_zoo_model_state_dict_saved_with_torch_save(tmp_path, caplog):
    torch.manual_seed(11)
    model = zoo.load("bert_cls", variant="minilm-l6", hidden=48, layers=2, heads=4, intermediate=96,
                     vocab_size=120, max_positions=40, num_classes=3)
    torch.save(torch.compile(model).state_dict(), tmp_path / "compiled.pt")
    with caplog.at_level(logging.INFO, logger="zoo.weights.specs"):
        loaded = zoo.load("bert_cls", pretrained=tmp_path / "compiled.pt", hidden=48, layers=2, heads=4,
                          intermediate=96, vocab_size=120, max_positions=40)
    assert sum("'_orig_mod.'" in r.getMessage() for r in caplog.records) == 1
    assert loaded.config.num_classes == 3
    ids, mask, types = batch()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, mask, types), model.eval()(ids, mask, types))
