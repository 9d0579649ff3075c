"""Deployment latency per family: eager, compiled and the exported files, fp32 and int8 (issue 20 item 3).

    python bench/deploy_latency.py --save      # all five families (shipped weights), batch 1 and 32; hours on 2 cores
    python bench/deploy_latency.py --families effnetv2_cls --save   # one family: deploy_latency_effnetv2_cls.TAG.txt
    python bench/deploy_latency.py --families effnetv2_cls --batches 1,2 --formats onnx --no-compile --reps 1  # smoke

Per family and batch, interleaved round by round (zoo.bench): the eager fp32 model, `zoo.accel.compile(...,
freeze=True)`, and the files `zoo export` writes (`--format onnx`, `--format aoti`, each without and with
`--int8`, all verified by the export itself), with each file's size (eager and compiled: the fp32 state dict).
Inputs are each family's export graph at the shipped weights' shapes (bert_cls: 128 tokens; transformer_lm: the
prefill of a whole 256-token context, the export's "model" graph; unet3d_seg: 48^3 volumes, at batch 1 and 4:
one volume takes 2 s eager on one AVX2 thread, so 32 would be a minute a call and six rows x 5 rounds half an hour;
effnetv2_cls 32x32, diffusion_unet 16x16). onnxruntime runs with zoo.bench's settings (torch's threads); ratios to
eager fp32, medians over rounds. A failed export (or a runtime that refuses the file) is a row saying why.
"""
import argparse
import copy
import functools
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402

import zoo  # noqa: E402
from zoo.accel import model_size_bytes  # noqa: E402
from zoo.accel.compile import compile as zoo_compile  # noqa: E402
from zoo.bench import (BenchRun, add_run_arguments, build_row, format_table, onnxruntime_session,  # noqa: E402
                       onnxruntime_settings, time_rows)

BATCHES = (1, 32)
SMALLER = {"unet3d_seg": (1, 4)}  # 32 volumes: a minute a call eager (module docstring)


def export_all(model, formats: list[str], folder: Path) -> dict[tuple[str, bool], object]:
    """(format, int8) -> zoo.accel.export's result (or the exception it raised), all before any row is built:
    torch.export resets dynamo's caches, which would make a compiled row recompile inside the timing."""
    exports = {}
    for fmt in formats:
        for int8 in (False, True):
            try:
                exports[(fmt, int8)] = zoo.accel.export(model, fmt, folder / f"{fmt}{'-int8' if int8 else ''}",
                                                        int8=int8, progress=False)
            except Exception as e:  # the row says why
                exports[(fmt, int8)] = e
    return exports


def exported_call(result, inputs: tuple):
    """The call of one exported file on `inputs` (onnxruntime with zoo.bench's settings, or AOTInductor)."""
    if isinstance(result, Exception):
        raise result
    if result.manifest["format"] == "onnx":
        session = onnxruntime_session(result.files[0])
        kept = {i.name for i in session.get_inputs()}
        names = [i["name"] for i in result.manifest["graphs"]["model"]["inputs"]]
        feeds = {n: t.numpy() for n, t in zip(names, inputs) if n in kept}
        return functools.partial(session.run, None, feeds)
    import torch._inductor
    return functools.partial(torch._inductor.aoti_load_package(str(result.files[0])), *inputs)


def family_rows(batch: int, model, graph, exports: dict, args) -> list[dict]:
    inputs = tuple(t.contiguous() for t in graph.inputs)
    fp32_mb = model_size_bytes(model) / 1e6
    rows = [{**build_row("zoo", "eager fp32", lambda: functools.partial(graph.module, *inputs), batch=batch),
             "file MB": fp32_mb}]
    if not args.no_compile:
        rows.append({**build_row("zoo", "compile(freeze=True)", lambda: functools.partial(
            zoo_compile(copy.deepcopy(graph.module), freeze=True), *inputs), batch=batch, warmup=3),
            "file MB": fp32_mb})
    for (fmt, int8), result in exports.items():
        runtime = "onnxruntime" if fmt == "onnx" else "AOTInductor"
        row = build_row(fmt, f"{'int8' if int8 else 'fp32'} ({runtime})",
                        functools.partial(exported_call, result, inputs), batch=batch, warmup=2)
        size = {} if isinstance(result, Exception) else {"file MB": result.files[0].stat().st_size / 1e6}
        rows.append({**row, **size})
    return time_rows(rows, rounds=args.reps, calls=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(zoo.list_models()), help="comma-separated (default: all)")
    parser.add_argument("--batches", default=None,
                        help=f"comma-separated (default {','.join(map(str, BATCHES))}; unet3d_seg "
                             f"{','.join(map(str, SMALLER['unet3d_seg']))})")
    parser.add_argument("--formats", default="onnx,aoti", help="exported files to time: onnx, aoti or both")
    parser.add_argument("--no-compile", action="store_true", help="skip the compile(freeze=True) row")
    add_run_arguments(parser, reps=5)
    args = parser.parse_args()
    args.formats = [f for f in args.formats.split(",") if f]
    if unknown := sorted(set(args.formats) - {"onnx", "aoti"}):
        parser.error(f"--formats takes onnx and aoti, not {', '.join(unknown)}")
    families = args.families.split(",")
    if unknown := sorted(set(families) - set(zoo.list_models())):
        parser.error(f"unknown families {', '.join(unknown)}; zoo list names them")

    run = BenchRun("deployment latency, shipped weights: eager, compiled and exported files; rows interleaved, "
                   f"{args.reps} rounds, one call each, medians; ratio: to eager fp32", peaks=("fp32", "int8"))
    run.say(onnxruntime_settings())
    with tempfile.TemporaryDirectory(prefix="zoo-deploy-bench-") as tmp:
        for name in families:
            model = zoo.load(name, pretrained=True).eval()
            exports = export_all(model, args.formats, Path(tmp) / name)
            batches = [int(b) for b in args.batches.split(",")] if args.batches else SMALLER.get(name, BATCHES)
            for batch in batches:
                graph = model.export_graphs(batch)["model"]
                shapes = ", ".join(f"{n} {tuple(t.shape)}" for n, t in zip(graph.names, graph.inputs))
                rows = family_rows(batch, model, graph, exports, args)
                run.say(f"\n{name}, batch {batch}: {shapes}")
                run.say(format_table(rows, columns={"file MB": ".1f"}))
            for (fmt, int8), result in exports.items():
                if isinstance(result, Exception):
                    run.say(f"{name} {fmt}{' int8' if int8 else ''}: no export ({type(result).__name__}: {result})")
                    continue
                verified = result.manifest["verified"]
                against = (f"the int8 eager model, {verified['vs_fp32']['max_rel_error']:.2e} against fp32 eager"
                           if int8 else "eager")
                run.say(f"{name} {fmt}{' int8' if int8 else ''}: verified, max error {verified['max_rel_error']:.2e} "
                        f"of the output's magnitude against {against}")
    run.finish()
    if args.save:  # a subset of the families gets its own file: the all-family report is not overwritten
        run.save("deploy_latency" if set(families) == set(zoo.list_models()) else
                 "deploy_latency_" + "_".join(families))


if __name__ == "__main__":
    main()
