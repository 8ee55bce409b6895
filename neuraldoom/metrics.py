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


def frame_mse(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-frame MSE of uint8 frames (..., H, W, 3): what a set PSNR averages, kept per frame so that two
    evaluations on the same frames can be compared pair by pair (training.compare)."""
    return np.mean((np.asarray(a, np.float64) - np.asarray(b, np.float64)) ** 2, axis=(-3, -2, -1))


def psnr_from_mse(m: float) -> float:
    return float(10 * np.log10(255.0**2 / max(m, 1e-10)))


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """Set PSNR of uint8 frames (..., H, W, 3)."""
    return psnr_from_mse(mse(a, b))


def hud(frames: np.ndarray) -> np.ndarray:
    """The status-bar rows of (..., H, W, 3) frames."""
    return frames[..., hud_top(frames.shape[-3]):, :, :]


def _gauss1d(size: int = 11, sigma: float = 1.5) -> torch.Tensor:
    g = torch.exp(-((torch.arange(size, dtype=torch.float64) - size // 2) ** 2) / (2 * sigma**2))
    return (g / g.sum()).float()


def ssim(a: np.ndarray, b: np.ndarray) -> float:
    """Mean SSIM (Wang et al. 2004, 11x11 Gaussian window, sigma 1.5) of uint8 frames (..., H, W, 3).

    Separable float32 filtering of all five local statistics in one batched convolution: ~10 ms a
    160x120 frame on one core, fast enough for a live overlay."""
    H, W = a.shape[-3:-1]
    a, b = np.asarray(a).reshape(-1, H, W, 3), np.asarray(b).reshape(-1, H, W, 3)
    if len(a) > 64:  # bounded memory: the mean of equal-sized chunks' means, weighted by their frames
        return float(sum(ssim(a[i:i + 64], b[i:i + 64]) * len(a[i:i + 64]) for i in range(0, len(a), 64)) / len(a))
    x = torch.as_tensor(np.array(a, np.float32)).permute(0, 3, 1, 2).reshape(-1, 1, H, W)
    y = torch.as_tensor(np.array(b, np.float32)).permute(0, 3, 1, 2).reshape(-1, 1, H, W)
    g = _gauss1d()
    st = torch.cat([x, y, x * x, y * y, x * y], 1).reshape(-1, 1, H, W)  # (B*3*5, 1, H, W)
    f = F.conv2d(F.conv2d(st, g.view(1, 1, 1, 11)), g.view(1, 1, 11, 1)).reshape(-1, 5, H - 10, W - 10).double()
    mx, my, xx, yy, xy = f.unbind(1)
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    s = ((2 * mx * my + c1) * (2 * (xy - mx * my) + c2)) / ((mx**2 + my**2 + c1) * (xx - mx**2 + yy - my**2 + c2))
    return float(s.mean())


def gradient_energy(frames: np.ndarray) -> float:
    """Mean absolute spatial gradient: how much detail a frame holds."""
    f = np.asarray(frames, np.float32)
    return float(np.abs(np.diff(f, axis=-2)).mean() + np.abs(np.diff(f, axis=-3)).mean())


def sharpness(generated: np.ndarray, real: np.ndarray) -> float:
    """Gradient energy of generated over real frames: 1.0 = as sharp; blur (PSNR's favourite) is < 1."""
    return gradient_energy(generated) / max(gradient_energy(real), 1e-6)


def close_wall(frames: np.ndarray, chunk: int = 2048) -> np.ndarray:
    """(N, H, W, 3) uint8 -> (N,) bool: the view is one grey wall seen from up close, no floor, ceiling or
    edge in it. Sticky-random play ends ~20% of its steps walking into a wall, and a denoiser that loses the
    scene settles on that view; this measures how often. Rule (checked by eye on 80 recorded frames): on
    every second row of the view, over half the pixels are neutral mid grey (channel spread < 24,
    luminance 40-170) and the row means vary by under 5 levels (a floor or ceiling changes them)."""
    out = np.zeros(len(frames), bool)
    top = hud_top(frames.shape[1])
    for i in range(0, len(frames), chunk):
        f = np.asarray(frames[i:i + chunk, :top - 1:2], np.int16)  # the bar's top edge row is not view
        lum = f.mean(-1)
        grey = ((f.max(-1) - f.min(-1) < 24) & (lum > 40) & (lum < 170)).mean((1, 2))
        out[i:i + chunk] = (grey > 0.5) & (lum.mean(2).std(1) < 5)
    return out
