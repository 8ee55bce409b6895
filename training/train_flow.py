"""Train the learned motion of the view (neuraldoom/flow.py) on latents of recordings.

    python -m training.train_flow --data data/e1m1 --autoencoder checkpoints/e1m1/autoencoder --out runs/flow

Encodes DATA/train and DATA/heldout once into OUT/latents (the cache train_diffusion uses: point both at
the same folder, or symlink it), then fits the net's per-cell offsets, on top of the exact turn warp, so
that the last frame's view rows moved by them match the next frame's (MSE on the latent's view rows, a
little total variation on the offsets). No diffusion: a deterministic, sharp prediction of what moving
does. Every --save-every seconds, atomically: OUT/train_state.safetensors (rerunning resumes) and OUT/flow
(the EMA weights, what `train_diffusion --flow OUT/flow` grafts into a denoiser). The log reports the
held-out MSE of copying the last frame, of the turn warp alone and of the learned motion.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers import AutoencoderTiny

from neuraldoom import autoencoder as AE
from neuraldoom.checkpoint import CheckpointError, load_model_dir, save_model_dir
from neuraldoom.config import DenoiserConfig, parse_args
from neuraldoom.denoiser import move_view, turn_grids, warp_settings
from neuraldoom.flow import FlowNet, offset_grid
from neuraldoom.recording import Recording, RecordingError, find_recordings
from training import latents as L
from training import trainer


@dataclass(frozen=True)
class Args:
    data: str  # dataset folder with train/ and heldout/ recordings
    out: str  # run folder (resumed if it holds a state)
    autoencoder: str  # the autoencoder whose latents the denoiser reads (a checkpoint's autoencoder/)
    steps: int = 100000
    minutes: float = 0.0  # stop (and save) after this much wall time; 0 = no limit
    batch: int = 64
    lr: float = 1e-3
    warmup: int = 50
    schedule: str = "constant"
    ema: float = 0.99
    smooth: float = 1e-3  # weight of the offsets' total variation (walls move together)
    frames: int = 2  # newest context latents the net reads (two show the momentum)
    width: int = 64
    max_frames: int = 0  # frames of DATA/train to encode (0 = all; the same cache as train_diffusion's)
    save_every: float = 300.0
    eval_every: int = 200
    seed: int = 0
    threads: int = 1


ARCHITECTURE = ("frames", "width")


class Mover(torch.nn.Module):
    """The net with the fixed turn grids: moves a batch's last frame as the denoiser's reference does."""

    def __init__(self, net: FlowNet, grids: torch.Tensor, rows: int) -> None:
        super().__init__()
        self.net, self.rows = net, rows
        self.register_buffer("grids", grids, persistent=False)

    def forward(self, ctx: torch.Tensor, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(moved view rows, offsets) of the last context frame."""
        view = ctx[:, :, :, :self.rows]
        off = self.net(view, codes)
        return move_view(view[:, -1], offset_grid(self.grids[codes[:, -1, 1]], off)), off

    def turned(self, ctx: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The last context frame's view rows turned alone (the baseline the net adds to)."""
        return move_view(ctx[:, -1, :, :self.rows], self.grids[codes[:, -1, 1]])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    out = trainer.run_folder(a)
    try:
        if a.frames < 1 or a.width < 8 or a.smooth < 0:
            raise CheckpointError(f"--frames must be >= 1, --width >= 8 and --smooth >= 0 (not {a.frames}, "
                                  f"{a.width}, {a.smooth})")
        acc = trainer.accelerator()  # the net is not prepared: it trains in float32 (a small net, and the
        # warp's offsets are fractions of a cell)
        ae = load_model_dir(AutoencoderTiny, a.autoencoder).eval()
        data = Path(a.data)
        game = Recording(find_recordings(data / "train")[0]).game
        train = L.build(ae, data / "train", out / "latents" / "train", a.max_frames)
        held = L.build(ae, data / "heldout", out / "latents" / "heldout", max(a.max_frames // 10, 2000))
    except (CheckpointError, RecordingError, ValueError) as e:
        print(f"train_flow: {e}", file=sys.stderr)
        return 2
    if not game.hud:
        print("train_flow: the learned motion is made for a view above a status bar (record with the HUD on)",
              file=sys.stderr)
        return 2
    w = train.z.shape[-1]
    ws = warp_settings(game, AE.downsampling(ae))
    rows = ws["warp_rows"]
    grids = turn_grids(ws["turn_warp"], DenoiserConfig.fov, rows, (rows, w))
    net = FlowNet(ae.config.latent_channels, a.frames, a.width)
    mover = Mover(net, grids, rows)
    state_path = out / "train_state.safetensors"
    try:
        opt, ema, step, seen, elapsed = trainer.start_run(state_path, a, ARCHITECTURE, net, weight_decay=0.0)
    except CheckpointError as e:
        print(f"train_flow: {e}", file=sys.stderr)
        return 2
    prog = trainer.Progress(acc, out / "log.jsonl", a.steps, step, seen, elapsed, a.minutes, "flow")
    lr_sched = trainer.lr_schedule(opt, a.schedule, a.warmup, prog)
    gen = torch.Generator().manual_seed(a.seed * 1_000_003 + step * 7)
    held_idx = held.targets[torch.randperm(len(held), generator=torch.Generator().manual_seed(0))[:512]]

    @torch.no_grad()
    def held_mse() -> dict[str, float]:
        net.eval()
        sums = {"copy": 0.0, "turn": 0.0, "flow": 0.0}
        for i in range(0, len(held_idx), 128):
            z, ctx, codes = held.window(held_idx[i:i + 128], 1, a.frames)
            want = z[:, :, :rows]
            sums["copy"] += F.mse_loss(ctx[:, -1, :, :rows], want, reduction="sum").item()
            sums["turn"] += F.mse_loss(mover.turned(ctx, codes), want, reduction="sum").item()
            sums["flow"] += F.mse_loss(mover(ctx, codes)[0], want, reduction="sum").item()
        net.train()
        n = len(held_idx) * want[0].numel()
        return {f"held_{k}": v / n for k, v in sums.items()}

    def save() -> None:
        trainer.save_run(state_path, net, opt, ema, prog.step, prog.seen, prog.seconds, a)
        shipped = copy.deepcopy(net).eval()
        ema.copy_to(shipped.parameters())
        save_model_dir(shipped, out / "flow")

    net.train()
    while prog.step < a.steps and not prog.spent():
        idx = train.targets[torch.randint(0, len(train), (a.batch,), generator=gen)]
        z, ctx, codes = train.window(idx, 1, a.frames)  # the actions: the current one and the one before
        moved, off = mover(ctx, codes)
        tv = off.diff(dim=-1).abs().mean() + off.diff(dim=-2).abs().mean()
        loss = F.mse_loss(moved, z[:, :, :rows]) + a.smooth * tv
        trainer.optimizer_step(acc, net, opt, lr_sched, ema, loss)
        prog.tick(a.batch, loss)
        if prog.step % a.eval_every == 0:
            prog.write(loss=loss.item(), **held_mse())
        if prog.save_or_stop(save, a.save_every):
            break
    prog.close()
    h = held_mse()
    print(f"train_flow: step {prog.step}, {prog.seen} samples; held-out MSE of the view rows: copy-last "
          f"{h['held_copy']:.4f}, turn warp {h['held_turn']:.4f}, learned motion {h['held_flow']:.4f}; "
          f"weights in {out / 'flow'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
