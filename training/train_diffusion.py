"""Train the action-conditioned denoiser on latents of recordings (GameNGen §3.1-3.2).

    python -m training.train_diffusion --data data/e1m1 --autoencoder runs/ae/autoencoder --out runs/dm
    python -m training.train_diffusion --data data/e1m1 --init-from checkpoints/e1m1 --out runs/dm2

Encodes DATA/train and DATA/heldout once into OUT/latents (cached, reused while the autoencoder is the
same), then trains with the v-prediction loss (eq. 1, linear betas), noise augmentation of the context
(level ~ U[0, 0.7], 10 buckets, §3.2.1), context dropout 0.1 (for CFG), a quarter of the samples on the
model's own sample of their last context frame (what play feeds it), AdamW, EMA weights and gradient
clipping, under `accelerate` (one CPU process here; `accelerate launch` on GPUs). Every --save-every
seconds it writes, atomically, OUT/train_state.safetensors (weights, optimizer, EMA, step: rerunning the
same command resumes) and OUT/checkpoint (a complete playable checkpoint with the EMA weights).
"""

from __future__ import annotations

import copy
import math
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import AutoencoderTiny, DDPMScheduler

from neuraldoom import actions as A
from neuraldoom import autoencoder as AE
from neuraldoom import metrics as M
from neuraldoom import statusbar as SB
from neuraldoom.checkpoint import (
    Checkpoint,
    CheckpointError,
    load_model_dir,
    save_checkpoint,
)
from neuraldoom.config import DenoiserConfig, SamplerConfig, parse_args
from neuraldoom.denoiser import (
    WARP_FILLS,
    WARP_MODES,
    Denoiser,
    bar_rows,
    build_denoiser,
    cross_only,
    frames_read,
    graft,
    warp_settings,
)
from neuraldoom.flow import FlowNet
from neuraldoom.recording import Recording, RecordingError, find_recordings
from neuraldoom.sampler import DDIMSampler, Pass
from training import latents as L
from training import trainer
from training.widen import deepen, widen, widened_config


@dataclass(frozen=True)
class Args:
    data: str  # dataset folder with train/ and heldout/ recordings
    out: str  # run folder (resumed if it holds a state)
    autoencoder: str = ""  # autoencoder folder; default: the one in --init-from
    init_from: str = ""  # a checkpoint to continue training (weights only; optimizer starts fresh)
    steps: int = 100000
    minutes: float = 0.0  # stop (and save) after this much wall time; 0 = no limit
    batch: int = 32
    lr: float = 3e-4
    warmup: int = 200
    schedule: str = "constant"  # learning rate after the warm-up: constant, or cosine to the run's end
    ema: float = 0.999
    context_dropout: float = 0.1  # drop the past frames (not the actions) so CFG has an unconditional
    reference: str = "clean"  # a delta target's reference: the last context frame "clean" (static content is
    # exactly no change at every context-noise level: sharp, steady frames) or as "seen" (noised: the target
    # also asks to remove that noise; blurrier, the recipe before docs/EXPERIMENTS.md "The clean reference")
    clean_share: float = 0.0  # share of samples trained on an un-noised context (the one play feeds)
    own_frames: float = 0.25  # share of samples whose last context frame is the model's own sample of it (with
    # the clean reference, what keeps long rollouts from carrying their errors on; 0.5 measured worse)
    own_unroll: int = 1  # how many of the newest context frames an own-frames sample generates, each from the
    # ones before it (1: the last alone); each costs one more run of play's sampler on those samples
    hud_weight: float = 1.0  # loss weight of the latent rows under the status bar: it is game state that
    # barely changes, and an unsure model's small errors there smear its digits within a few steps of play
    drift: float = 0.0  # largest low-frequency offset (latent units) added to the context of a --drift-share of
    # samples, the change's reference included, so the target carries the way back: long free play drifts
    # slowly off the data's colours (a channel's mean wanders by several stds over ~500 steps, then the view
    # blows out), and the white noise of the augmentation never shows the model a drifted context
    drift_share: float = 0.25  # the best trade of 0.1 / 0.25 / 0.5 at 40 minutes (docs/EXPERIMENTS.md)
    digit_weight: float = 1.0  # loss weight of the latent cells that draw the status bar's numbers (160x120): the
    # ammo count is ~18 of 1,280 cells, and a model trained with them alike never drew it going down
    digit_scope: str = "all"  # the samples whose number cells take --digit-weight: "all", or "events" (only the
    # --event-share drawn where the numbers change). Measured: the view keeps its sharpness, but the count learns
    # to move and not when (the copying samples teach it to stay put), and the bar breaks (docs/EXPERIMENTS.md)
    event_share: float = 0.0  # share of each batch drawn from the targets where the status bar's numbers
    # change (statusbar.bar_changes): random play spends ammo in ~5% of its steps, and the model never drew it
    event_fields: tuple[str, ...] = SB.FIELDS  # the numbers whose change makes an event: "ammo" alone (the shots,
    # ~90% of the events) leaves out the damage and pickup flashes; it learns the count faster, but free play still
    # drifts red by 750-1,000 steps: the flashes were not the cause (docs/EXPERIMENTS.md)
    event_after: int = 0  # the targets that follow each event within this many steps are events too: the
    # status bar's denoiser drew a new number on its step, then smeared it one or two steps later
    event_before: int = 0  # the targets that lead up to each event within this many steps are events too: where
    # the trigger is held and the game has not fired yet (a shot shows 3 steps after the press and 7 after the
    # last one while held), the bar counted shots a step early or that the game never made; at 3 it waited too
    # well: real shots missed, 8.6 points under an equal-samples control (docs/EXPERIMENTS.md)
    view_weight: float = 1.0  # loss weight of a status-bar denoiser's rows above its first (--rows): view it reads
    # as context and play does not paste; at 1 its wider rows' view outweighs the bar in the loss
    digit_fields: tuple[str, ...] = SB.FIELDS  # the numbers whose cells take --digit-weight ("ammo": 18 cells, not
    # 54; with ammo events the count moved furthest per sample and 500 steps of free play held as the shipped's)
    wall_share: float = 1.0  # a training target that shows a close wall (metrics.close_wall: ~20% of sticky-random
    # play, and the grey texture every model's free play settles on) is kept with this probability, else replaced
    # by one that does not: 1 trains on the data as recorded
    timesteps: str = "all"  # the noise levels trained: "all" (uniform over the 1,000, the paper's), "importance" (the
    # same objective, t drawn where the gradient is noisiest and weighted back: IMPORTANCE_BANDS), "plan" (only
    # the sampler's: play and the students' teacher ask for no other, so every sample trains one that is used) or
    # "lognormal" (EDM's and DIAMOND's noise levels, not weighted back: LOGNORMAL_SIGMA; 2% of t at 750 or above)
    snr_gamma: float = 0.0  # > 0: min-SNR loss weighting (Hang et al. 2023), each t's v-loss weighted by
    # min(SNR, gamma) / (SNR + 1), scaled to mean 1 over the schedule: the loud high-noise levels count for little
    offset_noise: float = 0.0  # > 0: offset noise (Guttenberg 2023), each sample's training noise given a
    # per-channel constant of this std on top, so that the model learns to move a whole channel's mean (play's
    # drift is a colour cast); the sampler still starts from plain Gaussian noise
    max_frames: int = 60000  # frames of DATA/train to encode into the cache (0 = all)
    save_every: float = 300.0  # seconds
    eval_every: int = 250
    seed: int = 0
    precision: str = "auto"  # auto (bf16 autocast on a GPU or a CPU with native bf16), fp32, bf16
    threads: int = 1
    compile: bool = False  # --compile: torch.compile the training and own-frames passes (trainer.training_pass,
    # sampling_pass): ~1.2x the samples/s; under CPU bf16 autocast the compiled backward gave most weights no
    # gradient (docs/EXPERIMENTS.md "A deeper denoiser grown from the shipped one"), so there it stays eager
    context: int = DenoiserConfig.context
    reads: int = DenoiserConfig.reads
    target: str = DenoiserConfig.target
    action_embed: bool = DenoiserConfig.action_embed
    turn_warp: bool = False  # the last frame turned by the current action as the change's reference
    # (DenoiserConfig.turn_warp from the game's frame skip and status bar); with --init-from, switches it on
    # for a checkpoint without it (its weights unchanged). With the "border" fill its free play blew up to noise
    # within 250-1,000 steps; with --warp-fill last it holds (docs/EXPERIMENTS.md)
    warp_mode: str = DenoiserConfig.warp_mode  # with --turn-warp: how the turn resamples (bicubic, nearest)
    warp_fill: str = DenoiserConfig.warp_fill  # with --turn-warp: what fills the view a turn brings in (border, last)
    flow: str = ""  # a learned motion's folder (training/train_flow.py's OUT/flow): grafted in, frozen, it moves
    # the turned reference further by walking, strafing and momentum (needs --turn-warp --warp-fill last); a
    # continued checkpoint that carries one keeps it
    block_out_channels: tuple[int, ...] = DenoiserConfig.block_out_channels
    attention_heads: int = DenoiserConfig.attention_heads
    only_cross_attention: bool = DenoiserConfig.only_cross_attention  # no self-attention: each transformer block's
    # first attention reads the action tokens too (the mid block keeps its self-attention); with --init-from,
    # grafted on (denoiser.graft: the model without that self-attention, the new attention starting at zero).
    # Measured: compiled play x1.10, held-out play tied, 1,000-step free play gathered a noise grid from step ~750
    # (docs/EXPERIMENTS.md)
    cross_only_levels: tuple[int, ...] = DenoiserConfig.cross_only_levels  # the same on these UNet levels only (0:
    # the full-size one). Measured on the 16x20 level: held-out play tied, no speed gained, the same noise grid
    cross_attention_dim: int = DenoiserConfig.cross_attention_dim
    widen: int = 1  # with --init-from: every UNet width times this, the function unchanged (training.widen), so a
    # trained model goes on with more capacity instead of a wider one starting from scratch
    widen_spread: float = 0.0  # with --widen: the copies' incoming weights differ by this share of the weights'
    # std (antithetic: the function changes at second order); 0: they start alike and grow apart only as fast as
    # the weights move. Measured: neither learns faster per sample than the small model (docs/EXPERIMENTS.md)
    rows: tuple[int, ...] = ()  # TOP FIRST BOTTOM: a status-bar denoiser (DenoiserConfig.rows) trained on the latent
    # rows [TOP, BOTTOM) alone; training.export --bar pastes its rows [FIRST, BOTTOM) over a checkpoint's frames.
    # With --init-from, it continues the status-bar denoiser the checkpoint carries (for other rows: from its
    # weights), else it starts from the checkpoint's frame denoiser (convolutions and attention fit any size)
    deepen: bool = False  # with --init-from: one more layer in every UNet block, the function unchanged
    # (training.widen.deepen): the latents' full-size level, where fine detail is drawn, gets twice the convolutions


ARCHITECTURE = ("context", "reads", "target", "action_embed", "turn_warp", "warp_mode", "warp_fill", "flow",
                "block_out_channels", "attention_heads", "only_cross_attention", "cross_only_levels",
                "cross_attention_dim", "widen", "deepen", "rows")


# The per-sample gradient's energy E|g|^2 of the shipped denoiser in four bands of t (0-249 ... 750-999), a
# quarter of each: 0.78 / 1.15 / 5.82 / 27.9 (1,024 single-sample gradients; docs/EXPERIMENTS.md "Where a
# sample's gradient is noise"). Drawing t with p proportional to sqrt(E) and weighting each sample by
# 1/(1000 p) keeps the gradient's expectation (the uniform objective) and cuts its variance by ~35%.
IMPORTANCE_BANDS = (0.78, 1.15, 5.82, 27.9)
# ln(sigma) ~ N(mean, std) of the training noise levels in EDM's sense (sigma = noise std over signal std at t):
# DIAMOND's (-0.4, 1.2) for data of std 0.5, moved to this denoiser's unit-std targets (+ln 2)
LOGNORMAL_SIGMA = (-0.4 + math.log(2.0), 1.2)


def noise_schedule(cfg: DenoiserConfig) -> DDPMScheduler:
    """The forward process the denoiser is trained on: linear betas, v-prediction (the sampler's DDIM matches)."""
    return DDPMScheduler(num_train_timesteps=cfg.num_train_timesteps, beta_schedule="linear",
                         prediction_type="v_prediction")


def importance_probs(T: int, bands: tuple[float, ...] = IMPORTANCE_BANDS) -> torch.Tensor:
    """P(t) over the T timesteps: constant within each band, proportional to sqrt(band energy)."""
    w = torch.tensor(bands, dtype=torch.float64).sqrt().repeat_interleave(-(-T // len(bands)))[:T]
    return (w / w.sum()).float()


def sigmas(sched: DDPMScheduler) -> torch.Tensor:
    """(T,) float64: sigma(t) = sqrt((1 - alpha_bar) / alpha_bar), the noise's std over the signal's."""
    ab = sched.alphas_cumprod.double()
    return ((1 - ab) / ab).sqrt()


def lognormal_probs(sched: DDPMScheduler, mean: float = LOGNORMAL_SIGMA[0], std: float = LOGNORMAL_SIGMA[1]
                    ) -> torch.Tensor:
    """P(t) over the schedule's timesteps that puts ln(sigma(t)) ~ N(mean, std): the normal density in ln(sigma)
    times the width in ln(sigma) that each t covers."""
    ls = sigmas(sched).log()
    p = torch.exp(-((ls - mean) ** 2) / (2 * std**2)) * torch.gradient(ls)[0]
    return (p / p.sum()).float()


def min_snr_weights(sched: DDPMScheduler, gamma: float) -> torch.Tensor:
    """(T,): the v-loss weight min(SNR, gamma) / (SNR + 1) per t (min-SNR-gamma for v-prediction), scaled to mean 1
    over the schedule so that a uniform draw keeps the loss's scale (and the gradient clip's meaning)."""
    snr = 1 / sigmas(sched) ** 2
    w = snr.clamp(max=gamma) / (snr + 1)
    return (w / w.mean()).float()


def noise_augment(ctx: torch.Tensor, cfg: DenoiserConfig, gen: torch.Generator,
                  clean_share: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """§3.2.1: Gaussian noise of a level ~ U[0, max] on the context; the level's bucket conditions the UNet.
    A `clean_share` of the samples gets level 0: the clean context that play feeds (bucket 0)."""
    B = len(ctx)
    level = torch.rand(B, generator=gen) * cfg.max_noise_level
    level = torch.where(torch.rand(B, generator=gen) < clean_share, torch.zeros_like(level), level)
    bucket = (level / cfg.max_noise_level * cfg.noise_buckets).long().clamp(max=cfg.noise_buckets - 1)
    noisy = ctx + level.view(B, 1, 1, 1, 1) * torch.randn(ctx.shape, generator=gen)
    return noisy, bucket


def drift_offsets(shape: tuple[int, ...], scale: float, share: float, gen: torch.Generator) -> torch.Tensor:
    """(B,C,h,w): for a `share` of the samples, a smooth offset of amplitude ~ U[0, scale]: half a per-channel
    constant, half a bilinear field from a 3x4 grid (play's drift is a colour cast that wanders over the
    view); zero for the rest."""
    B, C, h, w = shape
    amp = torch.rand(B, generator=gen) * scale * (torch.rand(B, generator=gen) < share)
    dc = torch.randn(B, C, 1, 1, generator=gen)
    field = F.interpolate(torch.randn(B, C, 3, 4, generator=gen), size=(h, w), mode="bilinear", align_corners=False)
    return amp.view(B, 1, 1, 1) * (dc + field) / 2**0.5


def training_noise(shape: tuple[int, ...], offset: float, gen: torch.Generator) -> torch.Tensor:
    """(B,C,h,w) the noise a training target is diffused with: white, plus (offset > 0) a constant per sample
    and channel of std `offset` (offset noise). offset 0 draws exactly the white noise alone."""
    eps = torch.randn(shape, generator=gen)
    if offset:
        eps = eps + offset * torch.randn(*shape[:2], 1, 1, generator=gen)
    return eps


def hud_rows(latent_h: int, factor: int, frame_h: int) -> torch.Tensor:
    """(latent_h,) bool: the latent rows (each `factor` pixel rows) that draw the status bar, not the
    padding rows below the frame."""
    rows = torch.arange(latent_h)
    return ((rows + 1) * factor > M.hud_top(frame_h)) & (rows * factor < frame_h)


def number_cells(latent_hw: tuple[int, int], factor: int, frame_hw: tuple[int, int],
                 fields: tuple[str, ...] = SB.FIELDS) -> torch.Tensor:
    """(h, w) bool: the latent cells that draw any pixel of the status bar's `fields` numbers (none where
    the reader does not apply)."""
    h, w = latent_hw
    px = np.zeros((h * factor, w * factor), bool)
    m = SB.number_mask(*frame_hw, fields)
    if m is not None:
        px[: m.shape[0], : m.shape[1]] = m
    return torch.from_numpy(px.reshape(h, factor, w, factor).any((1, 3)))


def loss_weights(latent_hw: tuple[int, int], factor: int, frame_hw: tuple[int, int], hud_weight: float,
                 digit_weight: float, fields: tuple[str, ...] = SB.FIELDS) -> torch.Tensor | None:
    """(h, w) per-cell loss weights (None: all alike): the status bar's rows ×hud_weight, the cells of its
    `fields` numbers ×digit_weight."""
    if hud_weight == 1 and digit_weight == 1:
        return None
    w = 1 + (hud_weight - 1) * hud_rows(latent_hw[0], factor, frame_hw[0]).float()[:, None].expand(latent_hw)
    return torch.where(number_cells(latent_hw, factor, frame_hw, fields), torch.tensor(float(digit_weight)), w)


def bar_weights(weight: torch.Tensor | None, region: tuple[int, int, int], width: int,
                view_weight: float) -> torch.Tensor | None:
    """A status-bar denoiser's share of the frame's loss weights (loss_weights; (h, w) or (B, h, w)): its rows
    (top, first, bottom), those above first ×view_weight."""
    top, first, bottom = region
    if weight is not None:
        weight = weight[..., top:bottom, :].clone()
    if view_weight == 1:
        return weight
    weight = torch.ones(bottom - top, width) if weight is None else weight
    weight[..., :first - top, :] *= view_weight
    return weight


def diffusion_loss(model: Denoiser, sched: DDPMScheduler, batch: tuple, cfg: DenoiserConfig,
                   dropout: float, gen: torch.Generator, device: torch.device, reference: str = "seen",
                   clean_share: float = 0.0, weight: torch.Tensor | None = None, drift: float = 0.0,
                   drift_share: float = 0.0, levels: torch.Tensor | None = None,
                   probs: torch.Tensor | None = None, t_weight: torch.Tensor | None = None,
                   offset_noise: float = 0.0) -> torch.Tensor:
    """The v-prediction loss of one batch. A "delta" target is taken against the reference (the last
    context frame, turned by the current action when the model warps turns) as the model sees it
    (`reference="seen"`: noise-augmented, so the target also asks it to remove that noise) or as it was
    (`"clean"`: static content is exactly zero change at every noise level).
    weight (h, w) or (B, h, w): per latent cell (and sample), normalised to mean 1 (None: all cells alike).
    drift: see drift_offsets; the offset is on every context frame and on the reference, so the target is the
    change plus the way back.
    levels: the timesteps to draw from (None: all of the schedule's).
    probs: P(t) over all the schedule's timesteps to draw t from (importance_probs, lognormal_probs).
    t_weight: (T,) the loss weight of each timestep (None: 1): 1/(T P(t)) takes an importance draw back to the
    uniform loss's expectation; min_snr_weights changes the objective.
    offset_noise: see training_noise."""
    target, ctx, codes = batch  # (B,C,h,w), (B,N,C,h,w), (B,N+1,2)
    B = len(target)
    raw = getattr(model, "module", model)
    if drift and drift_share:
        ctx = ctx + drift_offsets(target.shape, drift, drift_share, gen)[:, None]
    clean_last = raw.reference(ctx, codes)
    ctx, bucket = noise_augment(ctx, cfg, gen, clean_share)
    target = raw.to_target(target, clean_last if reference == "clean" else raw.reference(ctx, codes))
    drop = torch.rand(B, generator=gen) < dropout
    ctx = torch.where(drop.view(B, 1, 1, 1, 1), torch.zeros_like(ctx), ctx)
    eps = training_noise(target.shape, offset_noise, gen)
    T = sched.config.num_train_timesteps
    if probs is not None:
        t = torch.multinomial(probs, B, replacement=True, generator=gen)
    elif levels is None:
        t = torch.randint(0, T, (B,), generator=gen)
    else:
        t = levels[torch.randint(0, len(levels), (B,), generator=gen)]
    noisy = sched.add_noise(target, eps, t)
    v = sched.get_velocity(target, eps, t)  # eq. 1: v-prediction
    pred = model(noisy.to(device), t.to(device), ctx.to(device), codes.to(device), bucket.to(device))
    err = (pred.float() - v.to(device)).pow(2)
    if t_weight is not None:
        err = err * t_weight[t].to(device).view(B, 1, 1, 1)
    if weight is None:
        return err.mean()
    w = weight.to(device)
    w = w[:, None] if w.dim() == 3 else w
    return (err * (w / w.mean())).mean()


def with_own_frames(denoise: Pass, sampler: DDIMSampler, data: L.LatentSet, idx: torch.Tensor, batch: tuple,
                    share: float, gen: torch.Generator, acc: Any, unroll: int = 1) -> tuple:
    """Training on the model's own outputs: for a `share` of the batch, the last `unroll` context frames become
    the model's own rollout of them (play's sampler, from the real frames before them and the real actions,
    each generated frame fed back as the next one's context), so training sees the imperfect context that
    play feeds, and, the delta target being taken against the last of them, learns to correct it rather
    than to carry its errors on. unroll 1: one own frame after real ones; more: the several-step drift of
    free play (DIAMOND's unrolled training). denoise: the sampler's denoiser pass (trainer.sampling_pass)."""
    target, ctx, codes = batch
    pick = (torch.rand(len(idx), generator=gen) < share) & (idx - unroll > data.ep_start[idx])
    if not pick.any():
        return batch
    own: list[torch.Tensor] = []
    for j in range(unroll, 0, -1):  # frames idx-unroll ... idx-1, oldest first
        _, pctx, pcodes = data.window(idx[pick] - j, codes.shape[1] - 1, ctx.shape[1])
        if own:  # the frames already generated replace their real counterparts at the context's end
            pctx[:, -len(own):] = torch.stack(own, 1)
        noise = torch.randn(pctx[:, -1].shape, generator=gen)
        with torch.no_grad(), acc.autocast():
            own.append(sampler.sample(noise.to(acc.device), pctx.to(acc.device), pcodes.to(acc.device),
                                      denoise).float().cpu())
    ctx = ctx.clone()
    ctx[pick, -unroll:] = torch.stack(own, 1)
    return target, ctx, codes


def starting_context(data: Path, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The first n frames of the first held-out episode long enough, and the actions that led to them."""
    for p in find_recordings(data / "heldout") + find_recordings(data / "train"):
        r = Recording(p)
        for s, e in r.episodes():
            if e - s > n:
                acts = np.concatenate([[[A.NOOP.buttons, A.NOOP.turn]], r.actions[s:s + n - 1]])
                return np.asarray(r.frames[s:s + n]), acts
    raise RecordingError(f"no episode in {data} has more than {n} frames for the starting context")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    out = trainer.run_folder(a)
    state_path = out / "train_state.safetensors"
    try:
        acc = trainer.accelerator(a.precision)
    except ValueError as e:
        print(f"train_diffusion: {e}", file=sys.stderr)
        return 2
    try:
        init = Checkpoint(a.init_from) if a.init_from else None
        ae_dir = Path(a.autoencoder) if a.autoencoder else (init.path / "autoencoder" if init else None)
        if ae_dir is None:
            raise CheckpointError("give --autoencoder DIR (a trained autoencoder) or --init-from CHECKPOINT")
        ae = load_model_dir(AutoencoderTiny, ae_dir).eval()
        if a.target not in ("frame", "delta"):
            raise CheckpointError(f"--target must be frame or delta, not {a.target!r}")
        if a.timesteps not in ("all", "importance", "plan", "lognormal"):
            raise CheckpointError(f"--timesteps must be all, importance, plan or lognormal, not {a.timesteps!r}")
        if a.snr_gamma < 0:
            raise CheckpointError(f"--snr-gamma must be >= 0 (0: off), not {a.snr_gamma}")
        if a.offset_noise < 0:
            raise CheckpointError(f"--offset-noise must be >= 0 (0: off), not {a.offset_noise}")
        if a.warp_mode not in WARP_MODES:
            raise CheckpointError(f"--warp-mode must be one of {', '.join(WARP_MODES)}, not {a.warp_mode!r}")
        if a.warp_fill not in WARP_FILLS:
            raise CheckpointError(f"--warp-fill must be one of {', '.join(WARP_FILLS)}, not {a.warp_fill!r}")
        if (a.warp_mode, a.warp_fill) != (DenoiserConfig.warp_mode, DenoiserConfig.warp_fill) and not a.turn_warp:
            raise CheckpointError("--warp-mode and --warp-fill set how --turn-warp turns: give --turn-warp too")
        if a.flow and not (a.turn_warp and a.warp_fill == "last"):
            raise CheckpointError("--flow moves the view on top of the turn warp: give --turn-warp --warp-fill last")
        flow = load_model_dir(FlowNet, a.flow) if a.flow else (init.denoiser.flow if init else None)
        if flow is not None and flow.config.latent_channels != ae.config.latent_channels:
            raise CheckpointError(f"{a.flow}: the flow reads {flow.config.latent_channels} latent channels, the "
                                  f"autoencoder makes {ae.config.latent_channels}")
        if a.schedule not in trainer.SCHEDULES:
            raise CheckpointError(f"--schedule must be one of {', '.join(trainer.SCHEDULES)}, not {a.schedule!r}")
        if a.hud_weight <= 0 or a.digit_weight <= 0:
            raise CheckpointError(f"--hud-weight and --digit-weight must be > 0, not {a.hud_weight}, {a.digit_weight}")
        if a.digit_scope not in ("all", "events"):
            raise CheckpointError(f"--digit-scope must be all or events, not {a.digit_scope!r}")
        if not 0 <= a.wall_share <= 1:
            raise CheckpointError(f"--wall-share must be within [0, 1], not {a.wall_share}")
        if a.view_weight < 0:
            raise CheckpointError(f"--view-weight must be 0 or more, not {a.view_weight}")
        if a.event_after < 0 or a.event_before < 0:
            raise CheckpointError(f"--event-after and --event-before must be 0 or more, not {a.event_after}, "
                                  f"{a.event_before}")
        if not 0 <= a.event_share <= 1:
            raise CheckpointError(f"--event-share must be within [0, 1], not {a.event_share}")
        try:
            SB.field_index(a.event_fields), SB.field_index(a.digit_fields)
        except ValueError as e:
            raise CheckpointError(f"--event-fields, --digit-fields: {e}") from None
        if a.drift < 0 or not 0 <= a.drift_share <= 1:
            raise CheckpointError(f"--drift must be >= 0 and --drift-share within [0, 1] (not {a.drift}, "
                                  f"{a.drift_share})")
        if a.own_unroll < 1:
            raise CheckpointError(f"--own-unroll must be at least 1, not {a.own_unroll}")
        if a.reference not in ("seen", "clean") or not 0 <= a.clean_share <= 1 or not 0 <= a.own_frames <= 1:
            raise CheckpointError(f"--reference must be seen or clean (not {a.reference!r}), --clean-share and "
                                  f"--own-frames within [0, 1] (not {a.clean_share}, {a.own_frames})")
        # what continues: the checkpoint's denoiser, or with --rows the status-bar denoiser it carries (for other
        # rows too: the UNet's convolutions and attention fit any size, so a bar of more rows starts from its weights)
        base, base_cfg = (None, None) if init is None else (
            (init.bar, init.bar_cfg) if a.rows and init.bar_cfg is not None else (init.denoiser, init.denoiser_cfg))
        if init:  # a continued checkpoint keeps its architecture; --action-embed may graft the action path on
            dcfg = replace(base_cfg, action_embed=base_cfg.action_embed or a.action_embed,
                           only_cross_attention=base_cfg.only_cross_attention or a.only_cross_attention,
                           cross_only_levels=tuple(sorted({*base_cfg.cross_only_levels, *a.cross_only_levels})),
                           rows=a.rows or base_cfg.rows)
        else:
            dcfg = replace(DenoiserConfig(), context=a.context, block_out_channels=a.block_out_channels,
                           attention_heads=a.attention_heads, cross_attention_dim=a.cross_attention_dim,
                           reads=a.reads, target=a.target, action_embed=a.action_embed,
                           only_cross_attention=a.only_cross_attention, cross_only_levels=a.cross_only_levels,
                           rows=a.rows)
        if a.own_unroll > frames_read(dcfg):
            raise CheckpointError(f"--own-unroll {a.own_unroll} is more than the {frames_read(dcfg)} frames the "
                                  "model reads")
        try:
            cross_only(dcfg)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        if (a.widen != 1 or a.deepen) and init is None:
            raise CheckpointError("--widen and --deepen grow a trained denoiser: give --init-from CHECKPOINT")
        if a.widen != 1:
            try:
                widened_config(dcfg, a.widen)
            except ValueError as e:
                raise CheckpointError(f"--widen: {e}") from None
        data = Path(a.data)
        game = Recording(find_recordings(data / "train")[0]).game
        ctx_frames, ctx_actions = starting_context(data, dcfg.context)
        try:  # before the latents are encoded: rows that are not a status-bar region, or a bar that would turn
            bar_rows(replace(dcfg, turn_warp=dcfg.turn_warp or (0.0,) * a.turn_warp, flow=dcfg.flow or bool(a.flow)),
                     AE.latent_hw(ae, game.height, game.width)[0])
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        ae.to(acc.device)  # encode on the accelerator when there is one; the checkpoint keeps a CPU copy
        with acc.main_process_first():  # the main process encodes into the cache, the others then read it
            events = a.event_fields if a.event_share > 0 else ()
            train = L.build(ae, data / "train", out / "latents" / "train", a.max_frames, events=events,
                            walls=a.wall_share < 1)
            train.follow_events(a.event_after, a.event_before)
            held = L.build(ae, data / "heldout", out / "latents" / "heldout", max(a.max_frames // 10, 2000))
        ae.cpu()
    except (CheckpointError, RecordingError) as e:
        print(f"train_diffusion: {e}", file=sys.stderr)
        return 2
    full_hw = tuple(train.z.shape[-2:])
    if a.turn_warp and not dcfg.turn_warp:
        dcfg = replace(dcfg, **warp_settings(game, AE.downsampling(ae)))
    if a.turn_warp:  # a warped checkpoint may be continued with the other resampling
        dcfg = replace(dcfg, warp_mode=a.warp_mode, warp_fill=a.warp_fill)
    if dcfg.target == "delta" and init is None:  # unit-variance target: the std of one step's change
        dcfg = replace(dcfg, delta_scale=round(float(train.step_change_std()), 4))
    dcfg = replace(dcfg, flow=flow is not None)
    region = bar_rows(dcfg, full_hw[0])  # checked above
    top, bottom = (region[0], region[2]) if region else (0, full_hw[0])
    if region:  # a status-bar denoiser sees, and learns, its rows alone
        train.crop_rows(top, bottom)
        held.crop_rows(top, bottom)
    hw = tuple(train.z.shape[-2:])
    grafted = copy.deepcopy(flow.state_dict()) if flow is not None else None
    try:
        model = build_denoiser(dcfg, ae.config.latent_channels, hw, flow)
    except ValueError as e:
        print(f"train_diffusion: {e}", file=sys.stderr)
        return 2
    if init is not None:  # strict but for what may be grafted on: the action's zero map (--action-embed), the
        # attention that replaces self-attention (--only-cross-attention) and a flow net (--flow)
        missing, unexpected = model.load_state_dict(graft(base.state_dict(), base_cfg, model),
                                                    strict=False)
        missing = {k for k in missing if not k.startswith("flow.")}
        unexpected = [k for k in unexpected if not (a.flow and k.startswith("flow."))]
        if grafted is not None:
            model.flow.load_state_dict(grafted)  # --flow replaces the one the continued checkpoint carried
        if unexpected or missing - {"unet.time_embedding.cond_proj.weight"}:
            print(f"train_diffusion: {a.init_from}: its weights do not fit (missing {missing}, unexpected "
                  f"{unexpected})", file=sys.stderr)
            return 2
    if a.widen != 1:
        model, dcfg = widen(model, dcfg, ae.config.latent_channels, hw, a.widen, seed=a.seed,
                            spread=a.widen_spread)
    if a.deepen:
        model, dcfg = deepen(model, dcfg, ae.config.latent_channels, hw)
    try:
        opt, ema, step, seen, elapsed = trainer.start_run(state_path, a, ARCHITECTURE, model, weight_decay=0.01)
    except CheckpointError as e:
        print(f"train_diffusion: {e}", file=sys.stderr)
        return 2
    if step and acc.is_main_process:
        print(f"train_diffusion: resuming at step {step}")
    sched = noise_schedule(dcfg)
    prog = trainer.Progress(acc, out / "log.jsonl", a.steps, step, seen, elapsed, a.minutes, "denoiser")
    lr_sched = trainer.lr_schedule(opt, a.schedule, a.warmup, prog)
    model.train()
    model, opt = acc.prepare(model, opt)
    raw = acc.unwrap_model(model)
    model = trainer.training_pass(model, acc, a.compile)
    gen = torch.Generator().manual_seed(a.seed * 1_000_003 + step * 7 + acc.process_index)
    sampler_cfg = init.sampler_cfg if init else SamplerConfig()  # a continued checkpoint samples as it did
    own_sampler = DDIMSampler(raw, sampler_cfg.steps, 1.0, skip=sampler_cfg.skip)  # play's plan, conditional pass
    own_pass = trainer.sampling_pass(raw, a.compile)
    levels = torch.tensor([t for t, _, _ in own_sampler.plan]) if a.timesteps == "plan" else None
    probs = t_weight = None
    if a.timesteps == "importance":
        probs = importance_probs(dcfg.num_train_timesteps)
        t_weight = 1 / (dcfg.num_train_timesteps * probs)  # back to the uniform objective's expectation
    elif a.timesteps == "lognormal":
        probs = lognormal_probs(sched)
    if a.snr_gamma:
        snr_w = min_snr_weights(sched, a.snr_gamma)
        t_weight = snr_w if t_weight is None else t_weight * snr_w
    weight = loss_weights(full_hw, AE.downsampling(ae), (game.height, game.width), a.hud_weight, a.digit_weight,
                          a.digit_fields)
    k_events = int(round(a.event_share * a.batch)) if a.event_share and len(train.event_targets) else 0
    if weight is not None and a.digit_scope == "events":  # the weighted cells only on the event samples
        plain = loss_weights(full_hw, AE.downsampling(ae), (game.height, game.width), a.hud_weight, 1.0)
        plain = torch.ones_like(weight) if plain is None else plain
        weight = torch.stack([weight] * k_events + [plain] * (a.batch - k_events))
    if region:
        weight = bar_weights(weight, region, full_hw[1], a.view_weight)
    held_idx = held.targets[torch.randperm(len(held), generator=torch.Generator().manual_seed(0))[:64]]
    held_batch = held.window(held_idx, dcfg.context, raw.reads)  # gathered once: every evaluation reads the same

    @torch.no_grad()
    def held_loss(use_ema: bool = False) -> float:
        """The loss on 64 fixed held-out targets (fixed noise), of the training weights or of the EMA ones:
        the EMA's is what a checkpoint ships; the training weights' alone misranks runs of different rates."""
        raw.eval()
        if use_ema:
            ema.store(raw.parameters())
            ema.copy_to(raw.parameters())
        g = torch.Generator().manual_seed(1)
        loss = diffusion_loss(raw, sched, held_batch, dcfg, 0.0, g, acc.device, a.reference, a.clean_share,
                              levels=levels)  # the levels trained: "plan" is its own scale
        if use_ema:
            ema.restore(raw.parameters())
        raw.train()
        return float(loss)

    def save() -> None:
        if not acc.is_main_process:
            return
        trainer.save_run(state_path, raw, opt, ema, prog.step, prog.seen, prog.seconds, a)
        shipped = copy.deepcopy(raw).cpu().eval()
        ema.copy_to(shipped.parameters())
        notes = {"steps": prog.step, "samples": prog.seen, "batch": a.batch, "lr": a.lr,
                 "train_frames": int(train.z.shape[0]), "data": str(a.data),
                 "init_from": a.init_from, "autoencoder": str(ae_dir), "reference": a.reference,
                 "clean_share": a.clean_share, "own_frames": a.own_frames, "own_unroll": a.own_unroll,
                 "schedule": a.schedule,
                 "hud_weight": a.hud_weight, "digit_weight": a.digit_weight, "digit_scope": a.digit_scope,
                 "event_share": a.event_share, "event_fields": list(a.event_fields),
                 "event_after": a.event_after, "event_before": a.event_before,
                 "view_weight": a.view_weight,
                 "digit_fields": list(a.digit_fields),
                 "drift": a.drift, "drift_share": a.drift_share, "widen": a.widen, "widen_spread": a.widen_spread,
                 "deepen": a.deepen,
                 "timesteps": a.timesteps, "snr_gamma": a.snr_gamma, "flow": a.flow, "wall_share": a.wall_share,
                 "offset_noise": a.offset_noise, "rows": list(dcfg.rows)}
        save_checkpoint(out / "checkpoint", ae, shipped, game, dcfg, sampler_cfg, ctx_frames, ctx_actions, notes)

    if acc.is_main_process:
        print(f"train_diffusion: {acc.num_processes} process(es) on {acc.device}, {len(train)} training targets")
    while prog.step < a.steps and not prog.spent():
        idx = train.draw(a.batch, gen, a.wall_share)
        if k_events:
            idx[:k_events] = train.event_targets[torch.randint(0, len(train.event_targets), (k_events,), generator=gen)]
        batch = train.window(idx, dcfg.context, raw.reads)
        if a.own_frames:
            batch = with_own_frames(own_pass, own_sampler, train, idx, batch, a.own_frames, gen, acc, a.own_unroll)
        loss = diffusion_loss(model, sched, batch, dcfg, a.context_dropout, gen, acc.device, a.reference,
                              a.clean_share, weight, a.drift, a.drift_share, levels, probs, t_weight, a.offset_noise)
        trainer.optimizer_step(acc, model, opt, lr_sched, ema, loss)
        prog.tick(a.batch, loss)
        if prog.step % a.eval_every == 0 and acc.is_main_process:
            prog.write(loss=loss.item(), held_loss=held_loss(), held_loss_ema=held_loss(use_ema=True))
        if prog.save_or_stop(save, a.save_every):
            break
    prog.close()
    if acc.is_main_process:
        print(f"train_diffusion: step {prog.step}, {prog.seen} samples, held-out loss {held_loss():.4f} "
              f"(EMA weights {held_loss(use_ema=True):.4f}); "
              f"checkpoint in {out / 'checkpoint'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
