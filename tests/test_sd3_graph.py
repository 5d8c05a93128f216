"""SD3 / SD3.5 MMDiT graph (compiler/graphs/mmdit.py) against diffusers' SD3Transformer2DModel on tiny
random-weight SAI-layout files (plain MMDiT, QK norm, MMDiT-X dual attention), the diffusers <-> SAI
name table (compiler/sources/sd3_names.py) both ways, and fp16 exports with fp32 blocks."""
import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from safetensors.torch import load_file

import reference_sd3 as ref
from conftest import rel_err
from precast.compiler.demo_sd3 import (SD3_PREFIX, TINY_CLIP_G, TINY_SD3, TINY_SD3_CLIP_L, TINY_SD3_T5,
                                       TINY_SD35_LARGE, TINY_SD35_MEDIUM, TINY_VAE, write_clip_g_file,
                                       write_sd3_checkpoint)
from precast.compiler.errors import BadInput
from precast.compiler.graphs.mmdit import _fp32_blocks, build_mmdit, mmdit_config
from precast.compiler.graphs.onnx_graph import Graph
from precast.compiler.graphs.onnx_writer import save_model
from precast.compiler.sources import sd3_names
from precast.compiler.sources.checkpoint import open_checkpoint

VARIANTS = {"sd3-medium": TINY_SD3, "sd3.5-large": TINY_SD35_LARGE, "sd3.5-medium": TINY_SD35_MEDIUM}
SIZES = [(16, 24), (10, 6), (32, 32)]   # latent H x W: crops of the 16x16 (24x24) grid, odd grids, the whole


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sd3-files")
    out = {}
    for i, (name, cfg) in enumerate(VARIANTS.items()):
        out[name] = tmp / f"{name}.safetensors"
        extra = dict(clip_l=TINY_SD3_CLIP_L, clip_g=TINY_CLIP_G, t5=TINY_SD3_T5, vae=TINY_VAE) if i == 0 else {}
        write_sd3_checkpoint(out[name], cfg, seed=10 + i, dtype="fp32", **extra)
    return out


def _export(path, folder, dtype="fp32", overrides=None):
    g = Graph("transformer", open_checkpoint(path), SD3_PREFIX, dtype)
    cfg = mmdit_config(g, {}, overrides or {})
    build_mmdit(g, cfg)
    g.check_coverage([SD3_PREFIX])
    save_model(g, str(folder))
    return folder / "model.onnx", cfg, g


def _feeds(cfg, h, w, seed=0):
    rng = np.random.default_rng(seed)
    return {"hidden_states": rng.standard_normal((2, cfg.in_channels, h, w)).astype(np.float32),
            "encoder_hidden_states": rng.standard_normal((2, 7, cfg.context_dim)).astype(np.float32),
            "pooled_projections": rng.standard_normal((2, cfg.pooled_dim)).astype(np.float32),
            "timestep": np.array([950.0, 13.5], np.float32)}


def _run(model_path, feeds):
    sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    types = {i.name: i.type for i in sess.get_inputs()}
    cast = {k: v.astype(np.float16) if types[k] == "tensor(float16)" else v for k, v in feeds.items()}
    return sess.run(None, cast)[0].astype(np.float32)


@torch.no_grad()
def _want(model, feeds):
    return model(**{k: torch.from_numpy(v) for k, v in feeds.items()}).sample.numpy()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_transformer_matches_diffusers(files, tmp_path, variant):
    model_path, cfg, _ = _export(files[variant], tmp_path / "transformer")
    want_cfg = VARIANTS[variant]
    assert (cfg.hidden, cfg.heads, cfg.depth, cfg.pos_embed_max, cfg.qk_norm, cfg.dual_attention_layers) == \
        (want_cfg.hidden, want_cfg.heads, want_cfg.depth, want_cfg.pos_embed_max, want_cfg.qk_norm,
         want_cfg.dual_attention_layers)
    proto = onnx.load(str(model_path), load_external_data=False)
    assert [i.name for i in proto.graph.input] == ["hidden_states", "encoder_hidden_states", "pooled_projections",
                                                   "timestep"]
    assert [o.name for o in proto.graph.output] == ["out_hidden_states"]
    model = ref.sd3_reference(files[variant], want_cfg)
    for h, w in SIZES:
        feeds = _feeds(cfg, h, w)
        ours, want = _run(model_path, feeds), _want(model, feeds)
        assert ours.shape == (2, cfg.out_channels, h, w)
        assert rel_err(ours, want) <= 1e-4, (variant, h, w, rel_err(ours, want))


def test_num_heads_override(files, tmp_path):
    """Without QK norm the head count is not in the weights: --set transformer.num_heads."""
    model_path, cfg, _ = _export(files["sd3-medium"], tmp_path / "t", overrides={"num_heads": 4})
    assert (cfg.heads, cfg.head_dim) == (4, 32)
    feeds = _feeds(cfg, 16, 24, seed=1)
    ours, want = _run(model_path, feeds), _want(ref.sd3_reference(files["sd3-medium"], TINY_SD3, heads=4), feeds)
    assert rel_err(ours, want) <= 1e-4
    g = Graph("transformer", open_checkpoint(files["sd3-medium"]), SD3_PREFIX, "fp32")
    assert mmdit_config(g, {}, {}).heads == 2                                      # SAI's 64-wide heads
    assert mmdit_config(g, {"num_attention_heads": 8, "attention_head_dim": 16}, {}).heads == 8
    assert mmdit_config(g, {"attention_head_dim": 32}, {}).heads == 4
    with pytest.raises(BadInput, match="num_heads=3"):
        mmdit_config(g, {}, {"num_heads": 3})
    g = Graph("transformer", open_checkpoint(files["sd3.5-large"]), SD3_PREFIX, "fp32")
    with pytest.raises(BadInput, match="QK norm weights say 2 heads"):
        mmdit_config(g, {}, {"num_heads": 4})
    with pytest.raises(BadInput, match="num_attention_heads 3 x attention_head_dim 32"):
        mmdit_config(g, {"num_attention_heads": 3, "attention_head_dim": 32}, {})
    with pytest.raises(BadInput, match="pos_embed_max_size = 8, but the weights say 16"):
        mmdit_config(g, {"pos_embed_max_size": 8}, {})
    with pytest.raises(BadInput, match="fp32_blocks"):
        mmdit_config(g, {}, {"fp32_blocks": [3]})
    g = Graph("transformer", open_checkpoint(files["sd3-medium"]), "text_encoders.clip_g.transformer.", "fp32")
    with pytest.raises(BadInput, match="no SD3 transformer"):
        mmdit_config(g, {}, {})


def test_fp32_blocks_default():
    assert _fp32_blocks({}, 38) == (35,)         # SD3.5-large (and turbo)
    assert _fp32_blocks({}, 24) == ()
    assert _fp32_blocks({"fp32_blocks": [2, 0, 2]}, 24) == (0, 2)
    assert _fp32_blocks({"fp32_blocks": []}, 38) == ()


def test_fp16_export_keeps_fp32_blocks(files, tmp_path):
    path = files["sd3.5-large"]
    model_path, cfg, g = _export(path, tmp_path / "fp16", dtype="fp16", overrides={"fp32_blocks": [1]})
    assert cfg.fp32_blocks == (1,) and any("[1]" in n and "fp32" in n for n in g.notes)
    proto = onnx.load(str(model_path), load_external_data=False)
    types = {t.name: t.data_type for t in proto.graph.initializer if t.name.startswith("joint_blocks.")}
    block1 = {k: t for k, t in types.items() if k.startswith("joint_blocks.1.")}
    linears = {k: t for k, t in types.items() if k not in block1 and ".ln_" not in k}   # QK norms: fp32 anyway
    assert block1 and all(t == onnx.TensorProto.FLOAT for t in block1.values())
    assert linears and all(t == onnx.TensorProto.FLOAT16 for t in linears.values())
    inputs = {i.name: i.type.tensor_type.elem_type for i in proto.graph.input}
    assert inputs["hidden_states"] == onnx.TensorProto.FLOAT16 and inputs["timestep"] == onnx.TensorProto.FLOAT
    fp32_path, _, _ = _export(path, tmp_path / "fp32")
    feeds = _feeds(cfg, 16, 24, seed=2)
    half, full = _run(model_path, feeds), _run(fp32_path, feeds)
    assert np.isfinite(half).all() and rel_err(half, full) <= 1e-2, rel_err(half, full)


def test_sd3_names_round_trip(files):
    """A diffusers-saved transformer mapped back through sai_parts is the SAI file, bit for bit; its
    LoRA targets name the right rows of the fused SAI weights."""
    for variant, cfg in VARIANTS.items():
        sai = {k[len(SD3_PREFIX):]: v for k, v in load_file(str(files[variant])).items() if k.startswith(SD3_PREFIX)}
        diff = ref.sd3_reference(files[variant], cfg).state_dict()
        assert sd3_names.is_diffusers_sd3(diff) and not sd3_names.is_diffusers_sd3(sai)
        assert sd3_names.is_diffusers_sd3([f"transformer.{k}" for k in diff])
        parts, stray = sd3_names.sai_parts(list(diff), {k: tuple(v.shape) for k, v in diff.items()})
        assert not stray and set(parts) == set(sai), (variant, stray, set(parts) ^ set(sai))
        for key, srcs in parts.items():
            got = torch.cat([diff[d] if rows is None else diff[d][rows[0]:rows[1]] for d, rows in srcs])
            assert torch.equal(got, sai[key]), (variant, key)
        targets = sd3_names.lora_targets({SD3_PREFIX + k: tuple(v.shape) for k, v in sai.items()}, SD3_PREFIX)
        linears = {k[:-len(".weight")] for k, v in diff.items() if k.endswith(".weight") and v.ndim == 2}
        last = f"transformer_blocks.{cfg.depth - 1}.norm1_context.linear"
        assert set(targets) == linears - {"norm_out.linear", last}, set(targets) ^ linears
        for module, (key, rows) in targets.items():
            w = sai[key[len(SD3_PREFIX):]]
            assert torch.equal(w if rows is None else w[rows[0]:rows[1]], diff[module + ".weight"]), module


def test_clip_references_and_bare_clip_g(files, tmp_path):
    """CLIP-L / CLIP-G with projections load strictly from the all-in-one file; comfyanonymous-style
    clip_g.safetensors holds the same tensors bare."""
    bare = tmp_path / "clip_g.safetensors"
    write_clip_g_file(bare, seed=10, dtype="fp32")
    ids = torch.tensor([[49406, 320, 1929, 49407] + [49407] * 73])
    with torch.no_grad():
        big = ref.clip_reference(files["sd3-medium"], TINY_CLIP_G, "g")(ids)
        small = ref.clip_reference(bare, TINY_CLIP_G, "g")(ids)
        clip_l = ref.clip_reference(files["sd3-medium"], TINY_SD3_CLIP_L, "l")(ids, output_hidden_states=True)
    assert torch.equal(big.text_embeds, small.text_embeds) and big.text_embeds.shape == (1, TINY_CLIP_G.projection)
    assert clip_l.text_embeds.shape[-1] + big.text_embeds.shape[-1] == TINY_SD3.pooled_dim
    assert TINY_SD3_CLIP_L.width + TINY_CLIP_G.width <= TINY_SD3.context_dim == TINY_SD3_T5.d_model
