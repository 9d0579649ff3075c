"""Issue 16's acceptance commands: the train scripts fine-tune from checkpoints the peer libraries wrote themselves
(a torchvision EfficientNetV2-S state dict saved with torch.save, a transformers BertForPreTraining folder with
its BertTokenizerFast) to a new head, run as a user runs them (a fresh process, the command line). Tiny data,
2 steps; --batch-size fits the few examples (the defaults, 128 and 32, make no full step of them), and the
EfficientNet run crops to 64 instead of its 224 default to stay fast on a CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    cmd = [sys.executable, str(ROOT / "train_scripts" / f"{name}.py"), *args, "--workers", "0"]
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{' '.join(cmd)} exited {result.returncode}:\n{result.stderr[-4000:]}"
    return result


def final_metrics(out: Path) -> dict:
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in lines if r.get("split") == "eval"][-1]


@pytest.mark.slow
def test_effnetv2_script_fine_tunes_a_torchvision_state_dict_to_a_new_head(tmp_path):
    torchvision = pytest.importorskip("torchvision")
    import numpy as np
    from PIL import Image
    torch.manual_seed(0)
    torch.save(torchvision.models.efficientnet_v2_s(weights=None).state_dict(), tmp_path / "effnetv2_s.pth")
    rng = np.random.default_rng(0)
    for name in ("cat", "dog", "owl"):  # one folder of classes, a few PNGs of different sizes each
        (tmp_path / "images" / name).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 256, (40 + i, 50, 3), dtype=np.uint8)).save(tmp_path / "images" / name / f"{i}.png")
    out = tmp_path / "run"
    result = run_script("effnetv2_cls", "--pretrained", str(tmp_path / "effnetv2_s.pth"), "--variant", "s",
                        "--num-classes", "3", "--data", str(tmp_path / "images"), "--steps", "2", "--batch-size", "4",
                        "--image-size", "64", "--out", str(out), cwd=tmp_path)
    assert "head re-initialised" in result.stderr and "head.weight" in result.stderr  # the warning names the keys
    import zoo
    model = zoo.load("effnetv2_cls", pretrained=out / "model.safetensors")
    assert model.config.variant == "s" and model.config.num_classes == 3
    assert len(final_metrics(out)["confusion"]) == 3


def test_bert_script_fine_tunes_a_bert_for_pretraining_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "bert"
    folder.mkdir()
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + "great awful lovely boring film movie the a".split()
    (folder / "vocab.txt").write_text("\n".join(words) + "\n")
    transformers.BertTokenizerFast(vocab_file=str(folder / "vocab.txt")).save_pretrained(folder)
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=len(words), hidden_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    transformers.BertForPreTraining(config).save_pretrained(folder)  # cls.predictions.* and cls.seq_relationship.*
    rows = ["sentence\tlabel"] + [f"{w} film\t{label}" for w, label in
                                  [("great", 1), ("awful", 0), ("lovely", 1), ("boring", 0)] * 4]
    (tmp_path / "train.tsv").write_text("\n".join(rows) + "\n")
    (tmp_path / "dev.tsv").write_text("\n".join(rows[:5]) + "\n")
    out = tmp_path / "run"
    result = run_script("bert_cls", "--pretrained", str(folder), "--data", str(tmp_path / "train.tsv"),
                        "--eval", str(tmp_path / "dev.tsv"), "--steps", "2", "--batch-size", "4", "--out", str(out),
                        cwd=tmp_path)
    assert "cls.predictions" in result.stderr and "cls.seq_relationship" in result.stderr  # the dropped heads, named
    import zoo
    model = zoo.load("bert_cls", pretrained=out / "model.safetensors")
    assert (model.config.hidden, model.config.layers, model.config.num_classes) == (32, 2, 2)
    assert model.predict(["great film"])[0]["label"] in model.labels
    assert "accuracy" in final_metrics(out)
