"""Output files written whole or not at all: each is written beside its destination under a temporary
name, then renamed over it (a rename within a folder is atomic), so a kill mid-write leaves the previous
file, or none, never half of one."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yields a temporary path to write; on success it replaces `path`, on error it is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")  # same suffix: savefig picks the format
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: str | Path, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text)
