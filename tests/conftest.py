import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _name in ("PRECAST_REMOTE_CACHE", "PRECAST_REMOTE_CACHE_PUSH", "PRECAST_REMOTE_CACHE_STRICT"):
    os.environ.pop(_name, None)     # no test's build reads or pushes to a remote cache the shell names


def precast(*args, check=False, env=None):
    """Run the real `precast` CLI in a subprocess; returns CompletedProcess."""
    proc = subprocess.run([sys.executable, "-m", "precast.runtime.cli", *map(str, args)], capture_output=True,
                          text=True, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        raise AssertionError(f"precast {args} failed ({proc.returncode}):\n{proc.stderr}")
    return proc


def build_recipe(folder, text: str, name: str = "bundle"):
    """`precast build` of a recipe given as YAML text, in `folder` with a cache of its own; the bundle."""
    recipe = folder / f"{name}.yaml"
    recipe.write_text(text)
    precast("build", recipe, "--out", folder / name, env={"PRECAST_CACHE": str(folder / "cache")}, check=True)
    return folder / name


def flip_byte(path, offset: int, mask: int = 0xFF) -> None:
    """Change one byte of a file in place, as bit rot or a torn write would leave it."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ mask]))


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    """max|ours - ref| / max|ref| (the issue's parity measure)."""
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    return float(np.abs(ours.astype(np.float64) - ref).max() / np.abs(ref).max())


def run_half(folder, feeds: dict, dtype: str) -> list[np.ndarray]:
    """A half-precision export (folder/model.onnx) run as a user runs it: fp16 on ONNX Runtime, its float inputs fed
    in fp16 (optimum's convention); bf16 on OpenVINO, f32 compute on the bf16 weights. Outputs as float32."""
    from pathlib import Path
    folder = Path(folder)
    if dtype == "fp16":
        import onnxruntime as ort
        sess = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
        kinds = {i.name: i.type for i in sess.get_inputs()}
        outs = sess.run(None, {k: v.astype(np.float16) if kinds[k] == "tensor(float16)" else v for k, v in feeds.items()})
    else:
        from precast.runtime.sessions import OpenVinoSession
        outs = list(OpenVinoSession(folder / "model.onnx", "CPU", {"INFERENCE_PRECISION_HINT": "f32"},
                                    from_onnx=True).run(feeds).values())
    return [np.asarray(o, np.float32) for o in outs]


@pytest.fixture(scope="session")
def demo_ckpt(tmp_path_factory):
    from precast.compiler.demo_model import write_demo_model
    path = tmp_path_factory.mktemp("demo") / "tiny.safetensors"
    write_demo_model(str(path))
    return path


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory):
    """One tiny SD 1.x bundle (text encoder, UNet, VAE decoder; ONNX Runtime and OpenVINO CPU; 64x64),
    built once per session and shared read-only: (bundle folder, the demo checkpoint it was built from).
    A test that changes the bundle works on a copy."""
    from precast.compiler.demo_model import write_demo_model
    tmp = tmp_path_factory.mktemp("tiny-bundle")
    recipe = tmp / "tiny.yaml"
    recipe.write_text("model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder]\n"
                      "profiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime, {openvino: {device: CPU}}]\n")
    precast("build", recipe, "--out", tmp / "bundle", env={"PRECAST_CACHE": str(tmp / "cache")}, check=True)
    ckpt = tmp / "demo.safetensors"
    write_demo_model(str(ckpt))  # the same seeded checkpoint the recipe's demo source names
    return tmp / "bundle", ckpt


def linear_weights(onnx_path, min_k: int = 16) -> int:
    """MatMuls of an exported graph whose B is a weight: an initializer, directly or through Transpose /
    Slice, reducing over `min_k` values or more (the quantizers' bar, quantize.MIN_K: Flux's RoPE
    frequency table [3, 8], also a constant MatMul operand, is no Linear)."""
    import onnx
    m = onnx.load(str(onnx_path), load_external_data=False)
    inits = {t.name: t for t in m.graph.initializer}
    producer = {o: n for n in m.graph.node for o in n.output}
    count = 0
    for n in m.graph.node:
        x = n.input[1] if n.op_type == "MatMul" else None
        transposed = False
        while x is not None and x not in inits and x in producer and producer[x].op_type in ("Transpose", "Slice"):
            transposed |= producer[x].op_type == "Transpose"
            x = producer[x].input[0]
        count += x in inits and inits[x].dims[1 if transposed else 0] >= min_k
    return count
