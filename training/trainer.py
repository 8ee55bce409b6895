"""What the training stages share (a few functions, not a Trainer class): the accelerator with its
precision, and the check that a resumed run is the same model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator

from neuraldoom.checkpoint import CheckpointError
from neuraldoom.engine import bf16_supported

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
