"""Assemble a checkpoint to ship: the trained denoiser with a fine-tuned decoder swapped in.

    python -m training.export --checkpoint runs/dm/checkpoint --autoencoder runs/aedec/autoencoder \
        --out checkpoints/e1m1
    python -m training.export --checkpoint checkpoints/e1m1 --students runs/g4/checkpoint runs/p1/checkpoint \
        --out checkpoints/e1m1
    python -m training.export --checkpoint runs/wide/checkpoint --half --out runs/cand   # float16 on disk
    python -m training.export --checkpoint runs/dm/checkpoint --bounds-from runs/dm/latents/train --out runs/cand
    python -m training.export --checkpoint checkpoints/e1m1 --bar runs/bar/checkpoint --out runs/cand  # + its bar
    python -m training.export --checkpoint runs/fresh/checkpoint --play-like checkpoints/e1m1 --out runs/cand

The denoiser was trained on the latents of one encoder, so the new autoencoder must carry exactly that
encoder and latent normalization (a --decoder-only fine-tune does); anything else is refused. The
checkpoint's distilled students come along; --students adds those of other checkpoints (training.distill's
outputs), each of which must have been distilled from this very denoiser. So does its status-bar denoiser;
--bar puts in another (train_diffusion --rows), trained on the same encoder's latents. --play-like gives a
denoiser trained from scratch on a shipped checkpoint's autoencoder that checkpoint's way of playing: its sampler
settings and its status-bar denoiser (the flags above still override them).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from diffusers import AutoencoderTiny

from neuraldoom.checkpoint import Checkpoint, CheckpointError, load_model_dir, save_checkpoint, weights_digest
from neuraldoom.config import parse_args
from training import latents as L

MAX_MB = 60


@dataclass(frozen=True)
class Args:
    checkpoint: str  # the trained checkpoint (e.g. runs/dm/checkpoint)
    out: str
    autoencoder: str = ""  # a decoder-fine-tuned autoencoder folder to swap in
    students: tuple[str, ...] = ()  # checkpoints whose distilled students to carry (later ones win)
    guidance: float = 0.0  # the teacher's classifier-free guidance weight to ship (0 = keep the checkpoint's)
    deadband: float = -1.0  # the sampler's deadband to ship (SamplerConfig.deadband; -1 = keep the checkpoint's)
    bar_deadband: float = -1.0  # the status-bar denoiser's deadband to ship (SamplerConfig.bar_deadband; -1 = keep
    # the checkpoint's)
    skip: int = -1  # the teacher's first DDIM steps not run (SamplerConfig.skip; -1 = keep the checkpoint's)
    bounds_from: str = ""  # a latent cache of the training frames (train_diffusion's OUT/latents/train): hold every
    # generated frame inside their statistics' range (sampler.FrameBounds; "" = keep the checkpoint's)
    bounds_quantile: float = 0.001  # the share of training frames left outside the range at each end
    bar: str = ""  # a checkpoint whose denoiser is a status-bar one (train_diffusion --rows): carried, its rows pasted
    # over every frame in play ("" = keep the checkpoint's, if any)
    play_like: str = ""  # a checkpoint of the same encoder whose sampler settings and status-bar denoiser to ship
    # ("" = keep this checkpoint's)
    half: bool = False  # the teacher's weights in float16 on disk (half the bytes: what keeps a wider denoiser
    # under MAX_MB). It rounds the teacher, so students are distilled from the rounded one: export --half first


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    if a.guidance < 0:
        print(f"export: --guidance must be > 0 (or 0 to keep the checkpoint's), got {a.guidance}", file=sys.stderr)
        return 2
    if not 0 <= a.bounds_quantile < 0.5:
        print(f"export: --bounds-quantile must be in [0, 0.5), got {a.bounds_quantile}", file=sys.stderr)
        return 2
    try:
        ck = Checkpoint(a.checkpoint)
        ae = ck.ae
        latents = L.encoder_digest(ae)  # what a denoiser trained on this encoder's latents depends on
        if a.autoencoder:
            new = load_model_dir(AutoencoderTiny, a.autoencoder)
            if L.encoder_digest(new) != latents:
                raise CheckpointError(f"{a.autoencoder} has another encoder or latent normalization than "
                                      f"{a.checkpoint}: the denoiser's latents would not match")
            ae = new
        students = ck.student_models()
        base = weights_digest(ck.denoiser)
        for path in a.students:
            other = Checkpoint(path)
            for n, (model, info) in other.student_models().items():
                if info.get("base") != base:
                    raise CheckpointError(f"{path}: its {n}-step student was distilled from other weights "
                                          f"than {a.checkpoint}'s denoiser")
                students[n] = (model, info)
        stale = [n for n, (_, info) in students.items() if info.get("base") != base]
        if stale:
            raise CheckpointError(f"{a.checkpoint} carries students {stale} of another denoiser")
        rounds = a.half and any(not torch.equal(p, p.half().float()) for p in ck.denoiser.parameters())
        if rounds and students:
            raise CheckpointError(f"--half rounds {a.checkpoint}'s denoiser, and its students {sorted(students)} "
                                  f"were distilled from the float32 weights: export --half first, distil from that")
        bounds = L.frame_bounds(*L.frame_stats(Path(a.bounds_from), ck.ae), a.bounds_quantile) if a.bounds_from else {}
        sampler_cfg, bar = ck.sampler_cfg, ck.bar_parts()
        if a.play_like:
            like = Checkpoint(a.play_like)
            if L.encoder_digest(like.ae) != latents:
                raise CheckpointError(f"{a.play_like} has another encoder or latent normalization than "
                                      f"{a.checkpoint}: its sampler's frame bounds and status-bar denoiser would "
                                      "not fit")
            sampler_cfg, bar = like.sampler_cfg, like.bar_parts()
        if a.bar:
            other = Checkpoint(a.bar)
            if not other.denoiser_cfg.rows:
                raise CheckpointError(f"{a.bar}: its denoiser draws whole frames, not a status bar's rows "
                                      "(train_diffusion --rows)")
            if L.encoder_digest(other.ae) != latents:
                raise CheckpointError(f"{a.bar} was trained on another encoder's latents (or another latent "
                                      f"normalization) than {a.checkpoint}'s")
            bar = (other.denoiser, other.denoiser_cfg, dict(other.config.get("notes", {}), checkpoint=a.bar))
        if bar and bar[1].context != ck.denoiser_cfg.context:  # a bar brought by --bar or --play-like
            raise CheckpointError(f"the status-bar denoiser of {a.bar or a.play_like} reads {bar[1].context} context "
                                  f"frames, {a.checkpoint}'s denoiser {ck.denoiser_cfg.context}")
        if a.skip >= sampler_cfg.steps:
            raise CheckpointError(f"--skip {a.skip} leaves none of the teacher's {sampler_cfg.steps} DDIM steps")
    except CheckpointError as e:
        print(f"export: {e}", file=sys.stderr)
        return 2
    notes = dict(ck.config.get("notes", {}))
    if a.autoencoder:
        notes["decoder"] = str(a.autoencoder)
    if a.guidance:
        sampler_cfg = replace(sampler_cfg, cfg=a.guidance)
    if a.deadband >= 0:
        sampler_cfg = replace(sampler_cfg, deadband=a.deadband)
    if a.bar_deadband >= 0:
        sampler_cfg = replace(sampler_cfg, bar_deadband=a.bar_deadband)
    if a.skip >= 0:
        sampler_cfg = replace(sampler_cfg, skip=a.skip)
    sampler_cfg = replace(sampler_cfg, **bounds)
    save_checkpoint(a.out, ae, ck.denoiser, ck.game, ck.denoiser_cfg, sampler_cfg, ck.context_frames,
                    ck.context_actions, notes, students, half=a.half, bar=bar)
    mb = sum(f.stat().st_size for f in Path(a.out).rglob("*") if f.is_file()) / 2**20
    print(f"export: {a.out} ({mb:.1f} MB; students: {sorted(students) or 'none'}; status-bar denoiser: "
          f"{'rows ' + ' '.join(map(str, bar[1].rows)) if bar else 'none'})")
    if mb > MAX_MB:
        print(f"export: warning: over the {MAX_MB} MB limit for a shipped checkpoint", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
