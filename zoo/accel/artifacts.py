"""Running the files `zoo export` writes, with torch, onnxruntime or ExecuTorch alone.

This module imports nothing from zoo, so it runs where zoo is not installed: copy it beside an export, or run
it by path (the tests run it in a process where `import zoo` fails):

    python artifacts.py EXPORT_DIR inputs.npz outputs.npz

reads `zoo_export.json` in EXPORT_DIR, feeds each graph the arrays named `<graph>.<input>` in inputs.npz and
writes its outputs as `<graph>.<output>` to outputs.npz. From Python, `load(EXPORT_DIR)["model"](*arrays)`.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Callable

import numpy as np

MANIFEST = "zoo_export.json"

Runner = Callable[..., list[np.ndarray]]  # numpy arrays in, in the graph's input order; numpy arrays out


def load(folder: str | os.PathLike) -> dict[str, Runner]:
    """graph name -> a function running that graph of the export in `folder`."""
    folder = Path(folder)
    manifest = json.loads((folder / MANIFEST).read_text())
    opener = OPENERS[manifest["format"]]
    return {name: opener(folder / graph["file"], [i["name"] for i in graph["inputs"]])
            for name, graph in manifest["graphs"].items()}


def _onnx(path: Path, names: list[str]) -> Runner:
    import onnxruntime as ort
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    kept = {i.name for i in session.get_inputs()}  # the exporter drops an input the graph does not read

    def run(*arrays):
        return session.run(None, {n: a for n, a in zip(names, arrays) if n in kept})
    return run


def _torch(load_module: Callable[[str], Callable]) -> Callable[[Path, list[str]], Runner]:
    def opener(path: Path, names: list[str]) -> Runner:
        import torch
        module = load_module(str(path))

        def run(*arrays):
            with torch.no_grad():
                out = module(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))
            return [t.numpy() for t in (out if isinstance(out, (list, tuple)) else [out])]
        return run
    return opener


def _program(path: str):
    import torch
    return torch.export.load(path).module()


def _aoti(path: str):
    import torch._inductor
    return torch._inductor.aoti_load_package(path)


def _pte(path: Path, names: list[str]) -> Runner:
    import torch
    from executorch.runtime import Runtime
    method = Runtime.get().load_program(str(path)).load_method("forward")

    def run(*arrays):
        return [t.numpy() for t in method.execute([torch.from_numpy(np.ascontiguousarray(a)) for a in arrays])]
    return run


OPENERS = {"onnx": _onnx, "pt2": _torch(_program), "aoti": _torch(_aoti), "pte": _pte}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python artifacts.py EXPORT_DIR inputs.npz outputs.npz", file=sys.stderr)
        return 2
    folder, inputs, outputs = argv
    manifest = json.loads((Path(folder) / MANIFEST).read_text())
    arrays = np.load(inputs, allow_pickle=False)
    results = {}
    for name, run in load(folder).items():
        graph = manifest["graphs"][name]
        got = run(*(arrays[f"{name}.{i['name']}"] for i in graph["inputs"]))
        results.update({f"{name}.{o['name']}": a for o, a in zip(graph["outputs"], got)})
    np.savez(outputs, **results)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
