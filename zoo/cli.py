"""The `zoo` command: list, info, predict, export, bench, demo, cards."""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from zoo.weights import WeightsError

# Errors a user can fix; anything else is a bug and keeps its traceback. They exit with 2, as the train
# scripts' main_guard and argparse's usage errors do.
USER_ERRORS = (ValueError, FileNotFoundError, NotADirectoryError, PermissionError, WeightsError,
               RuntimeError, TypeError)
USER_ERROR_EXIT = 2


def cmd_list(args) -> int:
    from zoo.registry import get_entry, list_models
    for name in list_models():
        entry = get_entry(name)
        tags = ", ".join(f"{t}{'*' if t == entry.default_tag else ''}" for t in entry.weights) or "-"
        print(f"{name:<16} {entry.description}  [weights: {tags}]")
    return 0


def cmd_info(args) -> int:
    from zoo.cards import model_info
    info = model_info(args.name)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"{info['name']}: {info['description']}")
    print(f"  class:    {info['class']}")
    print(f"  params:   {info['params']:,} (default config)")
    if info["variants"]:
        print(f"  variants: {', '.join(info['variants'])}")
    print(f"  config:   {json.dumps(info['config'])}")
    if not info["weights"]:
        print("  weights:  none shipped yet")
    for tag, w in info["weights"].items():
        default = " (default)" if tag == info["default_weights"] else ""
        metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in w["metrics"].items())
        print(f"  weights {tag}{default}: {w['file']} [{w['dtype']}] on {w['dataset'] or '?'}; {metrics}")
    return 0


def _options(extra: list[str]) -> tuple[dict[str, str], list[str]]:
    """`--key value` / `--flag` pairs after the known arguments, for the family's predict, and the inputs that
    argparse left among them (`zoo predict NAME --top-k 3 cat.jpg` gives the inputs after the options)."""
    options, inputs, i = {}, [], 0
    while i < len(extra):
        if not extra[i].startswith("--"):
            inputs, i = inputs + [extra[i]], i + 1
            continue
        key = extra[i][2:].replace("-", "_")
        if i + 1 < len(extra) and not extra[i + 1].startswith("--"):
            options[key], i = extra[i + 1], i + 2
        else:
            options[key], i = "true", i + 1
    return options, inputs


def _pretrained(entry, spec: str | None, doing: str):
    """--pretrained, else the shipped weights, else False (random weights, with a warning)."""
    pretrained = spec if spec is not None else (entry.default_tag is not None)
    if pretrained is False:
        logging.getLogger("zoo").warning("%s has no shipped weights: %s random weights", entry.name, doing)
    return pretrained


def cmd_predict(args, extra) -> int:
    import zoo
    from zoo import predict
    entry = zoo.registry.get_entry(args.name)
    options, inputs = _options(extra)
    if args.out is not None:
        options["out"] = args.out
    options = predict.convert(args.name, options)  # a bad option fails before the model loads
    model = zoo.load(args.name, pretrained=_pretrained(entry, args.pretrained, "predicting with"))
    result, text = predict.run(args.name, model, [*args.inputs, *inputs], options)
    print(json.dumps(result, indent=2) if args.json else text)
    return 0


def cmd_export(args) -> int:
    import zoo
    from zoo.accel import deploy_int8
    from zoo.accel.deploy import FORMATS, export
    entry = zoo.registry.get_entry(args.name)
    if args.format not in FORMATS:  # before the model loads
        raise ValueError(f"unknown export format {args.format!r}; choose {', '.join(FORMATS)} (TorchScript is "
                         "deprecated upstream: aoti replaces it)")
    if args.int8:
        deploy_int8.check_format(args.format)
    if not args.verbose:  # the ONNX exporter's passes note each weight they fold at INFO: hundreds of lines
        for library in ("onnx_ir", "onnxscript"):
            logging.getLogger(library).setLevel(logging.WARNING)
        for handler in logging.getLogger().handlers:  # onnxruntime's quantizer logs a line per tensor to root
            handler.addFilter(_quiet_quantizer)
    model = zoo.load(args.name, pretrained=_pretrained(entry, args.pretrained, "exporting"))
    dynamic = None if args.dynamic is None else args.dynamic.split(",")
    result = export(model, args.format, args.out, batch=args.batch, dynamic=dynamic, int8=args.int8)
    manifest = result.manifest
    verified = manifest["verified"]
    for name, graph in manifest["graphs"].items():
        path = result.folder / graph["file"]
        shapes = ", ".join(f"{n} {tuple(s)}" for n, s in verified["graphs"][name]["inputs"].items())
        print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB); verified at {shapes}")
    if "int8" in manifest:
        int8 = manifest["int8"]
        smaller = (f", {manifest['fp32_size_bytes'] / manifest['size_bytes']:.2f}x smaller than fp32"
                   if "fp32_size_bytes" in manifest else "")
        print(f"int8 {int8['method']} ({int8['tool']}, weights {int8['weights']}){smaller}; max error against "
              f"the int8 eager model {result.max_abs_error:.3g} ({result.max_rel_error:.3g} of the output's "
              f"magnitude), against fp32 eager {verified['vs_fp32']['max_abs_error']:.3g} "
              f"({result.max_rel_error_vs_fp32:.3g}); described in {result.folder / 'zoo_export.json'}")
        return 0
    print(f"max error against eager {result.max_abs_error:.3g} ({result.max_rel_error:.3g} of the output's "
          f"magnitude); described in {result.folder / 'zoo_export.json'}")
    return 0


def _quiet_quantizer(record: logging.LogRecord) -> bool:
    """Drop onnxruntime.quantization's notes (a tensor it leaves in float, 'consider pre-processing') below ERROR."""
    return record.levelno >= logging.ERROR or "onnxruntime/quantization" not in record.pathname.replace("\\", "/")


EXPORT_HELP = """\
formats:
  onnx  ONNX (the torch.export-based exporter), runs in onnxruntime
  aoti  AOTInductor package (.aoti.pt2): compiled ahead of time; torch._inductor.aoti_load_package loads it in
        Python, AOTIModelPackageLoader in C++, without zoo; compiling takes minutes on a few cores
  pt2   torch.export.save of the ExportedProgram (torch.export.load(path).module() runs it)
  pte   ExecuTorch with the XNNPACK delegate, for mobile and edge (pip install 'zoo[mobile]'); its dynamic
        sizes are bounded at the traced ones, so trace at the largest batch you need; not unet3d_seg
        (ExecuTorch has no 3-D convolution kernel)

TorchScript (torch.jit.trace/script) is deprecated upstream and not offered: aoti is its successor for C++.
TensorRT is not offered either (its libraries install only from NVIDIA's package index, out of reach of the
machines zoo is tested on): on a CUDA machine with torch_tensorrt, torch_tensorrt.compile(model.eval().cuda(),
ir="dynamo", arg_inputs=[x.cuda()]) takes a zoo model as it is.

--int8 (onnx, aoti): Linear-only models (bert_cls, transformer_lm) get dynamic int8 (int8 weights and
embedding tables, activation scales per call); convolutional ones (effnetv2_cls, unet3d_seg, diffusion_unet)
static int8 calibrated on 4 batches of the model's example inputs (seeded noise; from Python,
zoo.accel.export(..., int8=True, calibration=batches) takes real ones). onnx: onnxruntime's quantizer (u8
weights on a CPU without VNNI, where its u8 x s8 kernel saturates; s8 with VNNI). aoti: PT2E with the x86
Inductor quantizer, compiled with frozen weights (oneDNN's int8 kernels) on a CPU with VNNI, unfrozen without
(those kernels saturate there: the int8 weights run dequantized in fp32, smaller but not faster); not
unet3d_seg (PT2E's x86 quantizer has no 3-D convolutions: use onnx). The int8 file
is verified against the int8 model it was made from (static: 5e-2 of the output's magnitude; dynamic: 0.15,
as per-call activation scales move whole steps on rounding differences; an onnx export's fp32 file first
against eager, 1e-3); its error against the fp32 model is printed and recorded, as are the quantization and
the CPU (zoo_export.json's int8). pt2 and pte have no --int8.

Every export is run from the written file at another shape than traced (batch + 1; a sequence, a cache or a
volume side one step longer, or shorter at its maximum), compared with the eager model (it fails above 1e-3
of the output's magnitude) and described in DIR/zoo_export.json (inputs, outputs, dynamic dimensions,
preprocessing, labels, the weights' sha256). transformer_lm writes two graphs: model (a whole sequence ->
logits and the KV cache) and decode (one token per row after `past` cached positions -> logits and the
cache one position longer).
"""


def cmd_demo(args) -> int:
    import zoo
    from tqdm import tqdm

    from zoo.demo import demo
    names = [n for n in zoo.list_models() if zoo.registry.get_entry(n).default_tag is not None]
    if not names:
        print("no model has shipped weights yet; nothing to demo")
        return 0
    reports = [f"== {name} ==\n{demo(name, zoo.load(name, pretrained=True))}"
               for name in tqdm(names, desc="zoo demo", unit="model")]
    print("\n\n".join(reports))
    return 0


def cmd_bench(args, extra) -> int:
    from zoo.bench import main as bench_main
    return bench_main(extra)


def cmd_cards(args) -> int:
    from zoo.cards import render_model_cards, write_model_cards
    path = Path(args.out)
    if args.check:
        if not path.is_file():
            raise FileNotFoundError(f"{path} does not exist{' (it is a directory)' if path.is_dir() else ''}; "
                                    f"`zoo cards --out {path}` writes it")
        current = path.read_text()
        if current != render_model_cards():
            print(f"{path} is out of date; run `zoo cards`", file=sys.stderr)
            return 1
        return 0
    changed = write_model_cards(path)
    print(f"{'wrote' if changed else 'unchanged:'} {path}")
    return 0


def cmd_publish(args) -> int:
    from zoo.weights import publish
    path = publish(args.file, args.name, args.tag)
    print(f"published {path}; make sure {args.name}'s registration lists the tag {args.tag!r}, then run `zoo cards`")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zoo", description="A reference model zoo for PyTorch.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser("list", help="list registered models")
    p = sub.add_parser("info", help="describe a model and its weights")
    p.add_argument("name")
    p.add_argument("--json", action="store_true")
    p = sub.add_parser("predict", help="run a model on inputs (files, text, ...); family options as --key value")
    p.add_argument("name")
    p.add_argument("inputs", nargs="*")
    p.add_argument("--pretrained", default=None, help="weights tag, path or hf:// URI (default: shipped)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("-o", "--out", default=None, help="the file to write (unet3d_seg, diffusion_unet)")
    p = sub.add_parser("export", help="write a deployable file (onnx, aoti, pt2, pte), verified against eager",
                       description="Export a model to a file that runs without zoo.", epilog=EXPORT_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name")
    p.add_argument("--pretrained", default=None, help="weights tag, path or hf:// URI (default: shipped)")
    p.add_argument("--format", required=True, metavar="{onnx,aoti,pt2,pte}", help="the file to write (see below)")
    p.add_argument("-o", "--out", required=True, metavar="DIR",
                   help="the folder to write: a new one, or a previous export (replaced)")
    p.add_argument("--batch", type=int, default=2, help="the batch traced (default 2)")
    p.add_argument("--dynamic", default=None, metavar="NAMES",
                   help="comma-separated dimensions that stay dynamic, e.g. batch,seq (default: all the model "
                   "offers; none: fixed shapes)")
    p.add_argument("--int8", action="store_true",
                   help="an int8 file (onnx, aoti): dynamic for Linear-only models, static for convolutional ones")
    # the harness parses its own options, so `zoo bench --help` shows them
    sub.add_parser("bench", help="benchmark a model (eager, bf16, compile, int8); see zoo bench --help",
                   add_help=False)
    sub.add_parser("demo", help="run every model with shipped weights on built-in inputs")
    p = sub.add_parser("cards", help="regenerate MODEL_CARDS.md")
    p.add_argument("--out", default="MODEL_CARDS.md")
    p.add_argument("--check", action="store_true", help="exit 1 if the file is out of date (2 if it is missing)")
    p = sub.add_parser("publish", help="copy trained weights into weights/ and the manifest (maintainers)")
    p.add_argument("file")
    p.add_argument("name")
    p.add_argument("tag")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("predict", "bench"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s: %(message)s")
    commands = {"list": cmd_list, "info": cmd_info, "demo": cmd_demo, "cards": cmd_cards, "publish": cmd_publish,
                "export": cmd_export}
    try:
        if args.command in ("predict", "bench"):
            return {"predict": cmd_predict, "bench": cmd_bench}[args.command](args, extra)
        return commands[args.command](args)
    except USER_ERRORS as e:
        print(f"zoo {args.command}: error: {e}", file=sys.stderr)
        return USER_ERROR_EXIT
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
