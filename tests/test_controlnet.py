"""ControlNets (issue 17): exported ControlNet graphs and the UNet with residual inputs match
diffusers' ControlNetModel and UNet2DConditionModel(down_block_additional_residuals=...,
mid_block_additional_residual=...) on tiny SD 1.x and SDXL models, for ControlNets in the LDM
layout (compiler/demo_controlnet.py; the reference reads them with diffusers' own converter) and
the diffusers layout (save_pretrained folder; a diffusers-named single file); fp32 within 1e-4.
A model exported without ControlNets is unchanged; a ControlNet of another base model is one line.
"""
import hashlib

import numpy as np
import onnxruntime as ort
import pytest
import torch
from diffusers import ControlNetModel, UNet2DConditionModel
from diffusers.loaders import single_file_utils as sfu
from safetensors.torch import load_file, save_file

import reference as ref
from conftest import precast, rel_err
from precast.compiler.demo_controlnet import TINY_HINT, write_demo_controlnet
from precast.compiler.demo_model import TINY, TINY_SDXL, write_demo_model
from precast.compiler.export import export

TOL = 1e-4
def _case(tmp, cfg, family: str, diffusers_single_file: bool):
    """(base checkpoint, diffusers UNet, [(controlnet path, name, diffusers ControlNetModel)])."""
    base = tmp / f"{family}.safetensors"
    write_demo_model(str(base), cfg, seed=3, dtype="fp32")
    unet_cfg = ref.unet_diffusers_config(cfg) if family == "sd1" else ref.unet_config_for(cfg)
    sd = {k: v.float() for k, v in load_file(str(base)).items()}
    unet = UNet2DConditionModel(**unet_cfg)
    unet.load_state_dict(sfu.convert_ldm_unet_checkpoint(sd, unet_cfg), strict=True)
    ldm = tmp / f"{family}-ldm-controlnet.safetensors"
    write_demo_controlnet(str(ldm), cfg, seed=4, dtype="fp32")
    torch.manual_seed(0)
    theirs = ref.randomize(ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=TINY_HINT), 5)
    if diffusers_single_file:      # diffusers names in one .safetensors file
        dpath = tmp / f"{family}-diffusers-controlnet.safetensors"
        save_file({k: v.contiguous() for k, v in theirs.state_dict().items()}, str(dpath))
    else:                          # a save_pretrained folder (config.json + diffusion_pytorch_model.safetensors)
        dpath = tmp / f"{family}-diffusers-controlnet"
        theirs.save_pretrained(dpath, safe_serialization=True)
    return base, unet.eval(), [(ldm, "ldm", ref.controlnet_from_ldm(ldm, unet_cfg)), (dpath, "diffusers", theirs)]


CASES = {"sd1": (TINY, False), "sdxl": (TINY_SDXL, True)}


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    cfg, single = CASES[request.param]
    base, unet, nets = _case(tmp, cfg, request.param, single)
    report = export(base, tmp / "onnx", ["unet"], progress=False, controlnets=[(p, n) for p, n, _ in nets])
    return dict(name=request.param, cfg=cfg, tmp=tmp, base=base, unet=unet, nets=nets, out=tmp / "onnx",
                report=report)


def _inputs(cfg, batch=2, h=8, w=12, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {"sample": rng.standard_normal((batch, 4, h, w)).astype(np.float32),
             "timestep": np.array([999.0, 11.5][:batch], np.float32),
             "encoder_hidden_states": rng.standard_normal((batch, 7, cfg.context_dim)).astype(np.float32)}
    if cfg.adm_in_channels:
        feeds["text_embeds"] = rng.standard_normal((batch, cfg.adm_in_channels - 6 * 256)).astype(np.float32)
        feeds["time_ids"] = np.tile(np.array([[64, 96, 0, 0, 64, 96]], np.float32), (batch, 1))
    return feeds


def _torch_kwargs(feeds):
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    kw = {"sample": t["sample"], "timestep": t["timestep"], "encoder_hidden_states": t["encoder_hidden_states"]}
    if "text_embeds" in t:
        kw["added_cond_kwargs"] = {"text_embeds": t["text_embeds"], "time_ids": t["time_ids"]}
    return kw


def _session(out, name):
    return ort.InferenceSession(str(out / name / "model.onnx"), providers=["CPUExecutionProvider"])


@torch.no_grad()
def _reference_residuals(net, feeds, image):
    down, mid = net(**_torch_kwargs(feeds), controlnet_cond=torch.from_numpy(image), conditioning_scale=1.0,
                    return_dict=False)
    return [d.numpy() for d in down], mid.numpy()


def test_io_names_and_report(case):
    comps = {c["name"]: c for c in case["report"]["components"]}
    assert set(comps) == {"unet", "controlnet_ldm", "controlnet_diffusers"}
    n = len(case["nets"][0][2].controlnet_down_blocks)
    residuals = [f"down_block_{i}_additional_residual" for i in range(n)] + ["mid_block_additional_residual"]
    extra = ["text_embeds", "time_ids"] if case["cfg"].adm_in_channels else []
    assert [i["name"] for i in comps["unet"]["inputs"]] == \
        ["sample", "timestep", "encoder_hidden_states", *extra, *residuals]
    assert comps["unet"]["config"]["control_residuals"] == n
    for name in ("controlnet_ldm", "controlnet_diffusers"):
        c = comps[name]
        assert [i["name"] for i in c["inputs"]] == ["sample", "timestep", "encoder_hidden_states", "controlnet_cond",
                                                    *extra]
        assert c["inputs"][3]["shape"] == ["batch", 3, "image_height", "image_width"]
        assert [o["name"] for o in c["outputs"]] == residuals
        assert c["config"]["control_residuals"] == n and c["config"]["hint_factor"] == 8
        assert c["config"]["family"] == case["name"]
    assert [r["name"] for r in case["report"]["controlnets"]] == ["controlnet_ldm", "controlnet_diffusers"]
    # engine profiles: the ControlNet reads latents and the image; residual sides are the latents' after l halvings
    from precast.compiler.profiles import ShapeProfile
    prof = ShapeProfile(batch=(1, 1, 1), height=(256, 512, 520), width=(512, 512, 512))
    cn = prof.input_shapes("controlnet_ldm", comps["controlnet_ldm"]["inputs"])
    assert cn["sample"][2] == (2, 4, 65, 64) and cn["controlnet_cond"][2] == (2, 3, 520, 512)
    un = prof.input_shapes("unet", comps["unet"]["inputs"])
    assert un[residuals[-1]] == ((2, case["cfg"].model_channels * 2, 8, 16), (2, case["cfg"].model_channels * 2, 16, 16),
                                 (2, case["cfg"].model_channels * 2, 17, 16))


@pytest.mark.parametrize("layout", ["ldm", "diffusers"])
def test_controlnet_residuals_match_diffusers(case, layout):
    _, name, net = next(x for x in case["nets"] if x[1] == layout)
    sess = _session(case["out"], f"controlnet_{name}")
    for batch, h, w in ((2, 8, 12), (1, 16, 8)):
        feeds = _inputs(case["cfg"], batch, h, w, seed=h)
        image = np.random.default_rng(1).uniform(0, 1, (batch, 3, 8 * h, 8 * w)).astype(np.float32)
        want_down, want_mid = _reference_residuals(net, feeds, image)
        got = sess.run(None, {**feeds, "controlnet_cond": image})
        assert len(got) == len(want_down) + 1
        errs = [rel_err(g, w_) for g, w_ in zip(got, [*want_down, want_mid])]
        assert max(errs) <= TOL, (layout, batch, h, w, errs)


@torch.no_grad()
def test_unet_with_residuals_matches_diffusers(case):
    """The residual UNet fed diffusers' residuals (two nets, scaled and summed as a pipeline does)
    equals diffusers' UNet given the same residuals."""
    feeds = _inputs(case["cfg"])
    image = np.random.default_rng(2).uniform(0, 1, (2, 3, 64, 96)).astype(np.float32)
    (d1, m1), (d2, m2) = (_reference_residuals(net, feeds, image) for _, _, net in case["nets"])
    down = [0.8 * a + 0.5 * b for a, b in zip(d1, d2)]
    mid = 0.8 * m1 + 0.5 * m2
    want = case["unet"](**_torch_kwargs(feeds), down_block_additional_residuals=tuple(map(torch.from_numpy, down)),
                        mid_block_additional_residual=torch.from_numpy(mid)).sample.numpy()
    plain = case["unet"](**_torch_kwargs(feeds)).sample.numpy()
    assert rel_err(plain, want) > 1e-2          # the residuals matter
    res = {f"down_block_{i}_additional_residual": d for i, d in enumerate(down)}
    (got,) = _session(case["out"], "unet").run(None, {**feeds, **res, "mid_block_additional_residual": mid})
    assert rel_err(got, want) <= TOL


# sha256 of unet/model.onnx and model.onnx_data exported from the demo checkpoint (`precast demo-model`,
# fp32) by the code before ControlNets existed: an export without ControlNets must not change by a byte.
# (If the UNet graph is changed on purpose, update these.)
PLAIN_UNET = {"model.onnx": "dbc771a0623335206ede35f53d5ecf5369b9fc1fade0d0387e8289af81a1ae00",
              "model.onnx_data": "0165540bb8291193558a05560c703d1d83c038287ca3819a09e0b1fae0e1693b"}


def _digests(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_export_without_controlnets_is_unchanged(demo_ckpt, tmp_path):
    plain = export(demo_ckpt, tmp_path / "plain", progress=False)
    got = _digests(tmp_path / "plain" / "unet")
    assert {k: got[k] for k in PLAIN_UNET} == PLAIN_UNET
    unet = next(c for c in plain["components"] if c["name"] == "unet")
    assert [i["name"] for i in unet["inputs"]] == ["sample", "timestep", "encoder_hidden_states"]
    assert "control_residuals" not in unet["config"] and "controlnets" not in plain
    # with a ControlNet: the UNet gains the inputs, every other component is byte for byte the same
    net = tmp_path / "canny.safetensors"
    write_demo_controlnet(str(net), TINY, seed=1)
    with_cn = export(demo_ckpt, tmp_path / "with", progress=False, controlnets=[(net, None)])
    assert [c["name"] for c in with_cn["components"]][-1] == "controlnet_canny"
    a, b = _digests(tmp_path / "plain"), _digests(tmp_path / "with")
    same = [k for k in a if not k.startswith(("unet/", "precast_export.json"))]
    assert same and all(a[k] == b[k] for k in same)
    assert a["unet/model.onnx"] != b["unet/model.onnx"]


def test_controlnet_of_another_base_model_is_one_line(tmp_path):
    xl = tmp_path / "xl.safetensors"
    write_demo_model(str(xl), TINY_SDXL, seed=0, dtype="fp16")
    net = tmp_path / "sd15_canny.safetensors"
    write_demo_controlnet(str(net), TINY)
    proc = precast("export", xl, "--out", tmp_path / "o", "--controlnet", net)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(net) in lines[0] and str(xl) in lines[0] and "family" in lines[0], lines
    assert not (tmp_path / "o").exists()
    # same family, other widths: the field is named
    other = tmp_path / "wide.safetensors"
    write_demo_controlnet(str(other), TINY.__class__(model_channels=64))
    sd1 = tmp_path / "sd1.safetensors"
    write_demo_model(str(sd1))
    proc = precast("export", sd1, "--out", tmp_path / "o2", "--controlnet", other)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1
    assert "model_channels" in proc.stderr and str(other) in proc.stderr and str(sd1) in proc.stderr
