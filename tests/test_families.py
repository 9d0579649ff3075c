"""The conformance battery: every registered family, at a tiny config in fp32, against the shared machinery.

Parametrised over `zoo.list_models()`, so a new family runs all of it as soon as it registers, and fails at
once (with what to add) until this file has its tiny config, its sample inputs and its train-script flags.
A family whose config switches between architectures or heads lists further tiny configs in VARIANTS; each
runs the model-level checks below (all but predict and DDP) as its own case, `<family>-<variant>`:

    save -> load round trip          zoo.save to a file, zoo.load(name, pretrained=path): identical outputs
    state-dict keys                  against tests/golden/<name>.keys (key and shape per line; a renamed
                                     key fails loudly; regenerate with ZOO_UPDATE_GOLDEN=1)
    contract                         config frozen, example_inputs deterministic, example_loss a finite
                                     scalar, head_prefixes name real keys, a new num_classes gets a finite head
    compile                          zoo.accel.compile: zero graph breaks, one graph across two batch sizes
    export                           zoo.accel.export to ONNX and .pt2 (each file run at another shape than
                                     traced against eager), manifests describing the inputs, and both files
                                     equal to eager at another batch in a process that cannot import zoo
    checkpointing                    zoo.accel.checkpointing(model, "blocks"): identical gradients, fewer
                                     saved activations, the same state-dict keys
    DDP                              the family's own train script under torchrun (2 processes, gloo) for
                                     3 steps: both ranks' parameter fingerprints in replicas.json are equal
    cast / autocast                  bf16 weights and bf16 autocast run: finite outputs of the right shape
    quantize                         every method works (another batch size than the calibration) or raises
                                     the documented error naming the method
    predict                          `zoo predict` on a sample input with tiny random (saved) weights, and
                                     one bad input giving one `zoo predict: error:` line and exit code 1

Compilation uses Dynamo with the "eager" backend: graph breaks and recompilations are Dynamo's decisions,
made before any backend runs, and inductor's code generation would add 18-54 s per family on a 2-core CPU
(measured: transformer_lm 18 s, diffusion_unet 54 s); tests/test_accel.py and tests/test_cuda.py compile
with inductor.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import zoo
import zoo.accel as accel

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden"
FAMILIES = zoo.list_models()

# ---------------------------------------------------------------------------------------------- the tables
# Every registered family needs an entry in each table; test_every_family_has_battery_entries says which.

# config overrides for zoo.load: small, fp32, no dropout (so train and eval forwards agree)
TINY: dict[str, dict] = {
    # the full BERT vocabulary, so the shipped tokenizer's ids fit (`zoo predict` tokenizes real text)
    "bert_cls": dict(variant="minilm-l6", layers=2, hidden=48, heads=4, intermediate=96, max_positions=40,
                     num_classes=3, hidden_dropout=0.0, attention_dropout=0.0, classifier_dropout=0.0),
    # b0 is the smallest EfficientNetV2 the config allows (no depth/width override)
    "effnetv2_cls": dict(variant="b0", num_classes=3, drop_rate=0.0, drop_path_rate=0.0),
    "transformer_lm": dict(vocab_size=256, context=16, dim=32, n_layers=2, n_heads=4, mlp_hidden=32, dropout=0.0),
    "unet3d_seg": dict(preset="small", num_classes=3),
    "diffusion_unet": dict(image_size=8, widths=(16, 32), attention_levels=(1,), heads=2, num_classes=3,
                           timesteps=50, dropout=0.0, class_dropout=0.0),
}

# further tiny configs of a family, each its own case `<family>-<variant>` (config overrides on top of TINY) in
# the model-level checks (weights, contract, compile, export, checkpointing, precision, quantize; predict and
# DDP run the default config only), with its own golden key list tests/golden/<family>-<variant>.keys: the
# architectures and heads one config field switches between, which share no code path a default run covers
VARIANTS: dict[str, dict[str, dict]] = {
    "bert_cls": {
        # RoBERTa's positions after pad_token_id + 1 and one token type; a one-output regression head (MSE)
        "roberta_regression": dict(arch="roberta", num_classes=1),
        # DistilBERT: no token types, pre_classifier for the pooler; sigmoid + BCE multi-label head
        "distilbert_multilabel": dict(arch="distilbert", problem="multi_label"),
    },
}
CASES = FAMILIES + [f"{name}-{variant}" for name in FAMILIES for variant in VARIANTS.get(name, {})]

# keyword arguments of example_inputs(batch, ...) beside the batch: small shapes
EXAMPLE: dict[str, dict] = {
    "bert_cls": dict(length=8),
    "effnetv2_cls": dict(size=16),
    "transformer_lm": {},
    "unet3d_seg": dict(size=8),
    "diffusion_unet": {},
}

BATCH, OTHER_BATCH = 2, 3  # the example's batch, and another one for dynamic shapes


# ---------------------------------------------------------------------------------------------- helpers

def _entry(table: dict, table_name: str, name: str):
    if name not in table:
        pytest.fail(f"family {name!r} has no entry in {table_name} of tests/test_families.py; add one "
                    f"(see the other families' entries) so the conformance battery covers it", pytrace=False)
    return table[name]


def build(name: str, **overrides) -> torch.nn.Module:
    """The family's (or a VARIANTS case's) tiny model with deterministic, non-trivial weights, in eval mode.

    Zero-initialised layers (diffusion_unet's output conv, residual branches) would make outputs constant
    and every comparison vacuous, so each floating tensor gets seeded noise; BatchNorm variances stay positive.
    """
    family = name.partition("-")[0]
    _entry(TINY, "TINY", family)
    config = {**build_config(name), **overrides}
    torch.manual_seed(0)
    model = zoo.load(family, **config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for key, t in model.state_dict().items():
            if not t.is_floating_point():
                continue
            if key.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            else:
                t.add_(0.1 * torch.randn(t.shape, generator=g))
    return model.eval()


def build_config(name: str) -> dict:
    """The tiny config of a family, or of a VARIANTS case `family-variant`."""
    name, _, variant = name.partition("-")
    return {**TINY.get(name, {}), **(VARIANTS[name][variant] if variant else {})}


def inputs(model, batch: int) -> tuple:
    return tuple(model.example_inputs(batch, **_entry(EXAMPLE, "EXAMPLE", type(model).zoo_name)))


def first(out) -> torch.Tensor:
    return out[0] if isinstance(out, (list, tuple)) else out


@torch.no_grad()
def run_eval(model, x) -> torch.Tensor:
    return first(model(*x))


def shape_line(key: str, t: torch.Tensor) -> str:
    return f"{key} {tuple(t.shape)}"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> a .safetensors file of the tiny model (with the metadata `zoo predict` needs), made once."""
    folder = tmp_path_factory.mktemp("saved")
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            model = build(name)
            path = folder / f"{name}.safetensors"
            zoo.save(model, path, _entry(SAVE_META, "SAVE_META", name))
            cache[name] = path
        return cache[name]
    return get


# metadata saved with the tiny weights: what predict needs beyond the config (tokenizer, preprocessing)
SAVE_META: dict[str, dict] = {
    "bert_cls": {"labels": ["neg", "neu", "pos"]},
    "effnetv2_cls": {"preprocessing": {"resize": 32, "crop": 32, "mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25],
                                       "interpolation": "bilinear"}},
    "transformer_lm": {"preprocessing": {"tokenizer": {"kind": "byte"}}},
    "unet3d_seg": {},
    "diffusion_unet": {},
}


# ---------------------------------------------------------------------------------------------- coverage

def test_a_family_without_entries_fails_clearly(tiny):
    # `tiny` (tests/conftest.py) registers a family this file has no tables for
    with pytest.raises(pytest.fail.Exception, match="has no entry in TINY of tests/test_families.py"):
        build(tiny)
    with pytest.raises(AssertionError, match=f"TINY\\[{tiny!r}\\]"):
        test_every_family_has_battery_entries(families=zoo.list_models())


def test_every_family_has_battery_entries(families=FAMILIES):
    tables = {"TINY": TINY, "EXAMPLE": EXAMPLE, "SAVE_META": SAVE_META, "DDP": DDP, "PREDICT": PREDICT,
              "BAD_PREDICT": BAD_PREDICT}
    missing = [f"{table}[{name!r}]" for table, entries in tables.items() for name in families if name not in entries]
    assert not missing, ("registered families without a conformance-battery entry in tests/test_families.py: "
                         + ", ".join(missing))
    stale = [f"{table}[{name!r}]" for table, entries in {**tables, "VARIANTS": VARIANTS}.items() for name in entries
             if name not in families]
    assert not stale, f"entries for families that are not registered: {', '.join(stale)}"


# ---------------------------------------------------------------------------------------------- weights

@pytest.mark.parametrize("name", CASES)
def test_save_load_round_trip_gives_identical_outputs(name, tmp_path):
    model = build(name)
    x = inputs(model, BATCH)
    path = tmp_path / f"{name}.safetensors"
    zoo.save(model, path)
    family = name.partition("-")[0]
    loaded = zoo.load(family, pretrained=path)
    assert type(loaded) is type(model) and loaded.config == model.config
    assert loaded.pretrained_meta is not None and loaded.pretrained_meta.model == family
    assert list(loaded.state_dict()) == list(model.state_dict())
    for key, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], t), f"{key} changed in the round trip"
    assert torch.equal(run_eval(loaded, x), run_eval(model, x))


@pytest.mark.parametrize("name", CASES)
def test_state_dict_keys_match_golden(name):
    lines = [shape_line(k, t) for k, t in build(name).state_dict().items()]
    path = GOLDEN / f"{name}.keys"
    regenerate = f"ZOO_UPDATE_GOLDEN=1 pytest -q tests/test_families.py -k 'golden and {name}'"  # and its variants
    if os.environ.get("ZOO_UPDATE_GOLDEN") == "1":
        GOLDEN.mkdir(exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
    if not path.is_file():
        pytest.fail(f"no golden key list {path.relative_to(ROOT)} for {name}; create it with: {regenerate}",
                    pytrace=False)
    want = path.read_text().splitlines()
    if lines != want:
        got_keys = {line.split(" ", 1)[0]: line for line in lines}
        want_keys = {line.split(" ", 1)[0]: line for line in want}
        gone = [k for k in want_keys if k not in got_keys]
        new = [k for k in got_keys if k not in want_keys]
        reshaped = [f"{want_keys[k]} -> {got_keys[k].split(' ', 1)[1]}" for k in want_keys
                    if k in got_keys and want_keys[k] != got_keys[k]]
        pytest.fail(
            f"{name}'s state-dict keys changed against {path.relative_to(ROOT)} (tiny config {build_config(name)}).\n"
            f"  keys gone ({len(gone)}): {gone[:20]}\n  keys new ({len(new)}): {new[:20]}\n"
            f"  shapes changed ({len(reshaped)}): {reshaped[:20]}\n"
            + ("  (same keys, other order)\n" if not (gone or new or reshaped) else "")
            + "State-dict keys are an API: every saved checkpoint uses them. If the change is intended, make old "
            f"files keep loading (convert their keys on load), then regenerate the list with: {regenerate}",
            pytrace=False)


@pytest.mark.parametrize("name", CASES)
def test_contract_hooks(name):
    model = build(name)
    assert dataclasses.is_dataclass(model.config) and type(model.config).__dataclass_params__.frozen
    a, b = inputs(model, BATCH), inputs(model, BATCH)
    assert all(torch.equal(u, v) for u, v in zip(a, b)), "example_inputs must be deterministic (seeded)"
    assert all(t.shape[0] == BATCH for t in a), "example_inputs(batch) must have `batch` rows in every input"
    blocks = model.checkpoint_blocks
    assert blocks and all(isinstance(m, torch.nn.Module) for m in blocks)
    keys = list(model.state_dict())
    if model.head_prefixes:  # a prefix may name an optional part (unet3d_seg's deep-supervision heads)
        assert any(k.startswith(model.head_prefixes) for k in keys), \
            f"no state-dict key starts with a head prefix {model.head_prefixes}"
    assert isinstance(model.labels, list)
    loss = model.train().example_loss(*a)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


@pytest.mark.parametrize("name", [n for n in FAMILIES if "num_classes" in TINY.get(n, {})])
def test_new_num_classes_gets_a_finite_fresh_head(name, saved):
    with pytest.warns(UserWarning) as record:
        model = zoo.load(name, pretrained=saved(name), num_classes=5)
    assert any(p in str(w.message) for w in record for p in model.head_prefixes), \
        f"the re-initialised head's warning should name its keys: {[str(w.message) for w in record]}"
    assert model.config.num_classes == 5 and len(model.labels) == 5
    for key, t in model.state_dict().items():
        assert torch.isfinite(t.float()).all(), f"{key} is not finite after the head was re-initialised"
    assert torch.isfinite(run_eval(model, inputs(model, BATCH))).all()


# ---------------------------------------------------------------------------------------------- compile

@pytest.mark.parametrize("name", CASES)
def test_compile_has_no_graph_breaks_and_no_recompile_across_batch_sizes(name):
    from torch._dynamo.utils import counters
    model = build(name)
    keys = list(model.state_dict())
    x2, x3 = inputs(model, BATCH), inputs(model, OTHER_BATCH)
    eager2, eager3 = run_eval(model, x2), run_eval(model, x3)
    torch._dynamo.reset()
    counters.clear()
    # the batch dimension of every input is dynamic (zoo.accel.compile's dynamic_dims); strict: no eager fallback
    compiled = accel.compile(model, dynamic_dims=(0,), strict=True, backend="eager")
    try:
        torch.testing.assert_close(run_eval(compiled, x2), eager2, atol=1e-5, rtol=1e-5)
        with torch._dynamo.config.patch(error_on_recompile=True):
            torch.testing.assert_close(run_eval(compiled, x3), eager3, atol=1e-5, rtol=1e-5)
        breaks = dict(counters["graph_break"])
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert not breaks, f"{name} has graph breaks: {breaks}"
    assert graphs == 1, f"{name} compiled {graphs} graphs for batch sizes {BATCH} and {OTHER_BATCH}; expected one"
    assert list(model.state_dict()) == keys, "compile must not change the state-dict keys"


# ---------------------------------------------------------------------------------------------- export

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """name -> (model, {"onnx": ..., "pt2": ...}): what zoo.accel.export wrote (an Exported, or the export's
    error), checked by export itself against eager at another shape. One torch.export trace per graph: the pt2
    export replays the programs the ONNX export traced."""
    from zoo.accel import deploy
    folder = tmp_path_factory.mktemp("export")
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            model, traced, replay = build(name), [], []
            real = deploy.export_program

            def trace_once(*args, **kwargs):
                if replay:
                    return replay.pop(0)
                traced.append(real(*args, **kwargs))
                return traced[-1]
            results = {}
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(deploy, "export_program", trace_once)
                for fmt in ("onnx", "pt2"):
                    replay[:] = traced
                    try:
                        results[fmt] = accel.export(model, fmt, folder / f"{name}-{fmt}", example=example(name),
                                                    progress=False)
                    except Exception as e:  # reported by the test of that format
                        results[fmt] = e
            cache[name] = (model, results)
        return cache[name]
    return get


def example(name: str) -> dict:
    return _entry(EXAMPLE, "EXAMPLE", name.partition("-")[0])


def written(result):
    if isinstance(result, Exception):
        raise result
    return result


@pytest.mark.parametrize("name", CASES)
def test_export_to_onnx_and_pt2_is_described_and_verified(name, exported):
    """Both exports succeed (zoo.accel.export runs each file at another shape against eager, and raises above
    1e-3), and their manifests describe the family's inputs and outputs and a verification at other sizes of
    every dynamic dimension."""
    pytest.importorskip("onnxruntime")
    model, results = exported(name)
    graphs = model.export_graphs(BATCH, **example(name))
    for fmt, suffix in (("onnx", ".onnx"), ("pt2", ".pt2")):
        manifest = written(results[fmt]).manifest
        assert manifest["format"] == fmt and manifest["file"] == f"model{suffix}"
        assert list(manifest["graphs"]) == list(graphs)
        for graph_name, graph in graphs.items():
            described = manifest["graphs"][graph_name]
            verified = manifest["verified"]["graphs"][graph_name]["inputs"]
            assert [i["name"] for i in described["inputs"]] == list(graph.names)
            assert [o["name"] for o in described["outputs"]] == list(graph.outputs)
            for entry, t, dims in zip(described["inputs"], graph.inputs, graph.dims):
                assert entry["dtype"] == str(t.dtype).removeprefix("torch.")
                assert entry["shape"] == [dims[d].name if d in dims else size for d, size in enumerate(t.shape)]
                assert all(verified[entry["name"]][d] != t.shape[d] for d in dims), \
                    f"{graph_name}.{entry['name']} was verified at the traced size of a dynamic dimension"
        assert manifest["verified"]["max_rel_error"] <= 1e-3


def test_exported_files_run_in_a_process_that_cannot_import_zoo(exported, tmp_path):
    """Every case's ONNX and .pt2 export, fed inputs at another batch in a process where `import zoo` fails,
    equals eager to 1e-3 of each output's magnitude. One process for all (starting torch costs seconds); an
    export that failed is reported by the test above."""
    pytest.importorskip("onnxruntime")
    jobs = []
    for name in CASES:
        model, results = exported(name)
        graphs = model.export_graphs(OTHER_BATCH, **example(name))
        jobs += [(r.folder, graphs, tmp_path / f"{name}-{fmt}") for fmt, r in results.items()
                 if not isinstance(r, Exception)]
    assert jobs, "no export succeeded"
    run_without_zoo(jobs)


ZOO_BLOCKED = """
import importlib.util, sys

class NoZoo:  # first on sys.meta_path: every import of zoo or of a zoo module fails
    def find_spec(self, name, path=None, target=None):
        if name == "zoo" or name.startswith("zoo."):
            raise ImportError(f"{name} may not be imported in this process")

sys.meta_path.insert(0, NoZoo())
spec = importlib.util.spec_from_file_location("standalone_artifacts", sys.argv[1])
artifacts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(artifacts)
jobs = sys.argv[2:]
for i in range(0, len(jobs), 3):
    artifacts.main(jobs[i:i + 3])
assert not [m for m in sys.modules if m == "zoo" or m.startswith("zoo.")]
"""


def run_without_zoo(jobs: list[tuple[Path, dict, Path]], tolerance: float = 1e-3) -> dict[str, float]:
    """Run each export folder's graphs on its (name -> ExportGraph) inputs in one process that cannot import zoo
    (zoo/accel/artifacts.py, loaded by path), and compare with the graphs' eager outputs; returns each job's
    largest error relative to the output's magnitude."""
    import numpy as np
    argv, expected = [], []
    for folder, graphs, stem in jobs:
        feeds, want = {}, {}
        for graph_name, graph in graphs.items():
            feeds.update({f"{graph_name}.{n}": t.numpy() for n, t in zip(graph.names, graph.inputs)})
            with torch.no_grad():
                out = graph.module.eval()(*graph.inputs)
            out = [out] if isinstance(out, torch.Tensor) else out
            want.update({f"{graph_name}.{n}": t for n, t in zip(graph.outputs, out)})
        np.savez(f"{stem}.in.npz", **feeds)
        argv += [str(folder), f"{stem}.in.npz", f"{stem}.out.npz"]
        expected.append((folder, want, f"{stem}.out.npz"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", ZOO_BLOCKED, str(ROOT / "zoo" / "accel" / "artifacts.py"), *argv],
                            cwd=jobs[0][2].parent, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"running the exports without zoo failed:\n{result.stderr[-4000:]}"
    errors = {}
    for folder, want, out in expected:
        got = np.load(out)
        assert set(got.files) == set(want), f"{folder.name}: outputs {sorted(got.files)}, expected {sorted(want)}"
        worst = 0.0
        for key, w in want.items():
            g = torch.from_numpy(got[key])
            assert g.shape == w.shape, f"{folder.name} {key}: shape {tuple(g.shape)}, eager {tuple(w.shape)}"
            worst = max(worst, float((g - w).abs().max()) / max(float(w.abs().max()), 1e-12))
        assert worst <= tolerance, f"{folder.name}: {worst:.3g} of the output's magnitude away from eager"
        errors[folder.name] = worst
    return errors


# ---------------------------------------------------------------------------------------------- checkpointing

@pytest.mark.parametrize("name", CASES)
def test_activation_checkpointing_gives_identical_gradients(name):
    from zoo.accel.checkpointing import checkpointed_modules
    model = build(name).train()
    x = inputs(model, BATCH)
    keys = list(model.state_dict())

    def step():
        """Gradients of one example_loss step and the number of tensors saved for backward."""
        model.zero_grad(set_to_none=True)
        saved_count = [0]

        def pack(t):
            saved_count[0] += 1
            return t
        torch.manual_seed(0)  # the same dropout masks and diffusion noise in both runs
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model.example_loss(*x)
        loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}, saved_count[0]

    plain, plain_saved = step()
    accel.checkpointing(model, "blocks")
    assert checkpointed_modules(model)
    ckpt, ckpt_saved = step()
    assert plain and plain.keys() == ckpt.keys()
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], atol=0, rtol=0, msg=lambda m: f"{k}: {m}")
    assert ckpt_saved < plain_saved, "checkpointing kept as many activations as the plain model"
    assert list(model.state_dict()) == keys, "checkpointing must not change the state-dict keys"


# ---------------------------------------------------------------------------------------------- precision

@pytest.mark.parametrize("name", CASES)
def test_bf16_cast_and_autocast_run(name):
    # tiny inputs: on a CPU without native bf16 these run emulated (~100x slower than fp32), so batch 1
    model = build(name)
    x = inputs(model, 1)
    ref = run_eval(model, x)
    with accel.autocast("cpu", force=True):  # force: bf16 also where it is emulated (else fp32 + a warning)
        out = run_eval(model, x)
    assert out.shape == ref.shape and torch.isfinite(out.float()).all()
    accel.cast(model, "bf16", force=True)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    out = run_eval(model, x)
    assert out.shape == ref.shape and out.dtype == torch.float32 and torch.isfinite(out).all()


# label -> (method, extra keyword arguments besides calibration / example_inputs). int8_dynamic's backend="pt2e"
# and its default, chosen by the CPU (a torch.export trace, 3-11 s per family here, then a compilation) are left
# to tests/test_accel.py and tests/test_bert.py; here torchao's int8 on each family.
QUANTIZE = {
    "int8_dynamic": ("int8_dynamic", {"backend": "torchao"}),
    "int8_weight_only": ("int8_weight_only", {}),
    "int8_static": ("int8_static", {}),
}


def test_quantize_table_lists_every_method():
    from zoo.accel.quantize import METHODS
    assert {method for method, _ in QUANTIZE.values()} == set(METHODS)


@pytest.mark.parametrize("label", QUANTIZE)
@pytest.mark.parametrize("name", CASES)
def test_quantize_works_or_says_why_not(name, label):
    method, options = QUANTIZE[label]
    model = build(name)
    x2, x3 = inputs(model, BATCH), inputs(model, OTHER_BATCH)
    ref = run_eval(model, x3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchao / PT2E deprecation notices
        try:
            q = accel.quantize(model, method, calibration=[x2], example_inputs=x2, **options)
        except (ValueError, RuntimeError, TypeError) as e:
            assert method in str(e), f"quantize({method!r}) on {name} raised an error that does not name the " \
                                     f"method: {type(e).__name__}: {e}"
            return
        out = run_eval(q, x3)  # another batch size than the calibration / trace example
    assert out.shape == ref.shape and torch.isfinite(out.float()).all()
    assert model.state_dict().keys() and all(t.dtype != torch.int8 for t in model.state_dict().values()), \
        "quantize must leave the input model untouched"


# ---------------------------------------------------------------------------------------------- predict

def _png(folder: Path) -> str:
    from PIL import Image
    path = folder / "image.png"
    g = torch.Generator().manual_seed(0)
    Image.fromarray(torch.randint(0, 256, (40, 48, 3), generator=g, dtype=torch.uint8).numpy()).save(path)
    return str(path)


def _volume(folder: Path, shape=(8, 8, 8)) -> str:
    import numpy as np
    path = folder / "volume.npy"
    np.save(path, np.random.default_rng(0).standard_normal(shape).astype(np.float32))
    return str(path)


def _not_an_image(folder: Path) -> str:
    path = folder / "notes.png"
    path.write_text("this is text, not a PNG\n")
    return str(path)


# name -> function(tmp folder) -> (arguments after `zoo predict NAME`, check(stdout json, folder))
PREDICT = {
    "bert_cls": lambda d: (["a gripping , beautifully acted film", "a waste of two hours"],
                           lambda r, d: len(r) == 2 and r[0]["label"] in ("neg", "neu", "pos")),
    "effnetv2_cls": lambda d: ([_png(d), "--top-k", "2"], lambda r, d: len(r) == 1 and len(r[0]["top"]) == 2),
    "transformer_lm": lambda d: (["the king", "--max-new-tokens", "5", "--seed", "1"],
                                 lambda r, d: r["prompt"] == "the king" and r["text"].startswith("the king")),
    "unet3d_seg": lambda d: ([_volume(d), "--window", "8", "--out", str(d / "pred.npy")],
                             lambda r, d: __import__("numpy").load(d / "pred.npy").shape == (8, 8, 8)),
    "diffusion_unet": lambda d: (["--classes", "0,2", "--n", "2", "--steps", "2", "--out", str(d / "grid.png")],
                                 lambda r, d: (d / "grid.png").stat().st_size > 0 and r["classes"] == [0, 2]),
}

# name -> function(tmp folder) -> arguments of one bad invocation, and a fragment the error line must contain
BAD_PREDICT = {
    "bert_cls": lambda d: (["   "], "empty"),
    "effnetv2_cls": lambda d: ([_not_an_image(d)], "not an image"),
    "transformer_lm": lambda d: (["the king", "--temperature", "-1"], "temperature"),
    "unet3d_seg": lambda d: ([_volume(d, (8, 8))], "shape"),
    "diffusion_unet": lambda d: (["--classes", "7", "--n", "1", "--steps", "1", "--out", str(d / "g.png")], "classes"),
}


@pytest.mark.parametrize("name", FAMILIES)
def test_predict_on_a_sample_input(name, saved, tmp_path, capsys):
    from zoo.cli import main
    args, check = _entry(PREDICT, "PREDICT", name)(tmp_path)
    code = main(["predict", name, *args, "--pretrained", str(saved(name)), "--json"])
    out, err = capsys.readouterr()
    assert code == 0, f"zoo predict {name} exited {code}: {err}"
    result = json.loads(out)
    assert check(result, tmp_path), f"unexpected result of zoo predict {name}: {out[:500]}"


@pytest.mark.parametrize("name", FAMILIES)
def test_predict_bad_input_is_one_clear_error_line(name, saved, tmp_path, capsys):
    from zoo.cli import main
    args, fragment = _entry(BAD_PREDICT, "BAD_PREDICT", name)(tmp_path)
    code = main(["predict", name, *args, "--pretrained", str(saved(name))])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, f"exit code {code}; stderr: {err[-2000:]}"
    assert len(lines) == 1 and lines[0].startswith("zoo predict: error:"), f"not one error line: {err[-2000:]}"
    assert "Traceback" not in err and fragment in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------- DDP

@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Tiny training data for the train scripts, made once."""
    import numpy as np
    folder = tmp_path_factory.mktemp("data")
    g = torch.Generator().manual_seed(0)
    words = ["the", "king", "queen", "speaks", "to", "his", "her", "lord", "and", "fair", "day", "night"]
    (folder / "corpus.txt").write_text(" ".join(words[i] for i in torch.randint(0, 12, (600,), generator=g)) + "\n")
    rows = ["sentence\tlabel"] + [f"{w} film\t{l}" for w, l in [("great", 1), ("awful", 0), ("lovely", 1),
                                                               ("boring", 0)] * 4]
    (folder / "train.tsv").write_text("\n".join(rows) + "\n")
    rng = np.random.default_rng(0)
    np.savez(folder / "images.npz", x_train=rng.integers(0, 256, (8, 32, 32, 3), dtype=np.uint8),
             y_train=np.arange(8) % 3)
    # diffusion_unet: an .npz rather than `digits`, whose final evaluation trains a judge classifier (seconds)
    np.savez(folder / "gray8.npz", x_train=rng.integers(0, 256, (16, 8, 8, 1), dtype=np.uint8),
             y_train=np.arange(16) % 3)
    return folder


# name -> function(data folder, saved) -> the script's own flags for a tiny 3-step run (besides --dist, --steps,
# --out, --workers, --seed); bert_cls starts from the tiny saved model instead of MiniLM
DDP = {
    "bert_cls": lambda d, saved: ["--data", str(d / "train.tsv"), "--pretrained", str(saved("bert_cls")),
                                  "--num-classes", "2", "--batch-size", "4", "--warmup", "1", "--lr", "1e-3"],
    "effnetv2_cls": lambda d, saved: ["--data", str(d / "images.npz"), "--variant", "b0", "--stem-stride", "2",
                                      "--augment", "none", "--drop-path", "0", "--batch-size", "2", "--warmup", "1"],
    "transformer_lm": lambda d, saved: ["--data", str(d / "corpus.txt"), "--context", "16", "--dim", "32",
                                        "--n-layers", "2", "--n-heads", "2", "--mlp-hidden", "32", "--dropout", "0",
                                        "--batch-size", "4", "--warmup", "1"],
    "unet3d_seg": lambda d, saved: ["--data", "synthetic", "--preset", "small", "--volume", "16", "--crop", "16",
                                    "--train-volumes", "4", "--val-volumes", "2", "--batch-size", "1", "--warmup", "1"],
    "diffusion_unet": lambda d, saved: ["--data", str(d / "gray8.npz"), "--image-size", "8", "--widths", "16,32",
                                        "--dropout", "0", "--batch-size", "4", "--warmup", "1"],
}


@pytest.mark.parametrize("name", FAMILIES)
def test_ddp_replicas_stay_identical_through_the_train_script(name, data, saved, tmp_path):
    flags = _entry(DDP, "DDP", name)(data, saved)
    out = tmp_path / "run"
    script = ROOT / "train_scripts" / f"{name}.py"
    assert script.is_file(), f"{name} has no train script {script.relative_to(ROOT)}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(script), "--dist", "ddp", "--steps", "3", "--workers", "0",
           "--log-every", "1", *flags, "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, start_new_session=True)
    path = out / "replicas.json"  # written by zoo.train at the end of a DDP run, before it checks the replicas
    if path.is_file():
        replicas = json.loads(path.read_text())
        assert replicas["world_size"] == 2 and len(replicas["fingerprints"]) == 2, replicas
        rank0, rank1 = replicas["fingerprints"]
        assert rank0 and len(rank0) == len(rank1), replicas
        assert rank0 == rank1, (f"{name}: the two DDP replicas differ after 3 steps of {script.name} (gradients "
                                "not all-reduced? the loss must go through the DDP-wrapped module's forward): "
                                f"rank 0 {rank0}, rank 1 {rank1}")
    assert result.returncode == 0, f"{' '.join(cmd)}\nexited {result.returncode}:\n{result.stderr[-4000:]}"
    assert path.is_file(), f"the DDP run wrote no {path.name} (zoo.train writes each rank's parameter fingerprint there)"
