"""Every sampler and sigma schedule precast runs follows the diffusers scheduler it names (runtime/schedulers.py,
runtime/flow.py): the sigma and timestep tables within 1e-6; step for step on a fixed random linear denoiser,
with the same noise fed to both sides -- drawn here by the rule docs/runtime.md states, SeedSequence(seed,
spawn_key=(step,)) -- PSNR >= 40 dB on the final latents, txt2img and img2img (start_index + add_noise),
epsilon and v-prediction; the names users type (A1111's, ComfyUI's) read into precast's; and end to end,
`precast generate --scheduler ...` on a real tiny SD bundle against diffusers' StableDiffusionPipeline."""
import copy
import functools
import json

import numpy as np
import pytest
import torch
from diffusers import (DDIMScheduler, DPMSolverMultistepScheduler, DPMSolverSDEScheduler,
                       EulerAncestralDiscreteScheduler, EulerDiscreteScheduler, FlowMatchEulerDiscreteScheduler,
                       FlowMatchHeunDiscreteScheduler, HeunDiscreteScheduler, KDPM2AncestralDiscreteScheduler,
                       KDPM2DiscreteScheduler, LCMScheduler, UniPCMultistepScheduler)

from conftest import precast
from precast.runtime import flow
from precast.runtime.errors import UserError
from precast.runtime.sampler_names import parse_sampler, parse_schedule
from precast.runtime.schedulers import SAMPLERS, NoiseSchedule, make_sampler, start_index

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")    # diffusers' np.array(tensor), per call

CFG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
           timestep_spacing="leading", steps_offset=1)
DIFFUSERS = {   # precast's sampler: (the diffusers scheduler, its settings beyond SD's config)
    "euler": (EulerDiscreteScheduler, {}),
    "euler-a": (EulerAncestralDiscreteScheduler, {}),
    "heun": (HeunDiscreteScheduler, {}),
    "dpm2": (KDPM2DiscreteScheduler, {}),
    "dpm2-a": (KDPM2AncestralDiscreteScheduler, {}),
    "dpm++2m": (DPMSolverMultistepScheduler, {"algorithm_type": "dpmsolver++"}),
    "dpm++2m-sde": (DPMSolverMultistepScheduler, {"algorithm_type": "sde-dpmsolver++"}),
    "dpm++sde": (DPMSolverSDEScheduler, {}),
    "ddim": (DDIMScheduler, {"set_alpha_to_one": False, "clip_sample": False}),    # SD's scheduler config
    "unipc": (UniPCMultistepScheduler, {}),
    "lcm": (LCMScheduler, {}),
}
SCHEDULE = {"normal": {}, "karras": {"use_karras_sigmas": True}, "exponential": {"use_exponential_sigmas": True},
            "sgm-uniform": {"timestep_spacing": "trailing"}}
CASES = [(name, kind) for name, cls in SAMPLERS.items() for kind in cls.schedules]
NOISY = {"euler-a": "scheduling_euler_ancestral_discrete", "dpm2-a": "scheduling_k_dpm_2_ancestral_discrete",
         "lcm": "scheduling_lcm"}    # where diffusers draws its noise with randn_tensor (patched to ours)
SHAPE, SEED = (1, 4, 8, 8), 11


def rule_noise(seed: int, step: int, draws: int = 1) -> list[np.ndarray]:
    """The noise precast adds at `step`, by the rule docs/runtime.md states (written here from it)."""
    rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(step,)))
    return [rng.standard_normal(SHAPE).astype(np.float32) for _ in range(draws)]


def psnr(ours: np.ndarray, ref: np.ndarray) -> float:
    err = float(np.sqrt(np.mean((ours.astype(np.float64) - ref) ** 2)))
    return 20 * np.log10(float(ref.max() - ref.min()) / err) if err else float("inf")


class Denoiser:
    """A fixed random linear 'UNet': out = A x (over channels) + cos(t / 150) * P."""

    def __init__(self, seed=0, channels=4):
        rng = np.random.default_rng(seed)
        self.a = (0.6 * np.eye(channels) + 0.1 * rng.standard_normal((channels, channels))).astype(np.float32)
        self.p = (0.2 * rng.standard_normal(SHAPE)).astype(np.float32)

    def __call__(self, x: np.ndarray, t) -> np.ndarray:
        return (np.einsum("ij,bjhw->bihw", self.a, x) + np.float32(np.cos(float(t) / 150)) * self.p).astype(np.float32)


@functools.lru_cache(maxsize=None)
def made(cls, config: tuple):
    """A diffusers scheduler as constructed (KDPM2's constructor alone takes 0.2 s), copied for each use."""
    return cls(**dict(config))


def reference(name: str, kind: str, steps: int, prediction: str = "epsilon"):
    cls, extra = DIFFUSERS[name]
    own = SCHEDULE[kind] if kind == "sgm-uniform" or cls is not EulerAncestralDiscreteScheduler else {}
    ref = copy.deepcopy(made(cls, tuple({**CFG, **extra, "prediction_type": prediction, **own}.items())))
    ref.set_timesteps(steps)
    if own != SCHEDULE[kind]:       # EulerAncestral has no Karras / exponential option: fed precast's table
        ours = make_sampler(name, steps, NoiseSchedule(prediction_type=prediction), kind)
        ref.sigmas, ref.timesteps = torch.from_numpy(ours.sigmas), torch.from_numpy(ours.timesteps)
    return ref


def deinterleave(ref, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(sigmas [steps + 1], timesteps [steps]) of a diffusers scheduler's table, one entry per step."""
    t = ref.timesteps.numpy().astype(np.float64)
    if name in ("ddim", "lcm"):
        return None, t
    s = ref.sigmas.numpy().astype(np.float64)
    if ref.order == 2:
        n = (len(t) + 1) // 2
        return np.concatenate([s[0:2 * n - 1:2], [0.0]]), t[0::2]
    return s, t


@pytest.mark.parametrize("steps", [4, 13, 30])
@pytest.mark.parametrize("name, kind", CASES)
def test_sigma_tables_equal_diffusers(name, kind, steps):
    ours = make_sampler(name, steps, NoiseSchedule(), kind)
    ref = reference(name, kind, steps)
    sigmas, timesteps = deinterleave(ref, name)
    np.testing.assert_allclose(ours.timesteps, timesteps, rtol=1e-6, atol=1e-6 * 1000)
    if sigmas is not None:
        np.testing.assert_allclose(ours.sigmas, sigmas, rtol=1e-6, atol=1e-6)
        assert float(ours.init_noise_sigma) == pytest.approx(float(ref.init_noise_sigma), rel=1e-6)
    else:      # DDIM, LCM: alphas_cumprod at each timestep
        np.testing.assert_allclose(ours.alphas[:-1], ref.alphas_cumprod.numpy()[ours.timesteps.astype(int)],
                                   rtol=1e-6, atol=1e-6)
    if name in ("dpm2", "dpm2-a") and steps > 1:      # the midpoints the second UNet call is fed
        np.testing.assert_allclose([ours.t_of(m) for m in ours.mids], ref.timesteps.numpy()[1::2], atol=2e-3)


def run_diffusers(ref, name, model, x, first, monkeypatch):
    """diffusers' own loop (as its pipelines run it) from step `first`, its noise replaced by the rule's."""
    order = ref.order
    timesteps = ref.timesteps[first * order:]
    if hasattr(ref, "set_begin_index"):
        ref.set_begin_index(first * order)
    call = {"i": first, "c": 0, "mid": None}
    if name in NOISY:
        module = __import__(f"diffusers.schedulers.{NOISY[name]}", fromlist=["randn_tensor"])
        monkeypatch.setattr(module, "randn_tensor", lambda *a, **k: torch.from_numpy(rule_noise(SEED, call["i"])[0]))
    if name == "dpm++sde":     # its Brownian tree: sigma -> midpoint on the first call, sigma -> next on the second
        def bridge(sigma, to):
            z1, z2 = rule_noise(SEED, call["i"], 2)
            if call["c"] % 2 == 0:
                call["mid"] = float(to)
                return torch.from_numpy(z1)
            s, m, n = float(sigma), call["mid"], float(to)
            return torch.from_numpy((((s - m) ** 0.5 * z1 + (m - n) ** 0.5 * z2) / (s - n) ** 0.5).astype(np.float32))
        ref.noise_sampler = bridge
    xt = torch.from_numpy(x)
    for c, t in enumerate(timesteps):
        call.update(i=first + c // order, c=c)
        out = torch.from_numpy(model(ref.scale_model_input(xt, t).numpy(), float(t)))
        kw = {"variance_noise": torch.from_numpy(rule_noise(SEED, call["i"])[0])} if name == "dpm++2m-sde" else {}
        xt = ref.step(out, t, xt, **kw).prev_sample
    return xt.numpy()


@pytest.mark.parametrize("name, kind", CASES)
def test_samplers_match_diffusers_step_for_step(name, kind, monkeypatch):
    steps, model = 8, Denoiser()
    rng = np.random.default_rng(5)
    noise, image = rng.standard_normal(SHAPE).astype(np.float32), rng.standard_normal(SHAPE).astype(np.float32)
    for prediction in ("epsilon", "v_prediction"):
        for first in (0, start_index(steps, 0.6)):          # txt2img, then img2img at strength 0.6
            ours = make_sampler(name, steps, NoiseSchedule(prediction_type=prediction), kind, seeds=(SEED,))
            ref = reference(name, kind, steps, prediction)
            if first:
                x = ours.add_noise(image, noise, first)
                t0 = ref.timesteps[first * ref.order:][:1]
                xr = ref.add_noise(torch.from_numpy(image), torch.from_numpy(noise), t0).numpy() if \
                    not hasattr(ref, "set_begin_index") else None
            else:
                x = noise * np.float32(ours.init_noise_sigma)
                xr = noise * np.float32(ref.init_noise_sigma)
            if xr is None:     # add_noise reads the begin index
                ref.set_begin_index(first * ref.order)
                xr = ref.add_noise(torch.from_numpy(image), torch.from_numpy(noise), t0).numpy()
            np.testing.assert_allclose(x, xr, rtol=1e-5, atol=1e-5)
            want = run_diffusers(ref, name, model, xr, first, monkeypatch)
            for i in range(first, steps):
                x = ours.step(model, i, x)
            assert psnr(x, want) >= 40.0, (prediction, first, psnr(x, want))


# ---- flow matching (Flux, Chroma, SD3): Euler, Heun, DPM++ 2M on the model's own schedule ------------------
FLOW = {"flux-dev": flow.FlowSchedule(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15),
        "sd3": flow.FlowSchedule(shift=3.0, spacing="training")}


def flow_reference(name: str, ours, steps: int):
    """The diffusers scheduler of a flow sampler, on precast's sigma table (FlowMatchHeun's own for SD3's)."""
    s = torch.from_numpy(ours.sigmas)
    if name == "flow-dpm++2m":
        ref = DPMSolverMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True)
        ref.set_timesteps(steps)
        ref.sigmas, ref.timesteps = s, s[:-1] * 1000
        return ref
    cls = FlowMatchHeunDiscreteScheduler if name == "flow-heun" else FlowMatchEulerDiscreteScheduler
    ref = cls(shift=3.0)
    ref.set_timesteps(steps)
    if cls is FlowMatchHeunDiscreteScheduler:       # two calls a step: each inner sigma twice
        two = torch.cat([s[:1], s[1:-1].repeat_interleave(2), s[-1:]])
        ref.sigmas, ref.timesteps = two, torch.cat([s[:1], s[1:-1].repeat_interleave(2)]) * 1000
    else:
        ref.sigmas, ref.timesteps = s, s[:-1] * 1000
    return ref


@pytest.mark.parametrize("name", list(flow.SAMPLERS))
@pytest.mark.parametrize("model_name", list(FLOW))
def test_flow_samplers_match_diffusers(name, model_name):
    steps, model, tokens = 7, Denoiser(3), 64
    ours = flow.SAMPLERS[name](FLOW[model_name], steps, tokens)
    if model_name == "sd3" and name == "flow-heun":     # FlowMatchHeun's own table is precast's SD3 one
        ref = FlowMatchHeunDiscreteScheduler(shift=3.0)
        ref.set_timesteps(steps)
        np.testing.assert_allclose(deinterleave(ref, name)[0], ours.sigmas, rtol=1e-6, atol=1e-6)
    ref = flow_reference(name, ours, steps)
    velocity = lambda x, sigma: model(x, 150 * 3 * float(sigma))      # noqa: E731
    x = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    xt = torch.from_numpy(x)
    for t in ref.timesteps:
        xt = ref.step(torch.from_numpy(velocity(xt.numpy(), float(t) / 1000)), t, xt).prev_sample
    for i in range(steps):
        x = ours.step(lambda x, j: velocity(x, ours.sigmas[j]), i, x)
    assert psnr(x, xt.numpy()) >= 40.0, psnr(x, xt.numpy())


# ---- the names users type ----------------------------------------------------------------------------
@pytest.mark.parametrize("typed, want", [
    ("euler", ("euler", None)), ("Euler a", ("euler-a", None)), ("euler_ancestral", ("euler-a", None)),
    ("Heun", ("heun", None)), ("dpm_2", ("dpm2", None)), ("DPM2 a Karras", ("dpm2-a", "karras")),
    ("dpm_2_ancestral", ("dpm2-a", None)), ("DPM++ 2M", ("dpm++2m", None)), ("dpmpp_2m", ("dpm++2m", None)),
    ("DPM++ 2M Karras", ("dpm++2m", "karras")), ("dpm++2m", ("dpm++2m", None)),
    ("DPM++ 2M SDE Exponential", ("dpm++2m-sde", "exponential")), ("dpmpp_2m_sde", ("dpm++2m-sde", None)),
    ("DPM++ SDE Karras", ("dpm++sde", "karras")), ("dpmpp_sde", ("dpm++sde", None)),
    ("DPM++ 2M SGM Uniform", ("dpm++2m", "sgm-uniform")), ("DDIM", ("ddim", None)), ("UniPC", ("unipc", None)),
    ("uni_pc", ("unipc", None)), ("LCM", ("lcm", None)), ("flow-heun", ("flow-heun", None)),
    ("ddim9", None), ("karras", None), ("", None), (3, None)])
def test_sampler_names(typed, want):
    assert parse_sampler(typed) == want


@pytest.mark.parametrize("typed, want", [("normal", "normal"), ("Karras", "karras"), ("Exponential", "exponential"),
                                         ("SGM Uniform", "sgm-uniform"), ("sgm_uniform", "sgm-uniform"),
                                         ("Automatic", "normal"), ("beta", None)])
def test_schedule_names(typed, want):
    assert parse_schedule(typed) == want


@pytest.mark.parametrize("kwargs, words", [
    ({"scheduler": "DDIM", "schedule": "karras"}, "schedule='karras': ddim runs normal or sgm-uniform"),
    ({"scheduler": "lcm", "schedule": "sgm_uniform"}, "schedule='sgm-uniform': lcm runs normal"),
    ({"scheduler": "DPM++ 2M Karras", "schedule": "exponential"},
     "schedule='exponential': scheduler='DPM++ 2M Karras' names the karras schedule"),
    ({"schedule": "beta"}, "schedule='beta': choose one of normal, karras, exponential, sgm-uniform"),
    ({"scheduler": "flow-heun"}, "scheduler='flow-heun': is Flux / Chroma / SD3"),
    ({"scheduler": "ddim9"}, "scheduler='ddim9': choose one of euler, euler-a, heun"),
])
def test_settings_refused_before_anything_loads(tiny_bundle, kwargs, words):
    from precast.runtime.api import open_bundle
    api = open_bundle(tiny_bundle[0])
    with pytest.raises(UserError) as e:
        api.txt2img("a cat", steps=2, **kwargs)
    assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not api._pipelines            # refused before any engine was opened


def test_flow_families_read_the_plain_names():
    """On a flow-matching bundle euler / heun / dpm++2m name the flow samplers; its schedule is the model's."""
    from types import SimpleNamespace
    from precast.runtime.generate import check_scheduler
    flux = SimpleNamespace(model={"family": "flux"}, root="flux-bundle")
    assert check_scheduler("Heun", flux) == ("flow-heun", None)
    assert check_scheduler("dpmpp_2m", flux, schedule="normal") == ("flow-dpm++2m", None)
    with pytest.raises(UserError, match="Flux samples on the model's own schedule"):
        check_scheduler("euler", flux, schedule="karras")
    with pytest.raises(UserError, match="is SD 1.x"):
        check_scheduler("euler_ancestral", flux)


# ---- on a real tiny SD bundle ----------------------------------------------------------------------------
def test_every_sampler_makes_an_image_and_a_seed_makes_the_same_one(tiny_bundle):
    from precast.runtime.api import open_bundle
    pipe = open_bundle(tiny_bundle[0]).pipeline(size=(64, 64))
    for name, cls in SAMPLERS.items():
        kind = cls.schedules[-1]
        image = pipe("a red fox", steps=3, seed=4, scheduler=name, schedule=kind)
        assert (image.scheduler, image.schedule) == (name, kind)
        assert np.isfinite(image.pixels).all() and image.pixels.std() > 0.02, name
        again = pipe("a red fox", steps=3, seed=4, scheduler=name, schedule=kind)
        np.testing.assert_array_equal(image.to_uint8(), again.to_uint8())
        if name in ("euler-a", "dpm2-a", "dpm++sde", "dpm++2m-sde", "lcm"):   # their added noise follows the seed
            other = pipe("a red fox", steps=3, seed=5, scheduler=name, schedule=kind)
            assert not np.array_equal(other.to_uint8(), image.to_uint8())


@pytest.fixture(scope="module")
def sd_parts(tiny_bundle):
    """diffusers' UNet, VAE, text encoder and tokenizer holding the tiny bundle's weights."""
    from transformers import CLIPTokenizer
    import reference as ref
    from precast.compiler.demo_model import TINY
    path, ckpt = tiny_bundle
    unet, vae, te = ref.models_from_single_file(ckpt, TINY)
    tok = CLIPTokenizer(str(path / "tokenizer/vocab.json"), str(path / "tokenizer/merges.txt"), model_max_length=77)
    return {"unet": unet, "vae": vae, "text_encoder": te, "tokenizer": tok}


@pytest.mark.parametrize("args, scheduler, want", [
    (["--scheduler", "DPM++ 2M SDE Karras"], (DPMSolverMultistepScheduler, {
        "algorithm_type": "sde-dpmsolver++", "use_karras_sigmas": True}, "scheduling_dpmsolver_multistep"),
     ("dpm++2m-sde", "karras")),
    (["--scheduler", "euler_ancestral", "--schedule", "sgm_uniform"], (EulerAncestralDiscreteScheduler, {
        "timestep_spacing": "trailing"}, "scheduling_euler_ancestral_discrete"), ("euler-a", "sgm-uniform")),
])
def test_generate_matches_stable_diffusion_pipeline(tiny_bundle, sd_parts, tmp_path, monkeypatch, args, scheduler,
                                                   want):
    """`precast generate` end to end against diffusers' StableDiffusionPipeline on the same weights: the seed's
    noise as its latents, each step's added noise by the rule (randn_tensor patched): PSNR >= 40 dB."""
    from diffusers import StableDiffusionPipeline
    from precast.runtime.png import read_png
    path, _ = tiny_bundle
    out, steps, seed = tmp_path / "x.png", 5, 3
    proc = precast("generate", path, "--prompt", "a photo of a cat", "--negative", "blurry", "--steps", steps,
                   "--seed", seed, "--size", "64x64", "--out", out, "--json", *args)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert (report["scheduler"], report["schedule"]) == want
    cls, extra, module = scheduler
    sched = cls(**{**CFG, **extra})
    monkeypatch.setattr(__import__(f"diffusers.schedulers.{module}", fromlist=["randn_tensor"]), "randn_tensor",
                        lambda *a, **k: torch.from_numpy(rule_noise(seed, sched.step_index)[0]))
    pipe = StableDiffusionPipeline(**sd_parts, scheduler=sched, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)
    noise = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)
    with torch.no_grad():
        want_px = pipe("a photo of a cat", negative_prompt="blurry", num_inference_steps=steps, guidance_scale=7.5,
                       height=64, width=64, latents=torch.from_numpy(noise), output_type="np").images[0]
    ours = read_png(out).astype(np.float64) / 255
    assert want_px.std() > 0.05
    assert 10 * np.log10(1.0 / np.mean((ours - want_px) ** 2)) >= 40.0
