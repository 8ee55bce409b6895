"""Checkpoints without pickle: model folders via diffusers save_pretrained (config.json + safetensors)
and training state (optimizer, step, RNG) as safetensors with JSON metadata, all written atomically."""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


class CheckpointError(ValueError):
    """A checkpoint that is missing, truncated or does not match what is asked of it."""


def save_state(path: str | Path, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Atomically write tensors + a JSON-able dict to one safetensors file."""
    path = Path(path)
    tmp = path.with_suffix(".tmp")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp),
              metadata={"meta": json.dumps(meta)})
    os.replace(tmp, path)


def load_state(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    path = Path(path)
    try:
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            meta = json.loads((f.metadata() or {}).get("meta", "{}"))
        return load_file(str(path)), meta
    except FileNotFoundError:
        raise CheckpointError(f"missing file {path}") from None
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"corrupt or truncated file {path}: {e}") from None


def optimizer_tensors(opt: torch.optim.Optimizer, prefix: str = "opt") -> tuple[dict[str, torch.Tensor],
                                                                                 dict[str, Any]]:
    """Flatten an optimizer state_dict into tensors (keys PREFIX.idx.name) + JSON (param_groups)."""
    sd = opt.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"{prefix}.{idx}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return tensors, {"param_groups": sd["param_groups"]}


def load_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                   prefix: str = "opt") -> None:
    """The inverse of optimizer_tensors; a second optimizer's param_groups live in meta[PREFIX_param_groups]."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for k, v in tensors.items():
        if k.startswith(prefix + "."):
            _, idx, name = k.split(".", 2)
            state.setdefault(int(idx), {})[name] = v
    groups = meta["param_groups"] if prefix == "opt" else meta[f"{prefix}_param_groups"]
    opt.load_state_dict({"state": state, "param_groups": groups})


def _swap_in(tmp: Path, path: Path) -> None:
    """Replace folder `path` by the finished folder `tmp` (the old one is moved aside, then removed)."""
    old = path.with_name(path.name + ".old")
    if path.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def save_model_dir(model: Any, path: str | Path) -> None:
    """save_pretrained into a temp folder, then swap it in, so a kill never leaves half a model."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    _swap_in(tmp, path)


def load_model_dir(cls: Any, path: str | Path) -> Any:
    """cls.from_pretrained on a local folder, with one clear line for a missing or broken file."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"missing {path / 'config.json'}")
    if not (path / "diffusion_pytorch_model.safetensors").is_file():
        raise CheckpointError(f"missing {path / 'diffusion_pytorch_model.safetensors'}")
    from diffusers.utils import logging as dlog

    level = dlog.get_verbosity()
    dlog.set_verbosity_error()  # AutoencoderTiny warns about its own saved "block_out_channels" key
    try:
        return cls.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # diffusers raises many types (OSError, EnvironmentError, SafetensorError…)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot load {path}: {first[:300]}") from None
    finally:
        dlog.set_verbosity(level)


# -- the playable checkpoint folder --------------------------------------------------------------
# config.json          neuraldoom's own: game, denoiser and sampler configs, action set, training notes
# autoencoder/         diffusers AutoencoderTiny (config.json + safetensors)
# unet/                diffusers UNet2DConditionModel (EMA weights; float32, or float16 when exported --half)
# action_encoder/      the action-token embedding (diffusers ModelMixin; the same precision)
# flow/                optional (denoiser config "flow"): the learned motion of the view (neuraldoom/flow.py),
#                      float32; the students move by it too
# context.safetensors  the starting context: N real frames (uint8) + the N actions that led to them
# students/N/          optional: a distilled N-step sampler's denoiser (unet/ + action_encoder/, float16 on
#                      disk), guidance folded in; config.json "students" says how each was made
#                      (training/distill.py)
# bar/                 optional: a status-bar denoiser (unet/ + action_encoder/, float16 on disk) whose rows play
#                      pastes over every frame; config.json "bar" holds its denoiser config and how it was made
CHECKPOINT_FORMAT = 1
SECTIONS = ("game", "denoiser", "sampler")


def weights_digest(module: Any, salt: str = "") -> str:
    """Identifies a module's weights (a student records its base teacher's, so that it is never shipped
    beside weights it was not distilled from; the latent cache records its encoder's)."""
    import hashlib

    h = hashlib.sha256(salt.encode())
    for k, v in sorted(module.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _save_denoiser(denoiser: Any, folder: Path, half: bool, flow: bool = True) -> None:
    for name in ("unet", "action_encoder"):
        part = getattr(denoiser, name)
        (copy.deepcopy(part).half() if half else part).save_pretrained(str(folder / name), safe_serialization=True)
    if flow and getattr(denoiser, "flow", None) is not None:  # float32 always: small, and its offsets are in cells
        denoiser.flow.save_pretrained(str(folder / "flow"), safe_serialization=True)


def save_checkpoint(path: str | Path, ae: Any, denoiser: Any, game: Any, denoiser_cfg: Any, sampler_cfg: Any,
                    context_frames: Any, context_actions: Any, notes: dict[str, Any] | None = None,
                    students: dict[int, tuple[Any, dict[str, Any]]] | None = None, half: bool = False,
                    bar: tuple[Any, Any, dict[str, Any]] | None = None) -> None:
    """Write a complete, playable checkpoint folder atomically (built aside, then swapped in).
    students: {steps: (denoiser, how it was made)} of distilled samplers to carry. half: the teacher's
    weights in float16 on disk too (loaded back as float32, like the students'). bar: (denoiser, its
    DenoiserConfig, how it was made) of a status-bar denoiser to carry (float16 on disk)."""
    from . import actions as A
    from .config import to_dict

    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    ae.save_pretrained(str(tmp / "autoencoder"), safe_serialization=True)
    _save_denoiser(denoiser, tmp, half)
    for n, (model, _) in (students or {}).items():  # float16 on disk: half the bytes (loaded back as float32)
        _save_denoiser(model, tmp / "students" / str(n), True, flow=False)  # they move by the teacher's flow/
    if bar is not None:
        _save_denoiser(bar[0], tmp / "bar", True, flow=False)
    save_file({"frames": torch.tensor(np.asarray(context_frames)),
               "actions": torch.as_tensor(context_actions, dtype=torch.int64).contiguous()},
              str(tmp / "context.safetensors"))
    cfg = {
        "format": CHECKPOINT_FORMAT,
        "game": to_dict(game),
        "denoiser": to_dict(denoiser_cfg),
        "sampler": to_dict(sampler_cfg),
        "buttons": list(A.BUTTONS),
        "turn_buckets": list(A.TURN_BUCKETS),
        "notes": notes or {},
        "students": {str(n): info for n, (_, info) in sorted((students or {}).items())},
    }
    if bar is not None:
        cfg["bar"] = {"denoiser": to_dict(bar[1]), "notes": bar[2]}
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    _swap_in(tmp, path)


class Checkpoint:
    """A loaded checkpoint: models (eval mode, float32, CPU) + configs + starting context."""

    def __init__(self, path: str | Path) -> None:
        from diffusers import AutoencoderTiny, UNet2DConditionModel

        from . import actions as A
        from . import autoencoder as AE
        from .config import DenoiserConfig, GameConfig, SamplerConfig, from_dict
        from .denoiser import ActionEncoder, Denoiser, bar_rows, frames_read, input_channels
        from .flow import FlowNet

        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"no checkpoint folder at {self.path}")
        try:
            cfg = json.loads((self.path / "config.json").read_text())
        except FileNotFoundError:
            raise CheckpointError(f"missing {self.path / 'config.json'}") from None
        except ValueError as e:
            raise CheckpointError(f"corrupt {self.path / 'config.json'}: {e}") from None
        if cfg.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{self.path}/config.json: unknown checkpoint format {cfg.get('format')!r}")
        if cfg.get("buttons") != list(A.BUTTONS) or cfg.get("turn_buckets") != list(A.TURN_BUCKETS):
            raise CheckpointError(f"{self.path} was trained with another action set: {cfg.get('buttons')}")
        missing = [k for k in SECTIONS if not isinstance(cfg.get(k), dict)]
        if missing:
            raise CheckpointError(f"{self.path}/config.json lacks its {', '.join(missing)} section")
        self.config = cfg
        self.students: dict[int, dict[str, Any]] = {int(k): v for k, v in cfg.get("students", {}).items()}
        self._student_models: dict[int, Any] = {}
        self.game = from_dict(GameConfig, cfg["game"])
        self.denoiser_cfg = from_dict(DenoiserConfig, cfg["denoiser"])
        self.sampler_cfg = from_dict(SamplerConfig, cfg["sampler"])
        self.ae = load_model_dir(AutoencoderTiny, self.path / "autoencoder").eval()
        unet = load_model_dir(UNet2DConditionModel, self.path / "unet")
        enc = load_model_dir(ActionEncoder, self.path / "action_encoder")
        flow = load_model_dir(FlowNet, self.path / "flow") if self.denoiser_cfg.flow else None
        try:
            self.denoiser = Denoiser(unet, enc, self.denoiser_cfg, flow).eval()
        except ValueError as e:
            raise CheckpointError(f"{self.path}/config.json: {e}") from None
        ctx, _ = load_state(self.path / "context.safetensors")
        if "frames" not in ctx or "actions" not in ctx:
            raise CheckpointError(f"{self.path / 'context.safetensors'} lacks frames/actions")
        self.context_frames = ctx["frames"].numpy()
        self.context_actions = ctx["actions"].numpy()
        n = self.denoiser_cfg.context
        H, W = self.game.height, self.game.width
        if self.context_frames.shape != (n, H, W, 3) or self.context_actions.shape != (n, 2):
            raise CheckpointError(
                f"{self.path / 'context.safetensors'}: frames {tuple(self.context_frames.shape)} / actions "
                f"{tuple(self.context_actions.shape)} do not match context {n} at {W}x{H}")
        k = frames_read(self.denoiser_cfg)
        want = input_channels(self.denoiser_cfg, self.ae.config.latent_channels)
        if unet.config.in_channels != want:
            raise CheckpointError(f"{self.path}: unet/ expects {unet.config.in_channels} input channels, "
                                  f"autoencoder/ and {k} context frames give {want}")
        self.bar: Denoiser | None = None  # a status-bar denoiser whose rows play pastes over every frame
        self.bar_cfg: DenoiserConfig | None = None
        if isinstance(cfg.get("bar"), dict):
            bcfg = from_dict(DenoiserConfig, cfg["bar"].get("denoiser", {}))
            bar_unet = load_model_dir(UNet2DConditionModel, self.path / "bar" / "unet")
            try:
                if bar_rows(bcfg, AE.latent_hw(self.ae, H, W)[0]) is None:
                    raise ValueError("its config has no rows")
                if bcfg.context != n or input_channels(bcfg, self.ae.config.latent_channels) != (
                        bar_unet.config.in_channels):
                    raise ValueError("it does not read this checkpoint's context")
                self.bar = Denoiser(bar_unet, load_model_dir(ActionEncoder, self.path / "bar" / "action_encoder"),
                                    bcfg).eval()
            except ValueError as e:
                raise CheckpointError(f"{self.path}: the status-bar denoiser in bar/: {e}") from None
            self.bar_cfg = bcfg

    def bar_parts(self) -> tuple[Any, Any, dict[str, Any]] | None:
        """The status-bar denoiser as save_checkpoint takes it (to carry it over); None where there is none."""
        if self.bar is None:
            return None
        return self.bar, self.bar_cfg, dict(self.config["bar"].get("notes", {}))

    def student(self, steps: int) -> Any:
        """The distilled denoiser of the `steps`-step sampler this checkpoint carries (loaded once)."""
        from diffusers import UNet2DConditionModel

        from .denoiser import ActionEncoder, Denoiser

        if steps not in self.students:
            raise CheckpointError(f"{self.path} carries no {steps}-step student "
                                  f"(it has: {sorted(self.students) or 'none'})")
        if steps not in self._student_models:
            d = self.path / "students" / str(steps)
            unet = load_model_dir(UNet2DConditionModel, d / "unet")
            enc = load_model_dir(ActionEncoder, d / "action_encoder")
            keys = ("in_channels", "out_channels", "block_out_channels", "cross_attention_dim", "time_cond_proj_dim")
            if any(unet.config.get(k) != self.denoiser.unet.config.get(k) for k in keys):
                raise CheckpointError(f"{d}: its unet is not the teacher's architecture")
            self._student_models[steps] = Denoiser(unet, enc, self.denoiser_cfg, self.denoiser.flow).eval()
        return self._student_models[steps]

    def student_models(self) -> dict[int, tuple[Any, dict[str, Any]]]:
        """Every student with how it was made, as save_checkpoint takes them (to carry them over)."""
        return {n: (self.student(n), info) for n, info in self.students.items()}
