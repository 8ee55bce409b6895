"""Distil the 4-step guided DDIM sampler into students that need fewer UNet passes a frame.

    python -m training.distill --checkpoint checkpoints/e1m1 --data data/e1m1 --out runs/g4 --steps 4
    python -m training.distill --checkpoint checkpoints/e1m1 --data data/e1m1 --out runs/p2 --steps 2
    python -m training.distill --checkpoint runs/p2/checkpoint --data data/e1m1 --out runs/p1 --steps 1

A student has the teacher's architecture and starts from its weights. The teacher is the checkpoint's
sampler at --teacher-steps (default: twice --steps, at most the checkpoint's own step count): its student
for that many steps where the checkpoint carries one, else the denoiser with classifier-free guidance.
- same step count (the first command): guidance distillation (Meng et al. 2023) — the student's one pass
  learns the guided pair's combined v, so CFG costs nothing at play;
- half the steps: progressive distillation (Salimans & Ho 2022) — one student DDIM step learns to land
  where two teacher steps land: from x_t the teacher steps twice to x_t''; the student's target is the
  clean estimate x0 for which one DDIM step from x_t gives x_t'' exactly, as a v target. Any multiple
  works the same way (--teacher-steps 4 --steps 1: one step learns the teacher's whole 4-step path).
Both train only at the student's own timesteps, on noised held-in latents with their real context (clean,
as at play), with the v-MSE loss, AdamW, EMA and gradient clipping, like train_diffusion.

--own-frames S: for a share S of each batch the last context frame is the student's own sample of it (its
sampler as play runs it, from the real frames before it) and the teacher's path starts from that context:
in play a student reads what it drew itself, and this teaches it the teacher's correction of such frames.
(Measured on the shipped 1-step student: no change, as its softness does not compound; docs/EXPERIMENTS.md.)

--sharp-weight W adds a gradient difference loss (Mathieu et al. 2016) between the student's clean latent
estimate and the teacher's: the mean |(|dz_student| - |dz_teacher|)| over the latent's neighbouring-cell
differences, W times it. A one-step student cannot read from the noise which of the teacher's details it
will draw and regresses to their average, a blur; this term asks for the teacher's edge strength wherever
the teacher has edges.

--adv-weight W adds adversarial diffusion distillation (Sauer et al. 2023): a latent critic
(`training.adversarial.LatentDiscriminator`) learns to tell the real next latent from the student's clean
estimate at its step, given the last frame and the current action, and the student is also trained to fool
it (hinge loss, weighted by VQGAN's adaptive weight at the UNet's last layer): the regression to the
teacher alone is minimised by the mean of the possible next frames, which is a blur. With the teacher the
student's own step count (`--steps 4 --teacher-steps 4` on a checkpoint carrying a 4-step student), the
student starts as the teacher and only the critic moves it.

Every --save-every seconds it writes, atomically, OUT/train_state.safetensors (rerunning the same command
resumes) and OUT/checkpoint: the teacher's checkpoint carrying the students it had plus this one, so
`python main.py --checkpoint OUT/checkpoint --steps N` plays it and `training.evaluate --steps N` measures
it. `training.export --students` gathers students of one teacher into a shipped checkpoint.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from neuraldoom.checkpoint import (
    Checkpoint,
    CheckpointError,
    save_checkpoint,
    weights_digest,
)
from neuraldoom.config import parse_args
from neuraldoom.denoiser import Denoiser
from neuraldoom.recording import RecordingError
from neuraldoom.sampler import DDIMSampler
from training import latents as L
from training import trainer
from training.adversarial import Critic, LatentDiscriminator, adaptive_weight
from training.train_diffusion import with_own_frames


@dataclass(frozen=True)
class Args:
    checkpoint: str  # the teacher's checkpoint (and the students it carries)
    data: str  # dataset folder with train/ and heldout/ recordings
    out: str  # run folder (resumed if it holds a state)
    steps: int = 2  # the student's DDIM steps
    teacher_steps: int = 0  # 0: 2 x steps, at most the checkpoint's own step count
    latents: str = ""  # latent cache folder (default OUT/latents); another run's is reused if the encoder matches
    max_frames: int = 60000  # frames of DATA/train to encode (0 = all)
    minutes: float = 0.0  # stop (and save) after this much wall time in all; 0 = no limit
    iterations: int = 100000
    batch: int = 32
    lr: float = 1e-4
    warmup: int = 100
    ema: float = 0.999
    save_every: float = 300.0  # seconds
    eval_every: int = 100
    seed: int = 0
    precision: str = "auto"
    threads: int = 1
    compile: bool = False  # --compile: torch.compile the student's training pass (trainer.training_pass); off
    # by default as in train_diffusion, where the compiled pass was measured to train worse
    own_frames: float = 0.0  # share of samples whose last context frame is the student's own sample of it
    sharp_weight: float = 0.0  # weight of the gradient difference loss against the teacher's clean estimate
    adv_weight: float = 0.0  # a latent critic's hinge loss on the student's clean estimates, relative to the
    # distillation loss's gradient at the UNet's last layer (adversarial diffusion distillation); 0 = off


ARCHITECTURE = ("checkpoint", "steps", "teacher_steps")


class Teacher:
    """The sampler being distilled: `v(x, t, context, codes)` is its (guided) prediction at one step."""

    def __init__(self, ck: Checkpoint, steps: int) -> None:
        self.student = steps in ck.students
        self.model = ck.student(steps) if self.student else ck.denoiser
        self.cfg = 1.0 if self.student else ck.sampler_cfg.cfg
        self.plan = DDIMSampler(self.model, steps, self.cfg).plan
        self.name = f"{steps}-step student" if self.student else f"{steps}-step DDIM, CFG {self.cfg:g}"

    @torch.no_grad()
    def v(self, x: torch.Tensor, t: torch.Tensor, ctx: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        bucket = torch.zeros_like(t)  # clean context, as at play
        if self.cfg == 1.0:
            return self.model(x, t, ctx, codes, bucket).float()
        v2 = self.model(torch.cat([x, x]), t.repeat(2), torch.cat([ctx, torch.zeros_like(ctx)]),
                        torch.cat([codes, codes]), bucket.repeat(2)).float()
        vc, vu = v2.chunk(2)
        return vu + self.cfg * (vc - vu)


def ddim_step(x: torch.Tensor, v: torch.Tensor, at: float, ap: float) -> torch.Tensor:
    """One DDIM (eta 0) step of a v-prediction from alpha_bar `at` to `ap` (exactly the sampler's)."""
    x0 = at**0.5 * x - (1 - at) ** 0.5 * v
    eps = at**0.5 * v + (1 - at) ** 0.5 * x
    return ap**0.5 * x0 + (1 - ap) ** 0.5 * eps


def student_target(x: torch.Tensor, x_end: torch.Tensor, at: float, ap: float) -> torch.Tensor:
    """The v that takes x (at alpha_bar `at`) to x_end (at `ap`) in one DDIM step: solve
    x_end = a'' x0 + s'' (x - a x0) / s for x0, then v = (a x - x0) / s."""
    a, s, a2, s2 = at**0.5, (1 - at) ** 0.5, ap**0.5, (1 - ap) ** 0.5
    x0 = (x_end - s2 / s * x) / (a2 - s2 / s * a)
    return (a * x - x0) / s


def gradient_difference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Mean |(|da| - |db|)| over the vertical and horizontal neighbour differences of (B,C,h,w) latents:
    zero when a has b's edge strength everywhere, whatever their means (the gradient difference loss)."""
    dh = (a.diff(dim=2).abs() - b.diff(dim=2).abs()).abs().sum((1, 2, 3))
    dw = (a.diff(dim=3).abs() - b.diff(dim=3).abs()).abs().sum((1, 2, 3))
    return (dh + dw) / (a[:1].diff(dim=2).numel() + a[:1].diff(dim=3).numel())


def distill_batch(student: torch.nn.Module, teacher: Teacher, plan: list, batch: tuple, gen: torch.Generator,
                  device: torch.device, sharp_weight: float = 0.0) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """The loss of one batch: a random student step per sample, the teacher's k = len(teacher.plan) /
    len(plan) steps from the same x_t as its target (plus, with sharp_weight, the gradient difference of
    the two clean estimates). Also returns, for the critic, the student's clean estimates as latents with
    the real latents, last context latents and current actions in their order."""
    z, ctx, codes = (b.to(device) for b in batch)
    B, k = len(z), len(teacher.plan) // len(plan)
    raw: Denoiser = getattr(student, "module", student)
    ref = raw.reference(ctx, codes)
    y = raw.to_target(z, ref)
    i = torch.randint(0, len(plan), (B,), generator=gen)
    eps = torch.randn(y.shape, generator=gen).to(device)
    loss = torch.zeros((), device=device)
    estimates, order = [], []
    for step in i.unique().tolist():  # the samples at each student step, as one sub-batch
        m = (i == step).to(device)
        t, at, ap = plan[step]
        x = at**0.5 * y[m] + (1 - at) ** 0.5 * eps[m]
        xe = x
        for tt, a1, a2 in teacher.plan[step * k:(step + 1) * k]:
            tv = torch.full((len(xe),), tt, dtype=torch.long, device=device)
            xe = ddim_step(xe, teacher.v(xe, tv, ctx[m], codes[m]), a1, a2)
        target = student_target(x, xe, at, ap)
        tv = torch.full((len(x),), t, dtype=torch.long, device=device)
        pred = student(x, tv, ctx[m], codes[m], torch.zeros_like(tv)).float()
        loss = loss + F.mse_loss(pred, target, reduction="sum") / y[0].numel()
        estimate = raw.from_target(at**0.5 * x - (1 - at) ** 0.5 * pred, ref[m])
        if sharp_weight:
            aimed = raw.from_target(at**0.5 * x - (1 - at) ** 0.5 * target, ref[m])
            loss = loss + sharp_weight * gradient_difference(estimate, aimed).sum()
        estimates.append(estimate)
        order.append(m.nonzero().squeeze(1))
    idx = torch.cat(order)
    return loss / B, (torch.cat(estimates), z[idx], ctx[idx, -1], codes[idx, -1])


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    out = trainer.run_folder(a)
    state_path = out / "train_state.safetensors"
    try:
        acc = trainer.accelerator(a.precision)
        ck = Checkpoint(a.checkpoint)
        own = ck.sampler_cfg.steps
        t_steps = a.teacher_steps or min(2 * a.steps, own)
        if a.steps < 1 or t_steps % a.steps or 1000 % t_steps:
            raise CheckpointError(f"--teacher-steps must be a multiple of --steps that divides 1000 (so the "
                                  f"samplers' timesteps nest), not {t_steps} for --steps {a.steps}")
        if a.adv_weight < 0:
            raise ValueError(f"--adv-weight must be >= 0, not {a.adv_weight}")
        if a.sharp_weight < 0:
            raise ValueError(f"--sharp-weight must be >= 0, not {a.sharp_weight}")
        if not 0 <= a.own_frames <= 1:
            raise ValueError(f"--own-frames must be within [0, 1], not {a.own_frames}")
        if t_steps != own and t_steps not in ck.students:
            raise CheckpointError(f"{a.checkpoint} has no {t_steps}-step sampler to learn from: distil that "
                                  f"one first (it plays {own} steps; students: {sorted(ck.students) or 'none'})")
        teacher = Teacher(ck, t_steps)
        base = ck.students[t_steps]["base"] if teacher.student else weights_digest(ck.denoiser)
        cache = Path(a.latents) if a.latents else out / "latents"
        data = Path(a.data)
        out.mkdir(parents=True, exist_ok=True)
        with acc.main_process_first():  # the main process encodes into the cache, the others then read it
            train = L.build(ck.ae, data / "train", cache / "train", a.max_frames)
            held = L.build(ck.ae, data / "heldout", cache / "heldout", max(a.max_frames // 10, 2000))
    except (CheckpointError, RecordingError, ValueError) as e:
        print(f"distill: {e}", file=sys.stderr)
        return 2
    plan = DDIMSampler(teacher.model, a.steps, 1.0).plan
    model = copy.deepcopy(teacher.model).train()
    teacher.model.to(acc.device).eval().requires_grad_(False)
    critic = (Critic(LatentDiscriminator(model.unet.config.out_channels), a.lr).to(acc.device) if a.adv_weight > 0
              else None)
    try:
        opt, ema, step, seen, elapsed = trainer.start_run(state_path, a, ARCHITECTURE, model, weight_decay=0.0,
                                                          extra=critic.load if critic is not None else None)
    except CheckpointError as e:
        print(f"distill: {e}", file=sys.stderr)
        return 2
    if step and acc.is_main_process:
        print(f"distill: resuming at step {step}")
    prog = trainer.Progress(acc, out / "log.jsonl", a.iterations, step, seen, elapsed, a.minutes,
                            f"distill {a.steps}")
    lr_sched = trainer.lr_schedule(opt, "constant", a.warmup, prog)
    model, opt = acc.prepare(model, opt)
    raw = acc.unwrap_model(model)
    model = trainer.training_pass(model, acc, a.compile)
    gen = torch.Generator().manual_seed(a.seed * 1_000_003 + step * 7 + acc.process_index)
    own_sampler = DDIMSampler(raw, a.steps, 1.0, ck.sampler_cfg.deadband)  # the student as play runs it
    own_pass = trainer.sampling_pass(raw, a.compile)
    held_batch = held.window(held.targets[torch.randperm(len(held), generator=torch.Generator().manual_seed(0))[:64]],
                             raw.context, raw.reads)

    @torch.no_grad()
    def held_loss() -> float:
        raw.eval()
        with acc.autocast():
            loss = distill_batch(raw, teacher, plan, held_batch, torch.Generator().manual_seed(1), acc.device)[0]
        raw.train()
        return float(loss)

    def save() -> None:
        if not acc.is_main_process:
            return
        trainer.save_run(state_path, raw, opt, ema, prog.step, prog.seen, prog.seconds, a,
                         *(critic.tensors() if critic is not None else ()))
        shipped = copy.deepcopy(raw).cpu().eval()
        ema.copy_to(shipped.parameters())
        info = {"steps": a.steps, "teacher": teacher.name, "base": base, "distilled_from": str(a.checkpoint),
                "iterations": prog.step, "samples": prog.seen, "minutes": round(prog.seconds / 60, 1),
                "batch": a.batch, "lr": a.lr}
        students = {**ck.student_models(), a.steps: (shipped, info)}
        save_checkpoint(out / "checkpoint", ck.ae, ck.denoiser, ck.game, ck.denoiser_cfg, ck.sampler_cfg,
                        ck.context_frames, ck.context_actions, ck.config.get("notes", {}), students,
                        bar=ck.bar_parts())

    if acc.is_main_process:
        print(f"distill: {a.steps}-step student of the {teacher.name}, {len(train)} training targets, "
              f"{acc.num_processes} process(es)")
    while prog.step < a.iterations and not prog.spent():
        idx = train.targets[torch.randint(0, len(train), (a.batch,), generator=gen)]
        batch = train.window(idx, raw.context, raw.reads)
        if a.own_frames:
            batch = with_own_frames(own_pass, own_sampler, train, idx, batch, a.own_frames, gen, acc)
        with acc.autocast():
            loss, (fake, real, last, action) = distill_batch(model, teacher, plan, batch, gen, acc.device,
                                                             a.sharp_weight)
        adv = {}
        if critic is not None:  # the critic learns real from estimated next latents, then the student fools it
            adv["d_loss"] = critic.update(real.float(), fake.float(), last.float(), action)
            g_loss = critic.generator_loss(fake.float(), last.float(), action)
            lam = adaptive_weight(loss, g_loss, raw.unet.conv_out.weight)
            adv.update(g_loss=g_loss.item(), adv_lambda=lam.item())
            loss = loss + a.adv_weight * lam * g_loss
        trainer.optimizer_step(acc, model, opt, lr_sched, ema, loss)
        prog.tick(a.batch, loss)
        if prog.step % a.eval_every == 0 and acc.is_main_process:
            prog.write(loss=loss.item(), held_loss=held_loss(), **adv)
        if prog.save_or_stop(save, a.save_every):
            break
    prog.close()
    if prog.step and not (out / "checkpoint").exists():
        save()
    if acc.is_main_process:
        print(f"distill: step {prog.step}, {prog.seen} samples, held-out loss {held_loss():.4f}; "
              f"checkpoint in {out / 'checkpoint'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
