"""diffusion_unet: a class-conditional UNet denoiser wrapped with its noise schedule and samplers.

    model = zoo.load("diffusion_unet", pretrained=True)
    images = model.sample(16, classes=[0, 1, 2, 3] * 4, steps=50, sampler="ddim", guidance=2.0, seed=0)

The denoiser sees x_t, the timestep and a class (index `num_classes` is the "no class" token used
for classifier-free guidance); images are in [-1, 1] inside and [0, 1] outside.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo.blocks.attention import MultiHeadAttention
from zoo.blocks.diffusion import (DDIMSampler, DDPMSampler, DPMSolverPP2M, NoiseSchedule, classifier_free_guidance,
                                  diffusion_loss, sample)
from zoo.blocks.embeddings import timestep_embedding
from zoo.blocks.layers import Dropout
from zoo.models.base import ZooModel, check_config
from zoo.registry import register_model

__all__ = ["DiffusionConfig", "DiffusionUNet"]


@dataclass(frozen=True)
class DiffusionConfig:
    image_size: int = 16
    in_chans: int = 1
    widths: tuple[int, ...] = (64, 128, 128)  # channels per resolution level; each level after the first halves H, W
    blocks_per_level: int = 2
    attention_levels: tuple[int, ...] = (2,)  # levels with self-attention (the low resolutions)
    heads: int = 4
    num_classes: int = 10  # 0: unconditional
    class_dropout: float = 0.1  # training: the label is replaced by "no class" this often (enables guidance)
    dropout: float = 0.1
    groups: int = 8  # GroupNorm groups
    schedule: Literal["linear", "cosine", "scaled_linear"] = "cosine"
    timesteps: int = 1000
    prediction: Literal["eps", "v", "x0"] = "eps"

    def __post_init__(self):
        check_config(self, image_size=">= 1", in_chans=">= 1", widths=">= 1", blocks_per_level=">= 1",
                     attention_levels=">= 0", heads=">= 1", num_classes=">= 0", class_dropout="[0, 1)",
                     dropout="[0, 1)", groups=">= 1", timesteps=">= 1")
        if not self.widths:
            raise ValueError("widths must name at least one level's channels, got ()")
        if self.image_size % 2 ** (len(self.widths) - 1):
            raise ValueError(f"image_size {self.image_size} must be divisible by 2 ** {len(self.widths) - 1}")
        if any(w % self.groups for w in self.widths):
            raise ValueError(f"every width must be divisible by groups={self.groups}")


class ResBlock(nn.Module):
    """GroupNorm-SiLU-conv twice, with the time+class embedding added in between (DDPM's residual block)."""

    def __init__(self, cin: int, cout: int, emb: int, groups: int, dropout: float):
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(groups, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.emb = nn.Linear(emb, cout)
        self.norm2, self.conv2 = nn.GroupNorm(groups, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.dropout = Dropout(dropout)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()
        nn.init.zeros_(self.conv2.weight)  # each block starts as the identity: stable early training
        nn.init.zeros_(self.conv2.bias)

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.emb(emb)[:, :, None, None]
        h = self.conv2(self.dropout(F.silu(self.norm2(h))))
        return self.skip(x) + h


class AttnBlock(nn.Module):
    """Self-attention over the H*W positions, through the package's attention block."""

    def __init__(self, channels: int, heads: int, groups: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, channels)
        self.attn = MultiHeadAttention(channels, heads)
        nn.init.zeros_(self.attn.proj.weight)
        nn.init.zeros_(self.attn.proj.bias)

    def forward(self, x: Tensor, emb: Tensor | None = None) -> Tensor:
        B, C, H, W = x.shape
        tokens = self.norm(x).flatten(2).transpose(1, 2)  # (B, H*W, C)
        return x + self.attn(tokens).transpose(1, 2).reshape(B, C, H, W)


class Level(nn.Module):
    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)

    def forward(self, x: Tensor, emb: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x, emb)
        return x


@register_model("diffusion_unet", config=DiffusionConfig, weights={"digits": "diffusion_unet.digits.safetensors"},
                default="digits", description="Class-conditional diffusion UNet with DDPM/DDIM/DPM-Solver++ sampling and guidance")
class DiffusionUNet(ZooModel):
    """UNet denoiser + noise schedule + samplers."""
    head_prefixes = ("class_embed.",)  # a new num_classes re-initialises the class embedding

    def __init__(self, config: DiffusionConfig = DiffusionConfig()):
        super().__init__()
        self.config = c = config
        emb = 4 * c.widths[0]
        self.time_mlp = nn.Sequential(nn.Linear(c.widths[0], emb), nn.SiLU(), nn.Linear(emb, emb))
        self.class_embed = nn.Embedding(c.num_classes + 1, emb) if c.num_classes > 0 else None
        self.stem = nn.Conv2d(c.in_chans, c.widths[0], 3, padding=1)

        def level(cin, cout, n, attend):
            blocks = []
            for i in range(n):
                blocks.append(ResBlock(cin if i == 0 else cout, cout, emb, c.groups, c.dropout))
                if attend:
                    blocks.append(AttnBlock(cout, c.heads, c.groups))
            return Level(blocks)

        self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
        skips, cin = [], c.widths[0]
        for i, w in enumerate(c.widths):
            self.down.append(level(cin, w, c.blocks_per_level, i in c.attention_levels))
            skips.append(w)
            cin = w
            last = i == len(c.widths) - 1
            self.downsample.append(nn.Identity() if last else nn.Conv2d(w, w, 3, stride=2, padding=1))
        deepest = len(c.widths) - 1
        self.middle = Level([ResBlock(cin, cin, emb, c.groups, c.dropout), AttnBlock(cin, c.heads, c.groups),
                             ResBlock(cin, cin, emb, c.groups, c.dropout)])
        self.up, self.upsample = nn.ModuleList(), nn.ModuleList()
        for i in reversed(range(len(c.widths))):
            w = c.widths[i]
            self.up.append(level(cin + skips[i], w, c.blocks_per_level, i in c.attention_levels or i == deepest))
            cin = w
            self.upsample.append(nn.Identity() if i == 0 else nn.Sequential(nn.Upsample(scale_factor=2.0),
                                                                            nn.Conv2d(w, w, 3, padding=1)))
        self.out = nn.Sequential(nn.GroupNorm(c.groups, cin), nn.SiLU(), nn.Conv2d(cin, c.in_chans, 3, padding=1))
        nn.init.zeros_(self.out[-1].weight)
        nn.init.zeros_(self.out[-1].bias)
        self.schedule = NoiseSchedule(c.schedule, c.timesteps)  # derived from the config: not in the state dict

    @property
    def checkpoint_blocks(self) -> list[nn.Module]:
        return [b for lvl in (*self.down, self.middle, *self.up) for b in lvl.blocks]

    def forward(self, x: Tensor, t: Tensor | None = None, y: Tensor | None = None, *, loss: bool = False,
                generator: torch.Generator | None = None) -> Tensor:
        """x (B, C, H, W) in [-1, 1] at timestep t (B,), class y (B,) or None -> prediction (B, C, H, W).

        loss=True: x is a clean batch x0 and the result is `training_loss(x, y, generator)`. A training step
        calls a DDP-wrapped model this way: DDP all-reduces the gradients only of what runs inside forward."""
        if loss:
            return self._training_loss(x, y, generator)
        if t is None:
            raise ValueError("forward needs the timesteps t (B,) to denoise x; or loss=True for the training "
                             "loss of a clean batch x")
        return self._denoise(x, t, y)

    def _denoise(self, x: Tensor, t: Tensor, y: Tensor | None) -> Tensor:
        # the sinusoid is computed in fp32 (bf16 angles would be coarse), then meets the MLP in its weights'
        # dtype, so a model cast to bf16 (zoo.accel.cast) runs too
        emb = self.time_mlp(timestep_embedding(t, self.config.widths[0]).to(self.time_mlp[0].weight.dtype))
        if self.class_embed is not None:
            if y is None:
                y = torch.full((x.shape[0],), self.config.num_classes, device=x.device, dtype=torch.long)
            emb = emb + self.class_embed(y)
        h = self.stem(x)
        skips = []
        for level, down in zip(self.down, self.downsample):
            h = level(h, emb)
            skips.append(h)
            h = down(h)
        h = self.middle(h, emb)
        for level, up in zip(self.up, self.upsample):
            h = level(torch.cat([h, skips.pop()], dim=1), emb)
            h = up(h)
        return self.out(h)

    def training_loss(self, x0: Tensor, y: Tensor | None = None, generator: torch.Generator | None = None) -> Tensor:
        """x0 in [-1, 1]; labels are dropped to "no class" with probability class_dropout. Runs through
        forward, so the hooks of a wrapper (FSDP, autocast) see it; a DDP wrapper needs `ddp(x0, y=y, loss=True)`."""
        return self(x0, y=y, loss=True, generator=generator)

    def _training_loss(self, x0: Tensor, y: Tensor | None, generator: torch.Generator | None) -> Tensor:
        c = self.config
        if y is not None and self.class_embed is not None and c.class_dropout > 0 and self.training:
            drop = torch.rand(y.shape, generator=generator).to(y.device) < c.class_dropout
            y = torch.where(drop, torch.full_like(y, c.num_classes), y)
        return diffusion_loss(lambda x, t: self._denoise(x, t, y), x0, self.schedule, prediction=c.prediction,
                              generator=generator)

    def example_loss(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        """training_loss on example_inputs(), which are forward's (x_t, t, y): x serves as the clean image
        and the loss draws its own t."""
        return self.training_loss(x.clamp(-1, 1), y)

    # ------------------------------------------------------------------ sampling

    def sampler(self, name: str = "ddim", steps: int = 50, eta: float = 0.0):
        c = self.config
        if name == "ddim":
            return DDIMSampler(self.schedule, steps=steps, eta=eta, prediction=c.prediction, clip_x0=1.0)
        if name == "ddpm":
            return DDPMSampler(self.schedule, prediction=c.prediction, clip_x0=1.0)
        if name in ("dpm++", "dpmpp2m"):
            return DPMSolverPP2M(self.schedule, steps=steps, prediction=c.prediction, clip_x0=1.0)
        raise ValueError(f"unknown sampler {name!r}; choose ddim, ddpm or dpm++")

    @torch.no_grad()
    def sample(self, n: int, *, classes: list[int] | Tensor | None = None, steps: int = 50, sampler: str = "ddim",
               guidance: float = 2.0, eta: float = 0.0, seed: int | None = 0, batch_size: int = 256) -> Tensor:
        """n images in [0, 1], (n, C, H, W). `classes`: one per image (or None: unconditional)."""
        c = self.config
        device = next(self.parameters()).device
        if classes is not None:
            classes = torch.as_tensor(classes, dtype=torch.long).flatten()
            if len(classes) != n:
                raise ValueError(f"{len(classes)} classes given for n={n} images")
            if c.num_classes == 0 or classes.min() < 0 or classes.max() >= c.num_classes:
                raise ValueError(f"classes must be in 0..{c.num_classes - 1} for this model")
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        was_training = self.training
        self.eval()
        out = []
        for start in range(0, n, batch_size):
            count = min(batch_size, n - start)
            y = classes[start:start + count].to(device) if classes is not None else None
            null = torch.full((count,), c.num_classes, device=device, dtype=torch.long)

            def denoise(x, t):
                if y is None:
                    return self(x, t, None)
                return classifier_free_guidance(self, x, t, y, null, guidance)

            x = sample(self.sampler(sampler, steps, eta), denoise, (count, c.in_chans, c.image_size, c.image_size),
                       generator=generator, device=device)
            out.append(((x.clamp(-1, 1) + 1) / 2).cpu())
        self.train(was_training)
        return torch.cat(out)

    # ------------------------------------------------------------------ benchmarking

    def example_inputs(self, batch: int = 16) -> tuple[Tensor, Tensor, Tensor]:
        c = self.config
        g = torch.Generator().manual_seed(0)
        return (torch.randn(batch, c.in_chans, c.image_size, c.image_size, generator=g),
                torch.randint(0, c.timesteps, (batch,), generator=g),
                torch.randint(0, max(1, c.num_classes), (batch,), generator=g))
