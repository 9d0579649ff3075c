"""The `zoo` command: output, exit codes and clear errors instead of tracebacks."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from zoo.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_list_and_info(capsys, tiny):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "transformer_lm" in out and "tiny_test_cls" in out
    assert main(["info", "tiny_test_cls", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["params"] == 4 * 8 + 8 + 16 + 8 * 3 + 3


@pytest.mark.parametrize("argv,message", [
    (["info", "transformer_l"], "Did you mean 'transformer_lm'"),
    (["predict", "nope", "x"], "unknown model 'nope'"),
    (["predict", "transformer_lm", "x", "--pretrained", "/no/such/file.safetensors"], "not a weights tag"),
])
def test_errors_are_one_line_without_traceback(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_predict_with_shipped_weights_and_json(capsys, tiny_shipped):
    assert main(["predict", "tiny_test_cls", "1", "2", "3", "4", "--json"]) == 0
    probs = json.loads(capsys.readouterr().out)["probs"]
    assert len(probs) == 3 and abs(sum(probs) - 1) < 1e-5


def test_predict_corrupt_weights_is_a_clear_error(capsys, tiny_shipped):
    _, weights_dir = tiny_shipped
    path = weights_dir / "tiny.v1.safetensors"
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    assert main(["predict", "tiny_test_cls", "1", "2", "3", "4"]) == 2
    assert "corrupt" in capsys.readouterr().err


def test_demo_runs_models_with_shipped_weights(capsys, tiny_shipped, monkeypatch):
    from zoo import registry
    # only the tiny model, so the test does not depend on which real weights exist yet
    monkeypatch.setattr(registry, "list_models", lambda: ["tiny_test_cls"])
    import zoo
    monkeypatch.setattr(zoo, "list_models", lambda: ["tiny_test_cls"])
    assert main(["demo"]) == 0
    assert "tiny demo ran" in capsys.readouterr().out


def test_cards_check_detects_drift(tmp_path, capsys):
    path = tmp_path / "CARDS.md"
    assert main(["cards", "--out", str(path)]) == 0
    assert main(["cards", "--out", str(path), "--check"]) == 0
    path.write_text(path.read_text() + "edited by hand\n")
    assert main(["cards", "--out", str(path), "--check"]) == 1


def test_model_cards_file_is_in_sync():
    """MODEL_CARDS.md is generated: `zoo cards` must not change it."""
    from zoo.cards import render_model_cards
    assert (ROOT / "MODEL_CARDS.md").read_text() == render_model_cards(), "run `zoo cards` and commit"


def test_console_script_usage_error():
    result = subprocess.run(["zoo", "frobnicate"], capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr
    result = subprocess.run(["zoo", "list", "--bogus"], capture_output=True, text=True)
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr
