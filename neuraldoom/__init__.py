"""neuraldoom: DOOM played through a diffusion model (GameNGen, Valevski et al. 2024)."""

import os

# OpenMP's default busy-waiting made 2 torch threads run 2-10x *slower* than one whenever the other core
# was busy (docs/DESIGN.md §4); passive waiting removes that cliff. Must be set before torch loads OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
