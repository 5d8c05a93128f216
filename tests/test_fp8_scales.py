"""ComfyUI scaled fp8: a scaled model's fp8 Linear weight without its scale is refused, by name, before
anything is written; what ComfyUI itself reads unscaled (another model's plain fp8, embedding tables) is not.

Files: the tiny Flux all-in-one in ComfyUI's scaled-fp8 layout (demo_dit: a `scaled_fp8` marker per
quantized model, a float32 scalar `.scale_weight` beside each fp8 Linear weight), rewritten with one
tensor dropped or changed, as a damaged download or an incomplete conversion leaves it.
"""
import json

import numpy as np
import pytest
from conftest import precast
from precast.compiler.demo_dit import (
    DEMO_AXES,
    FLUX_PREFIX,
    T5_PREFIX,
    TINY_FLUX_DEV,
    TINY_T5,
    write_flux_checkpoint,
)
from precast.compiler.demo_model import SAFETENSORS_DTYPES, write_safetensors
from precast.compiler.sources.safetensors_file import SafetensorsFile

AXES = "transformer.axes_dims_rope=" + json.dumps(DEMO_AXES).replace(" ", "")
LINEAR = FLUX_PREFIX + "double_blocks.0.img_attn.qkv.weight"


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    path = tmp_path_factory.mktemp("scaled") / "flux-fp8-scaled.safetensors"
    write_flux_checkpoint(path, TINY_FLUX_DEV, t5=TINY_T5, seed=5, dtype="fp8_e4m3_scaled")
    return path


def _rewrite(src, dst, drop=(), change=None):
    """`src` written again to `dst` without the keys in `drop` and with `change` {key: array} in place."""
    f = SafetensorsFile(src)
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    keys = [k for k in f.keys() if k not in drop]
    change = change or {}
    shapes = {k: change[k].shape if k in change else f.tensors[k].shape for k in keys}
    write_safetensors(str(dst), shapes, {k: names[f.tensors[k].dtype] for k in keys},
                      lambda k, shape: change[k] if k in change else f.read(k, raw=True))
    return dst


def _export(src, out):
    return precast("export", src, "--out", out, "--component", "transformer", "--component", "text_encoder_2",
                   "--set", AXES)


@pytest.mark.parametrize("drop", [(LINEAR[:-len("weight")] + "scale_weight",),
                                  (LINEAR[:-len("weight")] + "scale_weight", FLUX_PREFIX + "scaled_fp8")])
def test_a_missing_scale_is_refused_by_name(scaled, tmp_path, drop):
    """With the model's `scaled_fp8` marker, or without it (other weights of the model have scales), the
    weight whose scale is gone is named in one line; exit 2; no export folder is written."""
    bad = _rewrite(scaled, tmp_path / "damaged.safetensors", drop)
    proc = _export(bad, tmp_path / "out")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"error: {bad}: {LINEAR} is stored in fp8 without its scale") and "convert it again" in line, line
    assert not (tmp_path / "out").exists()
    recipe = tmp_path / "r.yaml"              # `precast plan` reads the header as export does: the same line
    recipe.write_text(f"model: {{source: {bad}}}\ntargets: [onnxruntime]\n")
    proc = precast("plan", recipe)
    assert proc.returncode == 2 and LINEAR in proc.stderr and "without its scale" in proc.stderr, proc.stderr


def test_what_comfyui_reads_unscaled_still_exports(scaled, tmp_path):
    """The T5 in plain (unscaled) fp8 beside the scaled transformer -- each model of a file is scaled or not
    on its own -- and an fp8 embedding table in the scaled model (ComfyUI scales Linear weights only)."""
    f = SafetensorsFile(scaled)
    t5_scales = [k for k in f.keys() if k.startswith(T5_PREFIX) and k.endswith(("scale_weight", "scaled_fp8"))]
    table = T5_PREFIX + "shared.weight"
    ok = _rewrite(scaled, tmp_path / "mixed.safetensors", t5_scales)
    assert _export(ok, tmp_path / "out").returncode == 0
    # the T5 scaled again, its embedding table in fp8 without a scale
    import ml_dtypes
    fp8_table = f.read(table).astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    names = {v: k for k, v in SAFETENSORS_DTYPES.items()}
    keys = f.keys()
    write_safetensors(str(tmp_path / "table.safetensors"), {k: f.tensors[k].shape for k in keys},
                      {k: "fp8_e4m3" if k == table else names[f.tensors[k].dtype] for k in keys},
                      lambda k, shape: fp8_table if k == table else f.read(k, raw=True))
    proc = _export(tmp_path / "table.safetensors", tmp_path / "out2")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_large_tensors_written_in_row_blocks_are_the_same_bytes(scaled, tmp_path, monkeypatch, dtype):
    """A stored tensor past onnx_writer.BLOCK_BYTES is read, decoded (scaled fp8 included) and written in blocks
    of rows; with the blocks made tiny (every weight past 1 KiB goes in parts: Flux's fused q | k | v, the T5
    embedding table, Z-Image's qkv cut in three) the data files are byte for byte those written whole, and
    those written with ordinary I/O (no O_DIRECT: macOS, Windows, a filesystem that refuses it)."""
    from click.testing import CliRunner
    from precast.compiler.demo_weights import write_components
    from precast.compiler.demo_zimage import DEMO_AXES as Z_AXES, zimage_components
    from precast.compiler import direct_io
    from precast.compiler.graphs import onnx_writer
    from precast.runtime.cli import main
    bare = tmp_path / "z_image_bf16.safetensors"
    write_components(bare, zimage_components(layout="bare"), 2, "bf16")
    z_axes = "transformer.axes_dims_rope=" + json.dumps(Z_AXES).replace(" ", "")
    runs = {"flux": (scaled, ["--component", "transformer", "--component", "text_encoder_2", "--set", AXES]),
            "zimage": (bare, ["--component", "transformer", "--set", z_axes])}
    for block in (None, 1024, "plain"):
        if block == "plain":      # ordinary reads and writes through the page cache: the same bytes
            monkeypatch.setattr(direct_io, "DIRECT", False)
        elif block:
            monkeypatch.setattr(onnx_writer, "BLOCK_BYTES", block)
        for name, (src, args) in runs.items():
            out = tmp_path / f"{name}-{block}"
            res = CliRunner().invoke(main, ["export", str(src), "--out", str(out), "--dtype", dtype, *args])
            assert res.exit_code == 0, res.output
    for name in runs:
        comps = [c.name for c in (tmp_path / f"{name}-None").iterdir() if (c / "model.onnx_data").is_file()]
        assert comps
        for comp in comps:
            whole, parts, plain = (tmp_path / f"{name}-{b}" / comp / "model.onnx_data" for b in (None, 1024, "plain"))
            assert whole.read_bytes() == parts.read_bytes() == plain.read_bytes(), (name, comp)
