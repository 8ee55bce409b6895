"""neuraldoom: DOOM played through a diffusion model (GameNGen, Valevski et al. 2024)."""

__version__ = "0.1.0"
