"""What the training stages share (a few functions, not a Trainer class): the accelerator with its
precision, and the time-boxed schedule."""

from __future__ import annotations

import torch
from accelerate import Accelerator

PRECISIONS = ("auto", "fp32", "bf16")


def bf16_is_fast() -> bool:
    """A GPU, or a CPU with native bf16 (AVX512-BF16 / AMX): there autocast roughly halves the autoencoder's
    step time; on an AVX2-only CPU bf16 convolutions run several times slower than fp32."""
    if torch.cuda.is_available():
        return True
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def accelerator(precision: str = "auto") -> Accelerator:
    """The device is chosen automatically (a GPU when there is one); precision: auto (bf16 autocast where
    it is fast, else fp32), fp32 or bf16."""
    if precision not in PRECISIONS:
        raise ValueError(f"--precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    bf16 = precision == "bf16" or (precision == "auto" and bf16_is_fast())
    return Accelerator(cpu=not torch.cuda.is_available(), mixed_precision="bf16" if bf16 else "no")
