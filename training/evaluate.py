"""Evaluate a checkpoint on held-out recordings (GameNGen §5, with the baselines that keep PSNR honest).

    python -m training.evaluate --checkpoint checkpoints/e1m1 --data data/e1m1 --out runs/eval

Prints a table and writes OUT/report.json, OUT/ar_psnr.png, OUT/grid.png, OUT/rollout.png and OUT/misses.png
(the status bar around each rollout's first miss, real over model, the miss's step fourth, then 8 and 32
steps on):
- teacher-forced next-frame PSNR/SSIM (real context, DDIM steps of the checkpoint, CFG as shipped and 1.0);
- the copy-last-frame baseline, the mean-frame baseline, the autoencoder ceiling (decode(encode(real)))
  with its sharpness (the reconstructions' gradient energy over the real frames');
- the status bar's own PSNR for the model and the autoencoder (it is game state);
- status-bar read accuracy (neuraldoom.statusbar's shipped reader: AMMO, HEALTH and ARMOR all read right,
  against the recording's variables as the bar shows them, statusbar.frame_values) of the real frames
  (real_statusbar_acc, a sanity row: 1.0 unless the reader does not fit the game), the autoencoder's
  reconstructions, the teacher-forced frames and the autoregressive frames (all of them, and per step);
  per-field fractions in statusbar_fields; null where the reader does not apply (not 160x120, no HUD);
- autoregressive rollouts fed the real actions: PSNR, sharpness and status-bar accuracy per step, with
  copy-last and mean-frame per step. A rollout never leaves its start's episode: one that reaches the
  episode's end stops there, and each per-step metric is over the rollouts still alive at that step
  (ar_alive counts them; null for a step none reaches); ar_statusbar_acc is over all alive frames, and
  ar_copy_last_statusbar_acc is the same for the rollout's last real frame held still (a bar that
  never changes: what tracking ammo and health must beat).
- still views: a held-out frame as the whole context (a player who has stood still for the context's
  length) and NOOP for --still-steps: the real game keeps showing that frame (only monsters and animated
  sprites move), so each generated frame is scored against it (still_psnr, still_sharpness per step;
  still_ae_psnr is the autoencoder's ceiling). OUT/still.png: the frame, then steps 1, 4, 16, 64.
- the status bar where its numbers change (--events N, 32 by default; last, so the rows above draw the
  same noise as before it existed): teacher-forced on N held-out targets whose bar reads other numbers
  than the frame before (ammo spent, health lost or picked up), event_statusbar_acc against copy-last's
  (a bar that never changes), and event_move (number_moves: how far the numbers' pixels moved towards the
  new ones, 0 to 1, which shows the count being learned before the reader reads it).
  OUT/events.png: the numbers' rows of the last context frame | real next | model next.
- free play (--free-steps N, off by default: 1,000 take ~12 minutes on one core): from the checkpoint's
  own start, N steps of the straight and the sticky policy (training.rollout_strip), seeds 0 and 1. With
  no real frames to score against, the frames at N/4, N/2, 3N/4 and N (free_steps) are measured against
  the start frame: free[run].sharpness, gradient energy (far below 1: the melt, or a white or dark
  blow-out; far above 1: noise), and free[run].colour_cast (rollout_strip.colour_cast: a red drift;
  start_colour_cast is the start frame's), and free[run].close_wall: the share of every 10th step that is
  one grey wall seen from up close (metrics.close_wall), the view every model's free play settles on.
  OUT/free.png: one row per run.
- the close-wall share of the real held-out frames, the teacher-forced frames, the rollouts' frames and
  their real frames (real_close_wall, tf_close_wall, ar_close_wall, ar_real_close_wall): how much of what
  the model draws is that one view, against how much of the game is.
Set PSNR is 10*log10(255^2 / mean MSE) over all frames, never a mean of per-frame PSNRs. The per-frame
errors behind the teacher-forced and autoregressive PSNRs (tf_mse, ar_mse and their copy-last twins) and the
rollouts' per-step status-bar reads (ar_statusbar_ok) are kept, so that `training.compare` can tell two
checkpoints evaluated on the same targets apart from the evaluation's own noise; ar_statusbar_misses holds each
rollout's first wrong read and its kind (first_misses), the printed table their count by kind.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from neuraldoom import actions as A
from neuraldoom import autoencoder as AE
from neuraldoom import metrics as M
from neuraldoom import statusbar as SB
from neuraldoom.checkpoint import Checkpoint, CheckpointError
from neuraldoom.config import parse_args
from neuraldoom.engine import NeuralEngine
from neuraldoom.files import atomic_path, write_text
from neuraldoom.recording import Recording, RecordingError, find_recordings
from neuraldoom.replay import check_compatible
from training import rollout_strip as RS


@dataclass(frozen=True)
class Args:
    checkpoint: str
    data: str  # dataset folder: DATA/heldout is evaluated, DATA/train gives the mean frame
    out: str
    samples: int = 64  # teacher-forced targets
    rollouts: int = 8  # autoregressive rollouts, each in its own held-out episode (see --per-episode)
    per_episode: int = 1  # rollout starts per episode, T steps apart from its first: the held-out set has 15
    # episodes long enough for 128 steps, so with 1 every seed that asks for 15 or more runs the same 15
    rollout_steps: int = 64
    seed: int = 0
    compile: bool = False  # use the compiled sampler (slower to start, faster to run)
    guidance: float = 0.0  # CFG weight of the main runs (0 = the checkpoint's own); plays the teacher
    steps: int = 0  # DDIM steps of the main runs (0 = the checkpoint's own); a distilled student where it has one
    teacher: bool = False  # the teacher with CFG even where a student for these steps is carried
    deadband: float = -1.0  # the sampler's deadband (SamplerConfig.deadband; -1 = the checkpoint's own)
    still: int = 4  # still views (0: none)
    still_steps: int = 64
    free_steps: int = 0  # free play of this many steps (module doc); 0: none
    events: int = 32  # teacher-forced targets where the status bar's numbers change (module doc); 0: none
    threads: int = 1


def rollout_starts(s: int, e: int, n: int, T: int, per_episode: int) -> list[int]:
    """Where the rollouts of episode [s, e) start: after n frames of context (or at its middle), then every T
    steps while a whole rollout still fits; none in an episode under T + 3 steps."""
    if e - s <= T + 2:
        return []
    first = s + min(n, (e - s) // 2)
    return [first + k * T for k in range(per_episode) if k == 0 or first + (k + 1) * T <= e]


def history(rec: Recording, i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The up-to-n real frames before row i of its episode, and the actions that led to them
    (action j-1 led to frame j; the episode's first frame was led to by no action: NOOP)."""
    s = next(s for s, e in rec.episodes() if s <= i < e)
    lo = max(s, i - n)
    noop = A.NOOP.code
    acts = np.stack([rec.actions[j - 1] if j - 1 >= s else noop for j in range(lo, i)])
    return np.asarray(rec.frames[lo:i]), acts


MISS_KINDS = ("unreadable", "missed", "spurious")


def first_misses(reads: np.ndarray, values: np.ndarray, ok: np.ndarray, alive: np.ndarray,
                 recent: int = 8) -> list[dict[str, Any] | None]:
    """Per rollout, its status bar's first wrong read (a rollout's bar, once wrong, mostly stays wrong: what
    the model does at that step decides the rest): step (1-based), field, what the bar showed and what was
    read, and its kind: "unreadable" (no number: a smeared glyph), "missed" (a number the bar showed within
    `recent` steps before: a change not drawn, e.g. a pickup or a shot) or "spurious" (another number: a change
    the game did not make). A missed change also names its cause: "shot" (the ammo count not stepped down: the
    player's own action, which the bar's context holds) or "world" (a pickup or damage: only the view shows it
    coming). None: read right at every step. reads (R, T, 3) as StatusBarReader.read; values (R, T, K, 3)
    candidates (statusbar.frame_values); ok (R, T, 3) per field; alive (R, T)."""
    out: list[dict[str, Any] | None] = []
    for j in range(len(reads)):
        bad = np.flatnonzero(alive[j] & ~ok[j].all(-1))
        if not len(bad):
            out.append(None)
            continue
        t = int(bad[0])
        k = int(np.flatnonzero(~ok[j, t])[0])
        got, shown = int(reads[j, t, k]), int(values[j, t, -1, k])
        before = values[j, max(0, t - recent):t + 1, :, k]
        kind = "unreadable" if got == SB.UNREADABLE else "missed" if (before == got).any() else "spurious"
        miss = {"step": t + 1, "field": SB.FIELDS[k], "shown": shown, "read": got, "kind": kind}
        if kind == "missed":
            miss["cause"] = "shot" if SB.FIELDS[k] == "ammo" and shown < got else "world"
        out.append(miss)
    return out


def statusbar_reads(frames: np.ndarray) -> np.ndarray | None:
    """(N, 3) the status-bar fields as the shipped reader reads them; None where it does not apply (frames not
    160x120)."""
    frames = np.asarray(frames)
    return SB.default_reader().read(frames) if frames.shape[1:] == SB.FRAME_SHAPE else None


def statusbar_ok(frames: np.ndarray, values: np.ndarray) -> np.ndarray | None:
    """(N, 3) bool, each status-bar field read right by the shipped reader; None where it does not apply
    (frames not 160x120). values: (N, 3) or (N, K, 3) candidates (statusbar.frame_values)."""
    got = statusbar_reads(frames)
    return None if got is None else SB.reads_ok(got, values)


def _fraction(ok: np.ndarray | None) -> float | None:
    """Share of frames with all three fields right; None without a reading or without frames."""
    return None if ok is None or not len(ok) else float(ok.all(-1).mean())


def _fields(ok: np.ndarray | None) -> dict[str, float] | None:
    return None if ok is None or not len(ok) else {f: float(ok[:, k].mean()) for k, f in enumerate(SB.FIELDS)}


def evaluate_autoencoder(ae: Any, frames: np.ndarray, values: np.ndarray | None = None) -> dict[str, Any]:
    """decode(encode(frames)) against uint8 frames (N, H, W, 3): psnr, ssim, hud_psnr, sharpness and
    statusbar_acc (share of frames whose three status-bar numbers read right) with statusbar_fields.
    values: what the real frames' bars show, (N, 3) or (N, K, 3) candidates (statusbar.frame_values);
    None: what the reader reads off the real frames. statusbar_* are None unless the frames are 160x120."""
    frames = np.asarray(frames)
    rec = AE.decode(ae, AE.encode(ae, frames), frames.shape[1], frames.shape[2])
    ok = None
    if frames.shape[1:] == SB.FRAME_SHAPE:
        ok = statusbar_ok(rec, SB.default_reader().read(frames) if values is None else values)
    return {"psnr": M.psnr(rec, frames), "ssim": M.ssim(rec, frames), "hud_psnr": M.psnr(M.hud(rec), M.hud(frames)),
            "sharpness": M.sharpness(rec, frames), "statusbar_acc": _fraction(ok), "statusbar_fields": _fields(ok)}


def motion(action: np.ndarray, prev: np.ndarray, nxt: np.ndarray) -> str:
    """What one step of play did to the view: "still" (the view rows unchanged), "turn" (the action
    turns), "move" (it walks without turning), else "other" (firing, using, momentum)."""
    top = M.hud_top(prev.shape[0])
    if np.array_equal(prev[:top], nxt[:top]):
        return "still"
    act = A.Action.from_code(action)
    if act.turn != A.NO_TURN:
        return "turn"
    return "move" if any(b.startswith("MOVE") for b in act.pressed()) else "other"


def by_motion(kinds: list, gen: np.ndarray, prev: np.ndarray, real: np.ndarray,
              view: bool = False) -> dict[str, dict]:
    """Teacher-forced PSNR, copy-last's and the sharpness, per kind of step (motion(), or any sortable key
    per target, in sorted order; None leaves a target out): where the gain over copy-last comes from. The
    sharpness sits beside the gain because the gain alone misranks: copy-last is worst on the fastest
    turns, where the model draws least. view: all three on the view rows alone (the status bar's sharp
    glyphs, the same in every kind of step, dilute the whole frame's sharpness)."""
    if view:
        top = M.hud_top(real.shape[1])
        gen, prev, real = gen[:, :top], prev[:, :top], real[:, :top]
    out = {}
    for kind in sorted({k for k in kinds if k is not None}):
        m = np.array([k == kind for k in kinds])
        out[str(kind)] = {"n": int(m.sum()), "psnr": M.psnr(gen[m], real[m]),
                          "copy_last_psnr": M.psnr(prev[m], real[m]), "sharpness": M.sharpness(gen[m], real[m])}
    return out


def turn_speed(action: np.ndarray, prev: np.ndarray, nxt: np.ndarray) -> float | None:
    """How fast one step turns the view, in degrees per tic (0: it does not turn); None where the view rows
    did not change (motion()'s "still": no turn to split)."""
    return None if motion(action, prev, nxt) == "still" else abs(A.Action.from_code(action).turn_degrees)


def _by_kind(rows: dict[str, dict]) -> str:
    return ", ".join(f"{v['psnr']:.2f} / {v['copy_last_psnr']:.2f} / {v['sharpness']:.2f} (n={v['n']})"
                     for v in rows.values())


def _masked(metric: Any, gen: np.ndarray, real: np.ndarray, alive: np.ndarray) -> list[float | None]:
    """metric(gen[:, t], real[:, t]) per step t over the rollouts alive at t; None for a step none reaches."""
    return [metric(gen[alive[:, t], t], real[alive[:, t], t]) if alive[:, t].any() else None
            for t in range(alive.shape[1])]


def _per_step(x: np.ndarray, alive: np.ndarray) -> list[list]:
    """(rollouts, steps) values as JSON lists, null where the rollout has ended."""
    return [[v.item() if ok else None for v, ok in zip(xr, ar, strict=True)] for xr, ar in zip(x, alive, strict=True)]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    torch.set_num_threads(a.threads)
    out = Path(a.out)
    if a.per_episode < 1:
        print(f"evaluate: --per-episode must be at least 1, not {a.per_episode}", file=sys.stderr)
        return 2
    try:
        ckpt = Checkpoint(a.checkpoint)
        recs = [Recording(p) for p in find_recordings(Path(a.data) / "heldout")]
        recs = [r for r in recs if len(r)]
        for r in recs:
            check_compatible(r, ckpt.game)
        train = [Recording(p) for p in find_recordings(Path(a.data) / "train")]
    except (CheckpointError, RecordingError) as e:
        print(f"evaluate: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    n = ckpt.denoiser_cfg.context
    H, W = ckpt.game.height, ckpt.game.width
    # one core, fp32: the same numbers on every machine and run (play may use bf16 and a second core)
    deadband = None if a.deadband < 0 else a.deadband
    eng = NeuralEngine(ckpt, compile=a.compile, guidance=a.guidance or None, seed=a.seed, wait_compile=True,
                       cores=1, dtype="float32", steps=a.steps or None, teacher=a.teacher, deadband=deadband)
    eng1 = NeuralEngine(ckpt, compile=a.compile, guidance=1.0, seed=a.seed, wait_compile=True, cores=1,
                        dtype="float32", deadband=deadband)

    # mean-frame baseline: the average training frame
    pool = [r.frames[i] for r in train if len(r) for i in np.linspace(0, len(r) - 1, 200).astype(int)]
    mean_frame = np.mean(np.stack(pool).astype(np.float32), 0).round().astype(np.uint8)

    # -- teacher-forced ----------------------------------------------------------------------
    targets = []
    for r in recs:
        for s, e in r.episodes():
            targets += [(r, i) for i in range(s + 1, e)]
    pick = rng.choice(len(targets), min(a.samples, len(targets)), replace=False)
    real, prev, gen, gen1, real_vals = [], [], [], [], []
    for k in pick:
        r, i = targets[k]
        frames, acts = history(r, i, n)
        act = r.actions[i - 1]
        for e, sink in ((eng, gen), (eng1, gen1)):
            e.set_context(frames, acts)
            sink.append(e.step(A.Action.from_code(act)))
        real.append(np.asarray(r.frames[i]))
        prev.append(frames[-1])
        real_vals.append(SB.frame_values(r, [i])[0])
    real, prev, gen, gen1, real_vals = map(np.stack, (real, prev, gen, gen1, real_vals))
    steps = list(zip([targets[k][0].actions[targets[k][1] - 1] for k in pick], prev, real, strict=True))
    kinds = [motion(*step) for step in steps]
    speeds = [turn_speed(*step) for step in steps]
    ae_ev = evaluate_autoencoder(ckpt.ae, real, real_vals)
    sb = ckpt.game.hud  # no status bar to read without the HUD
    sb_real = statusbar_ok(real, real_vals) if sb else None
    sb_tf = statusbar_ok(gen, real_vals) if sb else None
    report: dict = {
        "checkpoint": str(a.checkpoint),
        "guidance": eng.sampler.cfg,
        "steps": len(eng.sampler.plan),
        "student": eng.student,  # 0: the teacher; N: the N-step distilled student
        "deadband": eng.sampler.deadband,
        "n_samples": len(real),
        "tf_psnr": M.psnr(gen, real),
        "tf_psnr_nocfg": M.psnr(gen1, real),
        "tf_ssim": M.ssim(gen, real),
        "tf_sharpness": M.sharpness(gen, real),
        "tf_close_wall": float(M.close_wall(gen).mean()), "real_close_wall": float(M.close_wall(real).mean()),
        "tf_by_motion": by_motion(kinds, gen, prev, real),
        # the steps whose view changed, by the turn's speed in degrees per tic, slowest first; the view rows
        "tf_by_turn": by_motion(speeds, gen, prev, real, view=True),
        "copy_last_psnr": M.psnr(prev, real),
        "copy_last_ssim": M.ssim(prev, real),
        "mean_frame_psnr": M.psnr(np.broadcast_to(mean_frame, real.shape), real),
        "ae_psnr": ae_ev["psnr"],
        "ae_ssim": ae_ev["ssim"],
        "ae_sharpness": ae_ev["sharpness"],
        "hud_psnr": M.psnr(M.hud(gen), M.hud(real)),
        "ae_hud_psnr": ae_ev["hud_psnr"],
        "copy_last_hud_psnr": M.psnr(M.hud(prev), M.hud(real)),
        "real_statusbar_acc": _fraction(sb_real),
        "ae_statusbar_acc": ae_ev["statusbar_acc"] if sb else None,
        "tf_statusbar_acc": _fraction(sb_tf),
        # per target, for paired comparisons of two evaluations (training.compare)
        "tf_mse": M.frame_mse(gen, real).tolist(),
        "tf_copy_last_mse": M.frame_mse(prev, real).tolist(),
    }

    # -- autoregressive ----------------------------------------------------------------------
    T = a.rollout_steps
    starts = [(r, i) for r in recs for s, e in r.episodes() for i in rollout_starts(s, e, n, T, a.per_episode)]
    starts = [starts[k] for k in rng.choice(len(starts), min(a.rollouts, len(starts)), replace=False)]
    ar_real = np.zeros((len(starts), T, H, W, 3), np.uint8)
    ar_gen, ar_copy = np.zeros_like(ar_real), np.zeros_like(ar_real)
    ar_vals = np.zeros((len(starts), T, 2, 3), np.int64)
    alive = np.zeros((len(starts), T), bool)  # rollout j still inside its start's episode at step t
    for j, (r, i) in enumerate(starts):
        e = next(e for s, e in r.episodes() if s <= i < e)
        T_j = min(T, e - i)
        alive[j, :T_j] = True
        ar_vals[j, :T_j] = SB.frame_values(r, np.arange(i, i + T_j))
        frames, acts = history(r, i, n)
        eng.set_context(frames, acts)
        for t in range(T_j):
            ar_gen[j, t] = eng.step(A.Action.from_code(r.actions[i + t - 1]))
            ar_real[j, t] = r.frames[i + t]
            ar_copy[j, t] = frames[-1]
    report["ar_psnr"] = _masked(M.psnr, ar_gen, ar_real, alive)
    report["ar_copy_last_psnr"] = _masked(M.psnr, ar_copy, ar_real, alive)
    mean_gen = np.broadcast_to(mean_frame, ar_real.shape)
    report["ar_mean_frame_psnr"] = _masked(M.psnr, mean_gen, ar_real, alive)
    report["ar_sharpness"] = _masked(M.sharpness, ar_gen, ar_real, alive)
    wall_gen, wall_real = (M.close_wall(x.reshape(-1, H, W, 3)).reshape(alive.shape) for x in (ar_gen, ar_real))
    report["ar_close_wall"] = float(wall_gen[alive].mean()) if alive.any() else None
    report["ar_real_close_wall"] = float(wall_real[alive].mean()) if alive.any() else None
    report["ar_alive"] = alive.sum(0).tolist()
    # read once: the per-field hits and each rollout's first miss come from the same reads
    ar_reads = statusbar_reads(ar_gen.reshape(-1, H, W, 3)) if sb else None
    sb_ar = None if ar_reads is None else SB.reads_ok(ar_reads, ar_vals.reshape(-1, 2, 3)).reshape(len(starts), T, 3)
    report["ar_statusbar_acc"] = None if sb_ar is None else _fraction(sb_ar[alive])
    # the baseline: the rollout's first context frame's bar held still (what a bar that never changes scores)
    sb_copy = statusbar_ok(ar_copy.reshape(-1, H, W, 3), ar_vals.reshape(-1, 2, 3)) if sb else None
    report["ar_copy_last_statusbar_acc"] = None if sb_copy is None else _fraction(
        sb_copy.reshape(len(starts), T, 3)[alive])
    report["ar_statusbar_acc_steps"] = [None if sb_ar is None else _fraction(sb_ar[alive[:, t], t]) for t in range(T)]
    report["statusbar_fields"] = {"real": _fields(sb_real), "ae": ae_ev["statusbar_fields"] if sb else None,
                                  "tf": _fields(sb_tf), "ar": None if sb_ar is None else _fields(sb_ar[alive])}
    report["n_rollouts"] = len(starts)
    # per rollout and step (null past its episode's end), for paired comparisons (training.compare)
    report["ar_mse"] = _per_step(M.frame_mse(ar_gen, ar_real), alive)
    report["ar_copy_last_mse"] = _per_step(M.frame_mse(ar_copy, ar_real), alive)
    report["ar_statusbar_ok"] = None if sb_ar is None else _per_step(sb_ar.all(-1), alive)
    report["ar_statusbar_misses"] = None if sb_ar is None else first_misses(
        ar_reads.reshape(len(starts), T, 3), ar_vals, sb_ar, alive)
    report.update(still_views(eng, ckpt.ae, real[: a.still], a.still_steps, out))
    report.update(free_runs(eng, a.free_steps, out))
    if sb:  # last: the rows above draw the engine's noise exactly as before this was measured
        report.update(event_targets(eng, recs, a.events, np.random.default_rng(a.seed + 1), out))
    write_text(out / "report.json", json.dumps(report, indent=2))
    _plots(out, report, prev, real, gen, ar_real, ar_gen, alive)

    main_run = (f"{eng.student}-step student" if eng.student else
                f"{len(eng.sampler.plan)} steps, CFG {eng.sampler.cfg:.1f}")
    rows = [(f"teacher-forced PSNR ({main_run})", report["tf_psnr"]),
            ("teacher-forced PSNR (the teacher, CFG 1.0)", report["tf_psnr_nocfg"]),
            ("teacher-forced SSIM", report["tf_ssim"]),
            ("copy-last-frame PSNR", report["copy_last_psnr"]),
            ("mean-frame PSNR", report["mean_frame_psnr"]),
            ("autoencoder ceiling PSNR", report["ae_psnr"]),
            ("status bar PSNR: model / autoencoder", f"{report['hud_psnr']:.2f} / {report['ae_hud_psnr']:.2f}"),
            ("sharpness: teacher-forced / autoencoder", f"{report['tf_sharpness']:.2f} / {report['ae_sharpness']:.2f}"),
            ("teacher-forced PSNR / copy-last / sharpness by step: " + ", ".join(report["tf_by_motion"]),
             _by_kind(report["tf_by_motion"])),
            ("view rows that changed, by the turn (degrees a tic): " + ", ".join(report["tf_by_turn"]),
             _by_kind(report["tf_by_turn"])),
            ("status bar read right: real / autoencoder / teacher-forced",
             " / ".join(_fmt(report[k]) for k in ("real_statusbar_acc", "ae_statusbar_acc", "tf_statusbar_acc"))),
            ("status bar read right: autoregressive, all steps: model / copy-last",
             f"{_fmt(report['ar_statusbar_acc'])} / {_fmt(report['ar_copy_last_statusbar_acc'])}"),
            ("close-wall share (metrics.close_wall): real / teacher-forced / rollouts / their real frames",
             f"{report['real_close_wall']:.3f} / {report['tf_close_wall']:.3f} / {_fmt(report['ar_close_wall'])} / "
             f"{_fmt(report['ar_real_close_wall'])}")]
    for t in (1, 8, 16, 32, 64):
        if t <= T and report["ar_alive"][t - 1]:
            rows.append((f"autoregressive step {t}: model / copy-last / sharpness / status bar",
                         f"{report['ar_psnr'][t - 1]:.2f} / {report['ar_copy_last_psnr'][t - 1]:.2f} / "
                         f"{report['ar_sharpness'][t - 1]:.2f} / {_fmt(report['ar_statusbar_acc_steps'][t - 1])}"))
    for t in (1, 16, 64):
        if t <= len(report["still_psnr"]):
            rows.append((f"still view, step {t}: PSNR / sharpness (autoencoder {report['still_ae_psnr']:.2f})",
                         f"{report['still_psnr'][t - 1]:.2f} / {report['still_sharpness'][t - 1]:.2f}"))
    if report["ar_statusbar_misses"] is not None:
        misses = report["ar_statusbar_misses"]
        kinds = [m["kind"] if m else "none" for m in misses]
        causes = [m.get("cause") for m in misses if m and m["kind"] == "missed"]
        rows.append(("rollouts by their status bar's first miss: " + " / ".join(MISS_KINDS + ("none",))
                     + " (missed: a shot / the world)",
                     " / ".join(str(kinds.count(k)) for k in MISS_KINDS + ("none",))
                     + f" ({causes.count('shot')} / {causes.count('world')})"))
    if report.get("n_events"):
        rows.append((f"status bar read right where its numbers change (n={report['n_events']}): model / copy-last",
                     f"{_fmt(report['event_statusbar_acc'])} / {_fmt(report['event_copy_last_statusbar_acc'])}"))
        if report.get("event_move") is not None:
            rows.append(("  its numbers moved from the last frame's to the real next (0 old, 1 new): mean / median",
                         f"{report['event_move']:.2f} / {report['event_move_median']:.2f}"))
    for name, run in report["free"].items():
        rows.append((f"free play {name}, steps {'/'.join(map(str, report['free_steps']))}: sharpness, colour cast",
                     " / ".join(f"{x:.2f}" for x in run["sharpness"]) + ", " +
                     " / ".join(f"{x:.0f}" for x in run["colour_cast"]) +
                     f", close wall {_fmt(run['close_wall'])}"))
    print(f"{'metric':<66} value  (n={report['n_samples']} held-out targets, {len(starts)} rollouts)")
    for k, v in rows:
        print(f"{k:<66} {v:.3f}" if isinstance(v, float) else f"{k:<66} {v}")
    return 0


def still_views(eng: NeuralEngine, ae: Any, views: np.ndarray, T: int, out: Path) -> dict[str, Any]:
    """Each view as the whole context, then T NOOP steps scored against the view itself (module doc)."""
    from PIL import Image

    if not len(views) or T < 1:
        return {"still_psnr": [], "still_sharpness": [], "still_ae_psnr": None, "n_still": 0}
    gen = np.zeros((len(views), T, *views.shape[1:]), np.uint8)
    for j, v in enumerate(views):
        eng.set_context(v[None], A.NOOP.code[None])
        for t in range(T):
            gen[j, t] = eng.step(A.NOOP)
    ref = np.broadcast_to(views[:, None], gen.shape)
    shown = [t for t in (1, 4, 16, 64) if t <= T]
    strip = np.concatenate([np.concatenate([views[j]] + [gen[j, t - 1] for t in shown], 1)
                            for j in range(len(views))], 0)
    with atomic_path(out / "still.png") as tmp:
        Image.fromarray(strip).save(tmp)  # rows: the view | its steps 1, 4, 16, 64 standing still
    return {"still_psnr": [M.psnr(gen[:, t], ref[:, t]) for t in range(T)],
            "still_sharpness": [M.sharpness(gen[:, t], ref[:, t]) for t in range(T)],
            "still_ae_psnr": evaluate_autoencoder(ae, views)["psnr"], "n_still": len(views)}


def event_targets(eng: NeuralEngine, recs: list[Recording], n: int, rng: np.random.Generator,
                  out: Path) -> dict[str, Any]:
    """Teacher-forced on n held-out targets where the status bar's numbers change (ammo spent, health lost
    or picked up: statusbar.bar_changes): the bar read right there, and copy-last's (a bar that never changes).
    OUT/events.png: the numbers' rows of the last context frame | real next | model next."""
    from PIL import Image

    targets = [(r, i) for r in recs for i in np.flatnonzero(SB.bar_changes(r.frames, r.steps["episode"]))]
    if n < 1 or not targets:
        return {"n_events": 0}
    ctx = eng.ckpt.denoiser_cfg.context
    gen, prev, real, vals = [], [], [], []
    for k in rng.choice(len(targets), min(n, len(targets)), replace=False):
        r, i = targets[k]
        frames, acts = history(r, int(i), ctx)
        eng.set_context(frames, acts)
        gen.append(eng.step(A.Action.from_code(r.actions[i - 1])))
        prev.append(frames[-1])
        real.append(np.asarray(r.frames[i]))
        vals.append(SB.frame_values(r, [i])[0])
    gen, prev, real, vals = map(np.stack, (gen, prev, real, vals))
    ok, ok_copy = statusbar_ok(gen, vals), statusbar_ok(prev, vals)
    moves = number_moves(eng.ckpt.ae, prev, real, gen)
    band = slice(SB.ROWS[0] - 4, SB.ROWS[1] + 4)  # the numbers' rows and a little around them
    strip = np.concatenate([np.concatenate([f[band] for f in x], 1)
                            for x in zip(prev[:8], real[:8], gen[:8], strict=True)], 0)
    with atomic_path(out / "events.png") as tmp:
        Image.fromarray(strip).save(tmp)
    return {"n_events": len(gen), "event_statusbar_acc": _fraction(ok), "event_statusbar_fields": _fields(ok),
            "event_copy_last_statusbar_acc": _fraction(ok_copy),
            "event_move": None if moves is None else float(np.mean(moves)),
            "event_move_median": None if moves is None else float(np.median(moves))}


def number_moves(ae: Any, prev: np.ndarray, real: np.ndarray, gen: np.ndarray) -> np.ndarray | None:
    """Per target, how far the generated frame moves the status bar's number pixels from the last frame to
    the real next one: <gen - ae(prev), ae(real) - ae(prev)> / |ae(real) - ae(prev)|^2 over
    statusbar.number_mask, both ends through the autoencoder so its blur is neither (0: the old numbers
    copied, 1: the new ones drawn). The reader's read is all-or-nothing, a digit drawn half-way reads as
    the old one or as nothing; this shows the learning before it reads. None where the mask does not apply."""
    m = SB.number_mask(*prev.shape[1:3])
    if m is None:
        return None
    h, w = prev.shape[1:3]
    rec = AE.decode(ae, AE.encode(ae, np.concatenate([prev, real])), h, w).astype(np.float32)
    a, b = rec[: len(prev)][:, m], rec[len(prev):][:, m]
    d_real = (b - a).reshape(len(a), -1)
    d_gen = (gen[:, m].astype(np.float32) - a).reshape(len(a), -1)
    return (d_gen * d_real).sum(1) / np.maximum((d_real * d_real).sum(1), 1e-6)


def free_runs(eng: NeuralEngine, steps: int, out: Path) -> dict[str, Any]:
    """Free play with the straight and sticky policies, seeds 0 and 1 (module doc)."""
    from PIL import Image

    if steps < 1:
        return {"free_steps": [], "free": {}}
    shown = sorted({max(1, steps * k // 4) for k in (1, 2, 3, 4)})
    runs, rows = {}, []
    every = range(10, steps + 1, 10)  # the close-wall share is counted on every 10th step
    for policy in ("straight", "sticky"):
        for seed in (0, 1):
            frames = RS.free_play(eng, policy, seed, steps, tuple(sorted({*shown, *every})))
            runs[f"{policy}/{seed}"] = {
                "sharpness": [M.sharpness(frames[t][None], frames[0][None]) for t in shown],
                "colour_cast": [RS.colour_cast(frames[t]) for t in shown],
                "start_colour_cast": RS.colour_cast(frames[0]),
                "close_wall": float(M.close_wall(np.stack([frames[t] for t in every])).mean()) if every else None}
            rows.append(np.concatenate([frames[t] for t in [0, *shown]], 1))
    with atomic_path(out / "free.png") as tmp:
        Image.fromarray(np.concatenate(rows, 0)).save(tmp)  # rows: straight 0, 1, sticky 0, 1
    return {"free_steps": shown, "free": runs}


def _fmt(v: float | None) -> str:
    return "n/a" if v is None else f"{v:.3f}"


def _plots(out: Path, rep: dict, prev, real, gen, ar_real, ar_gen, alive) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from PIL import Image

    def curve(k: str) -> np.ndarray:  # null (no rollout alive) -> a gap
        return np.array([np.nan if v is None else v for v in rep[k]], float)

    steps = np.arange(1, len(rep["ar_psnr"]) + 1)
    fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
    ax[0].plot(steps, curve("ar_psnr"), label="model")
    ax[0].plot(steps, curve("ar_copy_last_psnr"), label="copy last context frame")
    ax[0].plot(steps, curve("ar_mean_frame_psnr"), label="mean frame", ls=":")
    ax[0].axhline(rep["ae_psnr"], color="gray", ls="--", label="autoencoder ceiling")
    ax[0].set(xlabel="autoregressive step", ylabel="PSNR (dB)")
    ax[0].legend(fontsize=7)
    ax[1].plot(steps, curve("ar_sharpness"))
    ax[1].axhline(1.0, color="gray", ls="--")
    ax[1].set(xlabel="autoregressive step", ylabel="sharpness (generated / real)")
    fig.tight_layout()
    with atomic_path(out / "ar_psnr.png") as tmp:
        fig.savefig(tmp, dpi=90)
    plt.close(fig)
    k = min(6, len(real))
    tf = np.concatenate([np.concatenate([prev[i], real[i], gen[i]], 1) for i in range(k)], 0)
    with atomic_path(out / "grid.png") as tmp:
        Image.fromarray(tf).save(tmp)  # rows: last context frame | real next | model next
    if len(ar_real):
        j = int(alive.sum(1).argmax())  # the longest rollout
        idx = [t for t in (0, 3, 7, 15, 31, 63) if t < alive[j].sum()] or [0]
        strip = np.concatenate([np.concatenate([ar_real[j, t] for t in idx], 1),
                                np.concatenate([ar_gen[j, t] for t in idx], 1)], 0)
        with atomic_path(out / "rollout.png") as tmp:
            Image.fromarray(strip).save(tmp)  # top: real, bottom: model, steps 1..64
    shown = miss_strip(ar_real, ar_gen, alive, rep.get("ar_statusbar_misses") or [])
    if shown is not None:
        with atomic_path(out / "misses.png") as tmp:
            Image.fromarray(shown).save(tmp)


def miss_strip(ar_real: np.ndarray, ar_gen: np.ndarray, alive: np.ndarray, misses: list[dict[str, Any] | None],
               around: tuple[int, ...] = (-3, -2, -1, 0, 1, 8, 32)) -> np.ndarray | None:
    """The status bar around each rollout's first miss, a pair of rows per missing rollout: the real bar over
    the model's, at the miss's step plus `around` (clamped to the rollout's alive steps: whether a miss lasts
    shows in the last two); None if no rollout missed."""
    rows = []
    for j, m in enumerate(misses):
        if m is None:
            continue
        t, last = m["step"] - 1, max(int(alive[j].sum()) - 1, 0)
        ts = [min(max(t + d, 0), last) for d in around]
        rows.append(np.concatenate([np.concatenate([M.hud(x[j, u]) for u in ts], 1) for x in (ar_real, ar_gen)], 0))
    return np.concatenate(rows, 0) if rows else None


if __name__ == "__main__":
    sys.exit(main())
