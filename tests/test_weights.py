import json
import os
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


def _fake_hub_cache(cache, repo_id, files: dict[str, bytes], commit="0" * 40):
    """Lay out files as huggingface_hub's cache does: blobs, snapshots/<commit>, refs/main."""
    import hashlib
    root = cache / f"models--{repo_id.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = root / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as c
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(cache))
    return cache


def test_hub_loading_from_local_cache_offline(tiny, tmp_path, offline_hub):
    model = zoo.load(tiny)
    folder = zoo.save_pretrained(model, tmp_path / "export")
    _fake_hub_cache(offline_hub, "someone/tiny", {"model.safetensors": (folder / "model.safetensors").read_bytes(),
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
