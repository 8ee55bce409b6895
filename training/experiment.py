"""One row of the recipe comparison: train a denoiser variant for a fixed wall-clock budget, evaluate it
on the held-out episodes, and append the row (with the exact command) to docs/EXPERIMENTS.md.

    python -m training.experiment --name delta --minutes 30 --data data/e1m1 \\
        --autoencoder runs/ae/autoencoder -- --target delta

Everything after `--` goes to `training.train_diffusion` unchanged. The run lives in OUT/NAME (rerunning
resumes it until the budget is spent, then only re-evaluates); the evaluation is `training.evaluate` with
fixed settings (seed, targets, rollouts and their length), so rows are comparable. Look at
OUT/NAME/eval/grid.png and rollout.png before believing a row.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from neuraldoom.config import parse_args
from training import evaluate, train_diffusion

STEPS = (8, 32, 64, 128)  # the autoregressive steps a row reports


@dataclass(frozen=True)
class Args:
    name: str  # the variant's name (its run folder and its row)
    data: str  # dataset folder with train/ and heldout/
    autoencoder: str = ""  # the autoencoder every variant shares (or give --init-from after --)
    minutes: float = 30.0  # the training budget, wall clock, one process
    out: str = "runs/exp"
    table: str = "docs/EXPERIMENTS.md"
    samples: int = 64  # teacher-forced held-out targets
    rollouts: int = 8
    rollout_steps: int = 128
    guidance: float = 0.0  # CFG weight to evaluate with (0 = the checkpoint's)
    threads: int = 1


def row(name: str, minutes: float, report: dict, train_log: list[dict], command: str) -> str:
    """One markdown table row: TF PSNR (gain over copy-last), AR PSNR (gain) and sharpness per step."""
    seen = train_log[-1]["samples"] if train_log else 0
    tf = f"{report['tf_psnr']:.2f} ({report['tf_psnr'] - report['copy_last_psnr']:+.2f}) / {report['tf_sharpness']:.2f}"
    ar = []
    for t in STEPS:
        if t <= len(report["ar_psnr"]):
            g = report["ar_psnr"][t - 1] - report["ar_copy_last_psnr"][t - 1]
            ar.append(f"{report['ar_psnr'][t - 1]:.2f} ({g:+.2f}) / {report['ar_sharpness'][t - 1]:.2f}")
        else:
            ar.append("—")
    sb = [report.get(k) for k in ("tf_statusbar_acc", "ar_statusbar_acc")]
    sb_s = " / ".join("—" if v is None else f"{100 * v:.0f}%" for v in sb)
    name = f"{name}, CFG {report['guidance']:g}" if "guidance" in report else name
    return f"| {name} | {minutes:g} min | {seen:,} | {tf} | " + " | ".join(ar) + f" | {sb_s} | `{command}` |"


HEADER = ("| variant | budget | samples | TF PSNR (vs copy-last) / sharp | "
          + " | ".join(f"AR {t} (vs copy-last) / sharp" for t in STEPS)
          + " | status bar TF / AR | command |\n|" + "---|" * (6 + len(STEPS)) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    a = parse_args(Args, own, __doc__)
    run = Path(a.out) / a.name
    train_argv = ["--data", a.data, "--out", str(run), "--minutes", str(a.minutes), "--threads", str(a.threads)]
    if a.autoencoder:
        train_argv += ["--autoencoder", a.autoencoder]
    rc = train_diffusion.main(train_argv + extra)
    if rc:
        return rc
    ev = run / ("eval" if not a.guidance else f"eval-cfg{a.guidance:g}")
    rc = evaluate.main(["--checkpoint", str(run / "checkpoint"), "--data", a.data, "--out", str(ev),
                        "--samples", str(a.samples), "--rollouts", str(a.rollouts),
                        "--rollout-steps", str(a.rollout_steps), "--threads", str(a.threads),
                        "--guidance", str(a.guidance)])
    if rc:
        return rc
    report = json.loads((ev / "report.json").read_text())
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if x.strip()] \
        if (run / "log.jsonl").exists() else []
    command = "python -m training.experiment " + shlex.join(own + (["--", *extra] if extra else []))
    table = Path(a.table)
    table.parent.mkdir(parents=True, exist_ok=True)
    text = table.read_text() if table.exists() else "# Experiments\n"
    if "| variant | budget |" not in text:
        text += "\n## Denoiser recipes\n\n" + HEADER
    table.write_text(text.rstrip("\n") + "\n" + row(a.name, a.minutes, report, log, command) + "\n")
    print(f"experiment: row for {a.name} appended to {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
