"""DPM-Solver++ (moh_vision.diffusion.dpm_solver) on a made-up model with an exact score: Gaussian data, whose
epsilon prediction is analytic; its learned-variance and guidance handling; the sampler choice in tools/sample.py and
the training run's grids (moh_vision.diffusion.samplers)."""
import json
import math

import numpy as np
import pytest
import torch

from helpers import load_tool
from moh_vision.diffusion import create_diffusion, dpm_solver_sample, dpm_solver_timesteps, guided_model_fn
from moh_vision.diffusion import samplers
from moh_vision.errors import ConfigError
from test_sample import checkpoint  # noqa: F401  (the digits diffusion checkpoint fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = dict(noise_schedule="linear", learn_sigma=True, diffusion_steps=1000)
ALPHAS_CUMPROD = create_diffusion("").alphas_cumprod


def gaussian_eps(x, t, mean, std):
    """E[eps | x_t] for data N(mean, std^2) per value: sigma_t (x_t - alpha_t mean) / (alpha_t^2 std^2 + sigma_t^2)."""
    ac = ALPHAS_CUMPROD[t].to(x.dtype).view(-1, *([1] * (x.ndim - 1)))
    alpha, sigma = ac.sqrt(), (1 - ac).sqrt()
    return sigma * (x - alpha * mean) / (alpha ** 2 * std ** 2 + sigma ** 2)


def gaussian_model(mean, std, variance_channels=True):
    """A DiT-like model of Gaussian data: eps in the first C channels, v = -1 (the posterior variance) in the next C."""
    def model(x, t, y=None):
        eps = gaussian_eps(x, t, mean, std)
        return torch.cat([eps, torch.full_like(eps, -1.0)], dim=1) if variance_channels else eps
    return model


def exact_flow(noise, mean, std):
    """The probability-flow ODE's exact map from x_T to x_0 for Gaussian data: the affine map between the marginals."""
    ac = float(ALPHAS_CUMPROD[-1])
    return mean + std * (noise - math.sqrt(ac) * mean) / math.sqrt(ac * std ** 2 + 1 - ac)


def noise(n=4000, seed=0):
    return torch.randn(n, 1, 4, 4, generator=torch.Generator().manual_seed(seed))


def test_timesteps_are_diffusers_linspace_spacing():
    steps = dpm_solver_timesteps(1000, 25)
    assert len(steps) == 25 and steps[0] == 999 and steps[-1] == 40  # round(999 / 25): its 0 dropped
    assert all(a > b for a, b in zip(steps, steps[1:]))
    assert dpm_solver_timesteps(1000, 1) == [999]
    with pytest.raises(ConfigError, match="use 1 to 1000 solver steps"):
        dpm_solver_timesteps(1000, 1001)


# the SDE solver's discretisation error at 25 steps is larger: its standard deviation is 3 to 4% off, 0.3% at 250 steps
@pytest.mark.parametrize("sampler,std_rel", [("dpm++", 0.03), ("dpm++sde", 0.05)], ids=["dpm++", "dpm++sde"])
@pytest.mark.parametrize("mean,std", [(0.5, 1.0), (-0.3, 0.7)])
def test_25_steps_land_on_the_data_distribution_as_1000_ddpm_steps_do(mean, std, sampler, std_rel):
    x_T = noise()
    fast = samplers.sample_with(sampler, 25, ARGS, gaussian_model(mean, std), x_T,
                                generator=torch.Generator().manual_seed(2))
    slow = samplers.sample_with("ddpm", "1000", ARGS, gaussian_model(mean, std), x_T,
                                generator=torch.Generator().manual_seed(1))
    # 64,000 values: the sampling error of a mean is std / 253, of a std about std / 358
    assert slow.mean().item() == pytest.approx(mean, abs=0.02) and slow.std().item() == pytest.approx(std, rel=0.03)
    assert fast.mean().item() == pytest.approx(mean, abs=0.02) and fast.std().item() == pytest.approx(std, rel=std_rel)
    assert fast.mean().item() == pytest.approx(slow.mean().item(), abs=0.02)
    assert fast.std().item() == pytest.approx(slow.std().item(), rel=std_rel)


def test_the_solver_follows_the_ode_to_second_order():
    """Against the exact flow map: closer than DDIM (first order) in as many steps, and closer with more steps."""
    mean, std = 0.5, 1.0
    x_T = noise(500)
    exact = exact_flow(x_T, mean, std)
    error = {n: (samplers.sample_with("dpm++", n, ARGS, gaussian_model(mean, std), x_T) - exact).abs().max().item()
             for n in (10, 25, 50)}
    ddim = (samplers.sample_with("ddim", "25", ARGS, gaussian_model(mean, std), x_T) - exact).abs().max().item()
    assert error[25] < 0.5 * ddim
    assert error[50] < error[25] < error[10]
    assert error[25] < 0.03


def test_the_stochastic_solver_draws_its_noise_from_the_generator():
    """dpm++sde: the same seed gives the same samples, another seed others (each with the data's mean), and no
    generator still samples; the deterministic solver ignores the generator."""
    x_T, model = noise(500), gaussian_model(0.5, 1.0)
    draw = lambda sampler, seed: samplers.sample_with(  # noqa: E731
        sampler, 10, ARGS, model, x_T, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(draw("dpm++sde", 0), draw("dpm++sde", 0))
    other = draw("dpm++sde", 1)
    assert (other - draw("dpm++sde", 0)).abs().max().item() > 0.1
    assert other.mean().item() == pytest.approx(0.5, abs=0.1)
    assert torch.equal(draw("dpm++", 0), draw("dpm++", 1))
    assert samplers.sample_with("dpm++sde", 10, ARGS, model, x_T).isfinite().all()
    std_error = {n: abs(samplers.sample_with("dpm++sde", n, ARGS, gaussian_model(-0.3, 0.7), noise(),
                                             generator=torch.Generator().manual_seed(2)).std().item() - 0.7)
                 for n in (25, 250)}
    assert std_error[250] < 0.5 * std_error[25], std_error  # more steps: closer to the data


def test_only_the_epsilon_channels_of_a_learned_variance_model_are_read():
    x_T = noise(64)
    variance = create_diffusion("", learn_sigma=True)
    fixed = create_diffusion("", learn_sigma=False)

    def noisy_variance(x, t, y=None):  # any value in the variance channels
        eps = gaussian_eps(x, t, 0.2, 0.8)
        return torch.cat([eps, 100 * torch.randn_like(eps)], dim=1)

    two_c = dpm_solver_sample(variance, noisy_variance, x_T, 25)
    one_c = dpm_solver_sample(fixed, gaussian_model(0.2, 0.8, variance_channels=False), x_T, 25)
    assert torch.equal(two_c, one_c)
    with pytest.raises(ValueError, match="learned-sigma model output has shape"):
        dpm_solver_sample(variance, gaussian_model(0.2, 0.8, variance_channels=False), x_T, 5)


def test_guidance_moves_the_samples_as_classifier_free_guidance_does():
    """Class c's data N(m_c, s^2), the null class's N(m_u, s^2): the guided eps is the eps of N(m_u + w (m_c - m_u),
    s^2)."""
    means, std, null = {0: 0.6, 1: -0.4}, 0.8, 2
    uncond = 0.0

    def model(x, t, y):
        mean = torch.tensor([means.get(int(c), uncond) for c in y]).view(-1, 1, 1, 1)
        eps = gaussian_eps(x, t, mean, std)
        return torch.cat([eps, torch.zeros_like(eps)], dim=1)

    x_T = noise(2000)
    labels = torch.arange(2000) % 2
    for scale in (1.0, 2.0):
        out = samplers.sample_with("dpm++", 25, ARGS, guided_model_fn(model, scale, null), x_T,
                                   model_kwargs={"y": labels})
        for c, m in means.items():
            assert out[labels == c].mean().item() == pytest.approx(uncond + scale * (m - uncond), abs=0.03)


def test_a_sampler_that_cannot_take_its_steps_is_one_error():
    with pytest.raises(ConfigError, match="sampler=dpm\\+\\+ takes steps=<number of solver steps>"):
        samplers.check_sampler("dpm++", "ddim50")
    with pytest.raises(ConfigError, match="sampler=euler: use ddpm, ddim, dpm\\+\\+"):
        samplers.check_sampler("euler", "25")
    samplers.check_sampler("ddim", "ddim50")
    samplers.check_sampler("dpm++", 25)
    samplers.check_sampler("dpm++sde", "25")
    with pytest.raises(ConfigError, match="sampler=dpm\\+\\+sde takes steps=<number of solver steps>"):
        samplers.check_sampler("dpm++sde", "250x")


def test_the_config_offers_every_sampler():
    """The schema's sampler choices (written out: the config imports no torch) are the samplers'."""
    import dataclasses
    from moh_vision.config import SampleConfig
    fields = {f.name: f for f in dataclasses.fields(SampleConfig)}
    for name in ("sampler", "fid_sampler"):
        assert fields[name].metadata["choices"] == samplers.SAMPLERS, name


@pytest.fixture
def solver_calls(monkeypatch):
    calls = []
    real = samplers.dpm_solver_sample

    def spy(diffusion, model_fn, noise, steps, **kwargs):
        calls.append({"steps": steps, "num_timesteps": diffusion.num_timesteps, "batch": noise.shape[0]})
        return real(diffusion, model_fn, noise, steps, **kwargs)
    monkeypatch.setattr(samplers, "dpm_solver_sample", spy)
    return calls


def test_tools_sample_samples_with_dpm_solver(checkpoint, tmp_path, solver_calls, capsys):  # noqa: F811
    tool = load_tool("sample")
    summary = tool.main([f"ckpt={checkpoint}", "sampler=dpm++", "steps=3", "num_samples=6", "batch_size=3",
                         "progress=false", f"out={tmp_path}"])
    assert (summary["sampler"], summary["steps"]) == ("dpm++", 3)
    assert json.loads((tmp_path / "sample.json").read_text())["sampler"] == "dpm++"
    assert solver_calls and all(c == {"steps": 3, "num_timesteps": 1000, "batch": 3} for c in solver_calls[:2])
    assert np.load(tmp_path / "samples.npz")["arr_0"].shape == (6, 16, 16, 3)
    with pytest.raises(SystemExit) as stop:
        tool.main([f"ckpt={checkpoint}", "sampler=dpm++", "steps=ddim50", "progress=false", f"out={tmp_path}"])
    assert stop.value.code == 2
    assert "error: sampler=dpm++ takes steps=<number of solver steps>" in capsys.readouterr().err


def test_the_training_grids_sample_with_the_configured_sampler(checkpoint, tmp_path, solver_calls):  # noqa: F811
    from moh_vision.cli import parse_options
    from moh_vision.apps import sampling
    from moh_vision.tasks.protocols import EpochContext
    words = [f"ckpt={checkpoint}", "sampler=dpm++", "steps=2"]
    task, model, _, _ = sampling.load_model(parse_options(words, load_tool("sample").OPTIONS)[0], torch.device("cpu"))
    task.sample_cfg.update(per_class=2, grid_classes=3, eval_per_class=0)
    images = []
    ctx = EpochContext(epoch=0, step=1, last_epoch=True, is_main=True, device=torch.device("cpu"), out_dir=tmp_path,
                       model_for_eval=model, log_image=lambda key, path, caption="": images.append(path))
    task.on_epoch_end(ctx)
    assert images and images[0].exists()
    assert solver_calls == [{"steps": 2, "num_timesteps": 1000, "batch": 6}]


def test_compare_samplers_times_and_scores_each_arm_against_the_first(checkpoint, tmp_path):  # noqa: F811
    out = tmp_path / "samplers.json"
    record = load_tool("compare_samplers").main([f"ckpt={checkpoint}", "arms=ddpm:4,dpm++:2", "per_class=1",
                                                 f"out={out}"])
    assert json.loads(out.read_text())["arms"] == ["ddpm:4", "dpm++:2"]
    assert [(r["sampler"], r["model_calls"]) for r in record["results"]] == [("ddpm", 4), ("dpm++", 2)]
    (versus,) = record["vs_reference"]["dpm++:2"]
    assert versus["step_ratio"] == 2 and versus["speedup"] > 0
    first, second = record["results"]
    assert versus["class_acc_diff"] == pytest.approx(second["sample/class_acc"] - first["sample/class_acc"])
    assert versus["within_tolerance"] == (abs(versus["class_acc_diff"]) <= 3 and abs(versus["fd_digits_diff"]) <= 3)
