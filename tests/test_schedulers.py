"""Our numpy samplers follow diffusers' Euler and DPM++ 2M step for step (same noise, same model outputs), in
every timestep spacing (every sampler and sigma schedule: tests/test_samplers.py)."""
import numpy as np
import pytest
import torch
from diffusers import DPMSolverMultistepScheduler, EulerDiscreteScheduler

from precast.runtime.schedulers import NoiseSchedule, make_sampler

CFG = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")


@pytest.mark.parametrize("name", ["euler", "dpm++2m"])
@pytest.mark.parametrize("spacing", ["leading", "linspace", "trailing"])
@pytest.mark.parametrize("prediction", ["epsilon", "v_prediction"])
@pytest.mark.parametrize("steps", [4, 20])
def test_sampler_matches_diffusers(name, spacing, prediction, steps):
    offset = 1 if spacing == "leading" else 0
    cls, extra = ((EulerDiscreteScheduler, {}) if name == "euler" else
                  (DPMSolverMultistepScheduler, dict(algorithm_type="dpmsolver++", solver_order=2)))
    ref = cls(**CFG, timestep_spacing=spacing, steps_offset=offset, prediction_type=prediction, **extra)
    ref.set_timesteps(steps)
    ours = make_sampler(name, steps, NoiseSchedule(timestep_spacing=spacing, steps_offset=offset,
                                                   prediction_type=prediction))
    np.testing.assert_array_equal(ref.timesteps.numpy().astype(np.float32), ours.timesteps)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
    xr, xo = torch.from_numpy(x * float(ref.init_noise_sigma)), x * np.float32(ours.init_noise_sigma)
    for i, t in enumerate(ref.timesteps):
        out = rng.standard_normal((1, 4, 8, 8)).astype(np.float32)
        fed = []
        xo = ours.step(lambda x_in, t_in: fed.append((x_in, t_in)) or out, i, xo)      # the UNet's input, its output
        np.testing.assert_allclose(fed[0][0], ref.scale_model_input(xr, t).numpy(), rtol=1e-4,
                                   atol=1e-4 * float(np.abs(fed[0][0]).max()))
        assert fed[0][1] == np.float32(t)
        xr = ref.step(torch.from_numpy(out), t, xr).prev_sample
    assert np.abs(xr.numpy() - xo).max() <= 1e-5 * max(1.0, float(np.abs(xr.numpy()).max()))
