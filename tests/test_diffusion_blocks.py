"""zoo.blocks.diffusion against hand-computed values and a Gaussian toy problem with an exact denoiser."""
import math

import pytest
import torch

from zoo.blocks.diffusion import (DDIMSampler, DDPMSampler, DPMSolverPP2M, NoiseSchedule, classifier_free_guidance,
                                  diffusion_loss, sample)

MU, STD = 0.7, 0.5  # data distribution N(MU, STD^2) per dimension


def exact_eps(schedule):
    """E[eps | x_t] for Gaussian data: the best possible eps-predictor."""
    def denoise(x, t):
        ab = schedule.alpha_bar(t.cpu()).float().view(-1, *([1] * (x.dim() - 1)))
        a, s = ab.sqrt(), (1 - ab).sqrt()
        return s * (x - a * MU) / (a ** 2 * STD ** 2 + s ** 2)
    return denoise


def test_linear_schedule_values():
    s = NoiseSchedule("linear")
    assert s.betas[0].item() == pytest.approx(1e-4) and s.betas[-1].item() == pytest.approx(0.02)
    assert s.alphas_cumprod[0].item() == pytest.approx(1 - 1e-4)
    assert s.alphas_cumprod[1].item() == pytest.approx((1 - 1e-4) * (1 - (1e-4 + (0.02 - 1e-4) / 999)))
    assert s.alpha_bar(-1).item() == 1.0


def test_cosine_schedule_follows_improved_ddpm():
    s = NoiseSchedule("cosine", 1000)
    f = lambda t: math.cos((t / 1000 + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    for t in (0, 10, 500, 900):
        assert s.alphas_cumprod[t].item() == pytest.approx(f(t + 1) / f(0), rel=1e-6)
    assert s.betas.max().item() <= 0.999


def test_scaled_linear_schedule():
    s = NoiseSchedule("scaled_linear")
    assert s.betas[0].item() == pytest.approx(0.00085) and s.betas[-1].item() == pytest.approx(0.012)


def test_add_noise_targets_and_split_round_trip():
    s = NoiseSchedule("cosine")
    x0, noise = torch.randn(4, 3, 8, 8), torch.randn(4, 3, 8, 8)
    t = torch.tensor([0, 10, 500, 999])
    x_t = s.add_noise(x0, noise, t)
    ab = s.alpha_bar(t).float().view(-1, 1, 1, 1)
    torch.testing.assert_close(x_t, ab.sqrt() * x0 + (1 - ab).sqrt() * noise)
    for prediction in ("eps", "v", "x0"):
        got_x0, got_eps = s.split(s.target(x0, noise, t, prediction), x_t, t, prediction)
        # eps-prediction divides by sqrt(alpha-bar) ~ 0.006 at t = 999: fp32 error grows accordingly
        torch.testing.assert_close(got_x0, x0, atol=1e-2 if prediction == "eps" else 1e-4, rtol=1e-3)
        if prediction != "x0":
            torch.testing.assert_close(got_eps, noise, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="unknown prediction"):
        s.target(x0, noise, t, "score")
    with pytest.raises(ValueError, match="unknown schedule"):
        NoiseSchedule("sigmoid")


def test_ddim_eta_one_all_steps_is_the_ddpm_update():
    s = NoiseSchedule("linear", 100)
    ddpm = DDPMSampler(s, variance="fixed_small", clip_x0=None)
    ddim = DDIMSampler(s, steps=100, eta=1.0)
    assert ddim.timesteps == ddpm.timesteps
    x, out, z = torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4)
    for i in (0, 50, 98):
        torch.testing.assert_close(ddim.step(out, i, x, noise=z), ddpm.step(out, i, x, noise=z), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("make", [
    lambda s: DDPMSampler(s, variance="fixed_small", clip_x0=None),
    lambda s: DDPMSampler(s, variance="fixed_large", clip_x0=None),
    lambda s: DDIMSampler(s, steps=50),
    lambda s: DDIMSampler(s, steps=250, eta=1.0),  # stochastic DDIM needs more steps than eta=0
    lambda s: DPMSolverPP2M(s, steps=20),
], ids=["ddpm_small", "ddpm_large", "ddim50", "ddim250_eta1", "dpmpp2m_20"])
def test_samplers_recover_the_gaussian(make):
    s = NoiseSchedule("linear", 1000)
    g = torch.Generator().manual_seed(0)
    x = sample(make(s), exact_eps(s), (20000, 1), generator=g)
    assert x.mean().item() == pytest.approx(MU, abs=0.03)
    assert x.std().item() == pytest.approx(STD, abs=0.03)


def test_deterministic_ddim_inverts():
    s = NoiseSchedule("linear", 1000)
    x0 = MU + STD * torch.randn(64, 2, generator=torch.Generator().manual_seed(1))
    errors = []
    for steps in (50, 1000):  # inversion is first order: the round-trip error shrinks with the step size
        sampler = DDIMSampler(s, steps=steps)
        back = sample(sampler, exact_eps(s), x0.shape, x_T=sampler.invert(exact_eps(s), x0))
        errors.append((back - x0).abs().max().item())
    assert errors[1] < 0.02 and errors[1] < errors[0] / 5


def test_sampling_is_deterministic_under_a_seed():
    s = NoiseSchedule("cosine", 100)
    a = sample(DDPMSampler(s), exact_eps(s), (4, 3), generator=torch.Generator().manual_seed(3))
    b = sample(DDPMSampler(s), exact_eps(s), (4, 3), generator=torch.Generator().manual_seed(3))
    assert torch.equal(a, b)


def test_dpm_solver_20_steps_close_to_ddim_250():
    s = NoiseSchedule("linear", 1000)
    x_T = torch.randn(512, 1, generator=torch.Generator().manual_seed(2))
    fine = sample(DDIMSampler(s, steps=250), exact_eps(s), x_T.shape, x_T=x_T)
    fast = sample(DPMSolverPP2M(s, steps=20), exact_eps(s), x_T.shape, x_T=x_T)
    coarse = sample(DDIMSampler(s, steps=20), exact_eps(s), x_T.shape, x_T=x_T)
    assert (fast - fine).abs().mean() < (coarse - fine).abs().mean()
    assert (fast - fine).abs().mean() < 0.02


def test_classifier_free_guidance_combination():
    calls = []

    def denoise(x, t, cond):
        calls.append(x.shape[0])
        return cond.float().view(-1, 1).expand_as(x)
    x, t = torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)
    out = classifier_free_guidance(denoise, x, t, torch.tensor([2, 2]), torch.tensor([0, 0]), scale=3.0)
    torch.testing.assert_close(out, torch.full((2, 3), 6.0))  # 0 + 3 * (2 - 0)
    assert calls == [4], "conditional and unconditional halves in one batch"
    assert torch.equal(classifier_free_guidance(denoise, x, t, torch.tensor([2, 2]), torch.tensor([0, 0]), 1.0),
                       torch.full((2, 3), 2.0))


def test_loss_is_zero_for_the_exact_target():
    s = NoiseSchedule("linear", 1000)
    x0 = torch.randn(16, 3)
    g = torch.Generator().manual_seed(0)
    captured = {}

    def perfect(x_t, t):  # recovers eps exactly from x_t because it knows x0
        ab = s.alpha_bar(t).float().view(-1, 1)
        return (x_t - ab.sqrt() * x0) / (1 - ab).sqrt()
    assert diffusion_loss(perfect, x0, s, generator=g).item() < 1e-8
    with pytest.raises(ValueError):
        DDIMSampler(s, steps=0)
