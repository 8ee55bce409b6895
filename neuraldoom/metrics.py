"""Frame metrics. PSNR over a set is 10*log10(255^2 / mean MSE), never a mean of per-frame PSNRs
(unchanged frames would give copy-last a near-infinite score)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def hud_top(height: int) -> int:
    """First row of DOOM's status bar (32 of 200 rows at the bottom)."""
    return int(round(height * (200 - 32) / 200))


def mse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2))


def psnr_from_mse(m: float) -> float:
    return float(10 * np.log10(255.0**2 / max(m, 1e-10)))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Set PSNR of uint8 frames (..., H, W, 3)."""
    return psnr_from_mse(mse(a, b))


def hud(frames: np.ndarray) -> np.ndarray:
    """The status-bar rows of (..., H, W, 3) frames."""
    return frames[..., hud_top(frames.shape[-3]):, :, :]


def _gauss(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    g = torch.exp(-((torch.arange(size) - size // 2) ** 2) / (2 * sigma**2))
    g = g / g.sum()
    return (g[:, None] * g[None, :])[None, None].repeat(3, 1, 1, 1)


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM (Wang et al. 2004, 11x11 Gaussian window) of uint8 frames (..., H, W, 3)."""
    x = torch.as_tensor(np.asarray(a)).reshape(-1, *a.shape[-3:]).permute(0, 3, 1, 2).double()
    y = torch.as_tensor(np.asarray(b)).reshape(-1, *b.shape[-3:]).permute(0, 3, 1, 2).double()
    w = _gauss().double()
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    mx, my = F.conv2d(x, w, groups=3), F.conv2d(y, w, groups=3)
    sxx = F.conv2d(x * x, w, groups=3) - mx**2
    syy = F.conv2d(y * y, w, groups=3) - my**2
    sxy = F.conv2d(x * y, w, groups=3) - mx * my
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx**2 + my**2 + c1) * (sxx + syy + c2))
    return float(s.mean())


def gradient_energy(frames: np.ndarray) -> float:
    """Mean absolute spatial gradient: how much detail a frame holds."""
    f = np.asarray(frames, np.float32)
    return float(np.abs(np.diff(f, axis=-2)).mean() + np.abs(np.diff(f, axis=-3)).mean())


def sharpness(generated: np.ndarray, real: np.ndarray) -> float:
    """Gradient energy of generated over real frames: 1.0 = as sharp; blur (PSNR's favourite) is < 1."""
    return gradient_energy(generated) / max(gradient_energy(real), 1e-6)
