"""LoRA merged while weights stream into the ONNX: parity with diffusers' load_lora_weights +
fuse_lora (torch CPU) for random kohya, LoCon and PEFT LoRAs, single and stacked with different
strengths (merged weights within 1e-5 of max|ref|, component outputs within 1e-4); LoHa / LoKr /
DoRA against the formulas computed here in numpy; name resolution for every spelling; unmatched
keys and shape mismatches refused with nothing written; cache keys / manifests carry digests."""
import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper
from safetensors.numpy import save_file

from conftest import precast, rel_err
from precast.compiler.demo_model import TINY
from precast.compiler.errors import BadInput
from precast.compiler.export import export
from precast.compiler.sources.checkpoint import TEXT, UNET, open_checkpoint
from precast.compiler.sources.diffusers_names import unet_names
from precast.compiler.sources.lora_names import build_name_table
import reference as ref

WEIGHT_TOL, OUTPUT_TOL = 1e-5, 1e-4


# ---- LoRA files, written from the diffusers / transformers module lists (not from our table) -----

def _pair(rng, out_dim, in_shape, rank, up_tail=()):
    down = rng.standard_normal((rank, *in_shape)).astype(np.float32) * 0.2
    up = rng.standard_normal((out_dim, rank, *up_tail)).astype(np.float32) * 0.2
    return down, up


def _te_name(name):
    return name if name.startswith("text_model.") else "text_model." + name


def write_kohya(path, unet, te, seed, conv=False, rank=4, alpha=2.0):
    """kohya names over diffusers module paths (as SD 1.x kohya LoRAs have them). conv=True: LoCon
    (resnet / sampler convs 3x3 down + 1x1 up, 1x1 projections, time embedding projections)."""
    rng = np.random.default_rng(seed)
    sd = {}

    def add(key, down, up):
        sd[key + ".lora_down.weight"], sd[key + ".lora_up.weight"] = down, up
        sd[key + ".alpha"] = np.array(alpha, np.float32)

    for name, mod in unet.named_modules():
        key = "lora_unet_" + name.replace(".", "_")
        if isinstance(mod, torch.nn.Linear) and ".attentions." in name and not conv:
            add(key, *_pair(rng, mod.out_features, (mod.in_features,), rank))
        elif conv and isinstance(mod, torch.nn.Conv2d) and ("resnets" in name or "samplers" in name or "proj_" in name):
            k = mod.kernel_size[0]
            add(key, *_pair(rng, mod.out_channels, (mod.in_channels, k, k), rank, (1, 1)))
        elif conv and isinstance(mod, torch.nn.Linear) and "time_emb_proj" in name:
            add(key, *_pair(rng, mod.out_features, (mod.in_features,), rank))
    if not conv:
        for name, mod in te.named_modules():
            if isinstance(mod, torch.nn.Linear):
                add("lora_te_" + _te_name(name).replace(".", "_"), *_pair(rng, mod.out_features, (mod.in_features,), rank))
    save_file(sd, str(path))
    return path


def write_peft(folder, seed):
    """A diffusers-format LoRA written by diffusers itself from PEFT adapters (alpha in metadata)."""
    from diffusers import StableDiffusionPipeline
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict
    unet, _, te = _models()
    torch.manual_seed(seed)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                target_modules=["to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2", "conv1"]))
    te.add_adapter(LoraConfig(r=2, lora_alpha=3, init_lora_weights=False,
                              target_modules=["q_proj", "k_proj", "v_proj", "out_proj", "fc1"]))
    StableDiffusionPipeline.save_lora_weights(
        str(folder), unet_lora_layers=get_peft_model_state_dict(unet), text_encoder_lora_layers=get_peft_model_state_dict(te),
        unet_lora_adapter_metadata=unet.peft_config["default"].to_dict(),
        text_encoder_lora_adapter_metadata=te.peft_config["default"].to_dict())
    return folder / "pytorch_lora_weights.safetensors"


_DEMO = {}


def _models():
    """Fresh diffusers / transformers models holding the demo weights (converted once, then copied)."""
    import copy
    if "models" not in _DEMO:
        _DEMO["models"] = ref.models_from_single_file(_DEMO["path"], TINY)
    return tuple(copy.deepcopy(m) for m in _DEMO["models"])


@pytest.fixture(scope="module")
def loras(demo_ckpt, tmp_path_factory):
    _DEMO["path"] = demo_ckpt
    tmp = tmp_path_factory.mktemp("loras")
    unet, _, te = _models()
    return {"kohya": write_kohya(tmp / "kohya.safetensors", unet, te, 1),
            "locon": write_kohya(tmp / "locon.safetensors", unet, te, 2, conv=True),
            "peft": write_peft(tmp / "peft", 3), "tmp": tmp}


def _fused_reference(stack):
    """diffusers' own merge: load_lora_weights each, set_adapters with per-component strengths, fuse_lora."""
    from diffusers import PNDMScheduler, StableDiffusionPipeline
    unet, vae, te = _models()
    pipe = StableDiffusionPipeline(vae=vae, text_encoder=te, tokenizer=None, unet=unet, scheduler=PNDMScheduler(),
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    names = []
    for i, (path, s, ts) in enumerate(stack):
        pipe.load_lora_weights(str(path), adapter_name=f"l{i}")
        names.append(f"l{i}")
    pipe.set_adapters(names, adapter_weights=[{"unet": s, "text_encoder": s if ts is None else ts}
                                              for _, s, ts in stack])
    pipe.fuse_lora(adapter_names=names)
    pipe.unload_lora_weights()
    return unet.eval(), te.eval()


def _initializers(folder):
    m = onnx.load(str(folder / "model.onnx"))
    return {i.name: numpy_helper.to_array(i, base_dir=str(folder)) for i in m.graph.initializer}


CASES = {
    "kohya": [("kohya", 0.8, 0.5)],
    "locon": [("locon", 1.0, None)],
    "peft": [("peft", 0.7, None)],
    "kohya+locon+peft": [("kohya", 0.6, 1.2), ("locon", -0.5, None), ("peft", 1.3, 0.4)],
}


@pytest.mark.parametrize("case", list(CASES))
def test_parity_with_diffusers_fuse_lora(loras, demo_ckpt, tmp_path, case):
    stack = [(loras[name], s, ts) for name, s, ts in CASES[case]]
    out = tmp_path / "onnx"
    report = export(demo_ckpt, out, ["text_encoder", "unet"], progress=False, loras=stack)
    assert [(d["strength"], d["te_strength"]) for d in report["loras"]] == \
        [(s, s if ts is None else ts) for _, s, ts in stack]
    assert all(d["unmatched"] == [] and d["weights"] > 0 for d in report["loras"])
    unet, te = _fused_reference(stack)
    base_unet, _, base_te = _models()

    ours = _initializers(out / "unet")
    ref_sd = {k: v.detach().numpy() for k, v in unet.state_dict().items()}
    base_sd = {k: v.detach().numpy() for k, v in base_unet.state_dict().items()}
    names = unet_names(list(ref_sd))
    changed = 0
    for dk, want in ref_sd.items():
        got = ours[names[dk]].reshape(want.shape)
        assert rel_err(got, want) <= WEIGHT_TOL, dk
        changed += not np.array_equal(want, base_sd[dk])
    assert changed >= 20  # the LoRA did change the reference

    ours_te = _initializers(out / "text_encoder")
    te_sd = {k.removeprefix("text_model."): v.detach().numpy() for k, v in te.state_dict().items()}
    base_te_sd = {k.removeprefix("text_model."): v.detach().numpy() for k, v in base_te.state_dict().items()}
    for k, want in te_sd.items():
        if k in ours_te:
            assert rel_err(ours_te[k], want) <= WEIGHT_TOL, k
    if case != "locon":
        assert any(not np.array_equal(te_sd[k], base_te_sd[k]) for k in ours_te if k in te_sd)

    rng = np.random.default_rng(0)
    sample = rng.standard_normal((2, 4, 16, 16)).astype(np.float32)
    t = np.array([999.0, 10.0], np.float32)
    ctx = rng.standard_normal((2, 77, TINY.context_dim)).astype(np.float32)
    sess = ort.InferenceSession(str(out / "unet/model.onnx"), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"sample": sample, "timestep": t, "encoder_hidden_states": ctx})
    assert rel_err(got, ref.run_unet(unet, sample, t, ctx)) <= OUTPUT_TOL
    ids = np.full((1, 77), 49407, np.int32)
    ids[0, :6] = [49406, 320, 1125, 539, 2368, 49407]
    sess = ort.InferenceSession(str(out / "text_encoder/model.onnx"), providers=["CPUExecutionProvider"])
    got_h, _ = sess.run(None, {"input_ids": ids, "token_embeddings_extra": np.zeros((1, TINY.context_dim), np.float32)})
    assert rel_err(got_h, ref.run_text_encoder(te, ids)[0]) <= OUTPUT_TOL


# ---- LoHa / LoKr / DoRA / LoCon-Tucker / full diff against numpy formulas ------------------------

def _lyco_case(tmp, kind):
    """A LyCORIS-style file on a few weights, and the expected merged values computed here."""
    ckpt = open_checkpoint(_DEMO["path"])
    rng = np.random.default_rng(7)
    lin = UNET + "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"      # [32, 32]
    conv = UNET + "input_blocks.1.0.in_layers.2.weight"                        # [32, 32, 3, 3]
    te = TEXT + "encoder.layers.1.mlp.fc1.weight"                               # [256, 64]
    names = {lin: "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q",
             conv: "lora_unet_down_blocks_0_resnets_0_conv1",
             te: "lora_te_text_model_encoder_layers_1_mlp_fc1"}
    sd, want = {}, {}
    strength, te_strength = 0.75, 1.5
    r = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.3  # noqa: E731
    for key, name in names.items():
        w = ckpt.read(key).astype(np.float64)
        out_dim, rest = w.shape[0], w.shape[1:]
        s = te_strength if key.startswith(TEXT) else strength
        if kind == "loha":
            a1, b1, a2, b2 = r(out_dim, 3), r(3, int(np.prod(rest))), r(out_dim, 3), r(3, int(np.prod(rest)))
            sd.update({f"{name}.hada_w1_a": a1, f"{name}.hada_w1_b": b1, f"{name}.hada_w2_a": a2,
                       f"{name}.hada_w2_b": b2, f"{name}.alpha": np.array(1.5, np.float32)})
            delta = ((a1.astype(np.float64) @ b1) * (a2.astype(np.float64) @ b2)).reshape(w.shape) * (1.5 / 3)
            want[key] = w + s * delta
        elif kind == "lokr":
            f1 = 4
            w1 = r(f1, f1)
            w2a, w2b = r(out_dim // f1, 2), r(2, rest[0] // f1, *rest[1:])
            sd.update({f"{name}.lokr_w1": w1, f"{name}.lokr_w2_a": w2a, f"{name}.lokr_w2_b": w2b,
                       f"{name}.alpha": np.array(3.0, np.float32)})
            w2 = np.einsum("or,r...->o...", w2a.astype(np.float64), w2b)
            w1e = w1.astype(np.float64).reshape(w1.shape + (1,) * (w2.ndim - 2))
            delta = np.einsum("ab...,cd...->acbd...", w1e, w2).reshape(w.shape) * (3.0 / 2)
            want[key] = w + s * delta
        elif kind in ("dora", "dora_in"):
            down, up = r(4, *rest), r(out_dim, 4, *(1,) * (len(rest) - 1))
            delta = (up.reshape(out_dim, 4).astype(np.float64) @ down.reshape(4, -1)).reshape(w.shape) * (2.0 / 4)
            wc = w + delta
            if kind == "dora":
                norm = np.sqrt((wc.reshape(out_dim, -1) ** 2).sum(1)).reshape((out_dim,) + (1,) * (w.ndim - 1))
                m = (norm * rng.uniform(0.5, 1.5, norm.shape)).astype(np.float32)
            else:
                norm = np.sqrt((np.swapaxes(wc, 0, 1).reshape(w.shape[1], -1) ** 2).sum(1))
                norm = norm.reshape((1, w.shape[1]) + (1,) * (w.ndim - 2))
                m = (norm * rng.uniform(0.5, 1.5, norm.shape)).astype(np.float32)
            sd.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                       f"{name}.alpha": np.array(2.0, np.float32), f"{name}.dora_scale": m})
            want[key] = w + s * (wc * (m / norm) - w)
        elif kind == "tucker":
            if len(rest) != 3:
                continue
            down, mid, up = r(4, rest[0], 1, 1), r(4, 4, 3, 3), r(out_dim, 4, 1, 1)
            sd.update({f"{name}.lora_down.weight": down, f"{name}.lora_mid.weight": mid,
                       f"{name}.lora_up.weight": up})
            delta = np.einsum("oa,abkl,bc->ockl", up[:, :, 0, 0].astype(np.float64), mid, down[:, :, 0, 0])
            want[key] = w + s * delta
        elif kind == "full":
            d = r(*w.shape)
            sd[f"{name}.diff"] = d
            want[key] = w + s * d
            bkey = key[:-len("weight")] + "bias"
            if bkey in ckpt.refs:
                sd[f"{name}.diff_b"] = db = r(out_dim)
                want[bkey] = ckpt.read(bkey).astype(np.float64) + s * db
    path = tmp / f"{kind}.safetensors"
    save_file(sd, str(path))
    return path, want, strength, te_strength


@pytest.mark.parametrize("kind", ["loha", "lokr", "dora", "dora_in", "tucker", "full"])
def test_lycoris_and_dora_match_numpy_formulas(loras, demo_ckpt, tmp_path, kind):
    path, want, s, ts = _lyco_case(tmp_path, kind)
    out = tmp_path / "onnx"
    export(demo_ckpt, out, ["text_encoder", "unet"], progress=False, loras=[(path, s, ts)])
    ours = {**{UNET + k: v for k, v in _initializers(out / "unet").items()},
            **{TEXT + k: v for k, v in _initializers(out / "text_encoder").items()}}
    assert want
    for key, w in want.items():
        assert rel_err(ours[key].reshape(w.shape), w) <= WEIGHT_TOL, key


# ---- names ---------------------------------------------------------------------------------------

def test_every_spelling_resolves_to_the_same_weight(demo_ckpt):
    ckpt = open_checkpoint(demo_ckpt)
    table = build_name_table({k: r.shape for k, r in ckpt.refs.items()})
    q = UNET + "input_blocks.4.1.transformer_blocks.0.attn1.to_q.weight"
    out = UNET + "output_blocks.5.1.transformer_blocks.0.attn2.to_out.0.weight"
    up = UNET + "output_blocks.2.1.conv.weight"
    for spelling, key in [
        ("lora_unet_down_blocks_1_attentions_0_transformer_blocks_0_attn1_to_q", q),
        ("lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q", q),
        ("unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q", q),
        ("unet.down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor.to_q", q),
        ("down_blocks.1.attentions.0.transformer_blocks.0.attn1.processor.to_q", q),
        ("diffusion_model.input_blocks.4.1.transformer_blocks.0.attn1.to_q", q),
        ("unet.up_blocks.1.attentions.2.transformer_blocks.0.attn2.processor.to_out", out),
        ("lora_unet_up_blocks_1_attentions_2_transformer_blocks_0_attn2_to_out_0", out),
        ("lora_unet_up_blocks_0_upsamplers_0_conv", up),
        ("lora_unet_output_blocks_2_1_conv", up),
        ("lora_te_text_model_encoder_layers_1_self_attn_out_proj", TEXT + "encoder.layers.1.self_attn.out_proj.weight"),
        ("text_encoder.text_model.encoder.layers.0.self_attn.to_k", TEXT + "encoder.layers.0.self_attn.k_proj.weight"),
        ("text_encoder.encoder.layers.0.mlp.fc2", TEXT + "encoder.layers.0.mlp.fc2.weight"),
    ]:
        t = table.lookup(spelling)
        assert t is not None and t.key == key, spelling
    assert not table.ambiguous
    # The diffusers names derived for the table agree with a real diffusers UNet's parameters.
    unet, _, _ = ref.models_from_single_file(demo_ckpt, TINY)
    params = dict(unet.named_parameters())
    ldm = unet_names(list(params))
    for name, p in params.items():
        if name.endswith(".weight") and p.ndim >= 2:
            for spelling in ("unet." + name[:-len(".weight")], "lora_unet_" + name[:-len(".weight")].replace(".", "_")):
                t = table.lookup(spelling)
                assert t is not None and t.key == UNET + ldm[name], spelling


def test_openclip_fused_qkv_rows(tmp_path):
    """SD 2.x / SDXL OpenCLIP: q/k/v LoRAs patch row blocks of the fused in_proj weight."""
    shapes = {"conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight": (192, 64),
              "conditioner.embedders.1.model.transformer.resblocks.0.attn.out_proj.weight": (64, 64)}
    table = build_name_table(shapes)
    k = table.lookup("lora_te2_text_model_encoder_layers_0_self_attn_k_proj")
    assert (k.key, k.rows) == ("conditioner.embedders.1.model.transformer.resblocks.0.attn.in_proj_weight", (64, 128))
    from precast.compiler.lora_merge import LoraSpec, plan_merge
    rng = np.random.default_rng(0)
    down, up = rng.standard_normal((2, 64)).astype(np.float32), rng.standard_normal((64, 2)).astype(np.float32)
    save_file({"lora_te2_text_model_encoder_layers_0_self_attn_v_proj.lora_down.weight": down,
               "lora_te2_text_model_encoder_layers_0_self_attn_v_proj.lora_up.weight": up}, str(tmp_path / "l.safetensors"))
    plan = plan_merge(shapes, [LoraSpec(str(tmp_path / "l.safetensors"), 0.5, 2.0)])
    base = rng.standard_normal((192, 64)).astype(np.float32)
    got = plan.apply(next(iter(shapes)), base)
    np.testing.assert_allclose(got[:128], base[:128])
    np.testing.assert_allclose(got[128:], base[128:] + 2.0 * up @ down, rtol=1e-5, atol=1e-5)


# ---- refusals: nothing written --------------------------------------------------------------------

def test_unmatched_keys_are_listed_and_nothing_is_written(loras, demo_ckpt, tmp_path):
    bad = tmp_path / "other.safetensors"
    rng = np.random.default_rng(0)
    save_file({"lora_unet_down_blocks_9_attentions_0_proj_in.lora_down.weight": rng.standard_normal((4, 32), dtype=np.float32),
               "lora_unet_down_blocks_9_attentions_0_proj_in.lora_up.weight": rng.standard_normal((32, 4), dtype=np.float32),
               "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight":
                   rng.standard_normal((4, 32), dtype=np.float32),
               "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight":
                   rng.standard_normal((32, 4), dtype=np.float32),
               "something_else.weight": np.zeros(3, np.float32)}, str(bad))
    out = tmp_path / "out"
    proc = precast("export", demo_ckpt, "--out", out, "--component", "unet", "--lora", f"{bad}:0.5")
    assert proc.returncode == 2, proc.stderr
    assert "down_blocks_9_attentions_0_proj_in.lora_down.weight" in proc.stderr
    assert "something_else.weight" in proc.stderr and "--allow-unmatched" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists() and not list(tmp_path.glob(".out*"))
    proc = precast("export", demo_ckpt, "--out", out, "--component", "unet", "--lora", f"{bad}:0.5",
                   "--allow-unmatched", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "warning:" in proc.stderr and "down_blocks_9_attentions_0_proj_in" in proc.stderr
    (lora,) = json.loads(proc.stdout)["loras"]
    assert lora["strength"] == 0.5 and lora["weights"] == 1 and len(lora["unmatched"]) == 3


def test_shape_mismatch_names_both_shapes_and_the_weight(demo_ckpt, tmp_path):
    bad = tmp_path / "wide.safetensors"
    save_file({"lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_down.weight": np.zeros((4, 48), np.float32),
               "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q.lora_up.weight": np.zeros((48, 4), np.float32)},
              str(bad))
    out = tmp_path / "out"
    proc = precast("export", demo_ckpt, "--out", out, "--lora", bad)
    assert proc.returncode == 2
    assert "[48, 48]" in proc.stderr and "[32, 32]" in proc.stderr
    assert "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight" in proc.stderr
    assert not out.exists()
    with pytest.raises(BadInput, match="pickled LoRA refused"):
        (tmp_path / "x.pt").write_bytes(b"\x80\x04K\x01.")
        export(demo_ckpt, out, ["unet"], progress=False, loras=[(tmp_path / "x.pt", 1.0)])
    assert not out.exists()


# ---- cache keys and manifests ---------------------------------------------------------------------

def test_bundle_manifest_and_cache_key_carry_lora_digest_and_strength(loras, tmp_path):
    from precast.compiler.bundle import build_bundle
    from precast.compiler.cache import Cache
    from precast.compiler.recipe import load_recipe
    from precast.runtime.manifest import read_manifest, sha256_file
    cache = Cache(tmp_path / "cache")

    def build(strength, name):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(f"model: {{source: 'demo:tiny-sd15'}}\ncomponents: [unet]\n"
                          f"loras: [{{path: {loras['kohya']}, strength: {strength}, te_strength: 0.25}}]\n"
                          "profiles: {height: 64, width: 64}\ntargets: [onnxruntime]\n")
        build_bundle(load_recipe(recipe), tmp_path / name, progress=False, cache=cache)
        return read_manifest(tmp_path / name)

    a = build(0.5, "a")
    assert a.model["loras"] == [{"name": "kohya", "sha256": sha256_file(loras["kohya"]), "strength": 0.5,
                                 "te_strength": 0.25}]
    b = build(0.9, "b")
    assert b.model["loras"][0]["strength"] == 0.9
    data = "onnx/unet/model.onnx_data"
    assert a.files[data]["sha256"] != b.files[data]["sha256"]  # another strength: another export, other weights
    exports = [e for e in cache.list() if e.metadata.get("kind") == "export"]
    assert len(exports) == 2  # the cache key tells the two apart


# ---- swap without a re-export ---------------------------------------------------------------------

def test_openvino_swap_a_to_b_equals_a_fresh_build_with_b(loras, demo_ckpt, tmp_path):
    from precast.compiler.lora_swap import OpenVinoLoraEngine
    export(demo_ckpt, tmp_path / "base", ["unet"], progress=False)
    export(demo_ckpt, tmp_path / "b", ["unet"], progress=False, loras=[(loras["locon"], 0.8)])
    cfg = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32"}
    rng = np.random.default_rng(0)
    feeds = {"sample": rng.standard_normal((1, 4, 8, 8)).astype(np.float32), "timestep": np.array([500.0], np.float32),
             "encoder_hidden_states": rng.standard_normal((1, 77, TINY.context_dim)).astype(np.float32)}
    engine = OpenVinoLoraEngine(tmp_path / "base/unet/model.onnx", config=cfg)
    base = engine.run(feeds)["out_sample"]
    engine.set_loras([(loras["kohya"], 1.0), (loras["peft"], 0.5)])                    # A (a stack)
    a = engine.run(feeds)["out_sample"]
    timing = engine.set_loras([(loras["locon"], 0.8)])                                  # A -> B
    want = OpenVinoLoraEngine(tmp_path / "b/unet/model.onnx", config=cfg).run(feeds)["out_sample"]
    got = engine.run(feeds)["out_sample"]
    assert rel_err(a, base) > 1e-2 and timing["weights"] > 0
    assert rel_err(got, want) <= 1e-5  # A's weights went back to base, not B on top of A
    engine.set_loras([])
    assert rel_err(engine.run(feeds)["out_sample"], base) <= 1e-6


def test_tensorrt_rtx_refit_error_path(loras, demo_ckpt, tmp_path):
    """Refit needs a GPU driver; here only its refusal is checked (the refit itself is unverified)."""
    from precast.compiler.lora_swap import refit_tensorrt_rtx
    export(demo_ckpt, tmp_path / "base", ["unet"], progress=False)
    with pytest.raises(BadInput, match="no engine"):
        refit_tensorrt_rtx(None, tmp_path / "base/unet/model.onnx", [])


# ---- damaged LoRA files and bad strengths: exit 2, one line naming the file and the key ------------

Q = "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_q"
P = "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"


def _kohya(**extra):
    rng = np.random.default_rng(0)
    return {Q + ".lora_down.weight": rng.standard_normal((4, 32), dtype=np.float32),
            Q + ".lora_up.weight": rng.standard_normal((32, 4), dtype=np.float32), **extra}


def _peft(meta):
    rng = np.random.default_rng(0)
    return ({P + ".lora_A.weight": rng.standard_normal((4, 32), dtype=np.float32),
             P + ".lora_B.weight": rng.standard_normal((32, 4), dtype=np.float32)},
            {"lora_adapter_metadata": json.dumps(meta)})


BAD_LORAS = {
    "rank0": ({Q + ".lora_down.weight": np.zeros((0, 32), np.float32),
               Q + ".lora_up.weight": np.zeros((32, 0), np.float32)}, None, Q + ".lora_down.weight"),
    "alpha_empty": (_kohya(**{Q + ".alpha": np.zeros((0,), np.float32)}), None, Q + ".alpha"),
    "alpha_vector": (_kohya(**{Q + ".alpha": np.ones((3,), np.float32)}), None, Q + ".alpha"),
    "alpha_nan": (_kohya(**{Q + ".alpha": np.array(np.nan, np.float32)}), None, Q + ".alpha"),
    "alpha_inf": (_kohya(**{Q + ".alpha": np.array(np.inf, np.float32)}), None, Q + ".alpha"),
    "down_nan": (_kohya(**{Q + ".lora_down.weight": np.full((4, 32), np.nan, np.float32)}), None,
                 Q + ".lora_down.weight"),
    "peft_alpha_str": (*_peft({"lora_alpha": "abc"}), "lora_alpha"),
    "peft_alpha_list": (*_peft({"lora_alpha": [1]}), "lora_alpha"),
    "peft_alpha_nan": (*_peft({"unet.lora_alpha": float("nan")}), "unet.lora_alpha"),
    "peft_pattern_badre": (*_peft({"alpha_pattern": {"(": 3}}), "alpha_pattern"),
    "peft_pattern_list": (*_peft({"alpha_pattern": [1, 2]}), "alpha_pattern"),
    "peft_pattern_value": (*_peft({"alpha_pattern": {"to_q": "x"}}), "alpha_pattern"),
    "peft_pattern_regex": (*_peft({"alpha_pattern": {"to_q+": 3}}), "alpha_pattern"),
    "peft_alpha_huge": (*_peft({"lora_alpha": 1e308}), "lora_alpha"),
    "peft_alpha_bigint": (*_peft({"lora_alpha": 10 ** 400}), "lora_alpha"),
    "peft_meta_deep": (_peft({})[0], {"lora_adapter_metadata": "[" * 100000 + "]" * 100000}, "lora_adapter_metadata"),
    "int_factors": ({Q + ".lora_down.weight": np.ones((4, 32), np.int32),
                     Q + ".lora_up.weight": np.ones((32, 4), np.int32)}, None, Q + ".lora_down.weight"),
    "alpha_bool": (_kohya(**{Q + ".alpha": np.array(True)}), None, Q + ".alpha"),
    "loha_vector": ({Q + ".hada_w1_a": np.ones((32,), np.float32), Q + ".hada_w1_b": np.ones((4, 32), np.float32),
                     Q + ".hada_w2_a": np.ones((32, 4), np.float32), Q + ".hada_w2_b": np.ones((4, 32), np.float32)},
                    None, "are not all matrices"),
    "lokr_vector": ({Q + ".lokr_w1_a": np.ones((4,), np.float32), Q + ".lokr_w1_b": np.ones((4, 4), np.float32),
                     Q + ".lokr_w2": np.ones((8, 8), np.float32)}, None, "lokr_w1_a [4]"),
    "lokr_scalar": ({Q + ".lokr_w1": np.ones((4, 4), np.float32), Q + ".lokr_w2": np.array(1.0, np.float32)},
                    None, "lokr_w2 [] is not a matrix"),
    "alpha_overflow": (_kohya(**{Q + ".alpha": np.array(3e38, np.float32)}), None,
                       UNET + "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"),
    "factors_overflow": (_kohya(**{Q + ".lora_down.weight": np.full((4, 32), 1e30, np.float32),
                                   Q + ".lora_up.weight": np.full((32, 4), 1e30, np.float32)}), None,
                         UNET + "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"),
}


@pytest.mark.parametrize("case", sorted(BAD_LORAS))
def test_damaged_lora_is_one_error_line_naming_file_and_key(demo_ckpt, tmp_path, case):
    tensors, meta, key = BAD_LORAS[case]
    bad = tmp_path / f"{case}.safetensors"
    save_file(tensors, str(bad), metadata=meta)
    out = tmp_path / "out"
    proc = precast("export", demo_ckpt, "--out", out, "--component", "unet", "--lora", bad)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and key in lines[0], proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".out*"))


@pytest.mark.parametrize("args, words", [
    (("{lora}:nan",), "finite"), (("{lora}:inf",), "finite"), (("{lora}:-inf",), "finite"),
    (("{lora}", "--lora-te-strength", "nan"), "finite"), (("{lora}", "--lora-te-strength", "inf"), "finite"),
    (("{lora}:1e39",), "float32"), (("{lora}:-1e39",), "float32"),      # finite in Python, inf in float32
    (("{lora}", "--lora-te-strength", "1e39"), "float32")])
def test_strength_that_is_not_a_finite_float32_is_refused(demo_ckpt, tmp_path, args, words):
    good = tmp_path / "good.safetensors"
    save_file(_kohya(**{Q + ".alpha": np.array(2.0, np.float32)}), str(good))
    out = tmp_path / "out"
    proc = precast("export", demo_ckpt, "--out", out, "--component", "unet",
                   "--lora", *(a.format(lora=good) for a in args))
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    flag = "--lora-te-strength" if "--lora-te-strength" in args else f"--lora {good}"
    assert len(lines) == 1 and flag in lines[0] and words in lines[0], proc.stderr
    assert not out.exists()


def test_alpha_with_a_huge_empty_shape_is_one_error_line(demo_ckpt, tmp_path):
    """A header may claim shape [10**30, 0] (zero bytes, so it parses): counted in Python ints."""
    import struct
    down, up = _kohya()[Q + ".lora_down.weight"], _kohya()[Q + ".lora_up.weight"]
    header = {Q + ".lora_down.weight": {"dtype": "F32", "shape": [4, 32], "data_offsets": [0, 512]},
              Q + ".lora_up.weight": {"dtype": "F32", "shape": [32, 4], "data_offsets": [512, 1024]},
              Q + ".alpha": {"dtype": "F32", "shape": [10 ** 30, 0], "data_offsets": [1024, 1024]}}
    blob = json.dumps(header).encode()
    bad = tmp_path / "alpha_huge_shape.safetensors"
    bad.write_bytes(struct.pack("<Q", len(blob)) + blob + down.tobytes() + up.tobytes())
    out = tmp_path / "out"
    proc = precast("export", demo_ckpt, "--out", out, "--component", "unet", "--lora", bad)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and Q + ".alpha" in lines[0], proc.stderr
    assert not out.exists()


def test_alpha_pattern_cannot_hang_the_export(demo_ckpt, tmp_path):
    """A catastrophic-backtracking regex as an alpha_pattern key is refused by name, at once."""
    import subprocess
    import sys
    bad = tmp_path / "redos.safetensors"
    tensors, meta = _peft({"alpha_pattern": {"(.*.*)*Z": 3}})
    save_file(tensors, str(bad), metadata=meta)
    out = tmp_path / "out"
    try:
        proc = subprocess.run([sys.executable, "-m", "precast.runtime.cli", "export", str(demo_ckpt), "--out",
                               str(out), "--component", "unet", "--lora", str(bad)],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("an alpha_pattern regex hung the export")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and "(.*.*)*Z" in lines[0], proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("meta, scale", [
    ({"lora_alpha": 4}, 1.0),
    ({"lora_alpha": 4, "alpha_pattern": {"attn1.to_q": 8}}, 2.0),                       # dotted suffix
    ({"lora_alpha": 4, "alpha_pattern": {"to_q": 8, "attn1.to_q": 12}}, 2.0),           # first match wins
    ({"lora_alpha": 4, "alpha_pattern": {"o_q": 8}}, 1.0),                              # suffixes start at a dot
    ({"lora_alpha": 4, "alpha_pattern": {"^down_blocks.0.*.to_q$": 12}}, 3.0),          # anchored, wildcard
    ({"lora_alpha": 4, "alpha_pattern": {"^attn1.to_q": 12}}, 1.0),                     # anchored: whole path
    ({"unet.lora_alpha": 4, "unet.alpha_pattern": {"transformer_blocks.0.attn1.to_q": 2}}, 0.5),
])
def test_alpha_pattern_follows_peft_module_matching(tmp_path, meta, scale):
    """PEFT's rule (re.match(rf"(.*\\.)?({key})$", module), first key wins) without a regex."""
    from precast.compiler.lora_merge import LoraSpec, plan_merge
    key = UNET + "input_blocks.1.1.transformer_blocks.0.attn1.to_q.weight"
    tensors, md = _peft(meta)
    save_file(tensors, str(tmp_path / "l.safetensors"), metadata=md)
    plan = plan_merge({key: (32, 32)}, [LoraSpec(str(tmp_path / "l.safetensors"))])
    base = np.zeros((32, 32), np.float32)
    want = scale * tensors[P + ".lora_B.weight"] @ tensors[P + ".lora_A.weight"]
    np.testing.assert_allclose(plan.apply(key, base), want, rtol=1e-5, atol=1e-5)


def test_a_lora_folder_is_named_as_a_folder(demo_ckpt, tmp_path):
    (tmp_path / "lora").mkdir()
    proc = precast("export", demo_ckpt, "--out", tmp_path / "out", "--component", "unet", "--lora", tmp_path / "lora")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "a folder; give the LoRA's .safetensors file" in lines[0], lines
