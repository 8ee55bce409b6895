"""The learned motion of the view: a small CNN that moves the last frame where the next one shows it.

The turn warp (denoiser.turn_grids) is exact for a turn, but walking forward, strafing, sliding on the
player's momentum and the view bob move every wall by an amount that depends on its depth, which no fixed
warp knows. This net reads the newest context latents and the current and previous actions and predicts a
per-cell offset (in latent cells) added to the turn warp's sampling grid; the denoiser's reference (the
frame its "delta" target is the change from) is then the last frame moved, sharp by construction, and the
UNet draws only what moving does not explain. Trained alone on the latent cache (training/train_flow.py)
by the warp's MSE to the next latent, then frozen inside the denoiser (train_diffusion --flow).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers import ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from torch import nn

from . import actions as A

ACTION_PLANES = 2 * (A.NUM_BUTTONS + A.NUM_TURNS)  # the current and the previous action, one-hot


def action_planes(actions: torch.Tensor) -> torch.Tensor:
    """(B, N+1, 2) action codes -> (B, ACTION_PLANES): button bits and turn one-hot of the current action
    and of the one that led to the last context frame (the player's momentum)."""
    out = []
    for a in (actions[:, -1], actions[:, -2]):
        bits = (a[:, :1] >> torch.arange(A.NUM_BUTTONS, device=a.device)) & 1
        out += [bits, F.one_hot(a[:, 1], A.NUM_TURNS)]
    return torch.cat(out, 1).float()


class FlowNet(ModelMixin, ConfigMixin):
    """(B, frames, C, rows, w) newest context latents' view rows + (B, N+1, 2) actions -> (B, 2, rows, w)
    offsets (x, y) in latent cells. A two-level U-Net; the actions enter at the input and the bottleneck.
    The output layer starts at zero: an untrained net is the turn warp alone."""

    @register_to_config
    def __init__(self, latent_channels: int = 8, frames: int = 2, width: int = 64) -> None:
        super().__init__()
        a, c = ACTION_PLANES, width
        self.inp = nn.Conv2d(frames * latent_channels + a, c, 3, padding=1)
        self.down1 = nn.Conv2d(c, c * 3 // 2, 3, 2, 1)
        self.down2 = nn.Conv2d(c * 3 // 2, c * 2, 3, 2, 1)
        self.mid = nn.Sequential(nn.Conv2d(c * 2 + a, c * 2, 3, padding=1), nn.GELU(),
                                 nn.Conv2d(c * 2, c * 2, 3, padding=1), nn.GELU(),
                                 nn.Conv2d(c * 2, c * 2, 3, padding=1), nn.GELU())
        self.up1 = nn.Conv2d(c * 2 + c * 3 // 2, c * 3 // 2, 3, padding=1)
        self.up2 = nn.Conv2d(c * 3 // 2 + c, c, 3, padding=1)
        self.out = nn.Conv2d(c, 2, 3, padding=1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    @property
    def frames(self) -> int:
        return self.config.frames

    def forward(self, context: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        x = context[:, -self.frames:].flatten(1, 2)
        ap = action_planes(actions).to(x.dtype)[:, :, None, None]
        x0 = F.gelu(self.inp(torch.cat([x, ap.expand(-1, -1, *x.shape[-2:])], 1)))
        x1 = F.gelu(self.down1(x0))
        x2 = F.gelu(self.down2(x1))
        m = self.mid(torch.cat([x2, ap.expand(-1, -1, *x2.shape[-2:])], 1))
        y = F.gelu(self.up1(torch.cat([F.interpolate(m, size=x1.shape[-2:], mode="bilinear"), x1], 1)))
        y = F.gelu(self.up2(torch.cat([F.interpolate(y, size=x0.shape[-2:], mode="bilinear"), x0], 1)))
        return self.out(y)


def offset_grid(grid: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """A (B, rows, w, 2) `grid_sample` grid (align_corners=False) moved by (B, 2, rows, w) offsets in cells."""
    rows, w = grid.shape[1:3]
    scale = torch.tensor([2 / w, 2 / rows], dtype=grid.dtype, device=grid.device)
    return grid + offsets.permute(0, 2, 3, 1).to(grid.dtype) * scale
