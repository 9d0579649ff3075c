"""`zoo export` / zoo.accel.export: the command, its refusals, the AOTInductor package, the LM's decode graph and
the int8 exports.

The ONNX and .pt2 exports of every family (and their runs in a process that cannot import zoo) are part of
the conformance battery, tests/test_families.py. AOTInductor compiles for tens of seconds even at the tiny
configs, so the suite compiles one family; the full check runs apart, on the shipped weights:

    python -m tests.test_export_artifacts --all        # onnx and aoti (and pte, where executorch imports)
                                                      # for all five families; prints sizes, errors, times
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch
from torch import nn

import zoo
from zoo.accel import deploy_int8
from zoo.accel.hardware import capabilities
from zoo.models.base import ZooModel
from zoo.registry import register_model, unregister_model

from .conftest import long_test
from .test_families import BATCH, EXAMPLE, OTHER_BATCH, build, run_without_zoo


def zoo_cli(argv: list[str]) -> int:
    from zoo.cli import main
    return main(argv)


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(folder.rglob("*"))}


# ------------------------------------------------------------------ a family torch.export cannot trace


@dataclass(frozen=True)
class BranchyConfig:
    features: int = 4


class Branchy(ZooModel):
    """A classifier whose forward takes a Python branch on a tensor's value: torch.export cannot trace it."""

    def __init__(self, config: BranchyConfig = BranchyConfig()):
        super().__init__()
        self.config = config
        self.head = nn.Linear(config.features, 2)

    @property
    def checkpoint_blocks(self):
        return [self.head]

    def example_inputs(self, batch: int = 2):
        return (torch.randn(batch, self.config.features, generator=torch.Generator().manual_seed(0)),)

    def forward(self, x):
        if x.sum() > 0:
            return self.head(x)
        return -self.head(x)


@pytest.fixture
def branchy():
    register_model("branchy_test", config=BranchyConfig)(Branchy)
    yield "branchy_test"
    unregister_model("branchy_test")


# ------------------------------------------------------------------ bad input: one line, exit 2, nothing written


def _sys_is_read_only() -> bool:
    try:
        tempfile.mkdtemp(dir="/sys")
    except OSError:
        return True
    return False  # (a privileged container): the test below needs another unwritable place


BAD = {
    "unknown format": (lambda d: ["--format", "tflite", "-o", str(d / "out")], "unknown export format 'tflite'"),
    "--int8 pt2": (lambda d: ["--format", "pt2", "--int8", "-o", str(d / "out")], "--int8 exports onnx and aoti"),
    "--int8 pte": (lambda d: ["--format", "pte", "--int8", "-o", str(d / "out")], "--int8 exports onnx and aoti"),
    "unwritable -o": (lambda d: ["--format", "pt2", "-o", "/sys/zoo-export-test"], "cannot write in /sys"),
    "-o under a file": (lambda d: ["--format", "pt2", "-o", str(d / "notes.txt" / "out")], "is a file"),
    "-o holds other files": (lambda d: ["--format", "pt2", "-o", str(d)], "not an export"),
    "unknown --dynamic": (lambda d: ["--format", "pt2", "--dynamic", "batch,seq", "-o", str(d / "new" / "out")],
                          "no dynamic dimension 'seq'"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_export_input_is_one_line_exit_2_and_writes_nothing(case, tiny, tmp_path, capsys):
    args, word = BAD[case]
    if case == "unwritable -o" and not _sys_is_read_only():
        pytest.skip("/sys is writable here")
    (tmp_path / "notes.txt").write_text("a file, not a folder\n")
    before = snapshot(tmp_path)
    code = zoo_cli(["export", tiny, *args(tmp_path)])
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if "error:" in line]
    assert code == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("zoo export: error:") and word in lines[0], err
    assert snapshot(tmp_path) == before, "a refused export created or changed files"


def test_a_model_torch_export_cannot_trace_is_one_line_naming_the_branch(branchy, tmp_path, capsys):
    out = tmp_path / "exports" / "branchy"  # the parent folders it would create are removed again too
    assert zoo_cli(["export", branchy, "--format", "onnx", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.strip().splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert "branches on a tensor's value" in lines[0] and "test_export_artifacts.py" in lines[0], lines[0]
    assert "if x.sum() > 0:" in lines[0], lines[0]
    assert list(tmp_path.iterdir()) == [], "a failed export left files or folders behind"


# ------------------------------------------------------------------ the command and the manifest


def test_cli_export_describes_and_verifies_and_replaces_a_previous_export(tiny, tiny_shipped, tmp_path, capsys):
    name, out = tiny, tmp_path / "exports" / "tiny"
    assert zoo_cli(["export", name, "--format", "pt2", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out / 'model.pt2'}" in printed and "verified at x (3, 4)" in printed, printed
    manifest = json.loads((out / "zoo_export.json").read_text())
    model = zoo.load(name, pretrained=True)
    assert manifest["format"] == "pt2" and manifest["file"] == "model.pt2"
    assert manifest["graphs"]["model"]["inputs"] == [{"name": "x", "dtype": "float32", "shape": ["batch", 4]}]
    assert manifest["graphs"]["model"]["outputs"] == [{"name": "output", "dtype": "float32", "shape": ["batch", 3]}]
    assert manifest["labels"] == ["a", "b", "c"] and manifest["weights"]["sha256"] == model.pretrained_source["sha256"]
    assert manifest["versions"]["torch"] == importlib.metadata.version("torch")
    assert manifest["size_bytes"] == (out / "model.pt2").stat().st_size
    # a second export into the same folder replaces the first (and leaves no temporary folder beside it)
    assert zoo_cli(["export", name, "--format", "pt2", "--dynamic", "none", "-o", str(out)]) == 0
    manifest = json.loads((out / "zoo_export.json").read_text())
    assert manifest["graphs"]["model"]["inputs"][0]["shape"] == [2, 4]
    assert [p.name for p in out.parent.iterdir()] == ["tiny"]


def test_export_keeps_the_models_training_mode(tiny, tmp_path):
    model = zoo.load(tiny).train()
    zoo.accel.export(model, "pt2", tmp_path / "out", progress=False)
    assert model.training


def test_export_help_points_from_torchscript_to_aoti(capsys):
    with pytest.raises(SystemExit):
        zoo_cli(["export", "--help"])
    text = capsys.readouterr().out
    assert "TorchScript" in text and "deprecated" in text and "aoti" in text


# ------------------------------------------------------------------ the LM's KV-cache graphs


def test_lm_decode_step_continues_the_prefill_as_the_full_sequence_does():
    model = build("transformer_lm")
    graphs = model.export_graphs(BATCH)
    (ids,) = graphs["model"].inputs
    token, past_keys, past_values = graphs["decode"].inputs
    past = past_keys.shape[3]
    assert torch.equal(token, ids[:, past:past + 1])
    with torch.no_grad():
        logits, keys, values = graphs["decode"].module(token, past_keys, past_values)
        full_logits, full_keys, full_values = graphs["model"].module(ids[:, :past + 1])
    torch.testing.assert_close(logits, full_logits[:, -1:], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(keys, full_keys, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(values, full_values, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(full_logits, model(ids[:, :past + 1]), atol=0, rtol=0)


# ------------------------------------------------------------------ AOTInductor and ExecuTorch


@pytest.mark.slow
def test_aoti_package_runs_without_zoo(tmp_path):
    """One family (tiny BERT: a dynamic batch and sequence, a padding mask) through AOTInductor."""
    model = build("bert_cls")
    result = zoo.accel.export(model, "aoti", tmp_path / "bert", example=EXAMPLE["bert_cls"], progress=False)
    assert result.files == [tmp_path / "bert" / "model.aoti.pt2"] and result.max_rel_error <= 1e-3
    run_without_zoo([(result.folder, model.export_graphs(OTHER_BATCH, **EXAMPLE["bert_cls"]), tmp_path / "run")])


def test_pte_without_executorch_is_one_line_naming_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "executorch", None)  # as where it is not installed
    with pytest.raises(RuntimeError, match=r"needs the executorch package: pip install 'zoo\[mobile\]'"):
        zoo.accel.export(build("bert_cls"), "pte", tmp_path / "bert", progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_pte_runs_without_zoo(tmp_path):
    """ExecuTorch + XNNPACK, where executorch is installed (the [mobile] extra; 60 s of CPU for tiny BERT)."""
    pytest.importorskip("executorch")
    model = build("bert_cls")
    result = zoo.accel.export(model, "pte", tmp_path / "bert", example=EXAMPLE["bert_cls"], progress=False)
    # ExecuTorch plans memory for the largest shape: the dynamic sizes are bounded at the traced ones
    assert result.manifest["graphs"]["model"]["dims"]["batch"]["max"] == BATCH
    run_without_zoo([(result.folder, model.export_graphs(1, **EXAMPLE["bert_cls"]), tmp_path / "run")])


# ------------------------------------------------------------------ int8


INT8 = {"bert_cls": "dynamic", "effnetv2_cls": "static"}  # a Linear-only family and a convolutional one
INT8_OPS = {"dynamic": {"DynamicQuantizeLinear", "MatMulInteger"}, "static": {"QuantizeLinear", "DequantizeLinear"}}


class Outputs(nn.Module):
    """A callable giving a list of tensors (an int8 reference) as the module run_without_zoo compares with."""

    def __init__(self, run):
        super().__init__()
        self.run = run

    def forward(self, *inputs):
        return self.run(*inputs)


def assert_int8_verified(manifest: dict, method: str) -> None:
    int8, verified = manifest["int8"], manifest["verified"]
    assert int8["method"] == method and int8["cpu"] == capabilities(cuda=False).describe()
    assert verified["reference"] == "int8 eager" and verified["tolerance"] == deploy_int8.TOLERANCE[method]
    assert verified["max_rel_error"] <= verified["tolerance"]
    # int8, not a copy of the fp32 model: it differs from fp32 eager, by less than the output's magnitude
    assert 0 < verified["vs_fp32"]["max_rel_error"] < 0.5, verified["vs_fp32"]


@pytest.fixture(scope="module")
def int8_onnx(tmp_path_factory):
    """name -> (tiny model, its int8 ONNX export), exported once for the tests below."""
    pytest.importorskip("onnxruntime")
    folder = tmp_path_factory.mktemp("int8")
    return {name: (model := build(name), zoo.accel.export(model, "onnx", folder / name, example=EXAMPLE[name],
                                                          int8=True, progress=False))
            for name in INT8}


@pytest.mark.parametrize("name", INT8)
def test_int8_onnx_is_smaller_than_fp32_and_verified_against_the_int8_graph(name, int8_onnx):
    import onnx
    _, result = int8_onnx[name]
    manifest, method = result.manifest, INT8[name]
    assert_int8_verified(manifest, method)
    assert manifest["int8"]["weights"].startswith("int8" if capabilities(cuda=False).vnni else "uint8")
    assert manifest["verified"]["fp32_onnx"]["max_rel_error"] <= 1e-3  # the file it was quantized from
    assert manifest["size_bytes"] == result.size_bytes < manifest["fp32_size_bytes"] / 3
    assert sorted(p.name for p in result.folder.iterdir()) == ["model.onnx", "zoo_export.json"]  # no fp32 file
    ops = Counter(node.op_type for node in onnx.load(str(result.files[0])).graph.node)
    assert INT8_OPS[method] <= set(ops), ops


def test_int8_onnx_files_run_without_zoo_as_the_int8_graph(int8_onnx, tmp_path):
    """At another batch, in one process where zoo cannot be imported: as each int8 graph run op by op here."""
    jobs = []
    for name, (model, result) in int8_onnx.items():
        graphs = model.export_graphs(OTHER_BATCH, **EXAMPLE[name])
        reference = deploy_int8.onnx_reference(result.files[0], list(graphs["model"].names))
        jobs.append((result.folder, {"model": replace(graphs["model"], module=Outputs(reference))}, tmp_path / name))
    errors = run_without_zoo(jobs, tolerance=min(deploy_int8.TOLERANCE.values()))
    assert len(errors) == len(INT8)


# The int8 packages compile for 1-3 min each on 2 cores (bert_cls 56 s, effnetv2_cls 174 s, AVX2 EPYC): beyond
# the suite's 15-minute budget, so they run where ZOO_LONG_TESTS=1 is set (the int8 ONNX exports always run)
@long_test("1-3 min of AOTInductor compile on 2 cores")
@pytest.mark.slow
@pytest.mark.parametrize("name", INT8)
def test_int8_aoti_package_runs_without_zoo_as_verified(name, tmp_path):
    """PT2E int8 compiled by AOTInductor (minutes even at the tiny configs): verified against the PT2E module in
    eager; the package gives the same outputs in a process that cannot import zoo as in this one."""
    from zoo.accel import artifacts
    model, method = build(name), INT8[name]
    result = zoo.accel.export(model, "aoti", tmp_path / name, example=EXAMPLE[name], int8=True, progress=False)
    assert_int8_verified(result.manifest, method)
    state_dict_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert result.size_bytes < state_dict_bytes, "the int8 package is not smaller than the fp32 weights alone"
    graphs = model.export_graphs(OTHER_BATCH, **EXAMPLE[name])
    here = artifacts.load(result.folder)["model"]
    graphs = {"model": replace(graphs["model"], module=Outputs(
        lambda *t: [torch.from_numpy(a) for a in here(*(x.numpy() for x in t))]))}
    run_without_zoo([(result.folder, graphs, tmp_path / "run")], tolerance=1e-6)


def test_int8_aoti_where_pt2e_quantizes_nothing_is_one_line():
    """PT2E's x86 quantizer has no 3-D convolutions (unet3d_seg): an "int8" package would be fp32."""
    from zoo.models.base import BATCH as BATCH_DIM, ExportGraph
    volume = torch.randn(2, 1, 4, 4, 4)
    graph = ExportGraph(nn.Sequential(nn.Conv3d(1, 2, 3)).eval(), (volume,), ("volume",), ({0: BATCH_DIM},))
    plan = deploy_int8.Int8Plan("aoti", static=True, vnni=False, calibration="a test batch")
    with pytest.raises(RuntimeError, match=r"left every layer of Sequential in float .*not Conv3d.*--format onnx"):
        deploy_int8.quantize_graph(graph, plan, {"batch"}, [(volume,)])


def test_int8_calibration_batches_have_the_traced_shape(tmp_path):
    model = build("effnetv2_cls")
    graphs = model.export_graphs(BATCH, **EXAMPLE["effnetv2_cls"])
    batches = deploy_int8.calibration_batches(model, graphs, BATCH, EXAMPLE["effnetv2_cls"], None)["model"]
    assert len(batches) == deploy_int8.CALIBRATION_BATCHES
    assert all(b[0].shape == graphs["model"].inputs[0].shape for b in batches)
    assert not torch.equal(batches[0][0], batches[1][0])
    mine = [(torch.zeros(2, 3, 16, 16),)]
    assert deploy_int8.calibration_batches(model, graphs, BATCH, {}, mine)["model"] == mine
    with pytest.raises(ValueError, match="calibration= is for convolutional models"):
        zoo.accel.export(build("bert_cls"), "onnx", tmp_path / "out", int8=True, calibration=mine, progress=False)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ the full check, on the shipped weights


def check_all(formats: list[str], families: list[str], folder: Path):
    """`zoo export NAME --format F` with the shipped weights for each family and format, then each file run at
    batch 3 (pte: 1, bounded at the traced 2) in a process that cannot import zoo; yields a row per export."""
    for name in families:
        model = zoo.load(name, pretrained=True)
        for fmt in formats:
            out = folder / f"{name}-{fmt}"
            start = time.perf_counter()
            code = zoo_cli(["export", name, "--format", fmt, "-o", str(out)])
            seconds = time.perf_counter() - start
            if code != 0:
                yield {"family": name, "format": fmt, "error": f"zoo export exited {code}"}
                continue
            manifest = json.loads((out / "zoo_export.json").read_text())
            errors = run_without_zoo([(out, model.export_graphs(1 if fmt == "pte" else 3), folder / f"{out.name}-run")])
            yield {"family": name, "format": fmt, "MB": manifest["size_bytes"] / 1e6, "seconds": seconds,
                   "verify_rel_error": manifest["verified"]["max_rel_error"], "zoo_free_rel_error": errors[out.name],
                   "graphs": list(manifest["graphs"])}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="export every family with its shipped weights (module docstring)")
    parser.add_argument("--all", action="store_true", help="all five families in onnx and aoti (pte if it imports)")
    parser.add_argument("--formats", default=None, help="comma-separated formats instead")
    parser.add_argument("--families", default=None, help="comma-separated families instead")
    args = parser.parse_args(argv)
    if not (args.all or args.formats or args.families):
        parser.error("give --all, or --formats / --families")
    formats = args.formats.split(",") if args.formats else ["onnx", "aoti"]
    if not args.formats:
        try:
            import executorch  # noqa: F401
            formats.append("pte")
        except ImportError:
            print("executorch does not import here: no pte exports (pip install 'zoo[mobile]')", file=sys.stderr)
    families = args.families.split(",") if args.families else zoo.list_models()
    header = f"{'family':<16} {'format':<6} {'MB':>7} {'export s':>9} {'verify rel':>11} {'no-zoo rel':>11}  graphs"
    lines, failed = [header], False
    with tempfile.TemporaryDirectory() as tmp:
        for r in check_all(formats, families, Path(tmp)):
            if "error" in r:
                lines.append(f"{r['family']:<16} {r['format']:<6} {r['error']}")
                failed = True
            else:
                lines.append(f"{r['family']:<16} {r['format']:<6} {r['MB']:>7.2f} {r['seconds']:>9.1f} "
                             f"{r['verify_rel_error']:>11.2e} {r['zoo_free_rel_error']:>11.2e}  "
                             + ",".join(r["graphs"]))
            print(lines[-1], flush=True)
    print("\n".join(lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
