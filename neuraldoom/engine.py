"""The neural engine: DOOM generated frame by frame, behind the same protocol as the real game.

A ring buffer holds the last N latent frames and the N actions that led to them. `step(action)` samples
the next latent with the DDIM sampler (conditioned on the ring and the N+1 actions), pushes it and the
action into the ring, and decodes it to a uint8 frame. `reset()` refills the ring from the checkpoint's
starting context (real frames, encoded). Never imports pygame or ViZDoom.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from . import autoencoder as AE
from .actions import NOOP, Action, ActionError
from .checkpoint import Checkpoint
from .sampler import (
    DDIMSampler,
    build_in_background,
    build_package,
    cache_dir,
    example_inputs,
    load_package,
    package_path,
)


class NeuralEngine:
    """reset(seed) -> frame; step(action) -> frame (uint8 H x W x 3). `cfg` is the GameConfig it learned."""

    def __init__(self, ckpt: Checkpoint, compile: bool = True, steps: int | None = None,
                 guidance: float | None = None, seed: int = 0, wait_compile: bool = False) -> None:
        """compile: use the AOTInductor sampler — loaded from the cache, or built (in the background,
        eager meanwhile; or right here with wait_compile) on first use."""
        self.ckpt = ckpt
        self.cfg = ckpt.game
        self.n = ckpt.denoiser_cfg.context
        self.ae = ckpt.ae
        self.done = False
        self.variables = None
        self.seed = seed
        steps = steps or ckpt.sampler_cfg.steps
        guidance = ckpt.sampler_cfg.cfg if guidance is None else guidance
        self.sampler = DDIMSampler(ckpt.denoiser, steps, guidance).eval()
        self.start_z = AE.encode(self.ae, ckpt.context_frames)  # (N, C, h, w), encoded once
        self.start_actions = torch.as_tensor(ckpt.context_actions, dtype=torch.long)
        self.latent_shape = tuple(self.start_z.shape[1:])
        self.gen = torch.Generator().manual_seed(seed)
        self.run = self.sampler
        self._pending: Path | None = None
        if compile:
            path = package_path(ckpt.path, steps, guidance)
            if not path.exists():
                if wait_compile:
                    build_package(self.sampler, example_inputs(self.sampler, self.latent_shape), path)
                else:
                    print("neuraldoom: compiling the sampler for this machine in the background (once; "
                          "eager until it is ready)", file=sys.stderr)
                    self._builder = build_in_background(ckpt.path, steps, guidance)
                    self._pending = path
            if path.exists():
                self.run = load_package(path) or self.sampler
        self.reset()

    @property
    def compiled(self) -> bool:
        return self.run is not self.sampler

    def _swap_in_compiled(self) -> None:
        """Once the background build has landed in the cache, switch to it (checked with one stat a step)."""
        if self._pending is None:
            return
        if self._pending.exists():
            self.run = load_package(self._pending) or self.sampler
            self._pending = None
        elif self._builder.poll() not in (None, 0):  # the build failed (no compiler?): stay eager
            print(f"neuraldoom: compiling the sampler failed; staying eager (see {cache_dir() / 'build.log'})",
                  file=sys.stderr)
            self._pending = None

    @classmethod
    def from_checkpoint(cls, path: str | Path, compile: bool = True, **kw) -> NeuralEngine:
        return cls(Checkpoint(path), compile=compile, **kw)

    def set_context(self, frames: np.ndarray, actions: np.ndarray) -> None:
        """Fill the ring from real frames (N', H, W, 3) and the actions that led to them (N', 2);
        fewer than N frames are padded by repeating the first (as in training)."""
        z = AE.encode(self.ae, frames)
        a = torch.as_tensor(np.asarray(actions), dtype=torch.long)
        if len(z) == 0 or len(z) != len(a):
            raise ValueError(f"context needs as many frames as actions, got {len(z)} and {len(a)}")
        if len(z) < self.n:
            pad = self.n - len(z)
            z = torch.cat([z[:1].expand(pad, -1, -1, -1), z])
            a = torch.cat([torch.tensor([[NOOP.buttons, NOOP.turn]]).expand(pad, -1), a])
        self.z, self.actions = z[-self.n:].clone(), a[-self.n:].clone()
        self.frame = np.asarray(frames[-1])

    def reset(self, seed: int | None = None) -> np.ndarray:
        if seed is not None:
            self.gen.manual_seed(seed)
        self.z = self.start_z.clone()
        self.actions = self.start_actions.clone()
        self.frame = self.ckpt.context_frames[-1]
        return self.frame

    @torch.no_grad()
    def next_latent(self, action: Action) -> torch.Tensor:
        if not isinstance(action, Action):
            raise ActionError(f"step() takes an Action, got {type(action).__name__}")
        self._swap_in_compiled()
        a = torch.tensor([[action.buttons, action.turn]])
        codes = torch.cat([self.actions, a])[None]  # (1, N+1, 2)
        noise = torch.randn((1, *self.latent_shape), generator=self.gen)
        # contiguous: the compiled package assumes its inputs' strides; the encoder returns channels_last
        z = self.run(noise, self.z[None].contiguous(), codes).contiguous()  # (1, C, h, w)
        self.z = torch.cat([self.z[1:], z])
        self.actions = torch.cat([self.actions[1:], a])
        return z

    @torch.no_grad()
    def step(self, action: Action) -> np.ndarray:
        z = self.next_latent(action)
        self.frame = AE.decode(self.ae, z, self.cfg.height, self.cfg.width)[0]
        return self.frame

    def close(self) -> None:
        """Stop a background compile that has not landed (it must not outlive the game)."""
        builder = getattr(self, "_builder", None)
        if builder is not None and builder.poll() is None:
            import os
            import signal

            try:
                os.killpg(builder.pid, signal.SIGKILL)  # its own session: the compiler's children go too
            except ProcessLookupError:
                pass
            builder.wait()
        self._pending = None
