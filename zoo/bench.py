"""The benchmark harness behind `zoo bench NAME` and the scripts in bench/: one way to time and report.

A run (`BenchRun`) prints a header naming the CPU class, the threads and this run's matmul peaks, measured
before the rows and again after them (a machine that drifts shows as two figures). Rows are built and warmed
up first (`build_row`, `build_rows`), then timed interleaved round by round with the order rotating
(`time_rows`): per row the median time over rounds and the median over rounds of the ratio to the first row
(eager fp32) and to the peer library's first row, each taken within the same round. A row in a dtype the
machine only emulates (bf16 on AVX2: ~1 GFLOP/s) is skipped with the reason unless forced. onnxruntime is a
peer row for any model (`onnxruntime_row`: exported through zoo.accel.export_onnx). `--save` writes the
report to bench/results/NAME.TAG.txt, TAG the CPU class (avx2, avx512, amx, ...) or GPU, so tables of
different machines sit side by side in the cards. `zoo bench NAME` also measures the peak memory of a
training step in a fresh process.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from zoo._deps import require
from zoo._io import atomic_write_bytes
from zoo.accel import hardware
from zoo.accel.hardware import cpu_class
from zoo.accel.variants import Variant, time_call, variants_for
from zoo.models.base import ZooModel

__all__ = ["time_call", "example_loss", "PEAK_DTYPES", "matmul_peak_gflops", "matmul_peaks", "count_flops", "emulated",
           "build_row", "build_rows", "time_rows", "OnnxRuntimeModel", "onnxruntime_row", "onnxruntime_session",
           "onnxruntime_settings",
           "BenchRun", "add_run_arguments", "cpu_tag", "device_tag", "results_heading", "train_step",
           "peak_rss_growth_mb", "peer_model", "format_table", "main"]

ROOT = Path(__file__).resolve().parent.parent  # the source checkout, where bench/peers.py and bench/results live


def example_loss(model: nn.Module, inputs: tuple) -> torch.Tensor:
    """The loss of a training step on `example_inputs()`: a zoo model's own `example_loss`; for a peer
    library's model the mean output (of `.logits` for transformers-style outputs)."""
    if isinstance(model, ZooModel):
        return model.example_loss(*inputs)
    out = model(*inputs)
    return (out.logits if hasattr(out, "logits") else out).float().mean()


def peer_model(name: str, model: ZooModel) -> tuple[str, nn.Module] | None:
    """(label, the peer library's model with `model`'s weights) from bench/peers.py, which lives in the source
    checkout only (peers need diffusers, MONAI, ... and are no part of the package); None without one."""
    path = ROOT / "bench" / "peers.py"
    if not path.is_file():
        return None
    spec = importlib.util.spec_from_file_location("zoo_bench_peers", path)  # by path: sys.path stays as it is
    peers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peers)
    return peers.PEERS[name](model) if name in peers.PEERS else None


# ------------------------------------------------------------------------------------------ the peaks

PEAK_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.int8}


def emulated(dtype: torch.dtype | None, device: str | torch.device = "cpu") -> str | None:
    """Why a row in `dtype` is not worth timing on `device` (it only emulates that dtype), else None."""
    device = torch.device(device)
    if dtype is None or dtype == torch.int8:
        return None
    caps = hardware.capabilities(cuda=device.type == "cuda")
    return None if caps.native(device, dtype) else hardware.slow_reason(device, dtype, caps)


def matmul_peak_gflops(dtype: torch.dtype, n: int | None = None, device: str | torch.device = "cpu") -> float:
    """GFLOP/s of an n x n matmul in `dtype` on `device`; int8 through the kernels the int8 rows reach."""
    device = torch.device(device)
    # an emulated dtype (bf16 without AVX512-BF16/AMX: ~1 GFLOP/s) measures the same on a smaller matrix,
    # in a second instead of two minutes
    n = n or (256 if emulated(dtype, device) else 8192 if device.type == "cuda" else 2048)
    if dtype == torch.int8:
        call = _int8_matmul(n, device)
        if call is None:
            return float("nan")
    else:
        a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
        call = functools.partial(torch.mm, a, b)
    return 2 * n ** 3 / time_call(call, warmup=2, reps=5) / 1e9


def _int8_matmul(n: int, device: torch.device) -> Callable[[], object] | None:
    a = torch.randint(-128, 128, (n, n), dtype=torch.int8, device=device)
    if device.type == "cuda":
        return functools.partial(torch._int_mm, a, a)
    # u8 x s8 -> fp32 in oneDNN, the kernel the compiled PT2E int8 rows run; torch._int_mm on the CPU is a
    # reference loop (0.2 GFLOP/s against 11 here)
    try:
        packed = torch.ops.onednn.qlinear_prepack(a, [n, n])
    except (AttributeError, RuntimeError):  # a build without oneDNN (not x86)
        return None
    x = torch.randint(0, 256, (n, n), dtype=torch.uint8)
    scales, zeros = torch.ones(n), torch.zeros(n, dtype=torch.int32)
    return functools.partial(torch.ops.onednn.qlinear_pointwise, x, 0.1, 0, packed, scales, zeros, None, 1.0, 0,
                             torch.float32, "none", [], "")


def matmul_peaks(kinds: tuple[str, ...] = ("fp32", "bf16"), device: str | torch.device = "cpu") -> dict[str, float]:
    return {k: matmul_peak_gflops(PEAK_DTYPES[k], device=device) for k in kinds}


def count_flops(model: nn.Module, inputs: tuple) -> int:
    from torch.utils.flop_counter import FlopCounterMode
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(*inputs)
    return counter.get_total_flops()


# ------------------------------------------------------------------------------------------- the rows

def build_row(label: str, mode: str, build: Callable[[], Callable[[], object]], *, batch: int,
              dtype: torch.dtype | None = None, device: str | torch.device = "cpu", warmup: int = 1,
              context: Callable[[], contextlib.AbstractContextManager] = torch.inference_mode,
              force_emulated: bool = False) -> dict:
    """A row for `time_rows`: `build()` returns the call to time, which runs under `context()` (inference
    mode; `contextlib.nullcontext` for a training step) and `warmup` times here (the first compiled calls
    compile). {"model", "mode", "run", "batch"}; {"model", "mode", "skipped": why} for a row in a dtype
    `device` only emulates, unless `force_emulated`; {"model", "mode", "error"} where building or the
    warm-up raised: a mode that does not apply is a row saying so, not a crash."""
    reason = None if force_emulated else emulated(dtype, device)
    if reason:
        return {"model": label, "mode": mode, "skipped": f"{reason}; --force-emulated times it"}
    try:
        run = functools.partial(_under, context, build())
        for _ in range(warmup):
            run()
    except Exception as e:
        return {"model": label, "mode": mode, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"}
    return {"model": label, "mode": mode, "run": run, "batch": batch}


def _under(context: Callable[[], contextlib.AbstractContextManager], call: Callable[[], object]) -> None:
    with context():
        call()


def build_rows(model: nn.Module, inputs: tuple, variants: list[Variant], *, label: str = "zoo",
               force_emulated: bool = False) -> list[dict]:
    """A row per variant (`build_row`), each on a fresh copy of `model`."""
    return [build_row(label, v.name, functools.partial(_variant_call, v, model, inputs), batch=inputs[0].shape[0],
                      dtype=v.dtype, warmup=3 if v.compiled else 1, force_emulated=force_emulated)
            for v in variants]


def _variant_call(variant: Variant, model: nn.Module, inputs: tuple) -> Callable[[], object]:
    runnable, x = variant.build(copy.deepcopy(model).eval(), inputs)
    return functools.partial(runnable, *x)


def time_rows(rows: list[dict], *, rounds: int = 5, calls: int = 2, peer: str | None = None) -> list[dict]:
    """Time built rows interleaved: each round runs every row for `calls` calls (the median is that round's
    time), starting one row later each round, so a machine that drifts (turbo, a neighbour) moves every row
    alike instead of whichever ran last. Per row: the median over rounds of its time, of (first row's time /
    its time) in the same round ("ratio") and, with `peer`, of (the first row of model `peer` / its time)
    ("vs_peer"). Returns the rows without their callables, with ms and items_per_s; skipped and failed rows
    as they came."""
    live = [r for r in rows if "run" in r]
    times: dict[int, list[float]] = {id(r): [] for r in live}
    for k in range(max(rounds, 1)):
        shift = k % len(live) if live else 0
        for r in live[shift:] + live[:shift]:
            times[id(r)].append(time_call(r["run"], warmup=0, reps=max(calls, 1)))
    reference = next((r for r in live if r["model"] == peer), None) if peer else None
    out = []
    for r in rows:
        row = {k: v for k, v in r.items() if k != "run"}
        if "run" in r:
            mine = times[id(r)]
            seconds = statistics.median(mine)
            row.update(ms=seconds * 1e3, items_per_s=r["batch"] / seconds, ratio=_ratio(times[id(live[0])], mine))
            if reference is not None:
                row["vs_peer"] = _ratio(times[id(reference)], mine)
        out.append(row)
    return out


def _ratio(base: list[float], mine: list[float]) -> float:
    return statistics.median(b / t for b, t in zip(base, mine))


# --------------------------------------------------------------------------------- onnxruntime rows

def _onnxruntime():
    return require("onnxruntime", "onnxruntime rows", "pip install onnxruntime")


def _session_options(ort):
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # spinning intra-op threads would hold the cores into the torch row that runs next
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return options


def onnxruntime_session(model: str | os.PathLike | bytes):
    """An onnxruntime InferenceSession of an ONNX file (or its bytes) on the CPU with `onnxruntime_settings()`."""
    ort = _onnxruntime()
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), sess_options=_session_options(ort),
                                providers=["CPUExecutionProvider"])


def onnxruntime_settings() -> str:
    """The header line naming the onnxruntime version and the settings its rows ran with."""
    try:
        ort = _onnxruntime()
    except RuntimeError as e:
        return f"no onnxruntime rows: {e}"
    return (f"onnxruntime {ort.__version__}: CPUExecutionProvider, {torch.get_num_threads()} intra-op threads "
            f"(torch's), 1 inter-op, sequential, all graph optimisations, no spin-waiting")


def _dynamic_int8():
    """onnxruntime's dynamic int8 as `zoo export --int8` makes it on this CPU (zoo.accel.deploy_int8)."""
    from zoo.accel.deploy_int8 import Int8Plan
    return Int8Plan("onnx", static=False, vnni=hardware.capabilities(cuda=False).vnni, calibration=None)


class OnnxRuntimeModel:
    """`model` exported through zoo.accel.export_onnx (fp32, checked against PyTorch on `inputs`; a dynamic
    batch, and `dynamic_dims` as export_onnx takes them) and run in an onnxruntime InferenceSession on the CPU
    with `onnxruntime_settings()`; `int8` runs onnxruntime's own dynamic int8 of that file (quantize_dynamic as
    `zoo export --int8` runs it: u8 weights per channel on a CPU without VNNI, where u8 x s8 saturates; s8 with
    VNNI). Called like the model on tensors; returns the
    first output as a tensor."""

    def __init__(self, model: nn.Module, inputs: tuple, *, int8: bool = False,
                 dynamic_dims: dict[int, tuple[int, ...]] | None = None):
        _onnxruntime()  # before the export: without onnxruntime, one line at once
        from zoo.accel.export import export_onnx
        with tempfile.TemporaryDirectory(prefix="zoo-bench-") as folder:
            path = export_onnx(model, inputs, Path(folder) / "model.onnx", dynamic_dims=dynamic_dims)
            if int8:
                from zoo.accel.deploy_int8 import quantize_onnx
                quantize_onnx(path, Path(folder) / "int8.onnx", _dynamic_int8(), (), [])
                path = Path(folder) / "int8.onnx"
            data = path.read_bytes()
        self.size_bytes = len(data)
        self.session = onnxruntime_session(data)
        self.input_names = [i.name for i in self.session.get_inputs()]

    def __call__(self, *tensors: torch.Tensor) -> torch.Tensor:
        feeds = {name: t.contiguous().numpy() for name, t in zip(self.input_names, tensors)}  # channels_last too
        return torch.from_numpy(self.session.run(None, feeds)[0])


def onnxruntime_row(model: nn.Module, inputs: tuple, *, int8: bool = False,
                    dynamic_dims: dict[int, tuple[int, ...]] | None = None, label: str = "onnxruntime",
                    columns: Callable[[OnnxRuntimeModel], dict] | None = None) -> dict:
    """A peer row: `model` run in onnxruntime (`OnnxRuntimeModel`) on `inputs`; `columns(runtime)` returns
    table columns for the row (an accuracy, a size), as `format_table` prints them."""
    mode = (f"dynamic int8, {_dynamic_int8().describe()['weights']} weights (quantize_dynamic)" if int8 else
            "fp32 (export_onnx)")
    extra = {}

    def build():
        runtime = OnnxRuntimeModel(model, inputs, int8=int8, dynamic_dims=dynamic_dims)
        extra.update(columns(runtime) if columns else {})
        return functools.partial(runtime, *inputs)
    row = build_row(label, mode, build, batch=inputs[0].shape[0], context=contextlib.nullcontext)
    return {**row, **extra}


# ---------------------------------------------------------------------------------- a run and its file

CPU_TAGS = {"AMX": "amx", "AVX-512-BF16": "avx512bf16", "AVX-512": "avx512", "AVX2": "avx2"}  # class -> file tag


def cpu_tag() -> str:
    """A short file-name tag of this CPU's class: "amx", "avx512bf16", "avx512", "avx2", else torch's name."""
    name = hardware.capabilities(cuda=False).cpu_class
    return CPU_TAGS.get(name) or "".join(c for c in name.lower() if c.isalnum()) or "cpu"


def device_tag(device: str | torch.device = "cpu") -> str:
    """The results-file tag of `device`: `cpu_tag()`, or "gpu-" and the GPU's name ("gpu-h200")."""
    device = torch.device(device)
    if device.type != "cuda":
        return cpu_tag()
    return "gpu-" + "".join(c for c in torch.cuda.get_device_name(device).removeprefix("NVIDIA ").lower()
                            if c.isalnum())


def results_heading(tag: str) -> str:
    """What a results-file tag names, for the cards: "CPU AMX", "GPU H200"."""
    classes = {t: name for name, t in CPU_TAGS.items()}
    if tag in classes:
        return f"CPU {classes[tag]}"
    return f"GPU {tag.removeprefix('gpu-').upper()}" if tag.startswith("gpu-") else tag or "machine not recorded"


def _gflops(value: float) -> str:
    return "n/a" if value != value else f"{value:.0f}" if value >= 10 else f"{value:.2g}"


class BenchRun:
    """One benchmark run as `zoo bench` and the bench scripts print it: the header (`title`, threads, torch,
    the CPU class; the GPU's on a CUDA `device`) and this run's matmul peaks of `peaks` ("fp32", "bf16",
    "fp16", "int8"), measured now and again by `finish()` after the rows, both then on one header line;
    `say` prints a line and keeps it; `save` writes what was said under the machine's class."""

    def __init__(self, title: str, *, peaks: tuple[str, ...] = ("fp32", "bf16"), device: str | torch.device = "cpu"):
        self.started = time.perf_counter()
        self.device = torch.device(device)
        self.kinds = tuple(peaks)
        self.lines: list[str] = []
        caps = hardware.capabilities(cuda=self.device.type == "cuda")
        self.say(f"{title}; {torch.get_num_threads()} threads, torch {torch.__version__}; {caps.describe()}")
        self.before = matmul_peaks(self.kinds, self.device)
        self._peaks_line = len(self.lines)
        self.say("matmul peaks before the rows: " + ", ".join(f"{k} {_gflops(v)}" for k, v in self.before.items())
                 + " GFLOP/s")
        self.peaks: dict[str, float] | None = None

    def say(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def finish(self) -> dict[str, float]:
        """Measure the peaks again after the rows; the header line then shows both. Returns the higher of each."""
        after = matmul_peaks(self.kinds, self.device)
        line = ("matmul peaks of this run (before / after the rows): "
                + ", ".join(f"{k} {_gflops(self.before[k])} / {_gflops(after[k])}" for k in self.kinds) + " GFLOP/s")
        self.lines[self._peaks_line] = line
        print(line, flush=True)
        self.after = after
        self.peaks = {k: max((v for v in (self.before[k], after[k]) if v == v), default=float("nan"))
                      for k in self.kinds}
        return self.peaks

    def save(self, stem: str, command: str | None = None) -> Path:
        """Write the report to bench/results/STEM.TAG.txt (TAG: `device_tag`), atomically, under a first line
        naming the command, the date and the time the run took."""
        if self.peaks is None:
            self.finish()
        command = command or " ".join(["python", *sys.argv])
        path = ROOT / "bench" / "results" / f"{stem}.{device_tag(self.device)}.txt"
        text = (f"# {command}, {time.strftime('%Y-%m-%d')}; took {time.perf_counter() - self.started:.0f} s\n"
                + "\n".join(self.lines) + "\n")
        atomic_write_bytes(path, text.encode())
        print(f"saved {path}")
        return path


def add_run_arguments(parser: argparse.ArgumentParser, *, reps: int | None = 5) -> None:
    """The options every benchmark takes: --reps (rounds; not where `reps` is None), --force-emulated, --save."""
    if reps is not None:
        parser.add_argument("--reps", type=int, default=reps,
                            help="rounds of the interleaved timing: each round times every row (medians over rounds)")
    parser.add_argument("--force-emulated", action="store_true",
                        help="also time rows in a dtype this machine only emulates (bf16/fp16 on a CPU without "
                             "AVX512-BF16/AMX run ~100x slower than fp32: hours)")
    parser.add_argument("--save", action="store_true",
                        help="also write the report to bench/results/NAME.TAG.txt (TAG: the CPU class, e.g. avx2, "
                             "amx, or the GPU)")


# ------------------------------------------------------------------------------- training steps

def train_step(model: nn.Module, inputs: tuple, labels: torch.Tensor, bf16: bool) -> Callable[[], None]:
    """One training step as a closure for `time_call`: forward (under bf16 autocast or not), cross-entropy
    on the logits (a tensor or an output with `.logits`, as transformers returns), backward, fused AdamW."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        with torch.autocast("cpu", torch.bfloat16, enabled=bf16):
            out = model(*inputs)
        logits = out.logits if hasattr(out, "logits") else out
        torch.nn.functional.cross_entropy(logits.float(), labels).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def train_step_peak_mb(name: str, batch: int, checkpointing: str = "none", amp: str = "off", *,
                       config: dict | None = None, example: dict | None = None) -> dict:
    """Peak RSS growth (MiB) and time (s) of one training step, in a fresh process (method: BASELINES.md).

    `name` is a registry model, or "module:function" for a peer: function(batch, **example) returns
    (model, inputs), the loss as `example_loss` takes it."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    code = (f"from zoo.bench import _train_step_child; _train_step_child({name!r}, {batch}, "
            f"{checkpointing!r}, {amp!r}, {config or {}!r}, {example or {}!r})")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"training-step probe failed: {result.stderr.strip().splitlines()[-1:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _train_step_child(name: str, batch: int, checkpointing: str, amp: str, config: dict, example: dict) -> None:
    import gc

    import zoo
    from zoo.accel.amp import autocast
    from zoo.accel.checkpointing import checkpointing as apply_checkpointing
    if ":" in name:  # a peer library's model, built by a bench script
        module, function = name.split(":")
        model, inputs = getattr(importlib.import_module(module), function)(batch, **example)
        model.train()
    else:
        model = zoo.load(name, **config).train()
        inputs = model.example_inputs(batch, **example)
    if checkpointing != "none":
        apply_checkpointing(model, checkpointing)

    def step():
        with autocast("cpu", "bf16" if amp == "bf16" else "fp32", force=True):  # a bf16 row measures bf16
            out = example_loss(model, inputs)
        out.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: allocator pools, lazy init
    gc.collect()
    t0 = time.perf_counter()
    peak = peak_rss_growth_mb(step)
    print(json.dumps({"peak_mb": round(peak, 1), "step_s": round(time.perf_counter() - t0, 3)}))


def peak_rss_growth_mb(call: Callable[[], object]) -> float:
    """How far this process's resident memory rose above its current size while `call()` ran (MiB): the
    kernel's peak-RSS mark (VmHWM) is reset first. Not getrusage's ru_maxrss: a process started by another
    inherits the parent's RSS at fork time there (a child of a 1 GiB bench process read 1 GiB for a 2 MiB call)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # then the mark may include what ran before, e.g. a warm-up call of about the same size
    base = _status_kb("VmRSS")
    call()
    return (_status_kb("VmHWM") - base) / 1024


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def format_table(rows: list[dict], flops: int | None = None, peaks: dict[str, float] | None = None, *,
                 peer: str | None = None, columns: dict[str, str] | None = None, unit: str = "batch",
                 items: str = "items") -> str:
    """The rows of `time_rows` as a table: ms per `unit`, `items`/s, the ratio to the first row and, with
    `peer`, to the peer's first row; with `flops` (per call) the achieved GFLOP/s and its % of `peaks` (int8
    rows of the int8 peak, bf16 rows of the bf16 one, others of fp32). `columns` (header -> format spec) are
    values the caller put into the rows under those headers, printed before the times."""
    columns = columns or {}
    widths = {h: max(len(h), 8) for h in columns}
    peer_width = max(len(f"vs {peer}"), 7) if peer else 0
    mode_width = max([34] + [len(r["mode"]) for r in rows])
    head = f"{'model':<14} {'mode':<{mode_width}}" + "".join(f" {h:>{widths[h]}}" for h in columns)
    head += f" {'ms/' + unit:>9} {items + '/s':>9} {'ratio':>6}" + (f" {'vs ' + peer:>{peer_width}}" if peer else "")
    lines = [head + (f" {'GFLOP/s':>8} {'% peak':>7}" if flops else "")]
    for r in rows:
        line = f"{r['model']:<14} {r['mode']:<{mode_width}}" + "".join(
            f" {_cell(r.get(h), spec):>{widths[h]}}" for h, spec in columns.items())
        if "ms" not in r:
            lines.append(line + (f" n/a: {r['error']}" if "error" in r else f" skipped: {r.get('skipped', '')}"))
            continue
        ms = f"{r['ms']:9.1f}" if r["ms"] >= 10 else f"{r['ms']:9.3f}"
        line += f" {ms} {r['items_per_s']:9.1f} {r['ratio']:5.2f}x"
        if peer:
            line += f" {r['vs_peer']:{peer_width - 1}.2f}x" if "vs_peer" in r else f" {'-':>{peer_width}}"
        if flops:
            gflops = flops / (r["ms"] / 1e3) / 1e9
            kind = "int8" if "int8" in r["mode"] else "bf16" if "bf16" in r["mode"] else "fp32"
            peak = (peaks or {}).get(kind, float("nan"))
            line += f" {gflops:8.1f} " + (f"{100 * gflops / peak:6.1f}%" if peak == peak else f"{'-':>7}")
        lines.append(line)
    return "\n".join(lines)


def _cell(value, spec: str) -> str:
    return "" if value is None else value if isinstance(value, str) else format(value, spec)


def main(argv: list[str] | None = None) -> int:
    import zoo
    parser = argparse.ArgumentParser(prog="zoo bench", description="Benchmark a registry model side by side.")
    parser.add_argument("name")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--size", type=int, default=None, help="input side (image models), e.g. 32")
    parser.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE",
                        help="model config overrides, e.g. stem_stride=1 variant=b0")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled rows (each compiles 20-60 s)")
    parser.add_argument("--no-int8", action="store_true")
    parser.add_argument("--no-peer", action="store_true",
                        help="skip the peer rows (the peer library's model, onnxruntime)")
    parser.add_argument("--no-memory", action="store_true", help="skip the training-step peak-memory probe")
    parser.add_argument("--calls", type=int, default=2, help="calls per row per round (the round's median)")
    parser.add_argument("--json", default=None, help="also write the results to this JSON file")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    overrides = {}
    for item in args.config:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--config takes KEY=VALUE pairs, got {item!r}")
        overrides[key] = int(value) if value.lstrip("-").isdigit() else value
    model = zoo.load(args.name, **overrides)
    batch = args.batch or model.bench_batch
    if args.size is not None and "size" not in inspect.signature(model.example_inputs).parameters:
        raise ValueError(f"{args.name}'s example inputs have no size to set; leave out --size")
    example = {"size": args.size} if args.size is not None else {}
    inputs = model.example_inputs(batch, **example)
    torch.manual_seed(0)

    flops = count_flops(model, inputs)
    params = sum(p.numel() for p in model.parameters())
    shapes = ", ".join(str(tuple(t.shape)) if isinstance(t, torch.Tensor) else repr(t) for t in inputs)
    run = BenchRun(f"{args.name}: {params / 1e6:.2f}M params, {flops / 1e9:.2f} GFLOP per batch of {shapes}",
                   peaks=("fp32", "bf16") if args.no_int8 else ("fp32", "bf16", "int8"))
    built = build_rows(model, inputs, variants_for(model, compile=not args.no_compile, int8=not args.no_int8),
                       force_emulated=args.force_emulated)
    label = None
    if not args.no_peer:
        peer = peer_model(args.name, model)
        if peer is not None:
            label, peer = peer  # a peer takes the zoo model's inputs
            built += build_rows(peer, inputs, variants_for(peer, compile=False, int8=False), label=label,
                                force_emulated=args.force_emulated)
        built.append(onnxruntime_row(model, inputs))
        run.say(onnxruntime_settings())
    rows = time_rows(built, rounds=args.reps, calls=args.calls, peer=label)
    peaks = run.finish()
    run.say(f"rows interleaved, {args.reps} rounds x {args.calls} calls, medians; ratio: to zoo eager fp32"
            + (f", vs {label}: to {label} eager fp32" if label else "") + "; % peak of the higher peak")
    run.say(format_table(rows, flops, peaks, peer=label))
    memory = {}
    if not args.no_memory:
        steps = {}
        for amp in ("off", "bf16"):
            reason = None if args.force_emulated or amp == "off" else emulated(torch.bfloat16)
            if reason:
                memory[f"train step ({amp})"] = f"skipped ({reason})"
                continue
            try:
                probe = train_step_peak_mb(args.name, batch, amp=amp, config=overrides, example=example)
                memory[f"train step peak MB ({amp})"] = probe["peak_mb"]
                memory[f"train step s ({amp})"] = steps[amp] = probe["step_s"]
            except Exception as e:
                memory[f"train step peak MB ({amp})"] = f"n/a ({e})"
        if len(steps) == 2:  # one step per fresh process: a rough figure, +-20% on this machine
            memory["train step bf16 speed-up"] = f"{steps['off'] / steps['bf16']:.2f}x"
        run.say("; ".join(f"{k}: {v}" for k, v in memory.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.name, "batch": batch, "params": params, "flops": flops, "peaks": peaks,
                       "peaks_before": run.before, "peaks_after": run.after, "cpu": cpu_class(), "rows": rows,
                       "memory": memory}, f, indent=2)
    if args.save:
        run.save(args.name, " ".join(["zoo bench", *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
