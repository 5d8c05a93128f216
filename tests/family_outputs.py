"""Digests of what precast makes from every tiny family's demo file: each export's files (the ONNX graph and
its weights, per component) and, with --png, the PNG `precast generate` makes from an ONNX Runtime bundle
of it. A redesign that must not change behaviour leaves every digest as it was:
tests/test_family_outputs.py holds the export digests; compare images by running
`.venv/bin/python tests/family_outputs.py --png` before and after a change on one machine (kernels differ
between CPUs, so image digests are not recorded in a test).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# family (precast demo-model --family) -> what the export needs beside the file
EXPORTS = {
    "sd15": {}, "sd2": {}, "sdxl": {}, "inpaint": {},
    "sd3": {}, "sd35-medium": {}, "sd35-large": {},
    "flux-dev": {"transformer": {"axes_dims_rope": [4, 6, 6]}},
    "flux-schnell": {"transformer": {"axes_dims_rope": [4, 6, 6]}},
    "chroma": {"transformer": {"axes_dims_rope": [4, 6, 6]}},
    "z-image": {"transformer": {"axes_dims_rope": [4, 6, 6]}},
    "flux2-klein": {"transformer": {"axes_dims_rope": [4, 4, 4, 4]}},
    "flux2-dev": {"transformer": {"axes_dims_rope": [4, 4, 4, 4]}},
    "qwen-image": {"transformer": {"axes_dims_rope": [4, 6, 6]}},
    "controlnet": {}, "lora": {},
}


def _folder_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h.update(p.relative_to(folder).as_posix().encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def export_digests(family: str, work: Path) -> dict[str, str]:
    """{component: digest of its export folder} for `family`'s tiny demo file, exported fp32."""
    from precast.compiler.demo_families import write_demo_file
    from precast.compiler.export import export
    base = work / "sd15.safetensors"
    if family in ("controlnet", "lora") and not base.exists():
        write_demo_file("sd15", str(base))
    path = work / f"{family}.safetensors"
    write_demo_file(family, str(path))
    out = work / f"{family}-export"
    if family == "controlnet":
        export(base, out, progress=False, controlnets=[(str(path), "demo")])
    elif family == "lora":
        export(base, out, progress=False, loras=[(str(path), 0.8)])
    else:
        export(path, out, overrides=EXPORTS[family], progress=False)
    return {p.name: _folder_digest(p) for p in sorted(out.iterdir()) if p.is_dir()}


def png_digest(family: str, work: Path) -> str:
    """sha256 of the PNG `precast generate` makes (seed 1, 3 steps, a negative prompt) from an ONNX Runtime
    bundle of the family's demo file (built through the real CLI): SD 1.x as img2img, the inpainting file
    inpainted, the ControlNet one with a control image."""
    from precast.compiler.demo_families import write_demo_file
    path = work / f"{family}-png.safetensors"
    recipe = write_demo_file(family, str(path)).replace("targets: [onnxruntime, {openvino: {device: CPU}}]",
                                                        "targets: [onnxruntime]")
    (work / f"{family}.yaml").write_text(recipe + "\n")
    env = {**os.environ, "PRECAST_CACHE": str(work / "cache")}
    run = lambda *a: subprocess.run([sys.executable, "-m", "precast.runtime.cli", *map(str, a)],  # noqa: E731
                                    capture_output=True, text=True, env=env, check=True)
    run("build", work / f"{family}.yaml", "--out", work / f"{family}-bundle")
    import numpy as np
    from precast.runtime.png import write_png
    write_png(str(work / "init.png"), np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8))
    write_png(str(work / "mask.png"), np.tile(np.uint8([0, 255]).repeat(32)[None, :, None], (64, 1, 3)))
    extra = {"inpaint": ["--init-image", work / "init.png", "--mask", work / "mask.png"],
             "sd15": ["--init-image", work / "init.png", "--strength", "0.7"],
             "controlnet": ["--control", f"{work / 'init.png'}:0.8", "--controlnet", "demo"]}.get(family, [])
    run("generate", work / f"{family}-bundle", "--prompt", "a photo of a cat", "--negative", "blurry",
        "--seed", "1", "--steps", "3", "--backend", "cpu:onnxruntime", "--out", work / f"{family}.png", *extra)
    return hashlib.sha256((work / f"{family}.png").read_bytes()).hexdigest()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        result = {"exports": {f: export_digests(f, work) for f in EXPORTS}}
        if "--png" in sys.argv:
            result["png"] = {f: png_digest(f, work) for f in EXPORTS if f != "lora"}
    print(json.dumps(result, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
