"""The latent cache for denoiser training: recordings encoded once by the autoencoder, stored as fp16
files per recording (resumable: a recording is encoded whole or not at all), loaded into RAM as one
tensor with the actions and episode starts needed to cut context windows."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from diffusers import AutoencoderTiny
from tqdm import tqdm

from neuraldoom import actions as A
from neuraldoom import autoencoder as AE
from neuraldoom import metrics as M
from neuraldoom import statusbar as SB
from neuraldoom.checkpoint import CheckpointError, weights_digest
from neuraldoom.files import write_text
from neuraldoom.recording import Recording, RecordingError, open_dataset


def encoder_digest(ae: AutoencoderTiny) -> str:
    """Identifies what the latents depend on: the encoder's weights and the latent normalization (a
    decoder-only fine-tune keeps the cache valid)."""
    return weights_digest(ae.encoder, salt=repr((ae.config.shift_factor, ae.config.scaling_factor)))


class LatentSet:
    """Latents (M, C, h, w) fp16, action codes (M, 2), episode start row (M,), target-able rows, and
    optionally which rows are events: the status bar's numbers change there (M,) bool; random play
    changes them in ~5% of its steps (statusbar.bar_changes), and the denoiser must draw them itself;
    and which rows show a close wall (metrics.close_wall), with the targets that do not."""

    def __init__(self, z: torch.Tensor, actions: np.ndarray, ep_start: np.ndarray, valid: np.ndarray,
                 events: np.ndarray | None = None, walls: np.ndarray | None = None) -> None:
        self.z = z
        self.actions = torch.as_tensor(actions, dtype=torch.int64)
        self.ep_start = torch.as_tensor(ep_start, dtype=torch.int64)
        self.targets = torch.as_tensor(np.flatnonzero(valid))
        ev = np.zeros(len(valid), bool) if events is None else np.asarray(events, bool)
        self.event_targets = torch.as_tensor(np.flatnonzero(ev & np.asarray(valid, bool)))
        self.wall = torch.as_tensor(np.zeros(len(valid), bool) if walls is None else np.asarray(walls, bool))
        self.open_targets = torch.as_tensor(np.flatnonzero(np.asarray(valid, bool) & ~self.wall.numpy()))
        self.noop = torch.from_numpy(A.NOOP.code)

    def __len__(self) -> int:
        return len(self.targets)

    def follow_events(self, after: int, before: int = 0) -> None:
        """Make the `after` target rows that follow each event in its episode events too, and the `before`
        rows that lead up to it: a status-bar denoiser draws a new number on the step it changes, then loses
        its shape one or two steps later, where the context's frames disagree (the newest shows it, the older
        ones the number before); and it counts a shot a step early, or where the trigger is held and the
        pistol is not ready to fire again: the steps before a change are where it must learn to wait."""
        ev = self.event_targets
        offsets = torch.arange(-before, after + 1)
        rows = (ev[:, None] + offsets).flatten()
        src = ev.repeat_interleave(len(offsets))
        keep = (rows >= 0) & (rows < len(self.ep_start))
        rows, src = rows[keep], src[keep]
        keep = (self.ep_start[rows] == self.ep_start[src]) & torch.isin(rows, self.targets)
        self.event_targets = torch.unique(rows[keep])

    def draw(self, n: int, gen: torch.Generator, wall_share: float = 1.0) -> torch.Tensor:
        """n target rows drawn uniformly; a close-wall one is kept with probability wall_share, else
        replaced by a draw from the others (1: the data as recorded, the generator used as before)."""
        idx = self.targets[torch.randint(0, len(self), (n,), generator=gen)]
        if wall_share < 1 and len(self.open_targets):
            drop = self.wall[idx] & (torch.rand(n, generator=gen) >= wall_share)
            idx[drop] = self.open_targets[torch.randint(0, len(self.open_targets), (int(drop.sum()),), generator=gen)]
        return idx

    def step_change_std(self) -> float:
        """Std of z_t - z_{t-1} within episodes (the scale of a "delta" target)."""
        t = self.targets[torch.linspace(0, len(self.targets) - 1, min(4096, len(self.targets))).long()]
        return float((self.z[t].float() - self.z[t - 1].float()).std())

    def crop_rows(self, top: int, bottom: int) -> None:
        """Keep the latent rows [top, bottom) alone: the data of a status-bar denoiser (DenoiserConfig.rows)."""
        self.z = self.z[:, :, top:bottom].contiguous()

    def window(self, idx: torch.Tensor, n: int, frames: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For target rows idx (B,): target (B,C,h,w), context (B,F,C,h,w), action codes (B,N+1,2).

        Context frames before the episode start repeat its first frame; the action that led to a frame
        before (or at) the start is NOOP. Token k belongs to context frame k; token N is the current action.
        `frames`: only the newest F of the N context frames (0 = all): a denoiser that reads 8 never sees
        the rest, and gathering and noising all 64 cost ~15% of a training step.
        """
        s = self.ep_start[idx][:, None]
        ctx_rows = torch.maximum(idx[:, None] + torch.arange(-(frames or n), 0), s)  # (B, F)
        tok_rows = idx[:, None] + torch.arange(-n - 1, 0)  # (B, N+1): action[j-1] led to frame j
        codes = self.actions[tok_rows.clamp(min=0)]
        codes = torch.where((tok_rows >= s)[..., None], codes, self.noop)
        return self.z[idx].float(), self.z[ctx_rows].float(), codes


def portions(data: Path, max_frames: int) -> list[tuple[Recording, int]]:
    """The recordings under `data` and how many of their first frames a cache of max_frames holds (0: all),
    in the order of its rows: row k of the cache is frame k - (rows before it) of its recording."""
    recs = [r for r in open_dataset(data) if len(r)]
    if not recs:  # a split gets whole episodes: a short collection can leave one empty
        raise RecordingError(f"{data} holds no frames: collect more play (or a larger --heldout)")
    per = max(1, max_frames // len(recs)) if max_frames else None
    return [(r, len(r) if per is None else min(len(r), per)) for r in recs]


def build(ae: AutoencoderTiny, data: Path, cache: Path, max_frames: int, events: tuple[str, ...] = (),
          walls: bool = False) -> LatentSet:
    """Encode (or reuse) the first frames of each recording under `data`, up to max_frames in all; with
    `events` (status bar fields), also which rows those numbers change at (reading every frame's bar: ~30 s
    for 285k frames); with `walls`, which rows show a close wall (~1 minute per 100k frames)."""
    digest = encoder_digest(ae)
    zs, acts, starts, ts, evs, ws = [], [], [], [], [], []
    offset = 0
    for r, n in portions(data, max_frames):
        d = cache / r.path.parent.name / r.path.name
        meta = {"ae": digest, "rows": n}
        f = d / "latents.f16"
        C = ae.config.latent_channels
        h, w = AE.latent_hw(ae, r.game.height, r.game.width)
        if not (d / "meta.json").exists() or json.loads((d / "meta.json").read_text()) != meta:
            d.mkdir(parents=True, exist_ok=True)
            out = np.lib.format.open_memmap(d / "tmp.npy", "w+", np.float16, (n, C, h, w))
            for i in tqdm(range(0, n, 256), desc=f"encode {r.path.name}", mininterval=10):
                j = min(i + 256, n)
                out[i:j] = AE.encode(ae, np.asarray(r.frames[i:j]), 64).half().numpy()
            out.flush()
            del out
            os.replace(d / "tmp.npy", f)
            write_text(d / "meta.json", json.dumps(meta))  # last: the cache is valid only once it is there
        zs.append(torch.from_numpy(np.load(f, mmap_mode="r")[:n].copy()))
        steps = r.steps[:n]
        acts.append(np.stack([steps["buttons"], steps["turn"]], -1))
        ep = np.asarray(steps["episode"])
        first = np.r_[0, np.flatnonzero(np.diff(ep)) + 1]
        starts.append(offset + first[np.searchsorted(first, np.arange(n), side="right") - 1])
        valid = np.ones(n, bool)
        valid[first] = False  # an episode's first frame has no previous frame to predict it from
        ts.append(valid)
        evs.append(SB.bar_changes(r.frames[:n], ep, events) if events else np.zeros(n, bool))
        ws.append(M.close_wall(r.frames[:n]) if walls else np.zeros(n, bool))
        offset += n
    return LatentSet(torch.cat(zs), np.concatenate(acts), np.concatenate(starts), np.concatenate(ts),
                     np.concatenate(evs), np.concatenate(ws))


def frame_stats(cache: Path, ae: AutoencoderTiny) -> tuple[torch.Tensor, torch.Tensor]:
    """Each cached frame's per-channel latent mean and std over the cells, (M, C) each, from a cache folder
    (`build`'s, any depth) encoded by this very `ae`'s encoder (CheckpointError otherwise, or if empty)."""
    digest = encoder_digest(ae)
    means, stds = [], []
    for meta in sorted(Path(cache).resolve().rglob("meta.json")):
        m = json.loads(meta.read_text())
        if m.get("ae") != digest:
            raise CheckpointError(f"{meta.parent} was encoded by another encoder than this checkpoint's")
        z = np.load(meta.parent / "latents.f16", mmap_mode="r")
        for i in range(0, m["rows"], 4096):
            part = torch.from_numpy(np.asarray(z[i:min(i + 4096, m["rows"])], np.float32))
            means.append(part.mean((2, 3)))
            stds.append(part.std((2, 3)))
    if not means:
        raise CheckpointError(f"no cached latents under {cache}")
    return torch.cat(means), torch.cat(stds)


def frame_bounds(means: torch.Tensor, stds: torch.Tensor, q: float) -> dict[str, tuple[float, ...]]:
    """SamplerConfig's bounds from frame_stats: the channel means' q and 1-q quantiles and the spreads'
    1-q quantile (q = 0: the data's extremes)."""
    def quant(x: torch.Tensor, p: float) -> tuple[float, ...]:
        return tuple(round(float(v), 4) for v in torch.quantile(x.double(), p, dim=0))

    return {"mean_lo": quant(means, q), "mean_hi": quant(means, 1 - q), "std_hi": quant(stds, 1 - q)}
