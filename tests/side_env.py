"""The side environment for the tools that cannot share the test venv (main process side).

optimum-onnx 0.1.0 (optimum 2.1) and optimum-intel 1.27 need transformers < 4.58; the test extra has
transformers >= 4.45, < 5.24 (5.23). `make interop-setup` builds `.venv-interop` with them (the Makefile
pins the set); tests run tests/interop_side.py there as a real subprocess and compare its files here.
PRECAST_INTEROP_PYTHON names another python with that set. optimum-intel 2.2 (optimum 2.3, transformers 5.5) has a
second one, `make interop-ov-setup`: .venv-interop-ov (PRECAST_INTEROP_OV_PYTHON). Missing: the tests skip and say
how to make it.
"""
import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SIDE = Path(os.environ.get("PRECAST_INTEROP_PYTHON", ROOT / ".venv-interop" / "bin" / "python"))
# optimum-intel 2.2 (FLUX.2 klein, Z-Image, Qwen-Image pipelines: optimum 2.3, transformers 5.5): `make interop-ov-setup`
SIDE_OV = Path(os.environ.get("PRECAST_INTEROP_OV_PYTHON", ROOT / ".venv-interop-ov" / "bin" / "python"))
SCRIPT = Path(__file__).resolve().parent / "interop_side.py"


def side_python(ov22: bool = False) -> Path:
    """The side environment's python (`ov22`: optimum-intel 2.2's), or a skip that says how to make it."""
    if ov22:
        if not SIDE_OV.is_file():
            pytest.skip(f"optimum-intel 2.2 runs in a side environment ({SIDE_OV} is missing): `make interop-ov-setup` "
                        "makes it (it needs optimum 2.3 and transformers 5.5)")
        return SIDE_OV
    if not SIDE.is_file():
        pytest.skip(f"optimum / optimum-intel run in a side environment ({SIDE} is missing): `make interop-setup` "
                    "makes it (optimum-onnx 0.1.0 and optimum-intel 1.27 need transformers<4.58; this "
                    "environment has the test extra's transformers>=4.45,<5.24)")
    return SIDE


def run_side(spec: dict, tmp, ov22: bool = False) -> dict:
    """Run tests/interop_side.py on `spec` in the side environment (`ov22`: optimum-intel 2.2's); the JSON line
    it printed."""
    python = side_python(ov22)
    tmp = Path(tmp)
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([str(python), str(SCRIPT), str(tmp / "spec.json")], capture_output=True, text=True,
                          timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, f"interop_side.py {spec} failed in the side environment:\n{proc.stderr[-6000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
