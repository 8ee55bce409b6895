"""The one configuration system: frozen dataclasses, saved as JSON inside recordings and checkpoints.

Command-line flags map onto these fields; nothing else holds settings.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


TICS_PER_SECOND = 35  # DOOM's game clock; one model step is GameConfig.frame_skip tics
EPISODE_TICS = 60 * TICS_PER_SECOND  # a recorded episode's timeout: one minute (collect, the agent)
DEFAULT_CHECKPOINT = "checkpoints/e1m1"  # relative to the repository root, so it resolves from any cwd
REPO_ROOT = Path(__file__).resolve().parent.parent
WINDOW_SCALE = 4  # window = frame size x scale, nearest neighbour
MOUSE_SENSITIVITY = 0.25  # degrees of turn per pixel of mouse x-motion

# Recorded with every step; the agent's reward and the status-bar reader read them. Defined here, not in
# game.py, so that recordings, rewards and metrics never import ViZDoom.
GAME_VARIABLES: tuple[str, ...] = (
    "HEALTH",
    "ARMOR",
    "SELECTED_WEAPON",
    "SELECTED_WEAPON_AMMO",
    "AMMO2",
    "AMMO3",
    "KILLCOUNT",
    "HITCOUNT",
    "HITS_TAKEN",
    "DAMAGECOUNT",
    "ITEMCOUNT",
    "SECRETCOUNT",
    "DEAD",
    "POSITION_X",
    "POSITION_Y",
    "ANGLE",
)

@dataclass(frozen=True)
class GameConfig:
    """What the real game runs: which WAD/scenario and map, at what size and speed."""

    wad: str = "freedoom1.wad"  # a WAD in the vizdoom package root, or a path
    scenario: str = ""  # a shipped scenario name ("basic", "defend_the_center"…) or a .wad/.cfg path
    map: str = "E1M1"
    height: int = 120
    width: int = 160  # 160x120 is ViZDoom's native small mode; 320x240 etc. for GPU users
    frame_skip: int = 2  # game tics per model step: 35/2 = 17.5 steps per game-second
    hud: bool = True
    skill: int = 3
    episode_timeout: int = 0  # in tics; 0 = none
    automap: bool = False  # also render the automap buffer (the agent's second image)


@dataclass(frozen=True)
class AutoencoderConfig:
    """diffusers AutoencoderTiny between pixel (un)shuffles: the encoder reads 4x4-folded pixels (4x), the
    decoder upsamples once and unfolds 2x2 (4x). 8 channels on a 32x40 latent: the 8x layout (16 channels on
    16x20) had to invent every 8x8 cell's texture and blurred it (docs/EXPERIMENTS.md, the autoencoder)."""

    latent_channels: int = 8
    encoder_fold: int = 4
    decoder_fold: int = 2
    encoder_channels: int = 64
    decoder_channels: int = 32  # decode is the per-frame wall on CPU (docs/DESIGN.md §4): keep it slim
    encoder_blocks: tuple[int, ...] = (2,)  # residual blocks per level; downsampling = fold x 2^(levels - 1)
    decoder_blocks: tuple[int, ...] = (2, 1)


@dataclass(frozen=True)
class DenoiserConfig:
    context: int = 64  # N past frames (and N+1 actions) in the engine's ring
    reads: int = 8  # how many of the newest ring frames conv_in reads (0 = all N); the actions stay N+1
    target: str = "delta"  # "frame": diffuse the next latent; "delta": its change from the last seen frame
    delta_scale: float = 1.0  # std of latent changes, measured on the data ("delta" target only)
    action_embed: bool = False  # the current action also through the time embedding (a bias in every ResNet
    # block, as DIAMOND conditions on actions), besides cross-attention, so the model cannot ignore it
    turn_warp: tuple[float, ...] = ()  # degrees the view turns in one step, per turn bucket (empty = off): the
    # last frame, turned by the current action as a pinhole camera turns, is the reference of the change and
    # what conv_in reads, so the model corrects a turned view instead of redrawing it (denoiser.turn_grids)
    warp_rows: int = 0  # latent rows of the 3D view (the status bar and padding below are not turned)
    fov: float = 90.0  # the game's horizontal field of view, degrees (ViZDoom's default)
    warp_mode: str = "bicubic"  # how the turn resamples the latent: "bicubic" (the least blur of the smooth
    # kernels) or "nearest" (whole cells copied: no blur, so no learned sharpening for free play to feed back)
    warp_fill: str = "border"  # what the turned frame holds where the turn brings in view the last frame never
    # had: "border" (its edge repeated, a smear up to a quarter of the view wide at 16° a step) or "last"
    # (the unturned last frame there, as a model without the warp sees it)
    flow: bool = False  # a learned motion (neuraldoom/flow.py, its weights in the checkpoint's flow/) moves the
    # turned view further by the depth-dependent shift of walking, strafing and momentum
    flow_snap: float = 0.25  # the flow's offsets under this (latent cells) are zero: a still view stays exactly
    # still instead of being resampled by tiny offsets at every step (it dissolved into noise within 64 steps)
    block_out_channels: tuple[int, ...] = (32, 64, 128)
    layers_per_block: int = 1
    attention_heads: int = 4
    only_cross_attention: bool = False  # drop self-attention (not the mid block's: diffusers has no switch for it)
    cross_only_levels: tuple[int, ...] = ()  # drop it only on these UNet levels (0: the full-size one), down and up
    # blocks alike
    cross_attention_dim: int = 256  # width of the action tokens
    noise_buckets: int = 10  # GameNGen §3.2.1: discretized context-noise level
    max_noise_level: float = 0.7
    num_train_timesteps: int = 1000
    rows: tuple[int, ...] = ()  # (top, first, bottom): a status-bar denoiser, trained on the latent rows [top, bottom)
    # alone, whose rows [first, bottom) play pastes over the main denoiser's frame (the ammo count is ~18 of the
    # frame's 1,280 cells: a model of the bar's rows alone learns it without costing the view); () = the whole frame


@dataclass(frozen=True)
class SamplerConfig:
    steps: int = 4  # GameNGen §3.3: 4 DDIM steps lose nothing against 20+
    skip: int = 0  # the plan's first (loudest) steps not run, the rest started from noise at the first level run:
    # with 4 trailing steps the level after t = 999 keeps 6% of the signal, so the pass at 999 moves the sample
    # by little (skip 1: 3 passes a frame, measured level with 4 in docs/EXPERIMENTS.md)
    cfg: float = 1.5  # guidance on the past frames only, not the actions
    deadband: float = 0.0  # a delta model's predicted change is dropped in the latent cells where it is under
    # this (RMS over channels, in units of one step's change std): there it is sampling noise, and in play it
    # accumulates step after step (status-bar digits and still views drift within seconds); 0 = off
    bar_deadband: float = -1.0  # the status-bar denoiser's own (DenoiserConfig.rows); below 0: the frame's. Its
    # fields sit still for hundreds of frames, then change a whole glyph at once; measured: 0.5 kept random play's
    # glyphs better and cut the agent's changes short, 0.8 froze every change half-way; the bar trained with
    # --event-after 2 reads as well at 0.5 and only there keeps 1,000 steps of free play (docs/EXPERIMENTS.md)
    mean_lo: tuple[float, ...] = ()  # per latent channel: the range of a training frame's mean (sampler.FrameBounds,
    mean_hi: tuple[float, ...] = ()  # set by training.export --bounds-from); every generated frame is held inside
    std_hi: tuple[float, ...] = ()  # it and under the largest spread; () = not held


def to_dict(cfg: Any) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def from_dict(cls: type[T], data: dict[str, Any]) -> T:
    """Build a dataclass from a dict, ignoring unknown keys and restoring tuples from JSON lists."""
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in data:
            v = data[f.name]
            kwargs[f.name] = tuple(v) if isinstance(v, list) else v
    return cls(**kwargs)


def dumps(cfg: Any) -> str:
    return json.dumps(to_dict(cfg), indent=2, sort_keys=True)


__all__ = [
    "DEFAULT_CHECKPOINT",
    "EPISODE_TICS",
    "GAME_VARIABLES",
    "MOUSE_SENSITIVITY",
    "REPO_ROOT",
    "TICS_PER_SECOND",
    "WINDOW_SCALE",
    "GameConfig",
    "AutoencoderConfig",
    "DenoiserConfig",
    "SamplerConfig",
    "to_dict",
    "from_dict",
    "dumps",
    "parse_args",
    "resolve_checkpoint",
]


def game_mismatch(got: GameConfig, trained: GameConfig) -> str | None:
    """How a game (a recording's, the real one's) differs from the game a checkpoint learned, in what the
    picture depends on, as the end of a sentence; None when it does not. The one such check."""
    if (got.width, got.height) != (trained.width, trained.height):
        return f"is {got.width}x{got.height} but the checkpoint was trained on {trained.width}x{trained.height}"
    for f in ("frame_skip", "map", "scenario", "hud"):
        if getattr(got, f) != getattr(trained, f):
            return f"has {f}={getattr(got, f)!r} but the checkpoint was trained on {f}={getattr(trained, f)!r}"
    if Path(got.wad).name.lower() != Path(trained.wad).name.lower():
        return f"is from {got.wad!r} but the checkpoint was trained on {trained.wad!r}"
    return None


def resolve_checkpoint(path: str | None) -> Path:
    """A checkpoint folder: the default one in the repository, or PATH (a relative PATH that is not here
    but is in the repository, e.g. `--checkpoint checkpoints/x` from elsewhere, resolves there)."""
    if path is None:
        return REPO_ROOT / DEFAULT_CHECKPOINT
    p = Path(path).expanduser()
    if not p.is_absolute() and not p.exists() and (REPO_ROOT / p).exists():
        return REPO_ROOT / p
    return p


def parse_args(cls: type[T], argv: list[str] | None, doc: str | None = None) -> T:
    """Command-line flags for every field of a frozen dataclass (--field-name); bools are --x/--no-x
    switches, tuples take several values; fields without a default are required; a field with
    metadata {"positional": True} is a positional argument (a tuple one takes one or more)."""
    import argparse

    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        name = "--" + f.name.replace("_", "-")
        typ = str(f.type)
        required = f.default is dataclasses.MISSING
        default = None if required else f.default
        if typ == "bool":  # --flag / --no-flag: a default of True can be switched off
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=default)
        elif f.metadata.get("positional"):
            p.add_argument(f.name, nargs="+" if typ.startswith("tuple") else None)
        elif typ.startswith("tuple"):
            inner = float if "float" in typ else int if "int" in typ else str
            p.add_argument(name, type=inner, nargs="+", default=default, required=required)
        else:
            p.add_argument(name, type={"int": int, "float": float}.get(typ, str), default=default, required=required)
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in vars(p.parse_args(argv)).items()}
    return cls(**kwargs)
