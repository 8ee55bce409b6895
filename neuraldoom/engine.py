"""The neural engine: DOOM generated frame by frame, behind the same protocol as the real game.

A ring buffer holds the last N latent frames and the N actions that led to them. `step(action)` samples
the next latent with the DDIM sampler (conditioned on the ring and the N+1 actions), pushes it and the
action into the ring, and decodes it to a uint8 frame. `reset()` refills the ring from the checkpoint's
starting context (real frames, encoded). Never imports pygame or ViZDoom.

Two cores (the default where the process may use two): a second thread with its own single-threaded
pool runs the unconditional pass of every guided DDIM step while this thread runs the conditional one
(`parallel="cfg"`; `cores=1` runs them one after the other, with the same numbers). `parallel="decode"`
decodes frame n on the second core while this one samples frame n+1 instead, and "both" does both; then
`step()` returns the previous step's frame: one frame of latency (measured against "cfg" in bench.py).
"auto" (what `play` asks for) is "cfg" for a guided sampler and "decode" for an unguided one (a distilled
student), which has no second pass to share out; the default, "cfg", never adds latency (replay, lockstep).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from . import autoencoder as AE
from .actions import NOOP, Action, ActionError
from .checkpoint import Checkpoint, CheckpointError
from .sampler import (
    DDIMSampler,
    FrameBounds,
    Pass,
    build_in_background,
    cache_dir,
    denoiser_pass,
    ensure_package,
    example_inputs,
    latent_shape,
    load_package,
    package_path,
    plan_skip,
    signature,
)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def bf16_supported() -> bool:
    """oneDNN runs bf16 here, natively (AVX512-BF16 or AMX): emulated bf16 would only be slower."""
    try:
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
        return bool(native and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def default_dtype() -> torch.dtype:
    """The UNet's dtype unless asked otherwise: bf16 where the CPU has it natively. Measured on the
    shipped checkpoint (2-core AVX512-BF16 EPYC, compiled, `python -m neuraldoom.bench`): 1.23-1.27x the
    float32 FPS; the sampled latent within 0.09 (max abs; latents have std 0.87) of float32's over 8
    autoregressive steps (0.03-0.10 over 16), frames 51-57 dB PSNR apart, where two noise seeds give frames
    26-28 dB apart."""
    return torch.bfloat16 if bf16_supported() else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None) -> torch.dtype:
    if dtype is None or dtype == "auto":
        return default_dtype()
    if isinstance(dtype, str):
        dtype = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16}[dtype]
    if dtype == torch.bfloat16 and not bf16_supported():
        return torch.float32
    return dtype


PARALLEL = ("auto", "cfg", "decode", "both")


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)  # this thread's own pool (OpenMP's count is per thread)
    torch.set_grad_enabled(False)  # no_grad is per thread too


class NeuralEngine:
    """reset(seed) -> frame; step(action) -> frame (uint8 H x W x 3). `cfg` is the GameConfig it learned."""

    def __init__(self, ckpt: Checkpoint, compile: bool = True, steps: int | None = None,
                 guidance: float | None = None, seed: int = 0, wait_compile: bool = False,
                 cores: int | None = None, parallel: str = "cfg", dtype: str | torch.dtype | None = None,
                 batched: bool = False, teacher: bool = False, deadband: float | None = None) -> None:
        """compile: use the AOTInductor pass — loaded from the cache, or built (in the background, eager
        meanwhile; or right here with wait_compile) on first use. cores: how many cores to use (default:
        all this process may use; 2 or more give a second stream of work, with 1 intra-op thread each
        per 2 cores). parallel: what the second core does: "cfg" (the unconditional passes), "decode" (the
        frames, one late), "both", or "auto" ("cfg" when guided, else "decode"). dtype: the UNet's ("auto",
        "float32", "bfloat16"; bf16 falls back to
        float32 where the CPU lacks it). batched: the two passes of a guided step as one batch-2 call (the
        pre-split form: faster on one core, no CFG split, numbers that differ by float rounding).
        steps: DDIM steps (default the checkpoint's). Where the checkpoint carries a student distilled for
        that many steps (guidance folded in), it plays, one pass a step; `teacher`, or an explicit
        `guidance`, plays the teacher with classifier-free guidance instead. deadband: the sampler's (default
        the checkpoint's; SamplerConfig.deadband)."""
        if ckpt.denoiser_cfg.rows:
            raise CheckpointError(f"{ckpt.path} holds a status-bar denoiser alone (rows "
                                  f"{' '.join(map(str, ckpt.denoiser_cfg.rows))}): `python -m training.export "
                                  "--bar` puts it into a checkpoint that plays")
        self.ckpt = ckpt
        self.cfg = ckpt.game
        self.n = ckpt.denoiser_cfg.context
        self.ae = ckpt.ae
        self.done = False
        self.variables = None
        self.seed = seed
        steps = steps or ckpt.sampler_cfg.steps
        self.student = steps if steps in ckpt.students and guidance is None and not teacher else 0
        if self.student:
            denoiser, guidance = ckpt.student(steps), 1.0
        else:
            denoiser, guidance = ckpt.denoiser, ckpt.sampler_cfg.cfg if guidance is None else guidance
        deadband = ckpt.sampler_cfg.deadband if deadband is None else deadband
        bounds = FrameBounds.from_config(ckpt.sampler_cfg)
        skip = plan_skip(ckpt.sampler_cfg, steps, bool(self.student))
        self.sampler = DDIMSampler(denoiser, steps, guidance, deadband, bounds, skip).eval()
        self.dtype = resolve_dtype(dtype)
        self.eager = denoiser_pass(denoiser, self.dtype)
        self.denoise = self.eager  # the pass: eager, or the compiled package once it is there
        # the checkpoint's status-bar denoiser, if any: the teacher's plan, unguided, compiled like the frame's pass;
        # it reads the ring alone, so on two cores it runs on the second while this one samples the frame
        cfg = ckpt.sampler_cfg
        self.bar_sampler = None if ckpt.bar is None else DDIMSampler(
            ckpt.bar, cfg.steps, 1.0, cfg.deadband if cfg.bar_deadband < 0 else cfg.bar_deadband, None, cfg.skip).eval()
        self.bar_eager = None if ckpt.bar is None else denoiser_pass(ckpt.bar, self.dtype)
        self.bar_pass = self.bar_eager  # eager, or its compiled package once it is there
        self._bar_wanted: tuple[Path, str | None] | None = None  # its package, to build once the frame's is built
        self._bar_building = False  # the background build is the bar's
        self.start_z = AE.encode(self.ae, ckpt.context_frames)  # (N, C, h, w), encoded once
        self.start_actions = torch.as_tensor(ckpt.context_actions, dtype=torch.long)
        self.latent_shape = tuple(self.start_z.shape[1:])
        self.gen = torch.Generator().manual_seed(seed)
        self.cores = cores or usable_cores()
        if parallel not in PARALLEL:
            raise ValueError(f"parallel must be one of {PARALLEL}, got {parallel!r}")
        two = self.cores >= 2
        if parallel == "auto":
            parallel = "cfg" if self.sampler.guided else "decode"
        self.batched = batched and self.sampler.guided
        self.split = two and self.sampler.guided and not self.batched and parallel in ("cfg", "both")  # (a)
        self.pipeline = two and parallel in ("decode", "both")  # (b): decode on the second core, a frame late
        self._pool: ThreadPoolExecutor | None = None
        if self.split or self.pipeline:
            per = max(1, self.cores // 2)
            if torch.get_num_threads() > per:
                torch.set_num_threads(per)  # two streams of `per` threads, not two of all of them
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="neuraldoom-core2", initializer=_worker_init,
                                            initargs=(torch.get_num_threads(),))
        self._undecoded: torch.Tensor | None = None  # pipeline: the latent whose frame is not drawn yet
        self.timing = {"sample_ms": 0.0, "decode_ms": 0.0}  # the last step's
        self.run = self._sample  # (noise, context, codes) -> next latent
        self._pending: Path | None = None
        self._builder = None
        if compile:
            self._start_compiled(ckpt.path, wait_compile)
        self.reset()

    @property
    def label(self) -> str:
        """What plays, for the overlay: e.g. "2-step student, compiled" or "4 steps CFG 1.5, eager"."""
        n, skip = len(self.sampler.plan), self.sampler.skip
        steps = f"{n} of {n + skip} steps" if skip else f"{n} steps"  # a plan run without its first steps
        what = f"{n}-step student" if self.student else f"{steps} CFG {self.sampler.cfg:g}"
        return f"{what}, {'compiled' if self.compiled else 'eager'}"

    # -- the compiled pass ----------------------------------------------------------------------------
    @property
    def compiled(self) -> bool:
        return self.denoise is not self.eager

    def _example(self) -> tuple[torch.Tensor, ...]:
        return example_inputs(self.sampler.denoiser, self.latent_shape, 2 if self.batched else 1)

    def _bar_example(self) -> tuple[torch.Tensor, ...]:
        return example_inputs(self.ckpt.bar, latent_shape(self.ckpt, bar=True))

    def _start_compiled(self, ckpt_path: Path, wait: bool) -> None:
        batch = 2 if self.batched else 1
        path = package_path(ckpt_path, self.dtype, batch=batch, student=self.student)
        self.denoise, broken = self._load(path, self.eager, self._example(), wait)
        if broken is not False:
            print("neuraldoom: compiling the sampler for this machine in the background (once; "
                  "eager until it is ready)", file=sys.stderr)
            self._builder = build_in_background(ckpt_path, self.dtype, broken, batch, self.student)
            self._pending = path
        if self.bar_sampler is not None:  # its package after the frame's (one build at a time beside play)
            path = package_path(ckpt_path, self.dtype, bar=True)
            self.bar_pass, broken = self._load(path, self.bar_eager, self._bar_example(), wait)
            self._bar_wanted = (path, broken) if broken is not False else None
            self._swap_in_compiled()

    def _load(self, path: Path, eager: Pass, example: tuple[torch.Tensor, ...], wait: bool
              ) -> tuple[Pass, str | None | bool]:
        """(the pass to play now, False or what to build in the background: None where the package is missing,
        the signature of a corrupt or stale one to rebuild over). With `wait` the package is built here."""
        broken = None
        if path.exists():
            run = load_package(path, eager, example)
            if run is not None:
                return run, False
            broken = signature(path)
        if not wait:
            return eager, broken
        try:
            ensure_package(eager, example, path, replace=broken)
        except Exception as e:  # no compiler, out of disk…: play eager
            first = (str(e).strip().splitlines() or [""])[0][:160]
            print(f"neuraldoom: compiling the sampler failed ({type(e).__name__}: {first}); staying eager",
                  file=sys.stderr)
            return eager, False
        return load_package(path, eager, example) or eager, False

    def _swap_in_compiled(self) -> None:
        """Once a background build is done (one waitpid a step), switch to its package; then build the next."""
        if self._pending is not None and self._builder.poll() is not None:
            path, self._pending = self._pending, None
            if self._builder.returncode != 0 or not path.exists():  # the build failed (no compiler?): stay eager
                print(f"neuraldoom: compiling the sampler failed; staying eager (see {cache_dir() / 'build.log'})",
                      file=sys.stderr)
            elif self._bar_building:
                self.bar_pass = load_package(path, self.bar_eager, self._bar_example()) or self.bar_eager
            else:
                self.denoise = load_package(path, self.eager, self._example()) or self.eager
            self._bar_building = False
        if self._pending is None and self._bar_wanted is not None:
            (path, broken), self._bar_wanted = self._bar_wanted, None
            self._builder = build_in_background(self.ckpt.path, self.dtype, broken, bar=True)
            self._pending, self._bar_building = path, True

    @classmethod
    def from_checkpoint(cls, path: str | Path, compile: bool = True, **kw) -> NeuralEngine:
        return cls(Checkpoint(path), compile=compile, **kw)

    # -- the game -------------------------------------------------------------------------------------
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
            a = torch.cat([torch.from_numpy(NOOP.code)[None].expand(pad, -1), a])
        self.z, self.actions = z[-self.n:].clone(), a[-self.n:].clone()
        self.frame = np.asarray(frames[-1])
        self._undecoded = None

    def reset(self, seed: int | None = None) -> np.ndarray:
        if seed is not None:
            self.gen.manual_seed(seed)
        self.z = self.start_z.clone()
        self.actions = self.start_actions.clone()
        self.frame = self.ckpt.context_frames[-1]
        self._undecoded = None
        return self.frame

    def _sample(self, noise: torch.Tensor, context: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        return self.sampler.sample(noise, context, codes, self.denoise, self._pool if self.split else None,
                                   self.batched)

    @torch.no_grad()
    def next_latent(self, action: Action) -> torch.Tensor:
        if not isinstance(action, Action):
            raise ActionError(f"step() takes an Action, got {type(action).__name__}")
        self._swap_in_compiled()
        t0 = time.perf_counter()
        a = torch.from_numpy(action.code)[None]
        codes = torch.cat([self.actions, a])[None]  # (1, N+1, 2)
        noise = torch.randn((1, *self.latent_shape), generator=self.gen)
        on_two = self.bar_sampler is not None and self._pool is not None
        bar = self._pool.submit(self._bar_rows, noise, codes) if on_two else None
        # contiguous: the compiled package assumes its inputs' strides; the encoder returns channels_last
        z = self.run(noise, self.z[None].contiguous(), codes).contiguous()  # (1, C, h, w)
        if self.bar_sampler is not None:  # the status bar's rows drawn by its own denoiser
            _, first, bottom = self.ckpt.bar_cfg.rows
            z[:, :, first:bottom] = bar.result() if bar is not None else self._bar_rows(noise, codes)
        self.z = torch.cat([self.z[1:], z])
        self.actions = torch.cat([self.actions[1:], a])
        self.timing["sample_ms"] = (time.perf_counter() - t0) * 1000
        return z

    def _bar_rows(self, noise: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """The status-bar denoiser's rows [first, bottom) of the next latent, from its rows of the ring."""
        top, first, bottom = self.ckpt.bar_cfg.rows
        # contiguous: the compiled package assumes its inputs' strides
        ring = self.z[None, :, :, top:bottom].contiguous()
        rows = self.bar_sampler.sample(noise[:, :, top:bottom].contiguous(), ring, codes, self.bar_pass)
        return rows[:, :, first - top:]

    def _decode(self, z: torch.Tensor) -> np.ndarray:
        t0 = time.perf_counter()
        frame = AE.decode(self.ae, z, self.cfg.height, self.cfg.width)[0]
        self.timing["decode_ms"] = (time.perf_counter() - t0) * 1000
        return frame

    @torch.no_grad()
    def step(self, action: Action) -> np.ndarray:
        if not self.pipeline:
            self.frame = self._decode(self.next_latent(action))
            return self.frame
        if not isinstance(action, Action):  # before the decode goes out: a bad action changes nothing
            raise ActionError(f"step() takes an Action, got {type(action).__name__}")
        job: Future | None = None
        if self._undecoded is not None:  # frame n on the second core while this one samples n+1
            job = self._pool.submit(self._decode, self._undecoded)
        try:
            self._undecoded = self.next_latent(action)
        finally:
            if job is not None:
                self.frame = job.result()
        return self.frame

    def close(self) -> None:
        """Stop a background compile that has not landed (it must not outlive the game), and the worker."""
        builder = self._builder
        if builder is not None and builder.poll() is None:
            import signal

            try:
                os.killpg(builder.pid, signal.SIGKILL)  # its own session: the compiler's children go too
            except ProcessLookupError:
                pass
            builder.wait()
        self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
            self.split = self.pipeline = False
