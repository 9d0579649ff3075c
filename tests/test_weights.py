import json
import os
import sys
import warnings

import pytest
import torch

import zoo
from zoo.weights import WeightsError, parse_hub_uri

X = torch.randn(5, 4, generator=torch.Generator().manual_seed(1))


def test_round_trip_gives_identical_outputs(tiny, tmp_path):
    model = zoo.load(tiny)
    meta = zoo.save(model, tmp_path / "m.safetensors", {"labels": ["a", "b", "c"], "metrics": {"acc": 0.9}})
    assert len(meta.data_sha256) == 64, "full sha256, not a prefix"
    loaded = zoo.load(tiny, pretrained=tmp_path / "m.safetensors")
    assert torch.equal(loaded(X), model(X))
    assert loaded.pretrained_meta.labels == ["a", "b", "c"]
    assert loaded.pretrained_meta.metrics == {"acc": 0.9}
    assert loaded.pretrained_meta.config == {"in_features": 4, "hidden": 8, "num_classes": 3}


def test_checkpoint_config_is_used(tiny, tmp_path):
    zoo.save(zoo.load(tiny, hidden=16), tmp_path / "m.safetensors")
    assert zoo.load(tiny, pretrained=tmp_path / "m.safetensors").config.hidden == 16


def test_half_precision_file_loads_into_fp32_model(tiny, tmp_path):
    model = zoo.load(tiny)
    meta = zoo.save(model, tmp_path / "m.safetensors", dtype=torch.float16)
    assert meta.dtype == "float16"
    loaded = zoo.load(tiny, pretrained=tmp_path / "m.safetensors")
    assert loaded.head.weight.dtype == torch.float32
    torch.testing.assert_close(loaded(X), model(X), atol=1e-2, rtol=1e-2)


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_file_is_an_error(tiny, tmp_path):
    path = tmp_path / "m.safetensors"
    zoo.save(zoo.load(tiny), path)
    _flip_last_byte(path)
    with pytest.raises(WeightsError, match="sha256.*corrupt"):
        zoo.load(tiny, pretrained=path)


def test_truncated_file_is_an_error(tiny, tmp_path):
    path = tmp_path / "m.safetensors"
    zoo.save(zoo.load(tiny), path)
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(WeightsError, match="truncated|corrupt|not a valid"):
        zoo.load(tiny, pretrained=path)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(WeightsError, match="shorter than"):
        zoo.load(tiny, pretrained=path)


def test_shipped_weights_checked_against_manifest(tiny_shipped):
    model, weights_dir = tiny_shipped
    loaded = zoo.load("tiny_test_cls", pretrained=True)
    assert torch.equal(loaded(X), model(X))
    assert torch.equal(zoo.load("tiny_test_cls", pretrained="v1")(X), model(X))
    _flip_last_byte(weights_dir / "tiny.v1.safetensors")
    with pytest.raises(WeightsError, match="manifest says"):
        zoo.load("tiny_test_cls", pretrained=True)


def test_shipped_weights_truncated(tiny_shipped):
    _, weights_dir = tiny_shipped
    path = weights_dir / "tiny.v1.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(WeightsError, match="truncated"):
        zoo.load("tiny_test_cls", pretrained=True)


def test_new_num_classes_reinitialises_head_with_warning(tiny, tmp_path):
    model = zoo.load(tiny)
    zoo.save(model, tmp_path / "m.safetensors", {"labels": ["a", "b", "c"]})
    with pytest.warns(UserWarning, match=r"head re-initialised.*head\.bias, head\.weight"):
        new = zoo.load(tiny, pretrained=tmp_path / "m.safetensors", num_classes=5)
    assert new.head.out_features == 5
    assert torch.isfinite(new.head.weight).all() and new.head.weight.abs().sum() > 0, "head must be initialised"
    assert torch.equal(new.body[0].weight, model.body[0].weight), "backbone kept"
    assert new.pretrained_meta.labels is None, "old labels do not describe the new head"
    assert torch.isfinite(new(X)).all()


def test_same_num_classes_loads_without_warning(tiny, tmp_path):
    zoo.save(zoo.load(tiny), tmp_path / "m.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        zoo.load(tiny, pretrained=tmp_path / "m.safetensors", num_classes=3)


def test_other_mismatches_name_the_keys(tiny, tmp_path):
    from zoo.weights import WeightsMeta, save_state_dict
    state = zoo.load(tiny).state_dict()
    state["extra.weight"] = torch.zeros(2)
    del state["norm.bias"]
    state["body.0.weight"] = torch.zeros(3, 3)
    save_state_dict(state, tmp_path / "bad.safetensors",
                    WeightsMeta(model="tiny_test_cls", config={"in_features": 4, "hidden": 8, "num_classes": 3}))
    with pytest.raises(WeightsError) as err:
        zoo.load(tiny, pretrained=tmp_path / "bad.safetensors")
    message = str(err.value)
    assert "missing keys: norm.bias" in message
    assert "unexpected keys: extra.weight" in message
    assert "body.0.weight (checkpoint (3, 3), model (8, 4))" in message


def test_weights_for_another_model_are_refused(tiny, tmp_path):
    lm = zoo.load("transformer_lm", vocab_size=8, context=8, dim=16, n_layers=1, n_heads=2, mlp_hidden=16)
    zoo.save(lm, tmp_path / "lm.safetensors")
    with pytest.raises(WeightsError, match="are for 'transformer_lm'"):
        zoo.load(tiny, pretrained=tmp_path / "lm.safetensors")


def test_pickle_checkpoint_loads_with_weights_only(tiny, tmp_path):
    model = zoo.load(tiny)
    torch.save({"state_dict": model.state_dict(), "epoch": 3}, tmp_path / "m.pt")
    assert torch.equal(zoo.load(tiny, pretrained=tmp_path / "m.pt")(X), model(X))


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_pickle_with_code_is_refused(tiny, tmp_path):
    torch.save({"x": Evil()}, tmp_path / "evil.bin")
    with pytest.raises(WeightsError, match="weights_only=True"):
        zoo.load(tiny, pretrained=tmp_path / "evil.bin")


def test_bad_specs(tiny, tmp_path):
    with pytest.raises(WeightsError, match="not a weights tag.*existing file"):
        zoo.load(tiny, pretrained="nope")
    with pytest.raises(WeightsError, match="no shipped default"):
        zoo.load(tiny, pretrained=True)
    (tmp_path / "m.onnx").write_bytes(b"x")
    with pytest.raises(WeightsError, match="unsupported weights format"):
        zoo.load(tiny, pretrained=tmp_path / "m.onnx")
    with pytest.raises(FileNotFoundError, match="holds neither"):
        zoo.load(tiny, pretrained=tmp_path)


def test_compiled_model_saves_plain_keys(tiny, tmp_path):
    model = zoo.accel.compile(zoo.load(tiny))
    zoo.save(model, tmp_path / "m.safetensors")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert not any("_orig_mod" in k for k in f.keys())


def test_save_pretrained_folder_round_trip(tiny, tmp_path):
    model = zoo.load(tiny)
    folder = zoo.save_pretrained(model, tmp_path / "repo", {"dataset": "random"})
    assert (folder / "README.md").read_text().startswith("# `tiny_test_cls`")
    assert torch.equal(zoo.load(tiny, pretrained=folder)(X), model(X))


def test_parse_hub_uri():
    assert parse_hub_uri("hf://a/b") == ("a/b", None, None)
    assert parse_hub_uri("hf://a/b/sub/m.safetensors@v1") == ("a/b", "sub/m.safetensors", "v1")
    with pytest.raises(WeightsError, match="expected hf://owner/repo"):
        parse_hub_uri("hf://justone")


def test_hub_loading_from_local_cache_offline(tiny, tmp_path, offline_hub):
    model = zoo.load(tiny)
    folder = zoo.save_pretrained(model, tmp_path / "export")
    offline_hub.publish("someone/tiny", {"model.safetensors": (folder / "model.safetensors").read_bytes(),
                                                   "README.md": b"# tiny"})
    assert torch.equal(zoo.load(tiny, pretrained="hf://someone/tiny")(X), model(X))
    assert torch.equal(zoo.load(tiny, pretrained="hf://someone/tiny/model.safetensors")(X), model(X))


def test_hub_offline_missing_file_names_repo_and_fix(tiny, offline_hub):
    with pytest.raises(FileNotFoundError) as err:
        zoo.load(tiny, pretrained="hf://someone/absent/model.safetensors")
    message = str(err.value)
    assert "someone/absent" in message and "model.safetensors" in message
    assert "HF_HUB_OFFLINE" in message and "huggingface-cli download someone/absent model.safetensors" in message


def test_push_to_hub_uploads_a_loadable_folder(tiny, tmp_path, monkeypatch):
    import huggingface_hub
    uploaded = {}

    class FakeApi:
        def create_repo(self, repo_id, private, exist_ok):
            uploaded["repo"] = repo_id

        def upload_folder(self, repo_id, folder_path, revision, commit_message):
            import shutil
            shutil.copytree(folder_path, tmp_path / "pushed")

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    model = zoo.load(tiny)
    assert zoo.push_to_hub(model, "me/tiny") == "hf://me/tiny"
    assert uploaded["repo"] == "me/tiny"
    assert torch.equal(zoo.load(tiny, pretrained=tmp_path / "pushed")(X), model(X))


def test_meta_keys_are_validated(tiny, tmp_path):
    with pytest.raises(ValueError, match="unknown metadata keys"):
        zoo.save(zoo.load(tiny), tmp_path / "m.safetensors", {"acc": 1})
    with pytest.raises(ValueError, match="3 labels"):
        zoo.save(zoo.load(tiny, num_classes=2), tmp_path / "m.safetensors", {"labels": ["a", "b", "c"]})


def test_no_partial_file_left_on_failure(tiny, tmp_path, monkeypatch):
    import zoo._io
    path = tmp_path / "m.safetensors"
    zoo.save(zoo.load(tiny), path)
    before = path.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(zoo._io.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        zoo.save(zoo.load(tiny, hidden=16), path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.safetensors"], "temporary file cleaned up"


# --------------------------------------------------------------------------- provenance


def _file_meta(path):
    from zoo.weights import read_weights
    return read_weights(path)[1]


def test_fine_tuned_shipped_bert_records_its_own_run_and_its_parent(tmp_path):
    """Issue 15 acceptance: one step on the SST-2 weights, then save: the file tells the new run, not the old."""
    from zoo.weights import read_manifest
    model = zoo.load("bert_cls", pretrained=True)
    shipped = model.pretrained_meta
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model.example_loss(*model.example_inputs(batch=2, length=8)).backward()
    opt.step()
    path = tmp_path / "tuned.safetensors"
    zoo.save(model, path, {"metrics": {"accuracy": 0.5}, "command": "finetune --steps 1"})
    meta = _file_meta(path)
    assert meta.command == "finetune --steps 1" and meta.metrics == {"accuracy": 0.5}
    assert meta.dataset == "" and meta.extra == {}, "the shipped run's data set and details are not this run's"
    assert meta.parent == {"sha256": read_manifest()["bert_cls.sst2.safetensors"]["sha256"],
                           "source": "bert_cls.sst2", "parent": None}
    assert meta.labels == shipped.labels and meta.preprocessing == shipped.preprocessing, "the model's own"


def test_save_of_shipped_weights_drops_run_metadata(tiny_shipped, tmp_path):
    _, weights_dir = tiny_shipped
    model = zoo.load("tiny_test_cls", pretrained=True)
    meta = zoo.save(model, tmp_path / "m.safetensors", {"metrics": {"loss": 1.0}})
    assert meta.metrics == {"loss": 1.0} and meta.dataset == ""
    assert meta.command.split()[0] == os.path.basename(sys.argv[0]), "defaults to this command line"
    assert meta.labels == ["a", "b", "c"]
    manifest = json.loads((weights_dir / "manifest.json").read_text())
    assert meta.parent["sha256"] == manifest["tiny.v1.safetensors"]["sha256"]
    assert meta.parent["source"] == "tiny_test_cls.v1"


def test_provenance_is_a_chain(tiny, tmp_path):
    from zoo.weights import file_sha256
    first, second, third = (tmp_path / f"{n}.safetensors" for n in ("first", "second", "third"))
    assert zoo.save(zoo.load(tiny), first).parent is None, "trained from scratch"
    zoo.save(zoo.load(tiny, pretrained=first), second, {"command": "step 2"})
    folder = zoo.save_pretrained(zoo.load(tiny, pretrained=second), tmp_path / "third")
    meta = _file_meta(folder / "model.safetensors")
    assert meta.parent["source"] == str(second) and meta.parent["sha256"] == file_sha256(second)
    assert meta.parent["parent"] == {"sha256": file_sha256(first), "source": str(first), "parent": None}
    assert f"- trained from: `{second}` (sha256 {file_sha256(second)})" in (folder / "README.md").read_text()
    # saving twice from one model: the second file descends from the first
    model = zoo.load(tiny)
    zoo.save(model, first)
    assert zoo.save(model, third).parent["sha256"] == file_sha256(first)


def test_new_head_keeps_parent_and_preprocessing_but_not_labels(tiny, tmp_path):
    zoo.save(zoo.load(tiny), tmp_path / "m.safetensors", {"labels": ["a", "b", "c"], "preprocessing": {"scale": 2}})
    with pytest.warns(UserWarning, match="head re-initialised"):
        model = zoo.load(tiny, pretrained=tmp_path / "m.safetensors", num_classes=5)
    meta = zoo.save(model, tmp_path / "new.safetensors")
    assert meta.labels is None and meta.preprocessing == {"scale": 2}
    assert meta.parent["source"] == str(tmp_path / "m.safetensors")


def test_file_without_parent_field_loads(tiny, tmp_path):
    from safetensors.torch import save_file
    model = zoo.load(tiny)
    old = {"model": tiny, "config": {"in_features": 4, "hidden": 8, "num_classes": 3}, "command": "old"}
    save_file(model.state_dict(), str(tmp_path / "old.safetensors"), metadata={"zoo": json.dumps(old)})
    loaded = zoo.load(tiny, pretrained=tmp_path / "old.safetensors")
    assert loaded.pretrained_meta.parent is None and torch.equal(loaded(X), model(X))


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int32])
def test_integer_storage_dtype_is_refused(tiny, tmp_path, dtype):
    with pytest.raises(ValueError, match="floating dtype.*zoo.accel.quantize"):
        zoo.save(zoo.load(tiny), tmp_path / "m.safetensors", dtype=dtype)
    assert not any(tmp_path.iterdir()), "nothing written"


# --------------------------------------------------------------------------- publish


def test_publish_replaces_file_and_manifest(tiny_shipped, tmp_path):
    from zoo.weights import publish
    _, weights_dir = tiny_shipped
    new = zoo.load("tiny_test_cls")
    zoo.save(new, tmp_path / "new.safetensors")
    assert publish(tmp_path / "new.safetensors", "tiny_test_cls", "v1") == weights_dir / "tiny.v1.safetensors"
    assert torch.equal(zoo.load("tiny_test_cls", pretrained="v1")(X), new(X)), "manifest matches the new file"
    assert sorted(p.name for p in weights_dir.iterdir()) == ["manifest.json", "tiny.v1.safetensors"]


@pytest.mark.parametrize("failure", ["copy", "rename"])
def test_failing_publish_leaves_file_and_manifest(tiny_shipped, tmp_path, monkeypatch, failure):
    import shutil

    import zoo._io
    from zoo.weights import publish
    _, weights_dir = tiny_shipped
    zoo.save(zoo.load("tiny_test_cls"), tmp_path / "new.safetensors")
    before = {p.name: p.read_bytes() for p in weights_dir.iterdir()}

    def half_copy(src, dst):
        with open(dst, "wb") as f:
            f.write(open(src, "rb").read(100))
        raise OSError("disk full")

    def boom(*a, **k):
        raise OSError("disk full")
    if failure == "copy":
        monkeypatch.setattr(shutil, "copyfile", half_copy)
    else:
        monkeypatch.setattr(zoo._io.os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        publish(tmp_path / "new.safetensors", "tiny_test_cls", "v1")
    assert {p.name: p.read_bytes() for p in weights_dir.iterdir()} == before, "old file and manifest, no temp file"
    zoo.load("tiny_test_cls", pretrained="v1")


# --------------------------------------------------------------------------- package layout


def test_cards_and_weights_import_alone_without_a_cycle():
    import ast
    import subprocess
    from pathlib import Path
    package = Path(zoo.__file__).parent / "weights"
    for source in package.glob("*.py"):
        nodes = list(ast.walk(ast.parse(source.read_text())))
        imported = {n.module for n in nodes if isinstance(n, ast.ImportFrom)}
        imported |= {alias.name for n in nodes if isinstance(n, ast.Import) for alias in n.names}
        assert "zoo.cards" not in imported, f"{source.name} imports zoo.cards: cards imports weights, not the reverse"
    for module in ("zoo.cards", "zoo.weights"):
        subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
