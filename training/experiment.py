"""One row of the recipe comparison: train a denoiser variant for a fixed wall-clock budget, evaluate it
on the held-out episodes, and append the row (with the exact command) to docs/EXPERIMENTS.md.

    python -m training.experiment --name delta --minutes 30 --data data/e1m1 \\
        --autoencoder runs/ae/autoencoder -- --target delta

Everything after `--` goes to `training.train_diffusion` unchanged. The run lives in OUT/NAME (rerunning
resumes it until the budget is spent, then only re-evaluates); the evaluation is `training.evaluate` with
fixed settings (seed, targets, rollouts and their length), so rows are comparable; the row lands in the
file's last table when it ends the file and has the row's columns, else under a new header. Look at
OUT/NAME/eval/grid.png and rollout.png before believing a row.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from neuraldoom.config import parse_args
from neuraldoom.files import write_text
from training import evaluate, train_diffusion
from training.compare import STEPS


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
    free_steps: int = 0  # free play of this many steps from the checkpoint's start (training.evaluate): the row
    # then carries its gradient energy range and largest colour cast, what 128-step rollouts cannot show
    still: int = evaluate.Args.still  # still views (0: none): the row does not show them, and on a 2-core CPU
    # their 64 steps each cost most of a small run's evaluation
    threads: int = 1


def free_cell(report: dict) -> str:
    """Free play over all its runs: the range of gradient energy against the start frame, the largest
    colour cast ("—" without free play)."""
    runs = (report.get("free") or {}).values()
    if not runs:
        return "—"
    sharp = [x for r in runs for x in r["sharpness"]]
    cast = max(x for r in runs for x in r["colour_cast"])
    return f"{min(sharp):.2f}–{max(sharp):.2f} / {cast:.0f}"


def row(name: str, minutes: float, report: dict, train_log: list[dict], command: str) -> str:
    """One markdown table row: TF PSNR (gain over copy-last), AR PSNR (gain) and sharpness per step, the
    status bar, and with free play its cell."""
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
    free = f" {free_cell(report)} |" if report.get("free_steps") else ""
    return f"| {name} | {minutes:g} min | {seen:,} | {tf} | " + " | ".join(ar) + f" | {sb_s} |{free} `{command}` |"


def header(free_steps: int = 0) -> str:
    """The table's header; with free play, its column (gradient energy range / largest colour cast)."""
    free = f" free play {free_steps}: energy / cast |" if free_steps else ""
    return ("| variant | budget | samples | TF PSNR (vs copy-last) / sharp | "
            + " | ".join(f"AR {t} (vs copy-last) / sharp" for t in STEPS)
            + f" | status bar TF / AR |{free} command |\n|" + "---|" * (6 + len(STEPS) + bool(free_steps)) + "\n")


def append_row(text: str, head: str, line: str) -> str:
    """The row under the file's last table when that table ends the file and has this header, else under a
    new copy of the header: a row always lands in a table with its columns."""
    lines = text.rstrip("\n").splitlines()
    tail = len(lines)
    while tail and lines[tail - 1].startswith("|"):
        tail -= 1
    table = lines[tail:]
    if len(table) < 2 or "\n".join(table[:2]) + "\n" != head:
        lines += ["", *head.rstrip("\n").splitlines()]
    return "\n".join(lines + [line]) + "\n"


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
                        "--guidance", str(a.guidance), "--free-steps", str(a.free_steps), "--still", str(a.still)])
    if rc:
        return rc
    report = json.loads((ev / "report.json").read_text())
    log = [json.loads(x) for x in (run / "log.jsonl").read_text().splitlines() if x.strip()] \
        if (run / "log.jsonl").exists() else []
    command = "python -m training.experiment " + shlex.join(own + (["--", *extra] if extra else []))
    table = Path(a.table)
    table.parent.mkdir(parents=True, exist_ok=True)
    text = table.read_text() if table.exists() else "# Experiments\n\n## Denoiser recipes\n"
    write_text(table, append_row(text, header(a.free_steps), row(a.name, a.minutes, report, log, command)))
    print(f"experiment: row for {a.name} appended to {table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
