"""Gaussian diffusion: schedules, respacing, closed forms, losses, samplers and guidance.

Every check compares against an independent derivation (a Python-float loop, a Gaussian product,
a model that knows the answer), so a wrong formula in the package makes it fail.
"""
import math

import pytest
import torch
from torch import nn

from moh_vision.diffusion import (GaussianDiffusion, create_diffusion, guided_model_fn, respace_betas,
                                  space_timesteps, uniform_timesteps)
from moh_vision.errors import ConfigError

C, H, W = 4, 4, 4


def broadcast(values, ndim=4):
    return values.view(-1, *([1] * (ndim - 1)))


def exact_eps_model(diffusion_1000, x_star, learn_sigma=True, calls=None):
    """eps of the point mass at x_star, computed from the full 1000-step schedule at the t it is given."""
    ac = diffusion_1000.alphas_cumprod

    def model(x, t, y=None):
        if calls is not None:
            calls.append(t.clone())
        a = broadcast(ac[t].to(x.dtype))
        eps = (x - a.sqrt() * x_star) / (1 - a).sqrt()
        return torch.cat([eps, torch.zeros_like(eps)], 1) if learn_sigma else eps

    return model


class TinyModel(nn.Module):
    """A class-conditional conv net with DiT's signature and learned-sigma output layout."""

    def __init__(self, channels=C, num_classes=3):
        super().__init__()
        self.conv = nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.t_embed = nn.Linear(1, 2 * channels)
        self.y_embed = nn.Embedding(num_classes + 1, 2 * channels)

    def forward(self, x, t, y):
        cond = self.t_embed(t.to(x.dtype).view(-1, 1) / 1000) + self.y_embed(y)
        # tanh keeps eps and the variance interpolation value in range, as a trained model's would be.
        return torch.tanh(self.conv(x) + cond.view(x.shape[0], -1, 1, 1))


# ---------------------------------------------------------------------------------------------
# Schedule and respacing
# ---------------------------------------------------------------------------------------------
def test_linear_betas_endpoints_and_length():
    d = create_diffusion("")
    assert d.betas.dtype == torch.float64 and d.num_timesteps == 1000 and len(d.betas) == 1000
    assert d.betas[0].item() == pytest.approx(1e-4, abs=1e-15)
    assert d.betas[-1].item() == pytest.approx(0.02, abs=1e-15)
    assert bool((d.betas[1:] > d.betas[:-1]).all())
    half = create_diffusion("", diffusion_steps=500)  # rescaled so the total noise is unchanged
    assert half.betas[0].item() == pytest.approx(2e-4) and half.betas[-1].item() == pytest.approx(0.04)
    assert half.alphas_cumprod[-1].item() == pytest.approx(d.alphas_cumprod[-1].item(), rel=0.1)


def test_alphas_cumprod_is_the_cumulative_product():
    d = create_diffusion("")
    running, expected = 1.0, []
    for beta in d.betas.tolist():
        running *= 1.0 - beta
        expected.append(running)
    assert torch.allclose(d.alphas_cumprod, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=0)
    assert torch.equal(d.alphas_cumprod_prev[1:], d.alphas_cumprod[:-1]) and d.alphas_cumprod_prev[0] == 1


def test_posterior_variance_closed_form():
    d = create_diffusion("")
    b, ac = d.betas.tolist(), d.alphas_cumprod.tolist()
    for t in (1, 2, 10, 500, 999):
        expected = b[t] * (1 - ac[t - 1]) / (1 - ac[t])
        assert d.posterior_variance[t].item() == pytest.approx(expected, rel=1e-12)
        assert d.posterior_log_variance_clipped[t].item() == pytest.approx(math.log(expected), rel=1e-12)
    assert d.posterior_variance[0].item() == 0.0  # x0 is known exactly after the last reverse step
    assert d.posterior_log_variance_clipped[0] == d.posterior_log_variance_clipped[1]


def test_space_timesteps_specs():
    steps = space_timesteps(1000, "250")
    assert len(steps) == 250 and steps[0] == 0 and steps[-1] == 999 and steps == sorted(set(steps))
    assert space_timesteps(1000, 250) == steps
    assert space_timesteps(1000, "ddim50") == list(range(0, 1000, 20))
    sections = space_timesteps(300, "10,15,20")
    assert len(sections) == 45
    assert sum(s < 100 for s in sections) == 10 and sum(100 <= s < 200 for s in sections) == 15
    assert sections[:2] == [0, 11] and 99 in sections and 199 in sections and 299 in sections
    assert space_timesteps(1000, [1000]) == list(range(1000))
    for bad in ("2000", "ddim6x", "ten"):
        with pytest.raises(ConfigError):
            space_timesteps(1000, bad)
    with pytest.raises(ConfigError):
        space_timesteps(10, "ddim6")  # no integer stride gives 6 of 10 steps


def _dit_space_timesteps(num_timesteps, spec):
    """DiT's / guided-diffusion's respacing (diffusion/respace.py), restated: the reference to match."""
    if spec.startswith("ddim"):
        want = int(spec[len("ddim"):])
        for stride in range(1, num_timesteps):  # the reference never tries stride == num_timesteps
            if len(range(0, num_timesteps, stride)) == want:
                return sorted(range(0, num_timesteps, stride))
        return None  # the reference raises
    counts = [int(part) for part in spec.split(",")]
    per, extra = divmod(num_timesteps, len(counts))
    taken, offset = set(), 0
    for i, count in enumerate(counts):
        size = per + (i < extra)
        if size < count:
            return None
        step = 1 if count <= 1 else (size - 1) / (count - 1)
        at = 0.0
        for _ in range(count):
            taken.add(offset + round(at))
            at += step
        offset += size
    return sorted(taken)


def test_space_timesteps_matches_dit_for_every_count():
    specs = [str(n) for n in range(1, 1001)] + ["ddim10", "ddim25", "ddim50", "ddim100", "ddim250", "ddim500"]
    for spec in specs:
        assert space_timesteps(1000, spec) == _dit_space_timesteps(1000, spec), spec
    assert space_timesteps(1000, "21") == _dit_space_timesteps(1000, "21")  # one of the counts that used to differ
    for spec in ("10,15,20", "7,33", "21,23,31", "1,2,3,4,5", "100,250,500", "3,999"):
        for total in (300, 1000, 1001):
            expected = _dit_space_timesteps(total, spec)
            if expected is None:
                with pytest.raises(ConfigError):
                    space_timesteps(total, spec)
            else:
                assert space_timesteps(total, spec) == expected, (total, spec)


@pytest.mark.parametrize("spec", ["ddim1", "ddim37", "ddim1001"])
def test_space_timesteps_ddim_without_integer_stride_is_a_config_error(spec):
    assert _dit_space_timesteps(1000, spec) is None
    with pytest.raises(ConfigError) as info:
        space_timesteps(1000, spec)
    assert "\n" not in str(info.value) and spec in str(info.value)


@pytest.mark.parametrize("spacing", ["250", "ddim50", "10,15,20", "1"])
def test_respaced_schedule_keeps_alphas_cumprod_at_kept_steps(spacing):
    base, spaced = create_diffusion(""), create_diffusion(spacing)
    kept = torch.tensor(space_timesteps(1000, spacing))
    assert torch.equal(spaced.timestep_map, kept) and spaced.num_timesteps == len(kept)
    assert torch.allclose(spaced.alphas_cumprod, base.alphas_cumprod[kept], rtol=1e-12, atol=0)
    assert bool((spaced.betas > 0).all() and (spaced.betas <= 1).all())


def test_respace_betas_identity_when_all_steps_are_kept():
    base = create_diffusion("")
    betas, timestep_map = respace_betas(base.betas, range(1000))
    assert torch.allclose(betas, base.betas, rtol=1e-10) and torch.equal(timestep_map, torch.arange(1000))


# ---------------------------------------------------------------------------------------------
# Forward process and posterior
# ---------------------------------------------------------------------------------------------
def test_q_sample_exact_with_fixed_noise():
    d = create_diffusion("")
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(3, C, H, W, generator=gen, dtype=torch.float64)
    noise = torch.randn(3, C, H, W, generator=gen, dtype=torch.float64)
    t = torch.tensor([0, 321, 999])
    ac = [math.prod(1 - b for b in d.betas[: i + 1].tolist()) for i in t.tolist()]
    expected = torch.stack([math.sqrt(a) * x0[i] + math.sqrt(1 - a) * noise[i] for i, a in enumerate(ac)])
    assert torch.allclose(d.q_sample(x0, t, noise), expected, rtol=1e-10, atol=1e-12)


def test_q_sample_statistics():
    d = create_diffusion("")
    torch.manual_seed(0)
    n, t = 200_000, 400
    x0 = torch.full((n, 1), 0.7)
    xt = d.q_sample(x0, torch.full((n,), t))
    a = d.alphas_cumprod[t].item()
    assert xt.mean().item() == pytest.approx(math.sqrt(a) * 0.7, abs=0.01)
    assert xt.var().item() == pytest.approx(1 - a, rel=0.02)


def test_q_posterior_matches_gaussian_product():
    """q(x_{t-1} | x_t, x0) ∝ q(x_{t-1} | x0) q(x_t | x_{t-1}); multiply the two Gaussians in x_{t-1}."""
    d = create_diffusion("")
    gen = torch.Generator().manual_seed(1)
    x0 = torch.randn(4, C, H, W, generator=gen, dtype=torch.float64)
    xt = torch.randn(4, C, H, W, generator=gen, dtype=torch.float64)
    t = torch.tensor([1, 5, 250, 999])
    mean, var, log_var = d.q_posterior_mean_variance(x0, xt, t)
    for i, step in enumerate(t.tolist()):
        beta, a_prev = d.betas[step].item(), d.alphas_cumprod[step - 1].item()
        # prior N(sqrt(a_prev) x0, 1 - a_prev); likelihood of x_t: N(sqrt(1 - beta) x_{t-1}, beta)
        precision = 1 / (1 - a_prev) + (1 - beta) / beta
        expected_mean = (math.sqrt(a_prev) * x0[i] / (1 - a_prev) + math.sqrt(1 - beta) * xt[i] / beta) / precision
        assert torch.allclose(mean[i], expected_mean, rtol=1e-9, atol=1e-12)
        assert var[i].item() == pytest.approx(1 / precision, rel=1e-9)
        assert log_var[i].item() == pytest.approx(-math.log(precision), rel=1e-9)


# ---------------------------------------------------------------------------------------------
# Losses
# ---------------------------------------------------------------------------------------------
def perfect_predictor(noise, var_value):
    def model(x, t, y=None):
        return torch.cat([noise, torch.full_like(noise, var_value)], 1)
    return model


@pytest.mark.parametrize("spacing", ["", "ddim50"])
def test_perfect_predictor_has_zero_vb_and_mse(spacing):
    d = create_diffusion(spacing)
    gen = torch.Generator().manual_seed(2)
    T = d.num_timesteps
    t = torch.tensor([1, 2, T // 4, T // 2, T - 1, 0])
    x0 = torch.rand(len(t), C, H, W, generator=gen, dtype=torch.float64) * 2 - 1
    noise = torch.randn(len(t), C, H, W, generator=gen, dtype=torch.float64)
    # v = -1 puts the learned log variance exactly on the true (clipped) posterior log variance.
    out = d.training_losses(perfect_predictor(noise, -1.0), x0, t, noise=noise)
    assert set(out) == {"loss", "mse", "vb"}
    assert bool((out["mse"] == 0).all())
    assert out["vb"][:-1].abs().max().item() < 1e-9
    assert torch.equal(out["loss"], out["mse"] + out["vb"])
    # t = 0: the decoder NLL in bits of x0's 2/255-wide bin under N(x0, posterior variance at t = 1)
    half_bin = (1 / 255) / math.exp(0.5 * d.posterior_log_variance_clipped[0].item())
    bin_mass = torch.special.ndtr(torch.tensor(half_bin)) - torch.special.ndtr(torch.tensor(-half_bin))
    assert out["vb"][-1].item() == pytest.approx(-math.log2(bin_mass.item()), rel=5e-3)
    # The same mean with the upper end of the range (beta_t) is a worse variance at small t.
    wrong = d.training_losses(perfect_predictor(noise, 1.0), x0, t, noise=noise)
    assert wrong["vb"][0].item() > 1e-3 and bool((wrong["vb"][:-1] >= out["vb"][:-1]).all())


def test_vb_term_trains_only_the_variance_channels():
    d = create_diffusion("")
    x0 = torch.rand(2, C, H, W) * 2 - 1
    output = torch.randn(2, 2 * C, H, W, requires_grad=True)
    t = torch.tensor([10, 600])
    losses = d.training_losses(lambda x, t: output, x0, t)
    grad_vb, = torch.autograd.grad(losses["vb"].sum(), output, retain_graph=True)
    assert grad_vb[:, :C].abs().max() == 0 and grad_vb[:, C:].abs().max() > 0
    grad_mse, = torch.autograd.grad(losses["mse"].sum(), output)
    assert grad_mse[:, C:].abs().max() == 0 and grad_mse[:, :C].abs().max() > 0


@pytest.mark.parametrize("sigma_small", [False, True])
def test_fixed_variance_uses_plain_mse(sigma_small):
    d = create_diffusion("", learn_sigma=False, sigma_small=sigma_small)
    x0 = torch.rand(3, C, H, W) * 2 - 1
    noise = torch.randn_like(x0)
    t = torch.tensor([0, 5, 900])
    predicted = noise + 0.1
    out = d.training_losses(lambda x, t: predicted, x0, t, noise=noise)
    assert set(out) == {"loss", "mse"} and torch.equal(out["loss"], out["mse"])
    assert torch.allclose(out["mse"], torch.full((3,), 0.01), rtol=1e-4)
    log_var = d.p_mean_variance(lambda x, t: predicted, x0, t)["log_variance"][:, 0, 0, 0].double()
    expected = d.posterior_log_variance_clipped[t] if sigma_small else torch.log(d.betas[t])
    assert torch.allclose(log_var[1:], expected[1:], rtol=1e-5)
    with pytest.raises(ValueError, match="expected"):
        d.training_losses(lambda x, t: torch.cat([predicted, predicted], 1), x0, t)


def test_loss_variants_scale_the_vb_term_and_switch_the_target():
    gen = torch.Generator().manual_seed(6)
    x0 = torch.rand(3, C, H, W, generator=gen, dtype=torch.float64) * 2 - 1
    noise = torch.randn(3, C, H, W, generator=gen, dtype=torch.float64)
    output = torch.randn(3, 2 * C, H, W, generator=gen, dtype=torch.float64).tanh()
    model, t = (lambda x, t: output), torch.tensor([0, 30, 99])
    hybrid = create_diffusion("", diffusion_steps=100).training_losses(model, x0, t, noise=noise)
    rescaled = create_diffusion("", diffusion_steps=100, rescale_learned_sigmas=True).training_losses(
        model, x0, t, noise=noise)
    assert torch.allclose(rescaled["vb"], hybrid["vb"] * 0.1) and torch.equal(rescaled["mse"], hybrid["mse"])
    kl = create_diffusion("", diffusion_steps=100, use_kl=True).training_losses(model, x0, t, noise=noise)
    assert set(kl) == {"loss", "vb"} and torch.allclose(kl["vb"], hybrid["vb"])
    assert torch.allclose(kl["loss"], hybrid["vb"] * 100)
    x0_pred = create_diffusion("", diffusion_steps=100, predict_xstart=True).training_losses(
        model, x0, t, noise=noise)
    assert torch.allclose(x0_pred["mse"], ((output[:, :C] - x0) ** 2).mean((1, 2, 3)))


def test_uniform_timesteps_cover_the_range():
    t = uniform_timesteps(4000, 10, generator=torch.Generator().manual_seed(0))
    assert t.dtype == torch.long and t.min() == 0 and t.max() == 9
    assert torch.bincount(t, minlength=10).min() > 300
    assert create_diffusion("").sample_timesteps(8).shape == (8,)


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler,spacing", [("ddpm", "8"), ("ddim", "ddim8")])
def test_samplers_run_with_a_tiny_model(sampler, spacing):
    torch.manual_seed(0)
    model = TinyModel().eval()
    d = create_diffusion(spacing)
    y = torch.tensor([0, 1, 2])
    x = d.sample(model, (3, C, H, W), dict(y=y), sampler=sampler, progress=True)
    assert x.shape == (3, C, H, W) and bool(torch.isfinite(x).all())
    loop = d.p_sample_loop if sampler == "ddpm" else d.ddim_sample_loop
    assert loop(model, (3, C, H, W), model_kwargs=dict(y=y)).shape == (3, C, H, W)


def test_respaced_model_sees_original_timesteps():
    calls = []
    d = create_diffusion("ddim50")
    model = exact_eps_model(create_diffusion(""), torch.zeros(1, C, H, W), calls=calls)
    d.ddim_sample_loop(model, (2, C, H, W))
    assert [c[0].item() for c in calls] == list(range(980, -1, -20))
    calls.clear()
    d.training_losses(model, torch.zeros(2, C, H, W), torch.tensor([0, 49]))
    assert calls[0].tolist() == [0, 980]


def test_ddim_eta0_is_deterministic_and_eta1_is_not():
    model = TinyModel().eval()
    d = create_diffusion("ddim10")
    y = torch.tensor([1, 2])
    noise = torch.randn(2, C, H, W)
    torch.manual_seed(1)
    first = d.ddim_sample_loop(model, noise.shape, noise=noise, model_kwargs=dict(y=y), eta=0.0)
    torch.manual_seed(2)
    second = d.ddim_sample_loop(model, noise.shape, noise=noise, model_kwargs=dict(y=y), eta=0.0)
    assert torch.equal(first, second)
    noisy = [d.ddim_sample_loop(model, noise.shape, noise=noise, model_kwargs=dict(y=y), eta=1.0,
                                generator=torch.Generator().manual_seed(seed)) for seed in (1, 2)]
    assert not torch.allclose(noisy[0], noisy[1])


def test_ddim_eta1_is_ddpm_with_the_posterior_variance():
    """DDIM's eta = 1 noise level is the posterior variance, so it reproduces DDPM draw for draw."""
    net = TinyModel().double().eval()

    def model(x, t, y):  # pin the learned variance to the posterior variance (v = -1)
        eps = net(x, t, y)[:, :C]
        return torch.cat([eps, -torch.ones_like(eps)], 1)

    d = create_diffusion("ddim10")
    kw = dict(model_kwargs=dict(y=torch.tensor([0, 2])), noise=torch.randn(2, C, H, W, dtype=torch.float64))
    ddpm = d.p_sample_loop(model, (2, C, H, W), generator=torch.Generator().manual_seed(7), **kw)
    ddim = d.ddim_sample_loop(model, (2, C, H, W), eta=1.0, generator=torch.Generator().manual_seed(7), **kw)
    assert torch.allclose(ddpm, ddim, atol=1e-9)


@pytest.mark.parametrize("sampler,spacing", [("ddim", "ddim20"), ("ddim", ""), ("ddpm", "25")])
def test_exact_eps_recovers_a_point_mass(sampler, spacing):
    gen = torch.Generator().manual_seed(3)
    x_star = torch.rand(1, C, H, W, generator=gen, dtype=torch.float64) * 1.6 - 0.8
    model = exact_eps_model(create_diffusion(""), x_star)
    noise = torch.randn(2, C, H, W, generator=gen, dtype=torch.float64)
    x = create_diffusion(spacing).sample(model, noise.shape, sampler=sampler, noise=noise, generator=gen)
    assert torch.allclose(x, x_star.expand_as(x), atol=1e-8)


def test_ddim_eta0_follows_the_exact_ode_path_of_a_point_mass():
    """With the exact eps, every DDIM step keeps the implied noise fixed: x_t = sqrt(ab) x* + sqrt(1 - ab) eps_T."""
    gen = torch.Generator().manual_seed(4)
    x_star = torch.rand(1, C, H, W, generator=gen, dtype=torch.float64) * 2 - 1
    d = create_diffusion("ddim10")
    x_T = torch.randn(2, C, H, W, generator=gen, dtype=torch.float64)
    a_T = d.alphas_cumprod[-1].item()
    eps_T = (x_T - math.sqrt(a_T) * x_star) / math.sqrt(1 - a_T)
    steps = list(d.sample_loop_progressive(exact_eps_model(create_diffusion(""), x_star), x_T.shape, "ddim",
                                           noise=x_T))
    for i, out in zip(range(d.num_timesteps - 1, -1, -1), steps):
        a_prev = d.alphas_cumprod_prev[i].item()
        assert torch.allclose(out["sample"], math.sqrt(a_prev) * x_star + math.sqrt(1 - a_prev) * eps_T, atol=1e-9)
        assert torch.allclose(out["pred_xstart"], x_star.expand_as(x_T), atol=1e-9)


def test_ddpm_marginals_match_the_forward_process_for_a_point_mass():
    """With the exact eps and the posterior variance (v = -1), each DDPM step samples q(x_{t-1} | x_t, x*),
    so every intermediate x_{t-1} is distributed as q(x_{t-1} | x*) = N(sqrt(ab) x*, 1 - ab)."""
    gen = torch.Generator().manual_seed(5)
    x_star = torch.full((1, 1, 1, 1), 0.6, dtype=torch.float64)
    base, d = create_diffusion(""), create_diffusion("10")
    eps_model = exact_eps_model(base, x_star, learn_sigma=False)

    def model(x, t):
        eps = eps_model(x, t)
        return torch.cat([eps, -torch.ones_like(eps)], 1)

    n = 40_000
    steps = list(d.sample_loop_progressive(model, (n, 1, 1, 1), "ddpm", generator=gen,
                                           noise=torch.randn(n, 1, 1, 1, generator=gen, dtype=torch.float64)))
    for i in (8, 5, 2):  # the sample produced at step i is x_{i-1}
        out = steps[d.num_timesteps - 1 - i]["sample"]
        a_prev = d.alphas_cumprod_prev[i].item()
        assert out.mean().item() == pytest.approx(math.sqrt(a_prev) * 0.6, abs=0.02)
        assert out.var().item() == pytest.approx(1 - a_prev, rel=0.04)


# ---------------------------------------------------------------------------------------------
# Classifier-free guidance
# ---------------------------------------------------------------------------------------------
NULL = 9


def toy_conditional_model(calls=None):
    """Output channel k of class y is (k + 1) * (y + 1) + 0.01 * x; 2C channels (learned sigma)."""
    scale = torch.arange(1, 2 * C + 1, dtype=torch.float32).view(1, -1, 1, 1)

    def model(x, t, y):
        if calls is not None:
            calls.append(len(x))
        return scale * (y.float() + 1).view(-1, 1, 1, 1) + 0.01 * x.repeat(1, 2, 1, 1)

    return model


def test_cfg_scale_one_is_the_conditional_model_in_one_pass():
    calls = []
    model = toy_conditional_model(calls)
    x, t, y = torch.randn(3, C, H, W), torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2])
    assert torch.equal(guided_model_fn(model, 1.0, NULL)(x, t, y), model(x, t, y))
    assert calls == [3, 3]  # the guided call did not double the batch


@pytest.mark.parametrize("scale", [1.5, 4.0])
def test_guidance_on_all_channels_vs_first_three(scale):
    model = toy_conditional_model()
    x, t, y = torch.randn(2, C, H, W), torch.tensor([3, 4]), torch.tensor([0, 2])
    cond, uncond = model(x, t, y), model(x, t, torch.full_like(y, NULL))
    mixed = uncond + scale * (cond - uncond)

    full = guided_model_fn(model, scale, NULL)(x, t, y)
    assert full.shape == (2, 2 * C, H, W)
    assert torch.allclose(full[:, :C], mixed[:, :C]) and torch.equal(full[:, C:], cond[:, C:])

    dit = guided_model_fn(model, scale, NULL, guidance_channels=3)(x, t, y)
    assert torch.allclose(dit[:, :3], mixed[:, :3])
    assert torch.equal(dit[:, 3:], cond[:, 3:])  # 4th eps channel and the variances: conditional
    differs = (dit != full).flatten(2).any(-1).any(0)
    assert differs.tolist() == [False, False, False, True] + [False] * C


def test_guided_model_drives_a_sampler():
    model = TinyModel(num_classes=3).eval()
    fn = guided_model_fn(model, 4.0, null_class=3)
    x = create_diffusion("4").sample(fn, (2, C, H, W), dict(y=torch.tensor([0, 1])))
    assert x.shape == (2, C, H, W) and bool(torch.isfinite(x).all())
    with pytest.raises(ConfigError):
        guided_model_fn(model, 4.0, 3, guidance_channels=C + 1)(x, torch.tensor([0, 0]), torch.tensor([0, 1]))


def test_invalid_options_raise_config_errors():
    with pytest.raises(ConfigError, match="cosine"):
        create_diffusion("", noise_schedule="cosine")
    with pytest.raises(ConfigError, match="sampler"):
        create_diffusion("4").sample(TinyModel(), (1, C, H, W), dict(y=torch.tensor([0])), sampler="euler")
    with pytest.raises(ConfigError):
        GaussianDiffusion(torch.tensor([0.1, 1.5]))
