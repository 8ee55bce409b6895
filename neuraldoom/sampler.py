"""DDIM sampling of the next latent (GameNGen §3.3): 4 steps (the first may be skipped: SamplerConfig.skip),
v-prediction, trailing timesteps, and classifier-free guidance on the past frames only (the unconditional
pass drops the context, keeps the actions).

Each guided step is two batch-1 UNet passes, the conditional and the unconditional one, so that on two
cores they run at once, one per core (`sample(..., pool=)`), giving the very numbers they give one after
the other on one core. One pass is what gets compiled: an AOTInductor package of the denoiser at batch 1
(the same package for every step count and guidance), built once per checkpoint, dtype, torch version,
CPU and thread count, cached, and loaded in about a second afterwards; `torch.compile` with freezing
would recompile (~30 s) at every start (docs/DESIGN.md §4). The package is run through its C entry points with
ctypes, which lets go of the GIL for the call (torch's own loader holds it, so two threads would take
turns). The first build runs in a background process so play starts at once, eager; a lock file next to
the package makes a second player wait for the first one's build and reuse it.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import fcntl
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from diffusers import DDIMScheduler
from torch import nn

from .config import SamplerConfig
from .denoiser import Denoiser

# one UNet pass: (x (1,C,h,w), t (1,) long, context (1,N,C,h,w), codes (1,N+1,2) long) -> v (1,C,h,w) float32
Pass = Callable[..., torch.Tensor]


def ddim_scheduler(num_train_timesteps: int = 1000) -> DDIMScheduler:
    return DDIMScheduler(num_train_timesteps=num_train_timesteps, beta_schedule="linear",
                         prediction_type="v_prediction", timestep_spacing="trailing", clip_sample=False,
                         set_alpha_to_one=True)


class DenoiserPass(nn.Module):
    """The denoiser at one noise level, clean context (bucket 0), run in `dtype` (its weights converted
    once), returning float32: the unit that is compiled and that the two cores share out."""

    def __init__(self, denoiser: Denoiser, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.dtype = dtype
        self.denoiser = denoiser if dtype == torch.float32 else copy.deepcopy(denoiser).to(dtype).eval()

    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        bucket = torch.zeros_like(t)  # no noise on a clean context
        v = self.denoiser(x.to(self.dtype), t, context.to(self.dtype), codes, bucket)
        return v.float()


_passes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_passes_lock = threading.Lock()


def denoiser_pass(denoiser: Denoiser, dtype: torch.dtype = torch.float32) -> DenoiserPass:
    """One DenoiserPass per (denoiser, dtype) in this process: engines of one checkpoint share a bf16 copy."""
    with _passes_lock:
        per = _passes.setdefault(denoiser, {})
        if dtype not in per:
            # the float32 pass wraps the caller's module itself: no .eval() here, which would switch a model in
            # training to eval mode behind its trainer's back (and recompile its compiled training pass)
            per[dtype] = DenoiserPass(denoiser, dtype)
        return per[dtype]


@dataclass(frozen=True)
class FrameBounds:
    """The range of the training frames' latent statistics, per channel: each frame's mean within
    [mean_lo, mean_hi] and its spread (std over the cells) at most std_hi. Long free play feeds every
    frame back as context, and a small bias per step grows into a view no recording ever had (a red or
    white wash, a speckled grid: per-channel means and spreads past anything in the data); holding each
    generated frame inside the data's range stops the feedback there and leaves a frame inside it
    untouched."""

    mean_lo: tuple[float, ...]
    mean_hi: tuple[float, ...]
    std_hi: tuple[float, ...]

    @classmethod
    def from_config(cls, cfg: SamplerConfig) -> FrameBounds | None:
        """The checkpoint's bounds; None where it has none (held free)."""
        return cls(cfg.mean_lo, cfg.mean_hi, cfg.std_hi) if cfg.std_hi else None

    def hold(self, z: torch.Tensor) -> torch.Tensor:
        """z (B,C,h,w) with each frame's channel means clamped into range and its spread scaled down to
        std_hi where over it; the exact input where every statistic is inside."""
        lo, hi, top = (torch.tensor(v, dtype=z.dtype, device=z.device).view(1, -1, 1, 1)
                       for v in (self.mean_lo, self.mean_hi, self.std_hi))
        mean = z.mean((2, 3), keepdim=True)
        std = z.std((2, 3), keepdim=True)
        if bool(((mean >= lo) & (mean <= hi) & (std <= top)).all()):
            return z
        scale = torch.where(std > top, top / std, torch.ones_like(std))
        return (z - mean) * scale + mean.clamp(lo, hi)


class DDIMSampler(nn.Module):
    """forward(noise (1,C,h,w), context (1,N,C,h,w), codes (1,N+1,2)) -> next latent (1,C,h,w)."""

    def __init__(self, denoiser: Denoiser, steps: int = 4, cfg: float = 1.5, deadband: float = 0.0,
                 bounds: FrameBounds | None = None, skip: int = 0) -> None:
        """skip: the plan's first steps not run (SamplerConfig.skip); the noise is scaled to the first level
        run, as x_t of a zero target (for a delta target, the last frame held)."""
        super().__init__()
        if not 0 <= skip < steps:
            raise ValueError(f"skip must be in [0, {steps}) for {steps} steps, got {skip}")
        self.denoiser = denoiser
        self.cfg = float(cfg)
        self.deadband = float(deadband) if denoiser.delta else 0.0  # a frame target has no change to drop
        self.bounds = bounds
        sched = ddim_scheduler()
        sched.set_timesteps(steps)
        a = sched.alphas_cumprod
        ts = [int(t) for t in sched.timesteps]
        prev = [a[t].item() for t in ts[1:]] + [sched.final_alpha_cumprod.item()]
        # (t, alpha_bar_t, alpha_bar_prev) per step, as Python constants
        self.skip = skip
        self.plan = [(t, a[t].item(), ap) for t, ap in zip(ts, prev, strict=True)][skip:]
        self.start = (1 - self.plan[0][1]) ** 0.5 if skip else 1.0  # the noise's std at the first level run

    @property
    def guided(self) -> bool:
        return self.cfg != 1.0

    def forward(self, noise: torch.Tensor, context: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        return self.sample(noise, context, codes, denoiser_pass(self.denoiser))

    def sample(self, noise: torch.Tensor, context: torch.Tensor, codes: torch.Tensor, denoise: Pass,
               pool=None, batched: bool = False) -> torch.Tensor:
        """The DDIM loop around `denoise` (a DenoiserPass or its compiled package). With `pool` (an
        executor of one single-threaded worker), the unconditional pass of each step runs there while the
        conditional one runs here: the same calls, so the same numbers as without it. `batched`: both
        passes as one batch-2 call instead (faster on one core; other numbers, by float rounding)."""
        x = x0 = noise * self.start if self.skip else noise
        last = self.denoiser.reference(context, codes)  # the reference of a "delta" target
        empty = torch.zeros_like(context) if self.guided else None  # the dropped context, same actions
        if empty is not None and batched:
            pair, codes2 = torch.cat([context, empty]), torch.cat([codes, codes])
        for t, at, ap in self.plan:
            tt = torch.full((len(x),), t, dtype=torch.long, device=x.device)
            if empty is not None and batched:
                v2 = denoise(torch.cat([x, x]), tt.repeat(2), pair, codes2)
                v = v2[1:] + self.cfg * (v2[:1] - v2[1:])
            elif empty is not None:
                other = pool.submit(denoise, x, tt, empty, codes) if pool is not None else None
                vc = denoise(x, tt, context, codes)
                vu = other.result() if other is not None else denoise(x, tt, empty, codes)
                v = vu + self.cfg * (vc - vu)
            else:
                v = denoise(x, tt, context, codes)
            x0 = at**0.5 * x - (1 - at) ** 0.5 * v
            eps = at**0.5 * v + (1 - at) ** 0.5 * x
            x = ap**0.5 * x0 + (1 - ap) ** 0.5 * eps
        if self.deadband:
            x0 = drop_small_changes(x0, self.deadband)
        z = self.denoiser.from_target(x0, last)
        return z if self.bounds is None else self.bounds.hold(z)


def plan_skip(cfg: SamplerConfig, steps: int, student: bool = False) -> int:
    """The steps a teacher's sampler of `steps` skips: the checkpoint's SamplerConfig.skip for its own plan, none
    for another step count or a student (whose one plan is what it was distilled to)."""
    return 0 if student or steps != cfg.steps else cfg.skip


def drop_small_changes(change: torch.Tensor, deadband: float) -> torch.Tensor:
    """A delta target (B,C,h,w) with the cells whose change (RMS over channels) is under `deadband` set to
    exactly no change: static content stays the very latent it was instead of taking a random step."""
    size = change.pow(2).mean(1, keepdim=True).sqrt()
    return torch.where(size < deadband, torch.zeros_like(change), change)


# -- the compiled pass: build, cache, lock, load ----------------------------------------------------------
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


def cache_dir() -> Path:
    base = os.environ.get("NEURALDOOM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "neuraldoom")
    return Path(base) / "aoti"


def package_path(checkpoint: Path, dtype: torch.dtype = torch.float32, threads: int | None = None,
                 batch: int = 1, student: int = 0, bar: bool = False) -> Path:
    """Where the compiled pass of a checkpoint lives: keyed by its weights (the teacher's, those of its
    `student`-step student, or with `bar` its status-bar denoiser's) and configs, the dtype, the batch, torch,
    the CPU and the thread count (the package is machine-specific; never commit it)."""
    h = hashlib.sha256()
    weights = checkpoint / "bar" if bar else checkpoint / "students" / str(student) if student else checkpoint
    for d in ("unet", "action_encoder"):
        h.update((weights / d / "diffusion_pytorch_model.safetensors").read_bytes())
        h.update((weights / d / "config.json").read_bytes())
    if (checkpoint / "flow").is_dir():  # the teacher's learned motion, which its students use too
        h.update((checkpoint / "flow" / "diffusion_pytorch_model.safetensors").read_bytes())
    h.update((checkpoint / "autoencoder" / "config.json").read_bytes())  # the latent's shape
    # of config.json only what the pass computes with (frames read, context length, the bar's rows, the frame's
    # size, the action set): new sampler settings, notes or another part's weights keep the package
    cfg = json.loads((checkpoint / "config.json").read_text())
    part = cfg["bar"]["denoiser"] if bar else cfg["denoiser"]
    h.update(json.dumps([cfg.get("format"), cfg["game"], part, cfg.get("buttons"), cfg.get("turn_buckets")],
                        sort_keys=True).encode())
    threads = torch.get_num_threads() if threads is None else threads
    h.update(repr(("pass-v1", dtype_name(dtype), batch, torch.__version__, platform.machine(),
                   torch.backends.cpu.get_cpu_capability(), threads)).encode())
    return cache_dir() / f"pass-{h.hexdigest()[:20]}.pt2"


def latent_shape(ckpt, bar: bool = False) -> tuple[int, int, int]:
    """(C, h, w): the latent a checkpoint's denoiser samples, or (`bar`) its status-bar denoiser's rows of it."""
    from . import autoencoder as AE

    h, w = AE.latent_hw(ckpt.ae, ckpt.game.height, ckpt.game.width)
    if bar:
        top, _, bottom = ckpt.bar_cfg.rows
        h = bottom - top
    return ckpt.ae.config.latent_channels, h, w


def example_inputs(denoiser: Denoiser, latent_shape: tuple[int, ...], batch: int = 1) -> tuple[torch.Tensor, ...]:
    """What a DenoiserPass takes (the shapes and strides the package is built for)."""
    n, b = denoiser.context, batch
    g = torch.Generator().manual_seed(0)
    return (torch.randn(b, *latent_shape, generator=g), torch.full((b,), 500),
            torch.randn(b, n, *latent_shape, generator=g), torch.randint(0, 7, (b, n + 1, 2), generator=g))


def signature(path: Path) -> str:
    """Identifies one version of a file (a rebuilt package gets another)."""
    st = path.stat()
    return f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}"


@contextlib.contextmanager
def build_lock(path: Path) -> Iterator[None]:
    """Exclusive flock on PATH.lock: one build of a package at a time, across processes; the kernel drops
    it when its holder dies, so a killed build never leaves a stale lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def build_package(module: nn.Module, example: tuple[torch.Tensor, ...], path: Path) -> None:
    """torch.export -> AOTInductor (freezing: weights folded in as constants) -> atomically into the cache."""
    import torch._inductor

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.pt2")
    with torch.no_grad():
        ep = torch.export.export(module.eval(), example, strict=False)
        torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp), inductor_configs={"freezing": True})
    os.replace(tmp, path)


def ensure_package(module: nn.Module, example: tuple[torch.Tensor, ...], path: Path,
                   replace: str | None = None) -> bool:
    """Build the package under its lock unless it is there (another player built it while we waited).
    `replace`: the signature of a broken package to rebuild over. Returns whether this call compiled."""
    with build_lock(path):
        if path.exists() and (replace is None or signature(path) != replace):
            return False
        for tmp in path.parent.glob(f"{path.stem}.*.tmp.pt2"):  # left by a killed build (we hold the lock)
            tmp.unlink(missing_ok=True)
        build_package(module, example, path)
        return True


_P = ctypes.pythonapi
_P.PyCapsule_GetPointer.restype, _P.PyCapsule_GetPointer.argtypes = ctypes.c_void_p, [ctypes.py_object,
                                                                                      ctypes.c_char_p]
_P.PyCapsule_New.restype, _P.PyCapsule_New.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                                         ctypes.c_void_p]


class CompiledPass:
    """A package's model, called through the AOTInductor C ABI with ctypes (no GIL held during the run,
    so two threads run passes at once); `models` instances let that many calls run concurrently."""

    def __init__(self, path: Path, models: int = 2) -> None:
        aoti = torch._C._aoti  # tensors <-> AtenTensorHandles (AttributeError on a torch without them)
        self._handles = aoti.unsafe_alloc_void_ptrs_from_tensors
        self._tensors = aoti.alloc_tensors_by_stealing_from_void_ptrs
        with zipfile.ZipFile(path) as z:
            names = [n for n in z.namelist() if n.endswith(".so") and "/aotinductor/" in n]
            if len(names) != 1:
                raise RuntimeError(f"{path.name}: expected one model library, found {len(names)}")
            tmp = tempfile.mkdtemp(prefix="neuraldoom-")
            try:
                so = Path(tmp) / "model.so"
                with z.open(names[0]) as src, open(so, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                lib = ctypes.CDLL(str(so))  # mapped: the file itself can go
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        self.lib = lib
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        lib.AOTInductorModelContainerCreateWithDevice.argtypes = [ctypes.POINTER(vp), sz, ctypes.c_char_p,
                                                                  ctypes.c_char_p]
        lib.AOTInductorModelContainerGetNumOutputs.argtypes = [vp, ctypes.POINTER(sz)]
        lib.AOTInductorModelContainerRun.argtypes = [vp, ctypes.POINTER(vp), sz, ctypes.POINTER(vp), sz, vp, vp]
        lib.AOTInductorModelContainerDelete.argtypes = [vp]
        self.handle = vp()
        self._check(lib.AOTInductorModelContainerCreateWithDevice(ctypes.byref(self.handle), models, b"cpu", None))
        n = sz()
        self._check(lib.AOTInductorModelContainerGetNumOutputs(self.handle, ctypes.byref(n)))
        self.outputs = n.value

    def _check(self, err: int) -> None:
        if err != 0:
            raise RuntimeError(f"AOTInductor call failed ({err})")

    def __call__(self, *inputs: torch.Tensor) -> torch.Tensor:
        caps = self._handles(list(inputs))  # new handles, stolen by Run
        ins = (ctypes.c_void_p * len(caps))(*[_P.PyCapsule_GetPointer(c, None) for c in caps])
        outs = (ctypes.c_void_p * self.outputs)()
        self._check(self.lib.AOTInductorModelContainerRun(self.handle, ins, len(caps), outs, self.outputs,
                                                          None, None))
        return self._tensors([_P.PyCapsule_New(o, None, None) for o in outs])[0]

    def __del__(self) -> None:
        handle = getattr(self, "handle", None)
        if handle:
            self.lib.AOTInductorModelContainerDelete(handle)
            self.handle = None


def _open_package(path: Path) -> Pass:
    try:
        return CompiledPass(path)
    except (OSError, AttributeError, RuntimeError, zipfile.BadZipFile):
        import torch._inductor  # another layout: torch's own loader (holds the GIL: the cores take turns)

        return torch._inductor.aoti_load_package(str(path))


_loaded: dict[tuple[str, str], Pass] = {}  # one loaded package per file version in this process


def load_package(path: Path, reference: nn.Module, example: tuple[torch.Tensor, ...]) -> Pass | None:
    """The compiled pass, checked once against the eager `reference` on `example`; None (and one line) if
    the package cannot be loaded or does not give the reference's numbers: a corrupt or stale entry."""
    try:
        key = (str(path), signature(path))
        if key in _loaded:
            return _loaded[key]
        run = _open_package(path)
        with torch.no_grad():
            got, want = run(*example), reference(*example)
        tol = (1e-3 if reference.dtype == torch.float32 else 5e-2) * (1 + want.abs().max().item())
        if got.shape != want.shape or not (got - want).abs().max().item() <= tol:
            raise ValueError("its output differs from the eager model's")
        _loaded[key] = run
        return run
    except Exception as e:  # never stop play over a cache entry
        first = (str(e).strip().splitlines() or [""])[0][:120]
        print(f"neuraldoom: cannot use the compiled sampler {path.name} ({type(e).__name__}: {first}); "
              "running eager", file=sys.stderr)
        return None


def build_in_background(checkpoint: Path, dtype: torch.dtype, replace: str | None = None,
                        batch: int = 1, student: int = 0, bar: bool = False) -> subprocess.Popen:
    """Compile in a separate process (play goes on eagerly meanwhile); the result lands in the cache."""
    cmd = [sys.executable, "-m", "neuraldoom.sampler", str(checkpoint), dtype_name(dtype),
           str(torch.get_num_threads()), str(batch), "bar" if bar else str(student)] + ([replace] if replace else [])
    cache_dir().mkdir(parents=True, exist_ok=True)
    log = open(cache_dir() / "build.log", "ab")  # a failed build explains itself here, not over the game
    try:
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    finally:
        log.close()


def _main(argv: list[str]) -> int:
    """python -m neuraldoom.sampler CHECKPOINT DTYPE THREADS BATCH PART [REPLACE]: build the compiled pass of the
    teacher (PART 0), of the PART-step student or (PART "bar") of the status-bar denoiser into the cache
    (REPLACE: the signature of a broken package to rebuild over)."""
    from .checkpoint import Checkpoint

    ckpt_dir, dtype, threads, batch = Path(argv[0]), DTYPES[argv[1]], int(argv[2]), int(argv[3])
    bar = argv[4] == "bar"
    student = 0 if bar else int(argv[4])
    replace = argv[5] if len(argv) > 5 else None
    torch.set_num_threads(threads)
    ck = Checkpoint(ckpt_dir)
    denoiser = ck.bar if bar else ck.student(student) if student else ck.denoiser
    shape = latent_shape(ck, bar)
    path = package_path(ckpt_dir, dtype, threads, batch, student, bar)
    t0 = time.time()
    if ensure_package(DenoiserPass(denoiser, dtype), example_inputs(denoiser, shape, batch), path, replace):
        print(f"neuraldoom: compiled the sampler {path.name} in {time.time() - t0:.0f}s", flush=True)
    else:
        print(f"neuraldoom: {path.name} was built by another player; reusing it", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
