"""A built wheel carries the shipped weights: install it in a fresh venv and load from elsewhere."""
import os
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import json, zoo
from zoo.weights import weights_dir, read_manifest
from zoo.registry import get_entry
import sys
assert zoo.__file__.startswith(sys.prefix) and "site-packages" in zoo.__file__, zoo.__file__  # the wheel's copy
assert weights_dir().name == "_weights", weights_dir()
manifest = read_manifest()
loaded = []
for name in zoo.list_models():
    entry = get_entry(name)
    if entry.default_tag is not None:
        assert entry.weights[entry.default_tag] in manifest
        zoo.load(name, pretrained=True)
        loaded.append(name)
print(json.dumps({"files": sorted(manifest), "loaded": loaded}))
"""


@pytest.mark.slow
def test_wheel_carries_weights_and_loads(tmp_path):
    wheel_dir = tmp_path / "wheel"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
                    "-w", str(wheel_dir), "-q"], check=True, cwd=tmp_path)
    wheel = next(wheel_dir.glob("zoo-*.whl"))
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    # without PYTHONPATH: a checkout on it (with the zoo.egg-info the wheel build leaves there) would make
    # pip think zoo is installed already and skip the wheel
    clean_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "-q", str(wheel)], check=True, env=clean_env)
    # torch & co. come from the interpreter running the tests, which may itself be a venv (there
    # system_site_packages would reach the bare base interpreter, without torch). A .pth file appends
    # this interpreter's site-packages to the new venv's sys.path, after the venv's own, so the wheel's
    # zoo wins; plain path lines, so that interpreter's .pth files (an editable zoo) are not processed.
    # Written after the install, so pip saw only the fresh venv.
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    ours = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (Path(purelib) / "_zoo_test_parent_site.pth").write_text("".join(f"{path}\n" for path in ours))
    result = subprocess.run([str(python), "-c", CHECK], cwd=tmp_path, capture_output=True, text=True,
                            env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    import json
    report = json.loads(result.stdout.strip().splitlines()[-1])
    shipped = json.loads((ROOT / "weights" / "manifest.json").read_text())
    assert report["files"] == sorted(shipped)
