"""Step previews (issue 33 item 7): a recipe's `preview:` TAESD decoder -- madebyollin's file, a diffusers
AutoencoderTiny folder or file -- becomes the `preview_decoder` component, equal to diffusers' AutoencoderTiny
on ONNX Runtime and OpenVINO; `on_preview` is called once per step with an image of the output's size
(taesd, latent2rgb) for the tiny SD 1.x and Flux bundles; `generate --preview FILE` leaves that PNG; a bad
decoder file and a preview method the bundle cannot run are one line each; the latent -> RGB projection is
the einsum ComfyUI's Latent2RGBPreviewer computes."""
import numpy as np
import pytest
import torch
from diffusers import AutoencoderTiny
from safetensors.torch import save_file

from conftest import precast
from precast.compiler.sources.taesd import open_preview_decoder
from precast.runtime.api import UserError, open_bundle
from precast.runtime.families.sd import SDXL_RGB
from precast.runtime.png import read_png
from precast.runtime.previews import project, upscale

SD_RECIPE = ("model: {source: demo:tiny-sd15}\ncomponents: [text_encoder, unet, vae_decoder]\n"   # tiny_bundle's
             "profiles: {batch: 1, height: 64, width: 64}\ntargets: [onnxruntime, {openvino: {device: CPU}}]\n")
FLUX_RECIPE = ("model: {source: 'demo:tiny-flux-schnell'}\ncomponents: [text_encoder, text_encoder_2, transformer, "
               "vae_decoder]\nprofiles: {batch: 1, height: 64, width: 64, t5_tokens: 32}\ntargets: [onnxruntime]\n")


def _taesd(channels: int, levels: int, seed: int) -> AutoencoderTiny:
    """A random AutoencoderTiny, 8 wide; `levels` decoder stages (4: TAESD's 8x upscale; 2: the tiny Flux's 2x)."""
    torch.manual_seed(seed)
    model = AutoencoderTiny(latent_channels=channels, encoder_block_out_channels=(8,) * levels,
                            decoder_block_out_channels=(8,) * levels, num_encoder_blocks=(1,) + (3,) * (levels - 1),
                            num_decoder_blocks=(3,) * (levels - 1) + (1,)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)          # outputs that use the whole [-1, 1] range, not a near-constant image
    return model


def _madebyollin(model: AutoencoderTiny, path, prefix: str = "") -> None:
    """The decoder alone in madebyollin's layout: diffusers' decoder.layers.N is nn.Sequential index N + 1."""
    save_file({f"{prefix}{int(k.split('.')[2]) + 1}.{k.split('.', 3)[3]}": v.contiguous()
               for k, v in model.state_dict().items() if k.startswith("decoder.layers.")}, str(path))


@pytest.fixture(scope="module")
def decoders(tmp_path_factory):
    """{name: (path, the diffusers model)}: TAESD as madebyollin's file and as a diffusers folder (4 channels, 8x),
    a 2x TAEF1-like diffusers file (16 channels), and its encoder alone in madebyollin's layout."""
    tmp = tmp_path_factory.mktemp("taesd")
    sd, flux = _taesd(4, 4, 0), _taesd(16, 2, 1)
    _madebyollin(sd, tmp / "taesd_decoder.safetensors")
    sd.save_pretrained(tmp / "taesd")                        # config.json + diffusion_pytorch_model.safetensors
    flux.save_pretrained(tmp / "taef1")
    save_file({k[len("encoder.layers."):]: v.contiguous() for k, v in sd.state_dict().items()
               if k.startswith("encoder.layers.")}, str(tmp / "taesd_encoder.safetensors"))
    return {"madebyollin": (tmp / "taesd_decoder.safetensors", sd), "diffusers-folder": (tmp / "taesd", sd),
            "flux": (tmp / "taef1" / "diffusion_pytorch_model.safetensors", flux),
            "encoder": (tmp / "taesd_encoder.safetensors", sd)}


def _build(folder, recipe: str, decoder, cache, name: str, code: int = 0):
    (folder / f"{name}.yaml").write_text(recipe + f"preview: {{path: '{decoder}'}}\n")
    proc = precast("build", folder / f"{name}.yaml", "--out", folder / name, env={"PRECAST_CACHE": str(cache)})
    assert proc.returncode == code, proc.stderr
    return folder / name if code == 0 else proc.stderr


@pytest.fixture(scope="module")
def bundles(tiny_bundle, decoders, tmp_path_factory):
    """{name: bundle}: tiny_bundle's recipe plus a preview decoder (its other exports and engines: cache hits), in
    both layouts; the tiny Flux schnell (ONNX Runtime) with the 16-channel one."""
    tmp = tmp_path_factory.mktemp("preview-bundles")
    cache = tiny_bundle[0].parent / "cache"
    out = {name: _build(tmp, SD_RECIPE, decoders[name][0], cache, name) for name in ("madebyollin", "diffusers-folder")}
    out["flux"] = _build(tmp, FLUX_RECIPE, decoders["flux"][0], tmp / "cache", "flux")
    return out


@pytest.mark.parametrize("name, backend", [("madebyollin", "onnxruntime"), ("madebyollin", "openvino"),
                                           ("diffusers-folder", "onnxruntime"), ("diffusers-folder", "openvino"),
                                           ("flux", "onnxruntime")])
def test_the_preview_decoder_matches_diffusers_autoencoder_tiny(bundles, decoders, name, backend):
    bundle = open_bundle(bundles[name])
    assert bundle.manifest.components["preview_decoder"]["config"]["latent_scale"] == 1.0   # fed latents as they are
    model = decoders[name][1]
    side = 8 if name != "flux" else 32
    x = np.random.default_rng(0).standard_normal((1, model.config.latent_channels, side, side)).astype(np.float32) * 2
    with torch.no_grad():
        want = model.decode(torch.from_numpy(x)).sample.numpy()
    comp = bundle.load("preview_decoder", f"vae=cpu:{backend}")
    assert comp.plan.backend == backend
    got = comp.run({"latent_sample": x})["sample"]
    assert got.shape == want.shape == (1, 3, 64, 64) and want.std() > 0.2
    assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize("family", ["sd", "flux"])
def test_on_preview_is_called_once_a_step_with_an_image_of_the_output_s_size(bundles, family):
    pipe = open_bundle(bundles["madebyollin" if family == "sd" else "flux"]).pipeline()
    for method in ("taesd", "latent2rgb"):
        seen = []
        image = pipe("a cat", steps=3, seed=1, preview=method,
                     on_preview=lambda done, total, px, seen=seen: seen.append((done, total, px)))
        assert [(d, t) for d, t, _ in seen] == [(1, 3), (2, 3), (3, 3)], method
        for _, _, px in seen:
            assert px.dtype == np.uint8 and px.shape == image.pixels.shape == (64, 64, 3), method
        assert len({px.tobytes() for _, _, px in seen}) > 1, method     # the estimate changes step by step
    assert "preview" in pipe.pipe.run_stages          # its seconds, reported with the run's stages


def test_a_preview_at_another_latent_size_loads_the_decoder_for_that_size(bundles):
    """A hires pass previews larger latents: the decoder is selected again for them (the OpenVINO engine loaded
    for the 64x64 profile takes only its own shape; 128x128 runs on the bundle's ONNX)."""
    model = open_bundle(bundles["madebyollin"]).pipeline("vae=cpu:openvino").pipe
    x = np.random.default_rng(0).standard_normal((1, 4, 16, 16)).astype(np.float32)
    assert model.preview(x[:, :, :8, :8], "taesd", None).shape == (64, 64, 3)
    assert model.preview(x, "taesd", None).shape == (128, 128, 3)


def test_generate_preview_leaves_a_png_of_the_output_s_size(bundles, tmp_path):
    out, preview = tmp_path / "cat.png", tmp_path / "preview.png"          # auto: taesd, the bundle has a decoder
    proc = precast("generate", bundles["madebyollin"], "--prompt", "a cat", "--steps", "2", "--out", out,
                   "--preview", preview)
    assert proc.returncode == 0, proc.stderr
    assert read_png(preview).shape == read_png(out).shape == (64, 64, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cat.png", "preview.png"]    # no temp file left


def test_a_preview_method_the_bundle_cannot_run_is_one_line(tiny_bundle, tmp_path):
    proc = precast("generate", tiny_bundle[0], "--prompt", "a cat", "--out", tmp_path / "o.png",
                   "--preview", tmp_path / "p.png", "--preview-method", "taesd")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--preview-method 'taesd': this bundle has no preview decoder" in proc.stderr and "preview:" in proc.stderr
    proc = precast("generate", tiny_bundle[0], "--prompt", "a cat", "--out", tmp_path / "o.png",
                   "--preview-method", "latent2rgb")
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "error: --preview-method: says how --preview FILE is made; give --preview too"
    assert list(tmp_path.iterdir()) == []
    bundle = open_bundle(tiny_bundle[0])
    with pytest.raises(UserError, match="preview='taesd': this bundle has no preview decoder"):
        bundle.txt2img("a cat", steps=1, preview="taesd", on_preview=lambda *a: None)
    seen = []                                    # auto, without a preview decoder: latent2rgb
    bundle.txt2img("a cat", steps=1, on_preview=lambda done, total, px: seen.append(px.shape))
    assert seen == [(64, 64, 3)]


def test_a_bad_decoder_file_is_one_line_naming_the_file_and_key(tiny_bundle, decoders, tmp_path):
    save_file({"decoder.conv_in.weight": torch.zeros(8, 4, 3, 3)}, str(tmp_path / "vae.safetensors"))
    cache = tiny_bundle[0].parent / "cache"
    for decoder, says in ((tmp_path / "vae.safetensors", "not a TAESD decoder (looked for madebyollin's 1.weight"),
                          (decoders["encoder"][0], "a TAESD encoder (0.weight"),
                          (decoders["flux"][0], "decoder.layers.0.weight takes 16-channel latents, but ")):
        err = _build(tmp_path, SD_RECIPE, decoder, cache, "b", code=2)
        assert len(err.strip().splitlines()) == 1 and says in err and str(decoder) in err, err
        assert not (tmp_path / "b").exists()


def test_comfyui_s_prefixed_file_reads_as_madebyollin_s(decoders, tmp_path):
    path, model = decoders["madebyollin"]
    plain = open_preview_decoder(path)
    _madebyollin(model, tmp_path / "taesd.safetensors", "taesd_decoder.")
    comfy = open_preview_decoder(tmp_path / "taesd.safetensors")
    assert sorted(comfy.refs) == sorted(plain.refs) and "1.weight" in plain.refs and "3.conv.0.weight" in plain.refs


def test_latent2rgb_is_comfyui_s_linear_projection():
    x = np.sin(np.arange(4 * 2 * 3, dtype=np.float32)).reshape(4, 2, 3) * 1.5     # a known latent [C, h, w]
    f, b = np.array(SDXL_RGB.factors, np.float32), np.array(SDXL_RGB.bias, np.float32)
    rgb = np.einsum("chw,cr->hwr", x, f) + b                                     # [h, w, RGB] in [-1, 1]
    want = (np.clip((rgb + 1) / 2, 0, 1) * 255).round().astype(np.uint8)
    got = project(x, SDXL_RGB.factors, SDXL_RGB.bias)
    assert got.dtype == np.uint8 and np.array_equal(got, want) and len(np.unique(got)) > 10
    big = upscale(got, 8)
    assert big.shape == (16, 24, 3) and np.array_equal(big[::8, ::8], got) and np.array_equal(big[7::8, 7::8], got)
