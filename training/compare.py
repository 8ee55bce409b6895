"""Is checkpoint B better than A on held-out play, or is the difference the evaluation's own noise?

    python -m training.compare runs/eval-shipped runs/eval-new

A and B are `training.evaluate` folders (or their report.json) evaluated with the same data, seed and
settings, hence on the same teacher-forced targets and the same rollouts: each difference is paired, and
its 95% interval comes from a bootstrap that resamples the targets (teacher-forced) or the rollouts
(autoregressive) together for both. Rows: teacher-forced PSNR; autoregressive PSNR at steps 8 / 32 / 64 /
128 and over every step; the least gain over copy-last across the steps; the status bar read right in the
rollouts. An interval that contains 0 is a difference this evaluation cannot see: 64 targets and 8 rollouts
are few, and the rollouts' rows are the noisiest. The intervals hold the weights fixed: two trainings of
one recipe that differ only in their seed land further apart than they allow (docs/EXPERIMENTS.md measures
that spread), so a recipe comparison needs a difference beyond both.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from neuraldoom.config import parse_args
from neuraldoom.metrics import psnr_from_mse

STEPS = (8, 32, 64, 128)  # the autoregressive steps a comparison, and a recipe row (training.experiment), report


@dataclass(frozen=True)
class Args:
    a: str = field(metadata={"positional": True})  # the baseline's evaluation folder or report.json
    b: str = field(metadata={"positional": True})  # the candidate's
    resamples: int = 2000
    seed: int = 0


class CompareError(ValueError):
    """Reports that cannot be compared pair by pair (one line for the user)."""


def load(path: str | Path) -> dict:
    p = Path(path)
    p = p / "report.json" if p.is_dir() else p
    if not p.exists():
        raise CompareError(f"{p}: no such report (run training.evaluate first)")
    rep = json.loads(p.read_text())
    if "tf_mse" not in rep or "ar_mse" not in rep:
        raise CompareError(f"{p} holds no per-frame errors: re-evaluate it with this version of training.evaluate")
    return rep


def _grid(rows: list[list]) -> np.ndarray:
    """(rollouts, steps) floats, NaN where the rollout had ended (JSON null)."""
    return np.array([[np.nan if v is None else float(v) for v in r] for r in rows], np.float64)


def _set_psnr(mse: np.ndarray) -> float:
    """Set PSNR over the finite entries (NaN when there are none)."""
    m = mse[np.isfinite(mse)]
    return psnr_from_mse(float(m.mean())) if m.size else float("nan")


def _steps_psnr(mse: np.ndarray) -> np.ndarray:
    """Per-step set PSNR of (rollouts, steps) errors."""
    return np.array([_set_psnr(mse[:, t]) for t in range(mse.shape[1])])


def paired(stat: Callable[[np.ndarray], float], n: int, resamples: int, rng: np.random.Generator,
           ) -> tuple[float, float, float]:
    """stat(indices) on all n units, and the 2.5 / 97.5 percentiles of it over `resamples` bootstrap draws
    of the units (ignoring draws where it is undefined)."""
    full = stat(np.arange(n))
    draws = np.array([stat(rng.integers(0, n, n)) for _ in range(resamples)])
    draws = draws[np.isfinite(draws)]
    lo, hi = np.percentile(draws, [2.5, 97.5]) if draws.size else (np.nan, np.nan)
    return full, float(lo), float(hi)


def compare(a: dict, b: dict, resamples: int = 2000, seed: int = 0) -> list[tuple[str, float, float, float, float,
                                                                                   float]]:
    """Rows (name, A, B, B − A, low, high) of the paired comparison; CompareError when the reports were not
    evaluated on the same targets and rollouts."""
    tf_a, tf_b = np.array(a["tf_mse"]), np.array(b["tf_mse"])
    cl_a, cl_b = np.array(a["tf_copy_last_mse"]), np.array(b["tf_copy_last_mse"])
    ar_a, ar_b = _grid(a["ar_mse"]), _grid(b["ar_mse"])
    ac_a, ac_b = _grid(a["ar_copy_last_mse"]), _grid(b["ar_copy_last_mse"])
    if cl_a.shape != cl_b.shape or not np.allclose(cl_a, cl_b) or ac_a.shape != ac_b.shape \
            or not np.allclose(ac_a, ac_b, equal_nan=True):
        raise CompareError("the two reports were not evaluated on the same targets and rollouts (other data, seed, "
                           "--samples, --rollouts or --rollout-steps): no paired comparison")
    rng = np.random.default_rng(seed)
    rows = []

    def add(name: str, value: Callable[[np.ndarray, np.ndarray], float], src_a: np.ndarray, src_b: np.ndarray,
            ) -> None:
        """value(errors or reads, indices of the resampled units) for A and B; the row of its difference."""
        n = len(src_a)
        d, lo, hi = paired(lambda i: value(src_b, i) - value(src_a, i), n, resamples, rng)
        rows.append((name, value(src_a, np.arange(n)), value(src_b, np.arange(n)), d, lo, hi))

    add("teacher-forced PSNR", lambda m, i: _set_psnr(m[i]), tf_a, tf_b)
    T = ar_a.shape[1]
    for t in STEPS:
        if t <= T:
            add(f"autoregressive PSNR, step {t}", lambda m, i, t=t: _set_psnr(m[i, t - 1]), ar_a, ar_b)
    add(f"autoregressive PSNR, steps 1-{T}", lambda m, i: _set_psnr(m[i]), ar_a, ar_b)
    add("least autoregressive gain over copy-last",
        lambda m, i: float(np.nanmin(_steps_psnr(m[i]) - _steps_psnr(ac_a[i]))), ar_a, ar_b)
    if a.get("ar_statusbar_ok") is not None and b.get("ar_statusbar_ok") is not None:
        add("status bar read right, autoregressive (%)", lambda m, i: 100 * float(np.nanmean(m[i])),
            _grid(a["ar_statusbar_ok"]), _grid(b["ar_statusbar_ok"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    a = parse_args(Args, argv, __doc__)
    try:
        rows = compare(load(a.a), load(a.b), a.resamples, a.seed)
    except (CompareError, json.JSONDecodeError, KeyError) as e:
        print(f"compare: {e}", file=sys.stderr)
        return 2
    w = max(len(r[0]) for r in rows)
    print(f"{'':{w}}  {'A':>7}  {'B':>7}  {'B - A':>7}  95% interval")
    for name, va, vb, d, lo, hi in rows:
        seen = "  (B better)" if lo > 0 else "  (A better)" if hi < 0 else ""
        print(f"{name:{w}}  {va:7.2f}  {vb:7.2f}  {d:+7.2f}  [{lo:+.2f}, {hi:+.2f}]{seen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
