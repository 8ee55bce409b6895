"""The denoiser: diffusers' UNet2DConditionModel conditioned on past frames and actions (GameNGen §3.1).

- past frames: the N context latents are concatenated with the noisy target latent on channels, so
  only `conv_in` sees them (the context length barely changes the cost);
- actions: one cross-attention token per step for the N+1 actions (the action that led to each context
  frame, plus the current one), in place of SD's text tokens;
- noise augmentation (§3.2.1): the level of the Gaussian noise added to the context, discretized into
  buckets, enters through the UNet's class embedding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import ModelMixin, UNet2DConditionModel
from diffusers.configuration_utils import ConfigMixin, register_to_config
from torch import nn

from . import actions as A
from . import metrics as M
from .config import DenoiserConfig, GameConfig
from .flow import FlowNet, offset_grid


class ActionEncoder(ModelMixin, ConfigMixin):
    """(B, T, 2) action codes -> (B, T, D) tokens: sum of per-button vectors + turn vector + position."""

    @register_to_config
    def __init__(self, dim: int = 256, length: int = 65, num_buttons: int = A.NUM_BUTTONS,
                 num_turns: int = A.NUM_TURNS) -> None:
        super().__init__()
        self.buttons = nn.Parameter(torch.randn(num_buttons, dim) * 0.02)
        self.turns = nn.Embedding(num_turns, dim)
        self.position = nn.Parameter(torch.randn(length, dim) * 0.02)
        self.norm = nn.LayerNorm(dim)
        nn.init.normal_(self.turns.weight, std=0.02)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        bits = (codes[..., :1] >> torch.arange(self.buttons.shape[0], device=codes.device)) & 1  # (B, T, nb)
        tok = bits.to(self.buttons.dtype) @ self.buttons + self.turns(codes[..., 1])  # (B, T, D)
        return self.norm(tok + self.position[-codes.shape[1]:])


def action_dim() -> int:
    """Width of the current action as the time embedding reads it: button bits, then a turn one-hot."""
    return A.NUM_BUTTONS + A.NUM_TURNS


def frames_read(cfg: DenoiserConfig) -> int:
    return min(cfg.reads, cfg.context) if cfg.reads else cfg.context


def input_channels(cfg: DenoiserConfig, latent_channels: int) -> int:
    """conv_in's width: the noisy target and the context frames read."""
    return latent_channels * (frames_read(cfg) + 1)


def bar_rows(cfg: DenoiserConfig, latent_h: int) -> tuple[int, int, int] | None:
    """A status-bar denoiser's latent rows (top, first, bottom) (DenoiserConfig.rows), checked against a latent
    `latent_h` rows high; None for a whole-frame denoiser. ValueError (one line) for rows that are not one."""
    if not cfg.rows:
        return None
    levels = 2 ** (len(cfg.block_out_channels) - 1)  # each UNet level halves the rows
    if len(cfg.rows) != 3 or not 0 <= cfg.rows[0] <= cfg.rows[1] < cfg.rows[2] <= latent_h:
        raise ValueError(f"rows must be TOP FIRST BOTTOM with 0 <= TOP <= FIRST < BOTTOM <= {latent_h} (the "
                         f"latent's rows), not {' '.join(map(str, cfg.rows))}")
    if (cfg.rows[2] - cfg.rows[0]) % levels:
        raise ValueError(f"rows: BOTTOM - TOP must be a multiple of {levels} (the UNet's levels halve it), not "
                         f"{cfg.rows[2] - cfg.rows[0]}")
    if cfg.turn_warp or cfg.flow:
        raise ValueError("rows: a status-bar denoiser neither turns nor moves the view (no turn warp, no flow)")
    return cfg.rows[0], cfg.rows[1], cfg.rows[2]


WARP_MODES = ("bicubic", "nearest")
WARP_FILLS = ("border", "last")


def turn_grids(degrees: tuple[float, ...], fov: float, rows: int, hw: tuple[int, int]) -> torch.Tensor:
    """(len(degrees), h, w, 2) `grid_sample` grids (align_corners=False) that turn a latent frame's top `rows`
    rows as a pinhole camera turning by each angle sees it (positive = right: the view's content moves left).
    A turn about the vertical axis maps image points independently of depth (a homography), so the walls a
    turn keeps in view are exactly where this puts them; what enters at the edge is the border repeated. The
    rows below (status bar, padding) stay put. The horizon is the middle of the view rows, as in DOOM."""
    h, w = hw
    f = (w / 2) / math.tan(math.radians(fov) / 2)  # focal length in latent cells
    cy = rows / 2
    v, u = torch.meshgrid(torch.arange(h, dtype=torch.float64) + 0.5 - cy,
                          torch.arange(w, dtype=torch.float64) + 0.5 - w / 2, indexing="ij")
    view = (torch.arange(h) < rows)[:, None]
    grids = []
    for deg in degrees:
        th = math.radians(deg)
        x = u / f  # each output cell's ray, turned back into the last frame's camera
        depth = (-x * math.sin(th) + math.cos(th)).clamp(min=1e-3)
        us = torch.where(view, f * (x * math.cos(th) + math.sin(th)) / depth, u)
        vs = torch.where(view, v / depth, v)
        grids.append(torch.stack([(us + w / 2) / w * 2 - 1, (vs + cy) / h * 2 - 1], -1))
    return torch.stack(grids).float()


def unseen_cells(grids: torch.Tensor) -> torch.Tensor:
    """(turns, h, w) bool: the cells whose turned source lies outside the image the `grids` sample (the view
    rows, turned as an image of their own): content a turn brings in that no frame held."""
    h, w = grids.shape[1:3]
    col = (grids[..., 0] + 1) / 2 * w - 0.5  # source cell coordinates (align_corners=False)
    row = (grids[..., 1] + 1) / 2 * h - 0.5
    return (col < -0.5) | (col > w - 0.5) | (row < -0.5) | (row > h - 0.5)


def move_view(view: torch.Tensor, grid: torch.Tensor, mode: str = "bicubic",
              keep: torch.Tensor | None = None) -> torch.Tensor:
    """The view rows (B,C,rows,w) sampled by `grid` (B,rows,w,2); where `keep` (B,1,rows,w; default: the cells
    whose source lies outside the view) is set, the view as it was: no edge smear, no status bar."""
    moved = F.grid_sample(view, grid.to(view.dtype), mode=mode, padding_mode="border", align_corners=False)
    return torch.where(unseen_cells(grid)[:, None] if keep is None else keep, view, moved)


def warp_settings(game: GameConfig, factor: int) -> dict[str, Any]:
    """DenoiserConfig's turn_warp and warp_rows for a game: each turn bucket's degrees per tic times the tics
    of one step, and the latent rows (of `factor` pixels) wholly above the status bar, or the whole frame."""
    view = M.hud_top(game.height) if game.hud else game.height
    return {"turn_warp": tuple(d * game.frame_skip for d in A.TURN_BUCKETS), "warp_rows": view // factor}


def norm_groups(widths: tuple[int, ...]) -> int:
    """GroupNorm's group count for these UNet widths: 32 where they allow (SD's), else fewer."""
    return math.gcd(32, *widths)


def cross_only(cfg: DenoiserConfig) -> tuple[bool, ...]:
    """Per UNet level (0: the full-size one), whether its transformer blocks drop self-attention. The mid block
    keeps its own either way (diffusers' UNetMidBlock2DCrossAttn has no such switch)."""
    n = len(cfg.block_out_channels)
    if any(not 1 <= i < n for i in cfg.cross_only_levels):  # level 0 has no attention
        raise ValueError(f"cross_only_levels must be within 1..{n - 1} (the levels with attention), "
                         f"not {list(cfg.cross_only_levels)}")
    return tuple(cfg.only_cross_attention or i in cfg.cross_only_levels for i in range(n))


def _block_level(name: str, levels: int) -> int | None:
    """The UNet level of a module named `unet.down_blocks.I...` or `unet.up_blocks.J...`; None for the mid block."""
    parts = name.split(".")
    if parts[1] == "down_blocks":
        return int(parts[2])
    return levels - 1 - int(parts[2]) if parts[1] == "up_blocks" else None


def build_unet(cfg: DenoiserConfig, latent_channels: int, latent_hw: tuple[int, int]) -> UNet2DConditionModel:
    n = len(cfg.block_out_channels)
    # the current action joins the timestep through diffusers' `timestep_cond` (a linear map added to the
    # sinusoidal timestep features): every ResNet block then sees it, as DIAMOND conditions on actions
    action = dict(time_cond_proj_dim=action_dim()) if cfg.action_embed else {}
    unet = UNet2DConditionModel(
        sample_size=latent_hw,
        in_channels=input_channels(cfg, latent_channels),
        out_channels=latent_channels,
        down_block_types=("DownBlock2D",) + ("CrossAttnDownBlock2D",) * (n - 1),
        up_block_types=("CrossAttnUpBlock2D",) * (n - 1) + ("UpBlock2D",),
        mid_block_type="UNetMidBlock2DCrossAttn",
        block_out_channels=cfg.block_out_channels,
        layers_per_block=cfg.layers_per_block,
        attention_head_dim=cfg.attention_heads,  # diffusers' legacy name: it sets the number of heads
        cross_attention_dim=cfg.cross_attention_dim,
        num_class_embeds=cfg.noise_buckets,
        **action,
        # a bool when it is one for every block: the shipped checkpoints' saved UNet config stays as it was
        only_cross_attention=cross_only(cfg) if cfg.cross_only_levels else cfg.only_cross_attention,
        norm_num_groups=norm_groups(cfg.block_out_channels),
    )
    if cfg.action_embed:  # zero: the model starts as it would without it, so a trained one can take it on
        nn.init.zeros_(unet.time_embedding.cond_proj.weight)
    return unet


class Denoiser(nn.Module):
    """UNet + action encoder. Predicts v (v-prediction) for the next frame's latent."""

    def __init__(self, unet: UNet2DConditionModel, action_encoder: ActionEncoder,
                 cfg: DenoiserConfig | None = None, flow: FlowNet | None = None) -> None:
        super().__init__()
        self.unet = unet
        self.action_encoder = action_encoder
        cfg = cfg or DenoiserConfig(context=action_encoder.config.length - 1)
        self.reads = frames_read(cfg)
        self.delta = cfg.target == "delta"
        self.delta_scale = float(cfg.delta_scale)
        self.action_embed = unet.config.time_cond_proj_dim is not None
        if cfg.warp_mode not in WARP_MODES:
            raise ValueError(f"warp_mode must be one of {', '.join(WARP_MODES)}, not {cfg.warp_mode!r}")
        self.warp_mode = cfg.warp_mode
        if cfg.warp_fill not in WARP_FILLS:
            raise ValueError(f"warp_fill must be one of {', '.join(WARP_FILLS)}, not {cfg.warp_fill!r}")
        hw = tuple(unet.config.sample_size)
        # not persistent: derived from the config, so checkpoints with and without it share one state dict
        self.register_buffer("grids", turn_grids(tuple(cfg.turn_warp), cfg.fov, cfg.warp_rows, hw)
                             if cfg.turn_warp else None, persistent=False)
        # warp_fill "last": the view rows are turned as an image of their own, so neither the edge fill nor a
        # bicubic kernel's support reaches into the status bar below them (the "border" fill paints status-bar
        # cells into the view's lower corners at every turn); the unseen cells keep the unturned frame
        last_fill = self.grids is not None and cfg.warp_fill == "last"
        self.view_rows = cfg.warp_rows
        # the bucket that does not turn keeps the frame bit for bit (resampling at the cell centres is off by
        # float rounding): a player standing still must see the view unchanged
        self.still = list(cfg.turn_warp).index(0.0) if 0.0 in cfg.turn_warp else -1
        view = turn_grids(tuple(cfg.turn_warp), cfg.fov, cfg.warp_rows, (cfg.warp_rows, hw[1])) if last_fill else None
        self.register_buffer("view_grids", view, persistent=False)
        self.register_buffer("unseen", unseen_cells(view) if last_fill else None, persistent=False)
        if flow is not None and not last_fill:
            raise ValueError("a flow net moves the view on top of the turn warp: it needs turn_warp and "
                             "warp_fill 'last'")
        # frozen: trained alone (training/train_flow.py); a denoiser run must not bend it toward its own loss
        self.flow = flow.requires_grad_(False).eval() if flow is not None else None
        self.flow_snap = float(cfg.flow_snap)

    def reference(self, context: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
        """The last context frame (B,C,h,w), turned by the current action when the model warps turns."""
        last = context[:, -1]
        if self.grids is None:
            return last
        turn = actions[:, -1, 1]
        # bicubic: two bilinear warps there and back lose ~4 dB more of the decoded frame than bicubic ones;
        # nearest: no resampling at all, the sub-cell rest of the turn is left to the model
        if self.unseen is None:
            return F.grid_sample(last, self.grids[turn].to(last.dtype), mode=self.warp_mode, padding_mode="border",
                                 align_corners=False)
        view = last[:, :, :self.view_rows]
        grid = self.view_grids[turn]
        if self.flow is None:
            keep = self.unseen[turn][:, None] | (turn == self.still).view(-1, 1, 1, 1)
            turned = move_view(view, grid, self.warp_mode, keep)
        else:  # the learned motion on top of the turn: nothing is exactly still while the player slides
            off = self.flow(context[:, :, :, :self.view_rows], actions)
            off = torch.where(off.abs() < self.flow_snap, torch.zeros_like(off), off)
            turned = move_view(view, offset_grid(grid, off), self.warp_mode)
        return torch.cat([turned, last[:, :, self.view_rows:]], 2)

    # The diffused variable. "delta" predicts the change from the reference (the last context frame as
    # the model saw it, turned by the current action if it warps turns), so an unsure model falls back to
    # holding that frame, not to the dataset's mean frame; the reference is the conditional context's, also
    # for the unguided pass.
    def to_target(self, z: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return (z - last) / self.delta_scale if self.delta else z

    def from_target(self, y: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        return last + self.delta_scale * y if self.delta else y

    @property
    def context(self) -> int:
        return self.action_encoder.config.length - 1

    def forward(self, noisy: torch.Tensor, t: torch.Tensor, context: torch.Tensor, actions: torch.Tensor,
                bucket: torch.Tensor) -> torch.Tensor:
        # noisy (B, C, h, w); t (B,); context (B, N, C, h, w); actions (B, N+1, 2) int; bucket (B,) int
        if self.grids is not None:  # conv_in reads the newest frame as turned by the current action
            context = torch.cat([context[:, -self.reads:-1], self.reference(context, actions)[:, None]], 1)
        x = torch.cat([noisy, context[:, -self.reads:].flatten(1, 2)], 1)  # (B, C*(reads+1), h, w)
        tokens = self.action_encoder(actions)  # (B, N+1, D)
        cond = None
        if self.action_embed:  # (B, buttons + turns): the current action
            now = actions[:, -1]
            bits = (now[:, :1] >> torch.arange(A.NUM_BUTTONS, device=now.device)) & 1
            cond = torch.cat([bits, F.one_hot(now[:, 1], A.NUM_TURNS)], 1).to(noisy.dtype)
        return self.unet(x, t, encoder_hidden_states=tokens, class_labels=bucket, timestep_cond=cond,
                         return_dict=False)[0]


def graft(state: dict[str, torch.Tensor], source: DenoiserConfig, model: Denoiser) -> dict[str, torch.Tensor]:
    """A trained denoiser's state dict (of config `source`) made to fit `model`, which may add to it. Where the model
    drops self-attention and the source did not (only_cross_attention, cross_only_levels), that transformer block's
    first attention reads the action tokens instead of the view's cells (its keys and values from the model's fresh
    init, its output projection zero): the grafted model is the old one without that self-attention, and training
    grows the new attention from nothing."""
    state = dict(state)
    own = model.state_dict()
    levels = cross_only(source)
    for name, blk in model.named_modules():
        if not hasattr(blk, "attn1") or not blk.only_cross_attention:
            continue
        level = _block_level(name, len(levels))
        if level is None or levels[level]:
            continue  # the source had no self-attention here either
        for k in own:
            if k.startswith(f"{name}.attn1.to_k.") or k.startswith(f"{name}.attn1.to_v."):
                state[k] = own[k]
            elif k.startswith(f"{name}.attn1.to_out."):
                state[k] = torch.zeros_like(own[k])
    return state


def build_denoiser(cfg: DenoiserConfig, latent_channels: int, latent_hw: tuple[int, int],
                   flow: FlowNet | None = None) -> Denoiser:
    return Denoiser(build_unet(cfg, latent_channels, latent_hw),
                    ActionEncoder(cfg.cross_attention_dim, cfg.context + 1), cfg, flow)
