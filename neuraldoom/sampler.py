"""DDIM sampling of the next latent (GameNGen §3.3): 4 steps, v-prediction, trailing timesteps, and
classifier-free guidance on the past frames only (the unconditional pass drops the context, keeps the
actions), both passes in one batch-2 call.

The whole loop is one module so it compiles to one graph. `compile_sampler` builds an AOTInductor
package once (~1 min), caches it per checkpoint, sampler settings, torch version and CPU, and loads it
in ~2 s afterwards; `torch.compile` with freezing would recompile (~30 s) at every start (DESIGN.md §4).
"""

from __future__ import annotations

import hashlib
import os
import platform
import sys
import time
from pathlib import Path

import torch
from diffusers import DDIMScheduler
from torch import nn

from .denoiser import Denoiser


def ddim_scheduler(num_train_timesteps: int = 1000) -> DDIMScheduler:
    return DDIMScheduler(num_train_timesteps=num_train_timesteps, beta_schedule="linear",
                         prediction_type="v_prediction", timestep_spacing="trailing", clip_sample=False,
                         set_alpha_to_one=True)


class DDIMSampler(nn.Module):
    """forward(noise (1,C,h,w), context (1,N,C,h,w), codes (1,N+1,2)) -> next latent (1,C,h,w)."""

    def __init__(self, denoiser: Denoiser, steps: int = 4, cfg: float = 1.5) -> None:
        super().__init__()
        self.denoiser = denoiser
        self.cfg = float(cfg)
        sched = ddim_scheduler()
        sched.set_timesteps(steps)
        a = sched.alphas_cumprod
        ts = [int(t) for t in sched.timesteps]
        prev = [a[t].item() for t in ts[1:]] + [sched.final_alpha_cumprod.item()]
        # (t, alpha_bar_t, alpha_bar_prev) per step, as Python constants baked into the graph
        self.plan = [(t, a[t].item(), ap) for t, ap in zip(ts, prev, strict=True)]

    def forward(self, noise: torch.Tensor, context: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        x = noise
        guided = self.cfg != 1.0
        if guided:  # row 0: with the past frames; row 1: without (dropped context, same actions)
            context = torch.cat([context, torch.zeros_like(context)])
            codes = torch.cat([codes, codes])
        bucket = torch.zeros(len(context), dtype=torch.long, device=noise.device)  # no noise on a clean context
        x0 = x
        for t, at, ap in self.plan:
            tt = torch.full((len(context),), t, dtype=torch.long, device=noise.device)
            xin = torch.cat([x, x]) if guided else x
            v = self.denoiser(xin, tt, context, codes, bucket)
            if guided:
                v = v[1:] + self.cfg * (v[:1] - v[1:])
            x0 = at**0.5 * x - (1 - at) ** 0.5 * v
            eps = at**0.5 * v + (1 - at) ** 0.5 * x
            x = ap**0.5 * x0 + (1 - ap) ** 0.5 * eps
        return x0


def cache_dir() -> Path:
    base = os.environ.get("NEURALDOOM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "neuraldoom")
    return Path(base) / "aoti"


def package_key(weights: list[Path], steps: int, cfg: float, shapes: tuple) -> str:
    h = hashlib.sha256()
    for w in weights:
        h.update(w.read_bytes())
    h.update(repr((steps, cfg, shapes, torch.__version__, platform.machine(),
                   torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())).encode())
    return h.hexdigest()[:20]


def compile_sampler(sampler: DDIMSampler, example: tuple[torch.Tensor, ...], weights: list[Path],
                    log=print) -> nn.Module | None:
    """The sampler as a cached AOTInductor package, or None (with one line of why) if that fails."""
    try:
        import torch._inductor

        shapes = tuple(tuple(x.shape) for x in example)
        path = cache_dir() / f"sampler-{package_key(weights, len(sampler.plan), sampler.cfg, shapes)}.pt2"
        if not path.exists():
            log(f"neuraldoom: compiling the sampler once for this machine (about a minute); cached in {path.parent}")
            t0 = time.time()
            path.parent.mkdir(parents=True, exist_ok=True)
            with torch.no_grad():
                ep = torch.export.export(sampler.eval(), example, strict=False)
                tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
                torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp),
                                                         inductor_configs={"freezing": True})
            os.replace(tmp, path)
            log(f"neuraldoom: compiled in {time.time() - t0:.0f}s")
        return torch._inductor.aoti_load_package(str(path))
    except Exception as e:  # any compiler/toolchain failure falls back to eager, never stops play
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"neuraldoom: compile failed, running eager ({type(e).__name__}: {msg[:200]})", file=sys.stderr)
        return None
