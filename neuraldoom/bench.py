"""Benchmark the play loop in one run: where a frame's milliseconds go (sampling, decode), eager vs
compiled, with and without CFG, 4 / 2 / 1 DDIM steps, one core vs two, and the real ViZDoom's speed.
The variants are timed in interleaved rounds, so that a shared machine's load hits them alike.

    python -m neuraldoom.bench [--checkpoint DIR] [--frames 30] [--rounds 3] [--steps 4 2 1] [--quick]
                               [--no-compile] [--threads 1]

cores: 1 = one thread; 2:cfg = the conditional and unconditional UNet passes of each guided step on two
threads, one per core (what the engine does on 2+ cores); 2:dec = decode frame n on the second core while
frame n+1 is sampled; 2:both = both. 2:dec and 2:both show each frame one step late (+1 frame latency).
/b2: the guided pair as one batch-2 UNet call per step (the form before the split: faster on one core, but
it cannot be split; its numbers differ from the split form's by float rounding).
cpu ms = CPU time per frame, all threads; busiest = the busiest thread's: about what a frame would take
with a free core per thread. Compiled rows need three builds (batch 1 and 2 in the default dtype, batch 1
in the other; ~30 s to a few minutes each), cached in ~/.cache/neuraldoom.

The last line is exactly: fps=<what `python main.py` plays by default> eager_fps=<the same, eager>
real_fps=<the real game>.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from .actions import StickyRandomPolicy
from .checkpoint import Checkpoint, CheckpointError
from .config import DEFAULT_CHECKPOINT, parse_args, resolve_checkpoint
from .engine import NeuralEngine, bf16_supported, default_dtype, usable_cores
from .sampler import dtype_name

LATE = ("decode", "both")  # parallel modes that show each frame one step late


@dataclass
class Variant:
    compile: bool
    dtype: torch.dtype
    cfg: float
    steps: int
    cores: int
    parallel: str = "cfg"
    batched: bool = False  # the CFG pair as one batch-2 call (the pre-split form; no 2:cfg then)
    student: bool = False  # the checkpoint's distilled student for `steps` (guidance folded in: cfg 1)
    default: bool = False  # what `python main.py` plays (compiled or eager)
    ckpt: Checkpoint | None = None
    eng: NeuralEngine | None = None
    start_s: float = 0.0
    policy: StickyRandomPolicy | None = None
    sums: dict[str, float] = field(default_factory=lambda: dict(frames=0, wall=0.0, cpu=0.0, main=0.0, sample=0.0,
                                                                decode=0.0))

    @property
    def cores_label(self) -> str:
        label = "1" if self.cores == 1 else {"cfg": "2:cfg", "decode": "2:dec", "both": "2:both"}[self.parallel]
        return label + ("/b2" if self.batched else "")

    @property
    def mode(self) -> str:
        if not self.compile:
            return "eager"
        return "compiled" if self.eng.compiled else "eager*"  # *: the compile failed; never called compiled

    def ms(self, k: str) -> float:
        return self.sums[k] / max(self.sums["frames"], 1) * 1000


def start(v: Variant, threads: int, failed: set, seed: int = 0) -> None:
    """The variant's engine, warmed up; a dtype whose build failed once is not built again (its rows run
    eager, marked eager*)."""
    torch.set_num_threads(threads if v.cores == 1 else 1)
    t0 = time.perf_counter()
    v.eng = NeuralEngine(v.ckpt, compile=v.compile and v.dtype not in failed, steps=v.steps,
                         guidance=None if v.student else v.cfg, teacher=not v.student, wait_compile=True,
                         cores=v.cores, parallel=v.parallel, dtype=v.dtype, batched=v.batched)
    v.start_s = time.perf_counter() - t0
    if v.compile and not v.eng.compiled:
        failed.add(v.dtype)
    v.policy = StickyRandomPolicy(np.random.default_rng(seed))
    v.eng.reset(seed)
    for _ in range(3):  # warm-up
        v.eng.step(v.policy())


def time_round(v: Variant, frames: int, threads: int) -> None:
    """`frames` steps of play; sums wall, CPU (all threads, this thread) and the engine's stage times."""
    torch.set_num_threads(threads if v.cores == 1 else 1)
    eng, s = v.eng, v.sums
    w0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(frames):
        eng.step(v.policy())
        s["sample"] += eng.timing["sample_ms"] / 1000
        s["decode"] += eng.timing["decode_ms"] / 1000
    s["wall"] += time.perf_counter() - w0
    s["cpu"] += time.process_time() - c0
    s["main"] += time.thread_time() - m0
    s["frames"] += frames


def real_fps(ckpt: Checkpoint, steps: int = 500) -> float:
    from .game import RealGame

    with RealGame(ckpt.game) as g:
        g.reset(0)
        policy = StickyRandomPolicy(np.random.default_rng(0))
        t0 = time.perf_counter()
        for _ in range(steps):
            g.step(policy())
            if g.done:
                g.reset(0)
        return steps / (time.perf_counter() - t0)


def variants(ckpt: Checkpoint, modes: list[bool], steps_list: list[int], quick: bool) -> list[Variant]:
    """The grid (mode x CFG x steps x 1/2 cores) of the teacher and of each distilled student the
    checkpoint carries, the (a)/(b)/(c) comparison at the checkpoint's settings, and the other dtype (bf16
    vs float32) compiled at those settings. Default: what `python main.py` plays (a student for the
    checkpoint's step count where it carries one)."""
    guided, steps0, dt = ckpt.sampler_cfg.cfg, ckpt.sampler_cfg.steps, default_dtype()
    two = usable_cores() >= 2
    by_student = steps0 in ckpt.students
    out = []
    for comp in modes:
        for cfg in dict.fromkeys((guided, 1.0)):
            for steps in steps_list:
                g = cfg != 1.0
                dflt = (cfg, steps) == (guided, steps0) and not by_student
                out.append(Variant(comp, dt, cfg, steps, 1, default=dflt and not two))
                # a second core without CFG has only the decode (and a status-bar denoiser) to take: play's "auto"
                out.append(Variant(comp, dt, cfg, steps, 2, "cfg" if g else "decode", default=dflt and two))
        for n in sorted(ckpt.students, reverse=True):
            out.append(Variant(comp, dt, 1.0, n, 1, student=True, default=n == steps0 and not two))
            out.append(Variant(comp, dt, 1.0, n, 2, "decode", student=True, default=n == steps0 and two))
        if guided != 1.0:
            out += [Variant(comp, dt, guided, steps0, 2, p) for p in LATE]
            out += [Variant(comp, dt, guided, steps0, 1, batched=True),
                    Variant(comp, dt, guided, steps0, 2, "decode", batched=True)]
    other = torch.float32 if dt == torch.bfloat16 else torch.bfloat16
    if True in modes and not quick and (other == torch.float32 or bf16_supported()):
        out += [Variant(True, other, guided, steps0, c) for c in (1, 2)]
    for v in out:
        v.ckpt = ckpt
    return out


def latent_gap(a: NeuralEngine, b: NeuralEngine, steps: int = 8) -> float:
    """Max abs difference of the latents two engines sample from the same seed and actions."""
    pa, pb = StickyRandomPolicy(np.random.default_rng(7)), StickyRandomPolicy(np.random.default_rng(7))
    a.reset(7)
    b.reset(7)
    return max((a.next_latent(pa()) - b.next_latent(pb())).abs().max().item() for _ in range(steps))


@dataclass(frozen=True)
class Args:
    checkpoint: str = DEFAULT_CHECKPOINT  # in the repository unless a path that exists here
    frames: int = 0  # timed frames per row (0: 30; 10 with --quick)
    rounds: int = 3  # interleaved rounds the frames are split into
    steps: tuple[int, ...] = ()  # DDIM step counts (default 4 2 1)
    quick: bool = False  # the checkpoint's step count only, 10 frames, no bf16 rows
    threads: int = 1  # torch threads of the 1-core rows
    compile: bool = True  # the compiled rows too (--no-compile skips them)


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    torch.set_num_threads(a.threads)
    try:
        ckpt = Checkpoint(resolve_checkpoint(a.checkpoint))
    except CheckpointError as e:
        print(f"bench: {e}", file=sys.stderr)
        return 2
    frames = a.frames or (10 if a.quick else 30)
    steps_list = sorted({ckpt.sampler_cfg.steps, *(a.steps or ([] if a.quick else [4, 2, 1]))}, reverse=True)
    vs = variants(ckpt, [False, True] if a.compile else [False], steps_list, a.quick)
    failed: set = set()
    for v in vs:
        start(v, a.threads, failed)
    rounds = max(1, min(a.rounds, frames))
    for r in range(rounds):
        share = frames // rounds + (1 if r < frames % rounds else 0)
        for v in vs:
            time_round(v, share, a.threads)
    rfps = real_fps(ckpt)

    guided, steps0, dt = ckpt.sampler_cfg.cfg, ckpt.sampler_cfg.steps, default_dtype()
    key = lambda v: (v.compile, v.dtype, v.cfg, v.steps, v.cores, v.parallel, v.batched)  # noqa: E731
    by = {key(v): v for v in vs if not v.student}
    base = by.get((True, dt, guided, steps0, 1, "cfg", False))
    if base is None or not base.eng.compiled:
        base = by[(False, dt, guided, steps0, 1, "cfg", False)]
    fps = lambda v: v.sums["frames"] / max(v.sums["wall"], 1e-9)  # noqa: E731
    print(f"checkpoint {a.checkpoint}: context {ckpt.denoiser_cfg.context}, {ckpt.game.width}x{ckpt.game.height}, "
          f"{usable_cores()} usable cores, torch {torch.__version__}, {frames} frames per row in {rounds} rounds; "
          f"x base: FPS over {base.mode} {dtype_name(base.dtype)} CFG {guided:g} {steps0} steps 1 core")
    print(f"{'mode':<9}{'dtype':<9}{'sampler':>8}{'CFG':>4}{'steps':>6}{'cores':>10}{'sample ms':>10}{'decode ms':>10}"
          f"{'frame ms':>9}{'FPS':>7}{'x base':>7}{'cpu ms':>8}{'busiest':>8}{'start s':>8}")
    for v in vs:
        busiest = max(v.ms("main"), v.ms("cpu") - v.ms("main"))
        mark = ("*" if v.parallel in LATE and v.cores > 1 else "") + (" <" if v.default else "")
        who = "student" if v.student else "DDIM"
        skip = v.eng.sampler.skip
        steps = f"{v.steps - skip}/{v.steps}" if skip else str(v.steps)  # run / planned: the first steps skipped
        print(f"{v.mode:<9}{dtype_name(v.dtype):<9}{who:>8}{v.cfg:>4.1f}{steps:>6}{v.cores_label:>10}{v.ms('sample'):>10.1f}"
              f"{v.ms('decode'):>10.1f}{v.ms('wall'):>9.1f}{fps(v):>7.1f}{fps(v) / fps(base):>7.2f}{v.ms('cpu'):>8.1f}"
              f"{busiest:>8.1f}{v.start_s:>8.1f}{mark}")
    print(f"{'real ViZDoom':<46}{'':>20}{1000 / rfps:>9.2f}{rfps:>7.0f}")
    print("<: what `python main.py` plays by default; *: one frame of latency; eager*: the compile failed; "
          "/b2: the CFG pair as one batch-2 call; student: distilled, guidance folded in; 3/4: 3 of a 4-step plan "
          "run, its first skipped")
    for comp in ([False, True] if a.compile else [False]):
        k = (comp, dt, guided, steps0)
        one = by.get((*k, 1, "cfg", False))
        rows = [("a", by.get((*k, 2, "cfg", False))), ("b", by.get((*k, 2, "decode", False))),
                ("b", by.get((*k, 2, "decode", True))), ("c", by.get((*k, 2, "both", False))),
                ("1 core", by.get((*k, 1, "cfg", True)))]
        if one is not None and all(v for _, v in rows) and guided != 1.0 and one.mode != "eager*":
            ratios = ", ".join(f"({x}) {v.cores_label} x{fps(v) / fps(one):.2f}" for x, v in rows)
            print(f"{one.mode}, CFG {guided:g}, {steps0} steps, FPS over 1 core: {ratios}")
    others = [v for v in vs if v.dtype != dt and v.cores == 1 and not v.batched]
    if others and others[0].eng.compiled and base.eng.compiled:
        o = others[0]
        b16, f32 = (base, o) if dt == torch.bfloat16 else (o, base)
        print(f"bf16 vs float32, compiled, 1 core: FPS x{fps(b16) / fps(f32):.2f}; sampled latent max |diff| over "
              f"8 steps {latent_gap(b16.eng, f32.eng):.3g} (latent std {ckpt_std(base.eng):.2f})")
    for v in vs:
        v.eng.close()
    default = next((v for v in vs if v.default and v.compile), None)
    eager = next(v for v in vs if v.default and not v.compile)
    play = default if default is not None and default.eng.compiled else eager
    print(f"fps={fps(play):.2f} eager_fps={fps(eager):.2f} real_fps={rfps:.1f}")
    return 0


def ckpt_std(eng: NeuralEngine) -> float:
    return eng.start_z.std().item()


if __name__ == "__main__":
    sys.exit(main())
