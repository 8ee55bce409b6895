"""DDIM sampling of the next latent (GameNGen §3.3): 4 steps, v-prediction, trailing timesteps, and
classifier-free guidance on the past frames only (the unconditional pass drops the context, keeps the
actions), both passes in one batch-2 call.

The whole loop is one module so it compiles to one graph: an AOTInductor package, built once per
checkpoint, sampler settings, torch version and CPU (~1 min on a quiet 2-core machine, several on a busy
one), cached, and loaded in ~2 s afterwards; `torch.compile` with freezing would recompile (~30 s) at
every start (DESIGN.md §4). The first build runs in a background process so play starts at once, eager.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
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
        last = context[:, -1]  # (1, C, h, w): the reference of a "delta" target
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
        return self.denoiser.from_target(x0, last)


def cache_dir() -> Path:
    base = os.environ.get("NEURALDOOM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "neuraldoom")
    return Path(base) / "aoti"


def package_path(checkpoint: Path, steps: int, cfg: float) -> Path:
    """Where the compiled sampler of a checkpoint lives: keyed by its weights, the sampler settings,
    torch, the CPU and the thread count (the package is machine-specific; never commit it)."""
    h = hashlib.sha256()
    for d in ("unet", "action_encoder", "autoencoder"):
        h.update((checkpoint / d / "diffusion_pytorch_model.safetensors").read_bytes())
    h.update(repr(("v3", steps, cfg, torch.__version__, platform.machine(), torch.backends.cpu.get_cpu_capability(),
                   torch.get_num_threads())).encode())
    return cache_dir() / f"sampler-{h.hexdigest()[:20]}.pt2"


def example_inputs(sampler: DDIMSampler, latent_shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    n = sampler.denoiser.context
    g = torch.Generator().manual_seed(0)
    return (torch.randn(1, *latent_shape, generator=g), torch.randn(1, n, *latent_shape, generator=g),
            torch.randint(0, 7, (1, n + 1, 2), generator=g))


def build_package(sampler: DDIMSampler, example: tuple[torch.Tensor, ...], path: Path) -> None:
    """torch.export -> AOTInductor (freezing: weights folded in as constants) -> atomically into the cache."""
    import torch._inductor

    path.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        ep = torch.export.export(sampler.eval(), example, strict=False)
        tmp = path.with_suffix(f".{os.getpid()}.tmp.pt2")
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs={"freezing": True})
    os.replace(tmp, path)


def load_package(path: Path) -> nn.Module | None:
    try:
        import torch._inductor

        return torch._inductor.aoti_load_package(str(path))
    except Exception as e:  # a stale or foreign package: fall back to eager, never stop play
        print(f"neuraldoom: cannot load the compiled sampler {path.name} ({type(e).__name__}); running eager",
              file=sys.stderr)
        return None


def build_in_background(checkpoint: Path, steps: int, cfg: float) -> subprocess.Popen:
    """Compile in a separate process (play goes on eagerly meanwhile); the result lands in the cache."""
    cmd = [sys.executable, "-m", "neuraldoom.sampler", str(checkpoint), str(steps), str(cfg),
           str(torch.get_num_threads())]
    cache_dir().mkdir(parents=True, exist_ok=True)
    log = open(cache_dir() / "build.log", "ab")  # a failed build explains itself here, not over the game
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)


def _main(argv: list[str]) -> int:
    """python -m neuraldoom.sampler CHECKPOINT STEPS CFG THREADS: build the compiled sampler into the cache."""
    from . import autoencoder as AE
    from .checkpoint import Checkpoint

    ckpt_dir, steps, cfg, threads = Path(argv[0]), int(argv[1]), float(argv[2]), int(argv[3])
    torch.set_num_threads(threads)
    ck = Checkpoint(ckpt_dir)
    sampler = DDIMSampler(ck.denoiser, steps, cfg)
    shape = (ck.ae.config.latent_channels, *AE.latent_hw(ck.ae, ck.game.height, ck.game.width))
    t0 = time.time()
    build_package(sampler, example_inputs(sampler, shape), package_path(ckpt_dir, steps, cfg))
    print(f"neuraldoom: compiled the sampler in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
