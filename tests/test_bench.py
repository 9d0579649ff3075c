"""zoo.bench, the one harness of `zoo bench` and bench/*.py: rows built first, then timed interleaved round by
round; emulated dtypes skipped with the reason; onnxruntime as a peer row; results named by CPU class."""
import json
import mmap
from pathlib import Path

import pytest
import torch
from torch import nn

import zoo.bench as bench
from zoo.accel.variants import Variant
from zoo.bench import BenchRun, build_row, build_rows, format_table, time_rows

from .test_hardware import AMX, AVX2, AVX512, play

def test_rows_are_built_first_then_timed_interleaved_round_by_round():
    log = []

    def variant(name, fail=False):
        def build(model, inputs):
            log.append(f"build {name}")
            if fail:
                raise RuntimeError("not on this model")
            return (lambda x: log.append(name)), inputs
        return Variant(name, build)

    built = build_rows(nn.Linear(4, 4), (torch.randn(2, 4),),
                       [variant("a"), variant("b"), variant("broken", fail=True), variant("c")])
    rows = time_rows(built, rounds=3, calls=1)
    builds = ["build a", "a", "build b", "b", "build broken", "build c", "c"]  # each built and warmed up
    rounds = ["a", "b", "c", "b", "c", "a", "c", "a", "b"]  # every row once a round, starting one later
    assert log == builds + rounds
    assert [r["mode"] for r in rows] == ["a", "b", "broken", "c"] and "error" in rows[2]
    assert rows[0]["ratio"] == 1.0 and all(r["ms"] > 0 for r in rows if "ms" in r)
    assert all("run" not in r for r in rows)


def test_time_rows_takes_medians_over_rounds_and_ratios_within_each_round(monkeypatch):
    # seconds per round, by row: a round where the machine is slow is slow for every row
    script = {"eager": [1.0, 2.0, 10.0], "peer": [4.0, 4.0, 40.0], "fast": [2.0, 1.0, 30.0]}
    calls = []

    def fake_time_call(fn, *, warmup, reps):
        fn()
        return script[calls[-1]].pop(0)

    monkeypatch.setattr(bench, "time_call", fake_time_call)
    rows = [build_row(model, mode, lambda mode=mode: (lambda: calls.append(mode)), batch=4, warmup=0)
            for model, mode in (("zoo", "eager"), ("theirs", "peer"), ("zoo", "fast"))]
    out = {r["mode"]: r for r in time_rows(rows, rounds=3, calls=1, peer="theirs")}
    assert calls == ["eager", "peer", "fast", "peer", "fast", "eager", "fast", "eager", "peer"]
    assert out["fast"]["ms"] == 2000.0 and out["fast"]["items_per_s"] == 2.0  # medians of its own times
    assert out["fast"]["ratio"] == 0.5  # median of 1/2, 2/1, 10/30; the ratio of medians would be 1.0
    assert out["fast"]["vs_peer"] == 2.0 and out["peer"]["vs_peer"] == 1.0 and out["eager"]["ratio"] == 1.0
    table = format_table(list(out.values()), peer="theirs")
    assert "vs theirs" in table.splitlines()[0] and " 0.50x" in table and " 2.00x" in table


def test_a_row_in_a_dtype_the_cpu_emulates_is_skipped_with_the_reason_unless_forced(monkeypatch):
    built = []

    def build():
        built.append(1)
        return lambda: None

    play(monkeypatch, AVX2)
    row = build_row("zoo", "bf16 autocast", build, batch=1, dtype=torch.bfloat16)
    assert built == [] and "run" not in row
    assert row["skipped"].startswith("bf16 matmuls on this AVX2 CPU run ~100x slower")
    assert row["skipped"].endswith("--force-emulated times it")
    assert "skipped: bf16 matmuls on this AVX2" in format_table(time_rows([row]))
    assert "run" in build_row("zoo", "bf16 autocast", build, batch=1, dtype=torch.bfloat16, force_emulated=True)
    assert "run" in build_row("zoo", "fp32", build, batch=1, dtype=torch.float32)
    play(monkeypatch, AMX)
    assert "run" in build_row("zoo", "bf16 autocast", build, batch=1, dtype=torch.bfloat16)
    assert len(built) == 3


def test_matmul_peaks_measure_each_dtype():
    for dtype in (torch.float32, torch.bfloat16, torch.int8):  # int8: oneDNN's u8 x s8 kernel on x86
        assert bench.matmul_peak_gflops(dtype, n=128) > 0


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="reads Linux's peak-RSS mark")
def test_peak_rss_growth_is_what_the_call_adds():
    def allocate():
        # a fresh mapping, every page written: a tensor could reuse heap pages that earlier tests left resident
        # (under pytest-xdist the RSS then did not move at all)
        size = 64 * 2**20
        with mmap.mmap(-1, size) as buf:
            for offset in range(0, size, mmap.PAGESIZE):
                buf[offset] = 1
    assert 48 < bench.peak_rss_growth_mb(allocate) < 128
    assert bench.peak_rss_growth_mb(lambda: None) < 16  # the mark is reset: not this process's history


def test_bench_harness_prints_side_by_side_rows_with_config_and_size(monkeypatch, capsys):
    play(monkeypatch, AVX2)
    monkeypatch.setattr(bench, "matmul_peak_gflops", lambda dtype, device="cpu": 100.0)  # measured above
    argv = ["effnetv2_cls", "--config", "variant=b0", "num_classes=10", "--size", "32", "--batch", "2",
            "--no-compile", "--no-int8", "--no-memory", "--no-peer", "--reps", "1"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("effnetv2_cls: 5.87M params") and "(2, 3, 32, 32)" in out  # b0, 10-class head
    assert "CPU AVX2 (no native bf16, no VNNI)" in out.splitlines()[0]
    rows = [line for line in out.splitlines() if line.startswith("zoo ")]
    assert [r.split()[1] for r in rows] == ["eager", "channels_last", "bf16"]
    assert rows[0].split()[-3] == "1.00x" and "skipped: bf16 matmuls on this AVX2 CPU" in rows[2]
    with pytest.raises(ValueError, match="KEY=VALUE"):
        bench.main(["effnetv2_cls", "--config", "variant"])
    with pytest.raises(ValueError, match="unknown config key|valid keys"):
        bench.main(["effnetv2_cls", "--config", "colour=red"])


def test_bench_save_names_the_table_by_cpu_class_and_reports_peaks_before_and_after(monkeypatch, tmp_path):
    play(monkeypatch, AVX512)
    monkeypatch.setattr(bench, "ROOT", tmp_path)  # where --save writes
    peaks = iter([100.0, 2.0, 120.0, 3.0])  # fp32, bf16 before the rows; fp32, bf16 after
    monkeypatch.setattr(bench, "matmul_peak_gflops", lambda dtype, device="cpu": next(peaks))
    argv = ["effnetv2_cls", "--config", "variant=b0", "num_classes=10", "--size", "32", "--batch", "2",
            "--no-compile", "--no-int8", "--no-memory", "--no-peer", "--reps", "1", "--calls", "1", "--save",
            "--json", str(tmp_path / "out.json")]
    assert bench.main(argv) == 0
    saved = (tmp_path / "bench" / "results" / "effnetv2_cls.avx512.txt").read_text().splitlines()
    assert saved[0].startswith("# zoo bench effnetv2_cls --config") and "CPU AVX-512" in saved[1]
    assert saved[2] == "matmul peaks of this run (before / after the rows): fp32 100 / 120, bf16 2 / 3 GFLOP/s"
    assert [line.split()[1] for line in saved if line.startswith("zoo ")] == ["eager", "channels_last", "bf16"]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["peaks"] == {"fp32": 120.0, "bf16": 3.0} and result["peaks_before"]["fp32"] == 100.0


@pytest.mark.parametrize("caps, tag", [(AVX2, "avx2"), (AVX512, "avx512"), (AMX, "amx")])
def test_results_files_are_named_by_cpu_class_and_the_cards_head_each_table_with_it(monkeypatch, tmp_path,
                                                                                   caps, tag):
    from zoo import cards
    play(monkeypatch, caps)
    monkeypatch.setattr(bench, "ROOT", tmp_path)
    monkeypatch.setattr(bench, "matmul_peak_gflops", lambda dtype, device="cpu": 50.0)
    run = BenchRun("tiny", peaks=("fp32", "int8"))
    run.say("a table")
    path = run.save("bert_cls_tiny", "python bench/tiny.py")
    assert path == tmp_path / "bench" / "results" / f"bert_cls_tiny.{tag}.txt"
    assert path.read_text().splitlines()[1:] == [
        f"tiny; {torch.get_num_threads()} threads, torch {torch.__version__}; {caps.describe()}",
        "matmul peaks of this run (before / after the rows): fp32 50 / 50, int8 50 / 50 GFLOP/s", "a table"]
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left"
    monkeypatch.setattr(cards, "BENCH_DIR", path.parent)
    (path.parent / "bert_cls_tiny.gpu-h200.txt").write_text("on the GPU\n")
    card = cards.render_model_cards()
    assert f"### benchmark: bert_cls_tiny (CPU {caps.cpu_class})\n\n```\n# python bench/tiny.py" in card
    assert "### benchmark: bert_cls_tiny (GPU H200)\n\n```\non the GPU\n```" in card


def test_onnxruntime_row_runs_the_exported_model_with_torchs_threads(monkeypatch):
    pytest.importorskip("onnxruntime")
    import functools

    from zoo.accel import model_size_bytes
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).eval()
    inputs = (torch.randn(4, 64),)
    play(monkeypatch, AVX2)
    # one export (export_onnx checks the fp32 session against the model on `inputs`), then onnxruntime's int8
    runtime = bench.OnnxRuntimeModel(model, inputs, int8=True)
    assert runtime.session.get_session_options().intra_op_num_threads == torch.get_num_threads()
    assert runtime.size_bytes < model_size_bytes(model) / 2  # int8 weights
    other = torch.randn(7, 64)  # another batch than the export's
    with torch.no_grad():
        want = model(other)
    # u8 weights without VNNI (zoo.accel.deploy_int8): full-range s8 ones saturated AVX2's pair sums here (16% off)
    assert runtime(other).shape == (7, 8) and (runtime(other) - want).abs().max() < 0.05 * want.abs().max()
    rows = time_rows([build_row("zoo", "eager fp32", lambda: (lambda: model(*inputs)), batch=4),
                      build_row("onnxruntime", "int8", lambda: functools.partial(runtime, *inputs), batch=4)],
                     rounds=2, calls=1, peer="onnxruntime")
    assert rows[1]["ms"] > 0 and rows[1]["vs_peer"] == 1.0
    settings = bench.onnxruntime_settings()
    assert settings.startswith("onnxruntime 1.") and f"{torch.get_num_threads()} intra-op threads" in settings
