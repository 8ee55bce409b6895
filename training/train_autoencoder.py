"""Train the frame autoencoder on recordings (pixel MSE + a little L1, the status bar weighted up), then
optionally fine-tune the decoder alone with the encoder frozen (GameNGen §3.2.2, which fixed the HUD).

    python -m training.train_autoencoder --data data/e1m1 --out runs/ae --minutes 25
    python -m training.train_autoencoder --data data/e1m1 --out runs/ae --decoder-only --minutes 10

Reads DATA/train for training and DATA/heldout for the reported PSNR (whole frame and status bar).
Saves OUT/autoencoder (diffusers folder) and OUT/ae_state.safetensors (optimizer, step) every
--save-every seconds, atomically; rerunning the same command resumes. OUT/ae_log.jsonl holds the curves.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderTiny

from neuraldoom import autoencoder as AE
from neuraldoom import metrics
from neuraldoom import statusbar as SB
from neuraldoom.checkpoint import (
    CheckpointError,
    load_model_dir,
    load_optimizer,
    load_state,
    optimizer_tensors,
    save_model_dir,
    save_state,
)
from neuraldoom.config import AutoencoderConfig, parse_args
from neuraldoom.recording import RecordingError
from training import trainer
from training.adversarial import Critic, PatchDiscriminator, adaptive_weight
from training.data import FramePool
from training.decoder_pairs import open_pairs
from training.latents import encoder_digest


@dataclass(frozen=True)
class Args:
    data: str  # dataset folder with train/ and heldout/ recordings
    out: str  # run folder (resumed if it holds a state)
    steps: int = 20000  # optimizer steps (cosine schedule length)
    minutes: float = 0.0  # stop (and save) after this much wall time; 0 = no limit
    batch: int = 32
    lr: float = 1e-3
    crop: tuple[int, int] = (64, 80)  # train on crops (fully convolutional; ~2.5x cheaper); 0,0 = frames
    hud_weight: float = 4.0  # loss weight of the status bar: it is game state, not decoration
    digit_weight: float = 30.0  # loss weight of the status bar's number cells (ammo, health, armor), 160x120
    l1: float = 0.1
    grad_weight: float = 0.0  # L1 on image gradients: MSE alone is minimised by blur (edges, textures)
    adv_weight: float = 0.0  # patch-discriminator (hinge) loss, relative to the reconstruction loss's gradient
    # at the decoder's last layer (VQGAN's adaptive weight, so one value fits any loss scale); how TAESD stays sharp
    decoder_only: bool = False  # freeze the encoder, fine-tune the decoder on whole frames
    latent_noise: float = 0.0  # add Gaussian noise of a level ~ U[0, this] to the (normalized) latents before
    # decoding, so the decoder draws the real frame from an imperfect latent: the denoiser's samples are such
    pairs: str = ""  # a training.decoder_pairs folder: with --decoder-only, a share of each batch is the play
    # sampler's latents to be drawn as the real frames they stand for (what play asks the decoder to draw)
    pair_share: float = 0.5  # that share of each batch
    init_from: str = ""  # an autoencoder folder to start from (e.g. checkpoints/e1m1/autoencoder)
    save_every: float = 120.0  # seconds
    eval_every: int = 250
    eval_frames: int = 256
    seed: int = 0
    precision: str = "auto"  # auto (bf16 autocast on a GPU or a CPU with native bf16), fp32, bf16
    threads: int = 1  # torch threads (1 per process: 2 threads on a busy 2-core CPU run slower)
    latent_channels: int = AutoencoderConfig.latent_channels
    encoder_channels: int = AutoencoderConfig.encoder_channels
    decoder_channels: int = AutoencoderConfig.decoder_channels
    # the downsampling: encoder_fold x 2^(levels - 1), the same for the decoder (4, 2 levels / 2, 3 levels: 8x;
    # 4, 1 level / 2, 2 levels: 4x, four times the latent cells)
    encoder_fold: int = AutoencoderConfig.encoder_fold
    decoder_fold: int = AutoencoderConfig.decoder_fold
    encoder_blocks: tuple[int, ...] = AutoencoderConfig.encoder_blocks
    decoder_blocks: tuple[int, ...] = AutoencoderConfig.decoder_blocks


def sample_batch(pool: FramePool, rng: np.random.Generator, a: Args, factor: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels (B,3,h,w) in [-1,1], per-pixel loss weights (B,1,h,w)); crops keep the status bar half the time."""
    x = AE.to_pixels(pool.sample(rng, a.batch), factor)  # (B, 3, H', W')
    H, W = pool.height, pool.width
    w = torch.ones(1, 1, *x.shape[-2:])
    w[..., metrics.hud_top(H):H, :] = a.hud_weight
    digits = SB.number_mask(H, W)
    if a.digit_weight and digits is not None:
        # ~3% of the pixels that MSE alone lets the decoder draw from memory ("33" on every frame)
        w[..., :H, :W][..., torch.from_numpy(digits)] = a.digit_weight
    w[..., H:, :] = 0  # padding rows carry no loss
    w[..., W:] = 0
    w = w.expand(len(x), -1, -1, -1)
    ch, cw = a.crop
    if ch and cw and not a.decoder_only:
        xs, ws = [], []
        for i in range(len(x)):
            if rng.random() < 0.5:  # a crop holding the status bar
                top = (x.shape[-2] - ch) // factor * factor
            else:
                top = int(rng.integers(0, (x.shape[-2] - ch) // factor + 1)) * factor
            left = int(rng.integers(0, (x.shape[-1] - cw) // factor + 1)) * factor
            xs.append(x[i, :, top:top + ch, left:left + cw])
            ws.append(w[i, :, top:top + ch, left:left + cw])
        x, w = torch.stack(xs), torch.stack(ws)
    return x, w


def reconstruction_loss(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, a: Args) -> torch.Tensor:
    """Weighted MSE + L1 on pixels, plus L1 on horizontal/vertical differences (edge loss)."""
    err = y - x
    loss = ((err.pow(2) + a.l1 * err.abs()) * w).sum() / (w.sum() * 3)
    if a.grad_weight:
        for d in (-1, -2):  # x and y differences; a pair counts where both pixels carry weight
            n = y.shape[d] - 1
            ey = y.diff(dim=d) - x.diff(dim=d)
            wd = w.narrow(d, 0, n) * w.narrow(d, 1, n)
            loss = loss + a.grad_weight * (ey.abs() * wd).sum() / (wd.sum() * 3)
    return loss


@torch.no_grad()
def evaluate(ae: AutoencoderTiny, frames: np.ndarray) -> dict[str, float]:
    ae.eval()
    rec = AE.decode(ae, AE.encode(ae, frames, 32), frames.shape[1], frames.shape[2])
    ae.train()
    return {"psnr": metrics.psnr(rec, frames), "hud_psnr": metrics.psnr(metrics.hud(rec), metrics.hud(frames)),
            "sharpness": metrics.sharpness(rec, frames)}


@torch.no_grad()
def normalize_latents(ae: AutoencoderTiny, frames: np.ndarray) -> None:
    """Record the latents' mean/std in the config so the denoiser sees ~unit-variance inputs."""
    ae.register_to_config(shift_factor=0.0, scaling_factor=1.0)
    z = AE.encode(ae, frames, 32)
    ae.register_to_config(shift_factor=float(z.mean()), scaling_factor=float(1.0 / z.std()))


ARCHITECTURE = ("latent_channels", "encoder_channels", "decoder_channels", "encoder_fold", "decoder_fold",
                "encoder_blocks", "decoder_blocks")


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    out = trainer.run_folder(a)
    state_path = out / ("dec_state.safetensors" if a.decoder_only else "ae_state.safetensors")
    if a.latent_noise < 0:
        print(f"train_autoencoder: --latent-noise must be >= 0, not {a.latent_noise}", file=sys.stderr)
        return 2
    if a.pairs and (not a.decoder_only or not 0 < a.pair_share <= 1):
        print("train_autoencoder: --pairs needs --decoder-only (the latents must stay the encoder's) and a "
              f"--pair-share within (0, 1], not {a.pair_share}", file=sys.stderr)
        return 2
    try:
        train = FramePool(Path(a.data) / "train")
        held = FramePool(Path(a.data) / "heldout")
    except RecordingError as e:
        print(f"train_autoencoder: {e}", file=sys.stderr)
        return 2
    eval_frames = held.evenly(a.eval_frames)

    try:
        acc = trainer.accelerator(a.precision)
    except ValueError as e:
        print(f"train_autoencoder: {e}", file=sys.stderr)
        return 2
    try:
        tensors, meta = load_state(state_path) if state_path.exists() else ({}, {})
        if meta:  # resume: the state file alone holds the weights, so a kill mid-save never loses them
            trainer.check_same_architecture(meta.get("args", {}), a, ARCHITECTURE, state_path)
            cfg = {k: v for k, v in meta["model_config"].items() if k != "block_out_channels"}  # not an init arg
            ae = AutoencoderTiny.from_config(cfg)
            ae.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
        elif a.decoder_only and (out / "autoencoder").exists():
            ae = load_model_dir(AutoencoderTiny, out / "autoencoder")  # decoder fine-tune in place
        elif a.init_from:
            ae = load_model_dir(AutoencoderTiny, a.init_from)
        else:
            if a.decoder_only:
                raise CheckpointError(f"--decoder-only needs a trained autoencoder in {out}/autoencoder")
            ae = AE.build_autoencoder(AutoencoderConfig(
                latent_channels=a.latent_channels, encoder_channels=a.encoder_channels,
                decoder_channels=a.decoder_channels, encoder_fold=a.encoder_fold, decoder_fold=a.decoder_fold,
                encoder_blocks=a.encoder_blocks, decoder_blocks=a.decoder_blocks))
        step, seen, elapsed = 0, 0, 0.0
        params = ae.decoder.parameters() if a.decoder_only else ae.parameters()
        ae.encoder.requires_grad_(not a.decoder_only)
        opt = torch.optim.AdamW(params, lr=a.lr, weight_decay=0.0)
        critic = Critic(PatchDiscriminator(), a.lr).to(acc.device) if a.adv_weight else None
        if critic is not None and meta:
            critic.load(tensors, meta)
        if meta:
            load_optimizer(opt, tensors, meta)
            for g in opt.param_groups:  # the schedule restarts from the --lr given now, at the saved step
                g["lr"] = g["initial_lr"] = a.lr
            step, seen, elapsed = int(meta["step"]), int(meta.get("seen", 0)), float(meta.get("elapsed", 0.0))
            print(f"train_autoencoder: resuming at step {step}")
        pairs = open_pairs(a.pairs, encoder_digest(ae)) if a.pairs else None
    except (CheckpointError, RecordingError, ValueError) as e:
        print(f"train_autoencoder: {e}", file=sys.stderr)
        return 2
    # A cosine over the run's length: --steps, or --minutes of wall time if that ends first, so a
    # time-boxed run anneals to its end instead of stopping at a high learning rate.
    prog = trainer.Progress(acc, out / "ae_log.jsonl", a.steps, step, seen, elapsed, a.minutes,
                            "decoder" if a.decoder_only else "autoencoder")
    lr_sched = trainer.lr_schedule(opt, "cosine", 200, prog)
    ae.train()
    ae, opt = acc.prepare(ae, opt)
    raw = acc.unwrap_model(ae)
    factor = AE.downsampling(raw)
    latent_shape = (raw.config.latent_channels, *AE.latent_hw(raw, train.height, train.width))
    rng = np.random.default_rng([a.seed, step, acc.process_index])

    def save() -> None:
        if acc.is_main_process:
            if not a.decoder_only:  # the frozen encoder keeps its latent statistics (the denoiser's inputs)
                normalize_latents(raw, eval_frames[:128])
            save_model_dir(raw, out / "autoencoder")
            t, m = optimizer_tensors(opt)
            t.update({f"model.{k}": v for k, v in raw.state_dict().items()})
            if critic is not None:
                ct, cm = critic.tensors()
                t.update(ct)
                m.update(cm)
            save_state(state_path, t, {**m, "step": prog.step, "seen": prog.seen, "elapsed": prog.seconds,
                                       "args": asdict(a), "model_config": dict(raw.config)})

    while prog.step < a.steps and not prog.spent():
        x, w = sample_batch(train, rng, a, factor)
        k = int(round(a.pair_share * len(x))) if pairs is not None else 0
        if k:  # whole frames in a decoder fine-tune, so the first k frames' weights fit the pairs' frames too
            sel = np.sort(rng.integers(0, len(pairs[0]), k))  # sorted: the memory map reads forward
            x[:k] = AE.to_pixels(pairs[1][sel], factor)
        x, w = x.to(acc.device), w.to(acc.device)
        with acc.autocast():
            with torch.no_grad() if a.decoder_only else torch.enable_grad():
                z = AE.encode_pixels(raw, x[k:]) if k < len(x) else x.new_zeros(0, *latent_shape)
            if a.latent_noise:
                level = torch.from_numpy(rng.uniform(0, a.latent_noise, (len(z), 1, 1, 1))).to(z)
                z = z + level * torch.from_numpy(rng.standard_normal(z.shape, np.float32)).to(z)
            if k:
                z = torch.cat([torch.from_numpy(np.asarray(pairs[0][sel], np.float32)).to(z), z])
            y = AE.decode_pixels(raw, z).float()
        loss = reconstruction_loss(y, x, w, a)
        if critic is not None:  # hinge GAN on the visible frame (the padding is not part of the picture)
            H, W = train.height, train.width
            real, fake = x[..., :H, :W], y[..., :H, :W]
            critic.update(real, fake)
            g_loss = critic.generator_loss(fake)
            loss = loss + a.adv_weight * adaptive_weight(loss, g_loss, raw.decoder.layers[-1].weight) * g_loss
        trainer.optimizer_step(acc, ae, opt, lr_sched, None, loss)
        prog.tick(len(x), loss)
        if prog.step % a.eval_every == 0 or prog.step == a.steps:
            prog.write(loss=loss.item(), **evaluate(raw, eval_frames))
        if prog.save_or_stop(save, a.save_every):
            break
    prog.close()
    ev = evaluate(raw, eval_frames)
    print(f"train_autoencoder: step {prog.step}, held-out PSNR {ev['psnr']:.2f} dB, status bar {ev['hud_psnr']:.2f} dB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
