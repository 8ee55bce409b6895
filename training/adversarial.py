"""The adversarial term the trainers share: a hinge-loss critic, and VQGAN's adaptive weight.

A per-pixel or per-latent regression loss is minimised by the mean of what could be there, and the mean of
many possible textures is a flat gradient: blur. A critic that tells real from generated patches gives the
generator a gradient towards *a* plausible texture instead (pix2pix, VQGAN, TAESD for decoders; adversarial
diffusion distillation, Sauer et al. 2023, for few-step samplers).

- `PatchDiscriminator`: real/fake per patch of a decoded frame (the autoencoder's decoder fine-tune);
- `LatentDiscriminator`: real/fake per patch of a next-frame latent, given the last frame's latent and the
  current action (distillation): realistic *as the next frame of this one under this action*, so holding
  the last frame is not enough to pass when the player turns;
- `Critic`: one discriminator with its optimizer: the hinge update, the generator's loss, and its tensors
  for the run's state file (so a resumed run continues the same game).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from neuraldoom import actions as A
from neuraldoom.checkpoint import load_optimizer, optimizer_tensors

_sn = nn.utils.parametrizations.spectral_norm


class PatchDiscriminator(nn.Module):
    """Real/fake logits per ~22x22-pixel patch (pix2pix-style, spectral norm for a stable hinge game)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        act = nn.LeakyReLU(0.2)
        self.net = nn.Sequential(
            _sn(nn.Conv2d(3, width, 4, 2, 1)), act,
            _sn(nn.Conv2d(width, 2 * width, 4, 2, 1)), act,
            _sn(nn.Conv2d(2 * width, 2 * width, 3, 1, 1)), act,
            _sn(nn.Conv2d(2 * width, 1, 3, 1, 1)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def action_planes(codes: torch.Tensor, hw: tuple[int, int]) -> torch.Tensor:
    """(B, 2) action codes -> (B, buttons + turns, h, w) constant planes (button bits, turn one-hot)."""
    bits = (codes[:, :1] >> torch.arange(A.NUM_BUTTONS, device=codes.device)) & 1
    v = torch.cat([bits, F.one_hot(codes[:, 1], A.NUM_TURNS)], 1).float()
    return v[:, :, None, None].expand(-1, -1, *hw)


class LatentDiscriminator(nn.Module):
    """Real/fake logits per latent patch (~5x5 latent cells, 40x40 pixels) of a next-frame latent, read
    together with the last frame's latent and the current action."""

    def __init__(self, latent_channels: int, width: int = 64) -> None:
        super().__init__()
        act = nn.LeakyReLU(0.2)
        self.net = nn.Sequential(
            _sn(nn.Conv2d(2 * latent_channels + A.NUM_BUTTONS + A.NUM_TURNS, width, 3, 1, 1)), act,
            _sn(nn.Conv2d(width, 2 * width, 4, 2, 1)), act,
            _sn(nn.Conv2d(2 * width, 2 * width, 3, 1, 1)), act,
            _sn(nn.Conv2d(2 * width, 1, 3, 1, 1)))

    def forward(self, z: torch.Tensor, last: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        # the change from the last frame is what a next-frame critic must judge: give it directly
        return self.net(torch.cat([z - last, last, action_planes(action, z.shape[-2:]).to(z.dtype)], 1))


class Critic:
    """A discriminator and its AdamW (betas 0.5, 0.9: the usual GAN setting) playing the hinge game."""

    def __init__(self, disc: nn.Module, lr: float) -> None:
        self.disc = disc
        self.opt = torch.optim.AdamW(disc.parameters(), lr=lr, betas=(0.5, 0.9), weight_decay=0.0)

    def to(self, device: torch.device) -> Critic:
        self.disc.to(device)
        return self

    def update(self, real: torch.Tensor, fake: torch.Tensor, *cond: torch.Tensor) -> float:
        """One hinge step of the discriminator (fake is detached here); returns its loss."""
        loss = F.relu(1 - self.disc(real, *cond)).mean() + F.relu(1 + self.disc(fake.detach(), *cond)).mean()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return loss.item()

    def generator_loss(self, fake: torch.Tensor, *cond: torch.Tensor) -> torch.Tensor:
        """-D(fake): its gradient flows to the generator only (the discriminator's weights are frozen)."""
        self.disc.requires_grad_(False)
        loss = -self.disc(fake, *cond).mean()
        self.disc.requires_grad_(True)
        return loss

    # One critic per run; its keys ("disc.*", "dopt.*", meta "dopt_param_groups") sit beside the generator's.
    def tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """Weights and optimizer state as flat tensors + JSON, for a run's one state file."""
        t, m = optimizer_tensors(self.opt, prefix="dopt")
        t.update({f"disc.{k}": v for k, v in self.disc.state_dict().items()})
        return t, {"dopt_param_groups": m["param_groups"]}

    def load(self, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> bool:
        """Restore what `tensors` saved; False (nothing changed) when the state holds no discriminator."""
        mine = {k[5:]: v for k, v in tensors.items() if k.startswith("disc.")}
        if not mine:
            return False
        self.disc.load_state_dict(mine)
        load_optimizer(self.opt, tensors, meta, prefix="dopt")
        return True


def adaptive_weight(rec: torch.Tensor, adv: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    """VQGAN's balance: ||d rec / d layer|| / ||d adv / d layer|| at the generator's last layer, so one
    --adv-weight means the same whatever the regression loss's scale (detached, at most 1e4)."""
    rg = torch.autograd.grad(rec, layer, retain_graph=True)[0]
    ag = torch.autograd.grad(adv, layer, retain_graph=True)[0]
    return (rg.norm() / (ag.norm() + 1e-4)).clamp(max=1e4).detach()
