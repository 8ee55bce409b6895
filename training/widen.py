"""Grow a trained denoiser wider without changing what it computes (Net2Net's "wider" operator).

Every channel of the UNet becomes `factor` copies of itself: a layer's outputs are repeated, the next
layer's weights on those inputs are split among the copies, so the wide model starts as the trained one
and training goes on from there with the extra capacity, instead of from scratch. Exact where it matters:
- GroupNorm keeps its group count and each group holds the copies of the old group's channels, so its
  mean and variance are the old ones (LayerNorm likewise);
- attention keeps its head count; each head holds the copies of its old channels, so q·k doubles and q is
  scaled by 1/sqrt(factor);
- the sinusoidal timestep features widen with the first width: the wide set holds every old frequency,
  and the time MLP reads only those.
The split of a weight among its copies is uneven (a random share that sums to the old weight), so the
copies get different gradients and grow apart: equal shares would keep them identical forever. They grow
apart only as fast as the weights move, though (measured: after 1,200 samples at 7.5e-5 the copies'
activations differ by 0.2-1%, about the weights' own change), so for tens of thousands of samples the wide
model is the small one computed twice. `spread` gives the copies different incoming weights from the start:
antithetic (w + n and w - n for two copies), so whatever reads the copies in equal shares sees their mean,
and the function changes only at second order, through the nonlinearities, while the copies differ at first.
With a spread the split is even: an uneven one would read the copies' difference, a first-order change.
Measured (docs/EXPERIMENTS.md "Underfit, not overfit"): with or without a spread, the x2 model learns exactly
what the small one does per sample over the first 23,500 samples.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from neuraldoom.config import DenoiserConfig
from neuraldoom.denoiser import Denoiser, build_denoiser, norm_groups


def _zero_sum(shape: torch.Size, dim: int, factor: int, size: float, gen: torch.Generator) -> torch.Tensor:
    """Random noise of std `size` whose entries along `dim`, in consecutive groups of `factor` copies, sum to 0."""
    noise = torch.randn(shape, generator=gen) * size
    grouped = list(shape)
    grouped[dim:dim + 1] = [grouped[dim] // factor, factor]
    noise = noise.view(grouped)
    return (noise - noise.mean(dim + 1, keepdim=True)).view(shape)


def _split(w: torch.Tensor, dim: int, factor: int, jitter: float, gen: torch.Generator) -> torch.Tensor:
    """Repeat along an input dim and share the weight among the copies: w/factor each, plus a zero-sum
    random part of size jitter·std(w) (the copies' inputs are equal, so the sum is all that counts)."""
    r = w.repeat_interleave(factor, dim) / factor
    return r + _zero_sum(r.shape, dim, factor, jitter * float(w.std()), gen) if jitter else r


def _feature_map(old: nn.Module, new: nn.Module) -> torch.Tensor:
    """For each old sinusoidal timestep feature, the index of the identical wide one."""
    t = torch.arange(0, 1000, 7)
    a, b = old(t), new(t)
    idx = torch.cdist(a.T.double(), b.T.double()).argmin(1)
    if not torch.allclose(a, b[:, idx], atol=1e-5):
        raise ValueError("the wide timestep features do not hold the old ones")
    return idx


def widened_config(cfg: DenoiserConfig, factor: int) -> DenoiserConfig:
    """The config of `cfg` widened by `factor`; ValueError where that cannot keep the function."""
    if factor < 1:
        raise ValueError(f"the widening factor must be >= 1, not {factor}")
    wide = tuple(c * factor for c in cfg.block_out_channels)
    groups = norm_groups(cfg.block_out_channels), norm_groups(wide)
    if groups[0] != groups[1]:  # each wide group must hold the copies of one old group
        raise ValueError(f"widening {cfg.block_out_channels} by {factor} changes GroupNorm's groups "
                         f"({groups[0]} to {groups[1]}): give widths that are multiples of 32")
    return replace(cfg, block_out_channels=wide)


def widen(model: Denoiser, cfg: DenoiserConfig, latent_channels: int, hw: tuple[int, int], factor: int = 2,
          jitter: float = 0.1, seed: int = 0, spread: float = 0.0) -> tuple[Denoiser, DenoiserConfig]:
    """A denoiser `factor` times as wide with the same function (to second order with a `spread`), and its
    config."""
    wide_cfg = widened_config(cfg, factor)
    wide = build_denoiser(wide_cfg, latent_channels, hw, model.flow)  # the frozen flow is shared, not widened
    if factor == 1:
        wide.load_state_dict(model.state_dict())
        return wide, wide_cfg
    gen = torch.Generator().manual_seed(seed)
    jitter = 0.0 if spread else jitter
    old_mods = dict(model.named_modules())
    feat = _feature_map(model.unet.time_proj, wide.unet.time_proj)
    with torch.no_grad():
        for name, new in wide.named_modules():
            if name == "flow" or name.startswith("flow."):
                continue
            old = old_mods[name]
            for pname, p in new.named_parameters(recurse=False):
                w = getattr(old, pname).detach().float()
                if name.endswith("time_embedding.linear_1") and pname == "weight":  # reads the sinusoid features
                    v = torch.zeros(w.shape[0], p.shape[1])
                    v[:, feat] = w
                    v = v.repeat_interleave(p.shape[0] // w.shape[0], 0)
                elif name.endswith("time_embedding.cond_proj"):  # writes into the sinusoid features
                    v = torch.zeros(p.shape)
                    v[feat] = w
                elif isinstance(new, nn.Embedding):  # (num, dim): the rows are the inputs
                    v = w.repeat_interleave(p.shape[1] // w.shape[1], 1)
                elif w.ndim == 1:  # biases, norm scales and shifts: one per output channel
                    v = w.repeat_interleave(p.shape[0] // w.shape[0], 0)
                else:  # Linear / Conv weights: (out, in, ...)
                    v = w.repeat_interleave(p.shape[0] // w.shape[0], 0)
                    if spread and p.shape[0] > w.shape[0]:  # the output copies' rows: apart, mean the old
                        v = v + _zero_sum(v.shape, 0, p.shape[0] // w.shape[0], spread * float(v.std()), gen)
                    f = p.shape[1] // w.shape[1]
                    v = _split(v, 1, f, jitter, gen) if f > 1 else v
                if v.shape != p.shape:
                    raise ValueError(f"{name}.{pname}: cannot widen {tuple(w.shape)} to {tuple(p.shape)}")
                if name.endswith(".to_q") and new.out_features != old.out_features:
                    v = v / math.sqrt(factor)  # same heads, each `factor` times as wide: q·k grows by factor
                p.copy_(v.to(p.dtype))
    return wide, wide_cfg


def deepen(model: Denoiser, cfg: DenoiserConfig, latent_channels: int,
           hw: tuple[int, int]) -> tuple[Denoiser, DenoiserConfig]:
    """A denoiser with one more layer in every UNet block and the same function (Net2Net's "deeper").

    Each down block gets a last ResNet (and attention) that passes its input through: conv2 and the
    attention's proj_out are zero, so the block adds nothing until training moves them, and the skip state
    it hands up equals the one before it. Each up block reads one skip more: the new layer goes second, a
    ResNet whose 1x1 shortcut keeps the running state and drops the extra skip (an identity again), so the
    old first layer reads the copy of its old skip and the later ones theirs. The top level's ResNets, the
    only layers at the latents' full size, then see two 3x3 convolutions more each way."""
    deep_cfg = replace(cfg, layers_per_block=cfg.layers_per_block + 1)
    deep = build_denoiser(deep_cfg, latent_channels, hw, model.flow)
    state = {}
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if parts[:2] == ["unet", "up_blocks"] and parts[3] in ("resnets", "attentions") and parts[4] != "0":
            parts[4] = str(int(parts[4]) + 1)  # the new layer is second
        state[".".join(parts)] = value
    _, unexpected = deep.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"deepening: weights without a place ({unexpected[:3]})")
    with torch.no_grad():
        for blocks, new in ((deep.unet.down_blocks, cfg.layers_per_block), (deep.unet.up_blocks, 1)):
            for block in blocks:
                res = block.resnets[new]
                nn.init.zeros_(res.conv2.weight)
                nn.init.zeros_(res.conv2.bias)
                if res.conv_shortcut is not None:  # keep the running state, drop the skip concatenated to it
                    w = torch.zeros_like(res.conv_shortcut.weight)
                    w[:, :, 0, 0] = torch.eye(w.shape[0], w.shape[1])
                    res.conv_shortcut.weight.copy_(w)
                    nn.init.zeros_(res.conv_shortcut.bias)
                if hasattr(block, "attentions"):
                    nn.init.zeros_(block.attentions[new].proj_out.weight)
                    nn.init.zeros_(block.attentions[new].proj_out.bias)
    return deep, deep_cfg
