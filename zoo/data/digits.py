"""scikit-learn's digits as small images, and a judge of generated digits: a classifier trained on the real
images, its recognition rate on samples, and a Fréchet distance on its features."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from zoo._deps import require

__all__ = ["load_digits_images", "DigitsJudge"]


def load_digits_images(size: int = 16, *, split: str = "train", holdout: float = 0.2, seed: int = 0):
    """(images in [-1, 1], (N, 1, size, size); labels (N,)) from sklearn's 1,797 8x8 digits, upsampled
    bilinearly; `split` train|test is a fixed, class-stratified random split."""
    load_digits = require("sklearn.datasets", "the digits data set", "pip install scikit-learn",
                          package="scikit-learn").load_digits
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32)[:, None] / 16.0  # (N, 1, 8, 8) in [0, 1]
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).clamp(0, 1) * 2 - 1
    y = torch.tensor(digits.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    test = torch.zeros(len(y), dtype=torch.bool)
    for c in range(10):  # stratified: the same fraction of every class held out
        idx = (y == c).nonzero().flatten()
        test[idx[torch.randperm(len(idx), generator=g)[:int(len(idx) * holdout)]]] = True
    keep = test if split == "test" else ~test
    return x[keep], y[keep]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                                      nn.Flatten(), nn.Linear(256, 128), nn.ReLU())
        self.head = nn.Linear(128, 10)

    def forward(self, x):
        return self.head(self.features(x))


class DigitsJudge:
    """Trained on the real training digits (deterministic); reports its own accuracy on the held-out ones."""

    def __init__(self, size: int = 16, seed: int = 0, epochs: int = 30):
        torch.manual_seed(seed)
        x, y = load_digits_images(size, split="train")
        self.net = _Net()
        opt = torch.optim.Adam(self.net.parameters(), lr=2e-3)
        g = torch.Generator().manual_seed(seed)
        for _ in range(epochs):
            for idx in torch.randperm(len(x), generator=g).split(64):
                xb = x[idx] + 0.05 * torch.randn(x[idx].shape, generator=g)  # a little noise: robust to samples
                loss = F.cross_entropy(self.net(xb), y[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
        self.net.eval()
        self.test_x, self.test_y = load_digits_images(size, split="test")
        self.accuracy = self.recognition(self.test_x, self.test_y)

    @torch.no_grad()
    def recognition(self, images: Tensor, classes: Tensor) -> float:
        """Fraction of images (in [-1, 1]) the judge labels as `classes`."""
        return float((self.net(images.float()).argmax(1) == classes).float().mean())

    @torch.no_grad()
    def frechet(self, images: Tensor) -> float:
        """Fréchet distance between the judge's features of `images` and of the held-out real digits."""
        a = self.net.features(images.float()).double()
        b = self.net.features(self.test_x).double()
        mu_a, mu_b = a.mean(0), b.mean(0)
        cov_a, cov_b = torch.cov(a.T), torch.cov(b.T)
        # trace of sqrt(cov_a cov_b) from the eigenvalues of the (similar) symmetric sqrt(a) b sqrt(a)
        vals, vecs = torch.linalg.eigh(cov_a)
        root_a = vecs @ torch.diag(vals.clamp(min=0).sqrt()) @ vecs.T
        mid = torch.linalg.eigvalsh(root_a @ cov_b @ root_a).clamp(min=0).sqrt().sum()
        return float((mu_a - mu_b).square().sum() + cov_a.trace() + cov_b.trace() - 2 * mid)
