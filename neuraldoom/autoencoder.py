"""The frame autoencoder: diffusers' AutoencoderTiny (TAESD design) between pixel (un)shuffles.

GameNGen reuses SD's VAE (8x8 pixels -> 4 channels) and fine-tunes its decoder; nothing can be
downloaded here, so we train our own on DOOM frames. On a CPU the full-resolution conv level of a
TAESD costs most of the time (decode ~43 ms at 160x128 with 32 channels, fp32, one core), so frames are
folded into channels (lossless space-to-depth): the encoder reads 4x4 folds (40x32) and downsamples
once; the decoder upsamples twice to 80x64 and unfolds 2x2: decode ~10 ms, encode ~15 ms.
The folds are stored implicitly: in_channels = 3 * encoder_fold**2, out_channels = 3 * decoder_fold**2.
Latents are normalized by the config's shift_factor/scaling_factor (measured after training) so the
denoiser sees roughly unit-variance inputs.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderTiny

from .config import AutoencoderConfig


def build_autoencoder(cfg: AutoencoderConfig) -> AutoencoderTiny:
    down = cfg.encoder_fold * 2 ** (len(cfg.encoder_blocks) - 1)
    up = cfg.decoder_fold * 2 ** (len(cfg.decoder_blocks) - 1)
    if down != up:
        raise ValueError(f"encoder downsamples {down}x but decoder upsamples {up}x")
    return AutoencoderTiny(
        in_channels=3 * cfg.encoder_fold**2,
        out_channels=3 * cfg.decoder_fold**2,
        encoder_block_out_channels=(cfg.encoder_channels,) * len(cfg.encoder_blocks),
        decoder_block_out_channels=(cfg.decoder_channels,) * len(cfg.decoder_blocks),
        num_encoder_blocks=cfg.encoder_blocks,
        num_decoder_blocks=cfg.decoder_blocks,
        latent_channels=cfg.latent_channels,
        scaling_factor=1.0,
        shift_factor=0.0,
    )


def folds(ae: AutoencoderTiny) -> tuple[int, int]:
    """(encoder fold, decoder fold)."""
    return math.isqrt(ae.config.in_channels // 3), math.isqrt(ae.config.out_channels // 3)


def downsampling(ae: AutoencoderTiny) -> int:
    return folds(ae)[0] * 2 ** (len(ae.config.num_encoder_blocks) - 1)


def padded_hw(height: int, width: int, factor: int) -> tuple[int, int]:
    # 4x more than the autoencoder needs, so a 3-level denoiser UNet can halve the latent twice
    m = factor * 4
    return -(-height // m) * m, -(-width // m) * m


def latent_hw(ae: AutoencoderTiny, height: int, width: int) -> tuple[int, int]:
    f = downsampling(ae)
    h, w = padded_hw(height, width, f)
    return h // f, w // f


def to_pixels(frames: np.ndarray | torch.Tensor, factor: int) -> torch.Tensor:
    """uint8 (B, H, W, 3) -> float (B, 3, H', W') in [-1, 1], zero-padded at the bottom/right."""
    x = torch.tensor(np.asarray(frames)).permute(0, 3, 1, 2).float().div(127.5).sub(1)  # copy: memmaps are read-only
    H, W = x.shape[-2:]
    Hp, Wp = padded_hw(H, W, factor)
    return F.pad(x, (0, Wp - W, 0, Hp - H))


def to_frames(x: torch.Tensor, height: int, width: int) -> np.ndarray:
    """float (B, 3, H', W') in [-1, 1] -> uint8 (B, H, W, 3), cropped."""
    x = x[..., :height, :width].float().add(1).mul(127.5).round().clamp(0, 255)
    return x.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()


def encode_pixels(ae: AutoencoderTiny, x: torch.Tensor) -> torch.Tensor:
    """(B, 3, H', W') in [-1, 1] -> normalized latents (B, C, h, w)."""
    z = ae.encoder(F.pixel_unshuffle(x, folds(ae)[0]))
    return (z - ae.config.shift_factor) * ae.config.scaling_factor


def decode_pixels(ae: AutoencoderTiny, z: torch.Tensor) -> torch.Tensor:
    """Normalized latents (B, C, h, w) -> (B, 3, H', W') in about [-1, 1]."""
    z = z / ae.config.scaling_factor + ae.config.shift_factor
    return F.pixel_shuffle(ae.decoder(z.to(ae.dtype)), folds(ae)[1])


@torch.no_grad()
def encode(ae: AutoencoderTiny, frames: np.ndarray, batch: int = 64) -> torch.Tensor:
    """uint8 frames (B, H, W, 3) -> normalized latents (B, C, h, w), float32."""
    f = downsampling(ae)
    out = [encode_pixels(ae, to_pixels(frames[i:i + batch], f).to(ae.device, ae.dtype)).float().cpu()
           for i in range(0, len(frames), batch)]
    return torch.cat(out).contiguous() if out else torch.zeros(0)


@torch.no_grad()
def decode(ae: AutoencoderTiny, z: torch.Tensor, height: int, width: int) -> np.ndarray:
    """Normalized latents (B, C, h, w) -> uint8 frames (B, H, W, 3)."""
    return to_frames(decode_pixels(ae, z.to(ae.device)).cpu(), height, width)
