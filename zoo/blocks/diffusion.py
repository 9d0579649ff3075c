"""Diffusion: noise schedules, training targets and samplers (DDPM, DDIM, DPM-Solver++ 2M), guidance.

Usable on its own by any project with a denoiser `denoise(x_t, t) -> prediction`:

    schedule = NoiseSchedule("cosine")
    loss = diffusion_loss(lambda x, t: net(x, t), x0, schedule, prediction="eps")
    x0 = sample(DDIMSampler(schedule, steps=50), lambda x, t: net(x, t), (16, 3, 32, 32))

Equation numbers refer to DDPM (Ho et al. 2020), improved DDPM (Nichol & Dhariwal 2021), DDIM
(Song et al. 2021) and DPM-Solver++ (Lu et al. 2022). The schedule arithmetic is float64 on the
host and is applied in fp32, also under autocast.
"""
from __future__ import annotations

import math
from typing import Callable, Literal

import torch
from torch import Tensor

__all__ = ["NoiseSchedule", "diffusion_loss", "DDPMSampler", "DDIMSampler", "DPMSolverPP2M", "sample",
           "classifier_free_guidance"]

Prediction = Literal["eps", "v", "x0"]
Denoiser = Callable[[Tensor, Tensor], Tensor]


class NoiseSchedule:
    """beta_1..beta_T and the quantities derived from them (float64, indexed by t = 0..T-1)."""

    def __init__(self, kind: Literal["linear", "cosine", "scaled_linear"] = "linear", steps: int = 1000, *,
                 beta_start: float | None = None, beta_end: float | None = None):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        t = torch.arange(steps, dtype=torch.float64)
        if kind == "linear":  # DDPM section 4: 1e-4 .. 0.02 over 1000 steps
            betas = torch.linspace(beta_start or 1e-4, beta_end or 0.02, steps, dtype=torch.float64)
        elif kind == "scaled_linear":  # latent diffusion: linear in sqrt(beta)
            betas = torch.linspace((beta_start or 0.00085) ** 0.5, (beta_end or 0.012) ** 0.5, steps,
                                   dtype=torch.float64) ** 2
        elif kind == "cosine":  # improved DDPM eq. 17, s = 0.008, betas clipped at 0.999
            f = lambda u: torch.cos((u / steps + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
            betas = (1 - f(t + 1) / f(t)).clamp(max=0.999)
        else:
            raise ValueError(f"unknown schedule {kind!r}; choose linear, cosine or scaled_linear")
        self.kind, self.steps = kind, steps
        self.betas = betas
        self.alphas = 1.0 - betas
        self.alphas_cumprod = torch.cumprod(self.alphas, dim=0)  # alpha-bar_t

    def __repr__(self):
        return f"NoiseSchedule({self.kind!r}, steps={self.steps})"

    def alpha_bar(self, t: Tensor | int) -> Tensor:
        """alpha-bar at integer t; t = -1 means 'clean data' (alpha-bar = 1). The table stays on the CPU in
        float64 (CUDA's float64 is slow), so timesteps from any device are looked up there."""
        t = torch.as_tensor(t, dtype=torch.long).cpu()
        return torch.where(t >= 0, self.alphas_cumprod[t.clamp(min=0)], torch.ones((), dtype=torch.float64))

    def _coef(self, values: Tensor, like: Tensor) -> Tensor:
        """Per-sample coefficients shaped to broadcast over `like` (B, ...), in fp32 on its device."""
        return values.to(device=like.device, dtype=torch.float32).reshape(-1, *([1] * (like.dim() - 1)))

    def add_noise(self, x0: Tensor, noise: Tensor, t: Tensor) -> Tensor:
        """q(x_t | x_0): sqrt(a_bar) x0 + sqrt(1 - a_bar) eps (DDPM eq. 4)."""
        ab = self.alpha_bar(t)
        return self._coef(ab.sqrt(), x0) * x0.float() + self._coef((1 - ab).sqrt(), x0) * noise.float()

    def target(self, x0: Tensor, noise: Tensor, t: Tensor, prediction: Prediction) -> Tensor:
        """What the network learns to output: eps, x0, or v = sqrt(a_bar) eps - sqrt(1 - a_bar) x0."""
        if prediction == "eps":
            return noise.float()
        if prediction == "x0":
            return x0.float()
        if prediction == "v":
            ab = self.alpha_bar(t)
            return self._coef(ab.sqrt(), x0) * noise.float() - self._coef((1 - ab).sqrt(), x0) * x0.float()
        raise ValueError(f"unknown prediction {prediction!r}; choose eps, v or x0")

    def split(self, model_out: Tensor, x_t: Tensor, t: Tensor, prediction: Prediction,
              clip_x0: float | None = None) -> tuple[Tensor, Tensor]:
        """(x0, eps) implied by the network output at x_t; with clipping, eps is recomputed from the clipped x0."""
        ab = self.alpha_bar(t)
        a, s = self._coef(ab.sqrt(), x_t), self._coef((1 - ab).sqrt(), x_t)
        out, x_t = model_out.float(), x_t.float()
        if prediction == "eps":
            x0, eps = (x_t - s * out) / a, out
        elif prediction == "x0":
            x0, eps = out, (x_t - a * out) / s.clamp_min(1e-12)
        elif prediction == "v":
            x0, eps = a * x_t - s * out, s * x_t + a * out
        else:
            raise ValueError(f"unknown prediction {prediction!r}; choose eps, v or x0")
        if clip_x0 is not None:
            x0 = x0.clamp(-clip_x0, clip_x0)
            eps = (x_t - a * x0) / s.clamp_min(1e-12)
        return x0, eps


def diffusion_loss(denoise: Denoiser, x0: Tensor, schedule: NoiseSchedule, *, prediction: Prediction = "eps",
                   generator: torch.Generator | None = None) -> Tensor:
    """Simple loss (DDPM eq. 14): MSE between the network output and the target at a uniform random t."""
    t = torch.randint(0, schedule.steps, (x0.shape[0],), generator=generator).to(x0.device)
    noise = torch.randn(x0.shape, generator=generator).to(x0.device) if generator is not None else torch.randn_like(x0)
    x_t = schedule.add_noise(x0, noise, t.cpu()).to(x0.dtype)
    out = denoise(x_t, t)
    return torch.nn.functional.mse_loss(out.float(), schedule.target(x0, noise, t.cpu(), prediction))


def _noise_like(x: Tensor, generator: torch.Generator | None) -> Tensor:
    return torch.randn(x.shape, generator=generator, dtype=torch.float32).to(x.device)


class DDPMSampler:
    """Ancestral sampling over all T steps (DDPM algorithm 2).

    variance: "fixed_small" is the posterior variance beta-tilde_t (eq. 7), "fixed_large" is beta_t;
    both give the same sampler in the limit (DDPM section 3.2).
    """

    def __init__(self, schedule: NoiseSchedule, *, variance: Literal["fixed_small", "fixed_large"] = "fixed_small",
                 prediction: Prediction = "eps", clip_x0: float | None = 1.0):
        if variance not in ("fixed_small", "fixed_large"):
            raise ValueError(f"unknown variance {variance!r}; choose fixed_small or fixed_large")
        self.schedule, self.variance, self.prediction, self.clip_x0 = schedule, variance, prediction, clip_x0
        self.timesteps = list(range(schedule.steps - 1, -1, -1))

    def step(self, model_out: Tensor, i: int, x_t: Tensor, *, generator=None, noise: Tensor | None = None) -> Tensor:
        s = self.schedule
        t = self.timesteps[i]
        tt = torch.full((x_t.shape[0],), t)
        x0, _ = s.split(model_out, x_t, tt, self.prediction, self.clip_x0)
        ab, ab_prev, beta = s.alphas_cumprod[t], s.alpha_bar(t - 1), s.betas[t]
        # posterior mean (eq. 7): coefficients on x0 and on x_t
        c0 = ab_prev.sqrt() * beta / (1 - ab)
        ct = s.alphas[t].sqrt() * (1 - ab_prev) / (1 - ab)
        mean = float(c0) * x0 + float(ct) * x_t.float()
        if t == 0:
            return mean
        var = (1 - ab_prev) / (1 - ab) * beta if self.variance == "fixed_small" else beta
        z = noise if noise is not None else _noise_like(x_t, generator)
        return mean + float(var.sqrt()) * z


class DDIMSampler:
    """DDIM (eq. 12) on a sub-sequence of `steps` timesteps; eta=0 is deterministic, eta=1 with all steps is DDPM."""

    def __init__(self, schedule: NoiseSchedule, *, steps: int = 50, eta: float = 0.0, prediction: Prediction = "eps",
                 clip_x0: float | None = None):
        if not 1 <= steps <= schedule.steps:
            raise ValueError(f"steps must be in 1..{schedule.steps}, got {steps}")
        if eta < 0:
            raise ValueError(f"eta must be >= 0, got {eta}")
        self.schedule, self.eta, self.prediction, self.clip_x0 = schedule, eta, prediction, clip_x0
        # evenly spaced from T-1 down to 0 (so steps == T visits every t)
        self.timesteps = torch.linspace(schedule.steps - 1, 0, steps, dtype=torch.float64).round().long().tolist()

    def _prev(self, i: int) -> int:
        return self.timesteps[i + 1] if i + 1 < len(self.timesteps) else -1

    def step(self, model_out: Tensor, i: int, x_t: Tensor, *, generator=None, noise: Tensor | None = None) -> Tensor:
        s = self.schedule
        t, t_prev = self.timesteps[i], self._prev(i)
        x0, eps = s.split(model_out, x_t, torch.full((x_t.shape[0],), t), self.prediction, self.clip_x0)
        ab, ab_prev = s.alpha_bar(t), s.alpha_bar(t_prev)
        sigma = self.eta * ((1 - ab_prev) / (1 - ab) * (1 - ab / ab_prev)).sqrt()  # eq. 16
        direction = (1 - ab_prev - sigma ** 2).clamp(min=0).sqrt()  # "direction pointing to x_t"
        x = float(ab_prev.sqrt()) * x0 + float(direction) * eps
        if sigma > 0:
            x = x + float(sigma) * (noise if noise is not None else _noise_like(x_t, generator))
        return x

    def invert_step(self, model_out: Tensor, i: int, x: Tensor) -> Tensor:
        """Deterministic DDIM run backwards (eta = 0): from timestep `_prev(i)` (x, less noisy) up to
        `timesteps[i]`; `model_out` is the denoiser at x (at t = 0 when x is clean data)."""
        s = self.schedule
        t, t_prev = self.timesteps[i], self._prev(i)
        x0, eps = s.split(model_out, x, torch.full((x.shape[0],), t_prev), self.prediction)
        ab = s.alpha_bar(t)
        return float(ab.sqrt()) * x0 + float((1 - ab).sqrt()) * eps

    @torch.no_grad()
    def invert(self, denoise: Denoiser, x0: Tensor) -> Tensor:
        """x0 -> x_T along the deterministic DDIM path; `sample` with x_T brings it back."""
        x = x0.float()
        for i in reversed(range(len(self.timesteps))):
            t_eval = max(self._prev(i), 0)
            x = self.invert_step(denoise(x, torch.full((x.shape[0],), t_eval, device=x.device)), i, x)
        return x


class DPMSolverPP2M:
    """DPM-Solver++(2M) (Lu et al. 2022, algorithm 2): a second-order multistep solver of the probability-flow
    ODE in data prediction; 20 steps come close to hundreds of DDPM steps."""

    def __init__(self, schedule: NoiseSchedule, *, steps: int = 20, prediction: Prediction = "eps",
                 clip_x0: float | None = None):
        if not 1 <= steps <= schedule.steps:
            raise ValueError(f"steps must be in 1..{schedule.steps}, got {steps}")
        self.schedule, self.prediction, self.clip_x0 = schedule, prediction, clip_x0
        # `steps` evaluations from T-1 down to T/steps; the last update jumps to clean data. Evaluating at
        # t = 0 as well would make the final log-SNR step so large that the second-order term overshoots.
        grid = torch.linspace(schedule.steps - 1, 0, steps + 1, dtype=torch.float64).round().long().tolist()
        self.timesteps = grid[:-1]
        self._last_x0: Tensor | None = None
        self._last_h: float | None = None

    def _lambda(self, t: int) -> float:
        ab = self.schedule.alpha_bar(t)
        return float(0.5 * torch.log(ab / (1 - ab)))  # log(alpha_t / sigma_t)

    def step(self, model_out: Tensor, i: int, x_t: Tensor, *, generator=None, noise=None) -> Tensor:
        s = self.schedule
        t = self.timesteps[i]
        t_next = self.timesteps[i + 1] if i + 1 < len(self.timesteps) else -1
        x0, _ = s.split(model_out, x_t, torch.full((x_t.shape[0],), t), self.prediction, self.clip_x0)
        if i == 0:
            self._last_x0, self._last_h = None, None
        if t_next < 0:  # the last step lands on clean data: first order there ("lower order final")
            self._last_x0 = None
            return x0
        ab, ab_next = s.alpha_bar(t), s.alpha_bar(t_next)
        sigma, sigma_next, alpha_next = float((1 - ab).sqrt()), float((1 - ab_next).sqrt()), float(ab_next.sqrt())
        h = self._lambda(t_next) - self._lambda(t)
        if self._last_x0 is None:
            d = x0  # first order (DPM-Solver++ 1 = DDIM)
        else:
            r = self._last_h / h
            d = (1 + 1 / (2 * r)) * x0 - (1 / (2 * r)) * self._last_x0
        self._last_x0, self._last_h = x0, h
        return (sigma_next / sigma) * x_t.float() - alpha_next * math.expm1(-h) * d


@torch.no_grad()
def sample(sampler, denoise: Denoiser, shape: tuple[int, ...], *, generator: torch.Generator | None = None,
           x_T: Tensor | None = None, device=None, progress: bool = False) -> Tensor:
    """Run a sampler from pure noise (or `x_T`) to data; `denoise(x_t, t)` returns the network's prediction."""
    x = x_T.float() if x_T is not None else torch.randn(shape, generator=generator).to(device or "cpu")
    steps = sampler.timesteps
    if progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc=type(sampler).__name__, leave=False)
    for i, t in enumerate(steps):
        out = denoise(x, torch.full((x.shape[0],), t, device=x.device, dtype=torch.long))
        x = sampler.step(out, i, x, generator=generator)
    return x


def classifier_free_guidance(denoise_cond: Callable[[Tensor, Tensor, Tensor], Tensor], x: Tensor, t: Tensor,
                             cond: Tensor, null_cond: Tensor, scale: float) -> Tensor:
    """out = uncond + scale * (cond - uncond) (Ho & Salimans 2022), both halves in one batch.
    scale 1 is the conditional model alone, 0 the unconditional one."""
    if scale == 1.0:
        return denoise_cond(x, t, cond)
    both = denoise_cond(torch.cat([x, x]), torch.cat([t, t]), torch.cat([cond, null_cond])).float()
    c, u = both.chunk(2)
    return u + scale * (c - u)
