"""What the training stages share (a few functions, not a Trainer class): the accelerator with its
precision, the check that a resumed run is the same model, one decision for all processes, and the
denoiser-side loop's pieces (train_diffusion, distill): resume and save of the one state file, the
optimizer step with clipping and EMA, the progress bar, jsonl log and time limit."""

from __future__ import annotations

import json
import math
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from diffusers.models.attention_processor import Attention, AttnProcessor
from diffusers.training_utils import EMAModel
from tqdm import tqdm

from neuraldoom.checkpoint import CheckpointError, load_optimizer, load_state, optimizer_tensors, save_state
from neuraldoom.engine import bf16_supported
from neuraldoom.sampler import Pass, denoiser_pass

PRECISIONS = ("auto", "fp32", "bf16")


def bf16_is_fast() -> bool:
    """A GPU, or a CPU with native bf16 (AVX512-BF16 / AMX): there autocast roughly halves the autoencoder's
    step time; on an AVX2-only CPU bf16 convolutions run several times slower than fp32."""
    return torch.cuda.is_available() or bf16_supported()


def check_same_architecture(saved: dict[str, Any], args: Any, keys: tuple[str, ...], path: Path) -> None:
    """A resumed run must be the same model: a changed flag is one line (CheckpointError), not a
    load_state_dict traceback. saved: the args stored in the state file (JSON: tuples are lists)."""
    for k in keys:
        now = getattr(args, k)
        if k in saved and saved[k] != (list(now) if isinstance(now, tuple) else now):
            raise CheckpointError(f"{path} was trained with --{k.replace('_', '-')} {saved[k]}, not {now}: "
                                  "use another --out or the same flags")


def agree(acc: Accelerator, flag: bool) -> bool:
    """One decision for every process: true if any process says so. A time limit reached by one process
    must stop them all, or the others would wait forever at the next gradient all-reduce."""
    if acc.num_processes == 1:
        return flag
    t = torch.tensor([float(flag)], device=acc.device)
    return bool(acc.reduce(t, reduction="sum").item() > 0)


def accelerator(precision: str = "auto") -> Accelerator:
    """The device is chosen automatically (a GPU when there is one); precision: auto (bf16 autocast where
    it is fast, else fp32), fp32 or bf16."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    bf16 = precision == "bf16" or (precision == "auto" and bf16_is_fast())
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="bf16" if bf16 else "no")


# -- the denoiser-side loop: resume, one optimizer step, progress, save ---------------------------------
def load_run(path: Path, args: Any, keys: tuple[str, ...], model: torch.nn.Module, opt: torch.optim.Optimizer,
             ema: Any, extra: Callable[[dict[str, torch.Tensor], dict[str, Any]], Any] | None = None,
             ) -> tuple[int, int, float]:
    """Resume from a state file written by save_run: weights, optimizer (at the given --lr), EMA, and
    whatever else the run kept (extra(tensors, meta), e.g. a critic's load); returns (step, samples seen,
    elapsed seconds), (0, 0, 0.0) when there is no state yet. A changed architecture flag or a broken file
    is a CheckpointError (one line)."""
    if not path.exists():
        return 0, 0, 0.0
    tensors, meta = load_state(path)
    check_same_architecture(meta.get("args", {}), args, keys, path)
    model.load_state_dict({k[6:]: v for k, v in tensors.items() if k.startswith("model.")})
    load_optimizer(opt, tensors, meta)
    for g in opt.param_groups:  # the saved groups carry the old --lr: a resumed run takes the one given now
        g["lr"] = g["initial_lr"] = args.lr
    ema.shadow_params = [tensors[f"ema.{i}"] for i in range(len(ema.shadow_params))]
    ema.optimization_step = meta["ema_step"]
    if extra is not None:
        extra(tensors, meta)
    return int(meta["step"]), int(meta["seen"]), float(meta.get("elapsed", 0.0))


def start_run(path: Path, args: Any, keys: tuple[str, ...], model: torch.nn.Module, weight_decay: float,
              extra: Callable[[dict[str, torch.Tensor], dict[str, Any]], Any] | None = None,
              ) -> tuple[torch.optim.Optimizer, Any, int, int, float]:
    """The optimizer (AdamW at --lr) and EMA (--ema) of a denoiser-side run, resumed from its state file
    where there is one: (opt, ema, step, samples seen, elapsed seconds); CheckpointError as load_run."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=weight_decay)
    ema = EMAModel(model.parameters(), decay=args.ema, use_ema_warmup=True, power=3 / 4)
    return (opt, ema, *load_run(path, args, keys, model, opt, ema, extra))


def save_run(path: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, ema: Any, step: int, seen: int,
             elapsed: float, args: Any, extra: dict[str, torch.Tensor] | None = None,
             extra_meta: dict[str, Any] | None = None) -> None:
    """One atomic safetensors file: weights, optimizer, EMA, step, samples, elapsed time, the args, and
    whatever else the run keeps (extra: e.g. a critic's tensors, keys not starting with model/opt/ema)."""
    t, m = optimizer_tensors(opt)
    t.update(extra or {})
    m.update(extra_meta or {})
    t.update({f"model.{k}": v for k, v in model.state_dict().items()})
    t.update({f"ema.{i}": p for i, p in enumerate(ema.shadow_params)})
    save_state(path, t, {**m, "step": step, "seen": seen, "ema_step": ema.optimization_step, "elapsed": elapsed,
                         "args": asdict(args)})


def run_folder(a: Any) -> Path:
    """A trainer's first lines: its torch threads (a.threads) and seed (a.seed) set, its run folder (a.out)
    made."""
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    return out


def optimizer_step(acc: Accelerator, model: torch.nn.Module, opt: torch.optim.Optimizer, schedule: Any, ema: Any,
                   loss: torch.Tensor, clip: float = 1.0) -> None:
    """Backward, gradient clipping, the optimizer and schedule steps, and the EMA of the unwrapped weights
    (ema None: a run that keeps none)."""
    opt.zero_grad(set_to_none=True)
    acc.backward(loss)
    acc.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    schedule.step()
    if ema is not None:
        ema.step(acc.unwrap_model(model).parameters())


def training_pass(model: torch.nn.Module, acc: Accelerator, compile: bool) -> torch.nn.Module:
    """The module a denoiser-side loss calls (the same weights: EMA and saving are unchanged). On a CPU its
    attention runs diffusers' classic processor (baddbmm, softmax, bmm): the backward of torch's CPU flash
    kernel took ~40% of a denoiser step, the classic one gives 1.28x the samples/s (a forward alone is ~5%
    slower). compile: torch.compile'd too, 1.61x in all on the 2-core AMX machine (docs/EXPERIMENTS.md "A
    training step 1.6x faster"); it compiles for ~100 s on the first step of every run and resume. A compiled
    run was later measured to learn worse than an eager one: under CPU bf16 autocast its backward gave most
    weights no gradient (docs/EXPERIMENTS.md "A deeper denoiser grown from the shipped one"), so there it
    stays eager, and the trainers default to eager."""
    if acc.device.type == "cpu":
        for m in model.modules():
            if isinstance(m, Attention):
                m.set_processor(AttnProcessor())
    if not compile:
        return model
    if acc.device.type == "cpu" and acc.mixed_precision != "no":  # the zero gradients of the docstring
        print("training: --compile trains eager under bf16 autocast on a CPU (compiled, most weights got no "
              "gradient); add --precision fp32 to compile", file=sys.stderr)
        return model
    return _compiled(model)


def _compiled(fn: Any, **options: Any) -> Any:
    # diffusers' up/downsamplers ask an lru_cached torch-version check inside forward: harmless, and warned
    # about once per call site and process
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")
    return torch.compile(fn, **options)


def sampling_pass(denoiser: torch.nn.Module, compile: bool) -> Pass:
    """The denoiser pass a training loop samples its own frames with (no gradient, the live weights, each step a
    batch of another size). compile: torch.compile'd with a dynamic batch, so one graph serves every size; it
    was eager, a third of a compiled training step; compiled, the loop runs 1.11x the samples/s
    (docs/EXPERIMENTS.md "The own frames' sampling compiled")."""
    p = denoiser_pass(denoiser)
    return _compiled(p, dynamic=True) if compile else p


SCHEDULES = ("constant", "cosine")


def lr_schedule(opt: torch.optim.Optimizer, kind: str, warmup: int,
                prog: Progress) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up, then constant, or a cosine down to 5% over the run (its --steps or --minutes,
    whichever ends first: a time-boxed run anneals to its end instead of stopping at a high rate)."""
    if kind not in SCHEDULES:
        raise ValueError(f"--schedule must be one of {', '.join(SCHEDULES)}, not {kind!r}")

    def factor(step: int) -> float:
        ramp = min(1.0, (step + 1) / warmup) if warmup else 1.0
        return ramp if kind == "constant" else ramp * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * prog.fraction())))

    for g in opt.param_groups:
        g.setdefault("initial_lr", g["lr"])
    return torch.optim.lr_scheduler.LambdaLR(opt, factor, last_epoch=prog.step - 1)


class Progress:
    """Steps, samples and time of a run (resumed counts included), its progress bar and jsonl log, both on
    the main process only; `over()` is the time limit, agreed by every process."""

    def __init__(self, acc: Accelerator, log: Path, total: int, step: int, seen: int, elapsed: float,
                 minutes: float, desc: str) -> None:
        self.acc, self.main = acc, acc.is_main_process
        self.step, self.seen, self.elapsed, self.minutes, self.total = step, seen, elapsed, minutes, total
        self.t0 = self.saved = time.time()
        self.seen0 = seen
        self.log = open(log, "a") if self.main else None
        self.bar = tqdm(total=total, initial=step, desc=desc, mininterval=10, disable=not self.main)

    @property
    def seconds(self) -> float:
        return self.elapsed + time.time() - self.t0

    def spent(self) -> bool:
        """The budget was used up before this run started (a rerun then trains no more)."""
        return bool(self.minutes) and self.elapsed >= self.minutes * 60

    def tick(self, batch: int, loss: torch.Tensor) -> None:
        self.step += 1
        self.seen += batch * self.acc.num_processes
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{loss.item():.4f}", sps=f"{self.samples_per_s:.1f}", refresh=False)

    @property
    def samples_per_s(self) -> float:
        return (self.seen - self.seen0) / max(time.time() - self.t0, 1e-9)

    def write(self, **rec: Any) -> None:
        if not self.main:
            return
        rec = {"step": self.step, "samples": self.seen, **rec, "samples_per_s": self.samples_per_s,
               "minutes": self.seconds / 60}
        self.log.write(json.dumps(rec) + "\n")
        self.log.flush()
        self.bar.write(json.dumps(rec))

    def fraction(self) -> float:
        """How far through the run: steps over --steps or wall time over --minutes, whichever is further."""
        f = self.step / max(self.total, 1)
        if self.minutes:
            f = max(f, self.seconds / (self.minutes * 60))
        return min(f, 1.0)

    def over(self) -> bool:
        return agree(self.acc, bool(self.minutes) and self.seconds > self.minutes * 60)

    def save_or_stop(self, save: Callable[[], None], every: float) -> bool:
        """After a step: `save()` once `every` seconds have passed since the last save, at the last step and
        at the time limit; true at the time limit, where the training loop stops."""
        timeout = self.over()
        if time.time() - self.saved > every or self.step == self.total or timeout:
            save()
            self.saved = time.time()
        return timeout

    def close(self) -> None:
        self.bar.close()
        if self.log is not None:
            self.log.close()
        self.acc.wait_for_everyone()
