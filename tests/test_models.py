"""The neural engine's parts: autoencoder, denoiser, sampler, checkpoint, engine, latent windows."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from neuraldoom import actions as A
from neuraldoom import autoencoder as AE
from neuraldoom.checkpoint import Checkpoint, CheckpointError
from neuraldoom.config import AutoencoderConfig, DenoiserConfig
from neuraldoom.denoiser import build_denoiser
from neuraldoom.engine import NeuralEngine
from neuraldoom.sampler import DDIMSampler, ddim_scheduler, denoiser_pass
from tests.conftest import TINY_DENOISER

TINY_AE = AutoencoderConfig(latent_channels=4, encoder_channels=8, decoder_channels=8)


def test_pixels_round_trip_and_padding():
    frames = np.random.default_rng(0).integers(0, 256, (3, 120, 160, 3), dtype=np.uint8)
    x = AE.to_pixels(frames, 8)
    assert x.shape == (3, 3, 128, 160)  # padded to 128 rows so a 3-level UNet can halve twice
    assert x.min() >= -1 and x.max() <= 1
    assert np.array_equal(AE.to_frames(x, 120, 160), frames)


def test_autoencoder_shapes():
    ae = AE.build_autoencoder(AutoencoderConfig())
    assert AE.downsampling(ae) == 4
    frames = np.zeros((2, 120, 160, 3), np.uint8)
    z = AE.encode(ae, frames)
    assert z.shape == (2, 8, 32, 40)  # 120 rows padded to 128 so the denoiser's UNet can halve twice
    assert AE.decode(ae, z, 120, 160).shape == (2, 120, 160, 3)
    with pytest.raises(ValueError, match="downsamples"):
        AE.build_autoencoder(AutoencoderConfig(encoder_blocks=(1, 1, 1)))


def test_autoencoder_overfits_one_batch(tiny_dataset):
    from neuraldoom.recording import open_dataset

    torch.manual_seed(0)
    frames = np.asarray(open_dataset(tiny_dataset / "train")[0].frames[:4])
    ae = AE.build_autoencoder(TINY_AE)
    x = AE.to_pixels(frames, 8)
    opt = torch.optim.Adam(ae.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        loss = (AE.decode_pixels(ae, AE.encode_pixels(ae, x)) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 5, (losses[0], losses[-1])


def _batch(dcfg: DenoiserConfig, B: int = 2, C: int = 4):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, C, 16, 20, generator=g), torch.randint(0, 1000, (B,), generator=g),
            torch.randn(B, dcfg.context, C, 16, 20, generator=g),
            torch.randint(0, 4, (B, dcfg.context + 1, 2), generator=g), torch.randint(0, 10, (B,), generator=g))


def test_denoiser_shapes_and_action_sensitivity():
    torch.manual_seed(0)
    dcfg = DenoiserConfig(**TINY_DENOISER)
    d = build_denoiser(dcfg, 4, (16, 20)).eval()
    x, t, ctx, codes, b = _batch(dcfg)
    with torch.no_grad():
        v = d(x, t, ctx, codes, b)
        assert v.shape == x.shape
        other = codes.clone()
        other[:, -1, 0] ^= 1  # press/release MOVE_FORWARD on the current step
        assert not torch.allclose(v, d(x, t, ctx, other, b))


def test_action_tokens_are_sums_of_button_embeddings():
    from neuraldoom.denoiser import ActionEncoder

    enc = ActionEncoder(dim=8, length=3)
    both = torch.tensor([[[1 | 16, A.NO_TURN]]])
    fwd, att, none = (torch.tensor([[[b, A.NO_TURN]]]) for b in (1, 16, 0))
    with torch.no_grad():
        raw = lambda c: (c[..., :1] >> torch.arange(A.NUM_BUTTONS) & 1).float() @ enc.buttons  # noqa: E731
        assert torch.allclose(raw(both), raw(fwd) + raw(att))
        assert enc(both).shape == (1, 1, 8)
        assert not torch.allclose(enc(both), enc(none))


def test_denoiser_overfits_one_batch():
    from diffusers import DDPMScheduler

    from training.train_diffusion import diffusion_loss

    torch.manual_seed(0)
    dcfg = DenoiserConfig(**TINY_DENOISER)
    d = build_denoiser(dcfg, 4, (16, 20))
    sched = DDPMScheduler(beta_schedule="linear", prediction_type="v_prediction")
    x, _, ctx, codes, _ = _batch(dcfg, B=4)
    opt = torch.optim.Adam(d.parameters(), lr=2e-3)
    losses = []
    for _ in range(120):
        g = torch.Generator().manual_seed(0)  # the same noise every step: one batch to memorise
        loss = diffusion_loss(d, sched, (x, ctx, codes), dcfg, 0.0, g, torch.device("cpu"))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] / 5, (losses[0], losses[-1])


def test_the_training_pass_is_the_eager_models_loss_and_gradients():
    """trainer.training_pass (on a CPU the classic attention processor, then torch.compile) trains the same
    function: one batch's loss and every weight's gradient match the eager model's."""
    import copy

    from diffusers import DDPMScheduler
    from diffusers.models.attention_processor import AttnProcessor

    from training import trainer
    from training.train_diffusion import diffusion_loss

    torch.manual_seed(0)
    dcfg = DenoiserConfig(**TINY_DENOISER)
    eager = build_denoiser(dcfg, 4, (16, 20)).train()
    fast = copy.deepcopy(eager)
    passed = trainer.training_pass(fast, trainer.accelerator("fp32"), compile=True)
    procs = [m.processor for m in fast.modules() if hasattr(m, "set_processor")]
    assert procs and all(type(p) is AttnProcessor for p in procs)  # not torch's SDPA, whose CPU backward is slow
    sched = DDPMScheduler(beta_schedule="linear", prediction_type="v_prediction")
    x, _, ctx, codes, _ = _batch(dcfg, B=4)
    losses = []
    for model in (eager, passed):
        loss = diffusion_loss(model, sched, (x, ctx, codes), dcfg, 0.1, torch.Generator().manual_seed(3),
                              torch.device("cpu"))
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(losses[1], rel=1e-4)
    for (name, a), b in zip(eager.named_parameters(), fast.parameters(), strict=True):
        assert a.grad is not None and torch.allclose(a.grad, b.grad, rtol=1e-3, atol=1e-6), name


def test_the_training_pass_under_cpu_bf16_trains_every_weight():
    """Under CPU bf16 autocast a torch.compile'd pass gave the same loss but most weights a gradient of exactly
    zero (167 of this model's 214 tensors); training_pass asked to compile there must train what the eager
    model trains: no weight left without its gradient, the whole gradient's direction the eager one's."""
    import copy

    from diffusers import DDPMScheduler

    from training import trainer
    from training.train_diffusion import diffusion_loss

    torch.manual_seed(0)
    dcfg = DenoiserConfig(**TINY_DENOISER)
    eager = build_denoiser(dcfg, 4, (16, 20)).train()
    fast = copy.deepcopy(eager)
    acc = trainer.accelerator("bf16")
    passed = trainer.training_pass(fast, acc, compile=True)
    sched = DDPMScheduler(beta_schedule="linear", prediction_type="v_prediction")
    x, _, ctx, codes, _ = _batch(dcfg, B=4)
    for model in (eager, passed):
        with acc.autocast():
            loss = diffusion_loss(model, sched, (x, ctx, codes), dcfg, 0.1, torch.Generator().manual_seed(3),
                                  torch.device("cpu"))
        loss.backward()
    pairs = [(name, a.grad, b.grad) for (name, a), b in zip(eager.named_parameters(), fast.parameters(), strict=True)]
    starved = [name for name, a, b in pairs if a.abs().sum() > 0 and (b is None or b.abs().sum() == 0)]
    assert not starved, starved
    a, b = (torch.cat([p[i].flatten() for p in pairs]) for i in (1, 2))
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.99


def test_the_compiled_sampling_pass_follows_the_batch_size_and_the_live_weights():
    """trainer.sampling_pass (own frames inside the training loop): compiled with a dynamic batch, it gives the
    eager pass's output at every batch size, and after the optimizer has moved the weights, the new weights'."""
    from training import trainer

    torch.manual_seed(0)
    dcfg = DenoiserConfig(**TINY_DENOISER)
    d = build_denoiser(dcfg, 4, (16, 20)).train()
    eager, fast = trainer.sampling_pass(d, compile=False), trainer.sampling_pass(d, compile=True)
    assert d.training  # left in training mode: a switch would recompile the compiled training pass
    with torch.no_grad():
        for b in (3, 5, 2):
            x, t, ctx, codes, _ = _batch(dcfg, B=b)
            torch.testing.assert_close(fast(x, t, ctx, codes), eager(x, t, ctx, codes), rtol=1e-4, atol=1e-5)
        before = eager(x, t, ctx, codes)
        for p in d.parameters():
            p.add_(0.01 * torch.randn_like(p))
        after = fast(x, t, ctx, codes)
        assert not torch.allclose(after, before, atol=1e-4)
        torch.testing.assert_close(after, eager(x, t, ctx, codes), rtol=1e-4, atol=1e-5)


def test_sampler_matches_diffusers_ddim_loop():
    torch.manual_seed(0)
    dcfg = DenoiserConfig(**TINY_DENOISER)
    d = build_denoiser(dcfg, 4, (16, 20)).eval()
    noise, _, ctx, codes, _ = _batch(dcfg, B=1)
    with torch.no_grad():
        ours = DDIMSampler(d, steps=4, cfg=1.0)(noise, ctx, codes)
        sched = ddim_scheduler()
        sched.set_timesteps(4)
        assert [int(t) for t in sched.timesteps] == [999, 749, 499, 249]  # trailing spacing
        x = noise
        for t in sched.timesteps:
            v = d(x, t.view(1), ctx, codes, torch.zeros(1, dtype=torch.long))
            x = sched.step(v, t, x).prev_sample
        assert torch.allclose(ours, x, atol=1e-4)
        # CFG: w=1.5 extrapolates from the context-free prediction towards the conditional one
        guided = DDIMSampler(d, steps=4, cfg=1.5)(noise, ctx, codes)
        assert guided.shape == ours.shape and not torch.allclose(guided, ours)
        # skip 1: the same loop from t = 749, the noise scaled to x_749 of a zero target
        short = DDIMSampler(d, steps=4, cfg=1.0, skip=1)
        assert [t for t, _, _ in short.plan] == [749, 499, 249]
        x = noise * (1 - sched.alphas_cumprod[749]) ** 0.5
        for t in sched.timesteps[1:]:
            v = d(x, t.view(1), ctx, codes, torch.zeros(1, dtype=torch.long))
            x = sched.step(v, t, x).prev_sample
        skipped = short(noise, ctx, codes)
        assert torch.allclose(skipped, x, atol=1e-4) and not torch.allclose(skipped, ours, atol=1e-3)
    with pytest.raises(ValueError, match="skip"):
        DDIMSampler(d, steps=4, cfg=1.0, skip=4)


def test_checkpoint_round_trip_gives_identical_outputs(tiny_checkpoint):
    a, b = Checkpoint(tiny_checkpoint), Checkpoint(tiny_checkpoint)
    dcfg = a.denoiser_cfg
    x, t, ctx, codes, bucket = _batch(dcfg)
    with torch.no_grad():
        assert torch.equal(a.denoiser(x, t, ctx, codes, bucket), b.denoiser(x, t, ctx, codes, bucket))
    assert a.context_frames.shape == (dcfg.context, 120, 160, 3)


@pytest.mark.parametrize("damage", ["missing_unet", "truncated", "bad_json", "wrong_context", "not_a_dir",
                                    "no_sampler_section", "student_missing_weights"])
def test_bad_checkpoints_give_one_clear_line(tiny_checkpoint, tmp_path, damage):
    p = tmp_path / "ck"
    shutil.copytree(tiny_checkpoint, p)
    if damage == "missing_unet":
        (p / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    elif damage == "truncated":
        f = p / "unet" / "diffusion_pytorch_model.safetensors"
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    elif damage == "bad_json":
        (p / "config.json").write_text("{not json")
    elif damage == "wrong_context":
        import json

        cfg = json.loads((p / "config.json").read_text())
        cfg["denoiser"]["context"] = 7
        (p / "config.json").write_text(json.dumps(cfg))
    elif damage == "not_a_dir":
        p = tmp_path / "nothing"
    elif damage in ("no_sampler_section", "student_missing_weights"):
        import json

        cfg = json.loads((p / "config.json").read_text())
        if damage == "no_sampler_section":
            del cfg["sampler"]
        else:  # config.json promises a 2-step student whose folder is not there
            cfg["students"] = {"2": {"steps": 2, "base": "x"}}
        (p / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        Checkpoint(p).student(2) if damage == "student_missing_weights" else Checkpoint(p)
    assert "\n" not in str(e.value) and str(p) in str(e.value)


def test_engine_protocol_ring_buffer_and_determinism(tiny_checkpoint):
    ck = Checkpoint(tiny_checkpoint)
    eng = NeuralEngine(ck, compile=False, seed=0)
    f0 = eng.reset(5)
    assert f0.shape == (120, 160, 3) and f0.dtype == np.uint8
    acts = [A.Action.of("MOVE_FORWARD"), A.Action.of("ATTACK", turn=4.0), A.Action.of("USE"),
            A.NOOP, A.Action.of("MOVE_LEFT"), A.Action.of("MOVE_RIGHT", turn=-8)]
    frames = [eng.step(a) for a in acts[:-1]]
    before = eng.z.clone()
    z = eng.next_latent(acts[-1])
    frames.append(AE.decode(ck.ae, z, 120, 160)[0])
    assert all(f.shape == (120, 160, 3) and f.dtype == np.uint8 for f in frames)
    # the ring holds the last N actions in order (N = 4: wrapped around)
    assert A.decode(eng.actions.numpy()) == acts[-4:]
    assert torch.equal(eng.z[-1], z[0]) and torch.equal(eng.z[:-1], before[1:])  # newest last, oldest dropped
    eng.reset(5)
    again = [eng.step(a) for a in acts]
    assert all(np.array_equal(x, y) for x, y in zip(frames, again, strict=True))
    with pytest.raises(A.ActionError):
        eng.step([1, 0, 0, 0, 0, 0, 0])


def test_engine_set_context_pads_short_history(tiny_checkpoint, tiny_dataset):
    from neuraldoom.recording import open_dataset

    eng = NeuralEngine(Checkpoint(tiny_checkpoint), compile=False)
    rec = open_dataset(tiny_dataset / "train")[0]
    eng.set_context(np.asarray(rec.frames[:2]), rec.actions[:2])
    assert eng.z.shape[0] == eng.n and torch.equal(eng.z[0], eng.z[1])  # padded by repeating the first
    with pytest.raises(ValueError):
        eng.set_context(np.asarray(rec.frames[:2]), rec.actions[:1])


def test_latent_windows_respect_episode_starts():
    from training.latents import LatentSet

    z = torch.arange(10, dtype=torch.float16).view(10, 1, 1, 1)
    acts = np.stack([np.arange(10), np.full(10, 3)], 1)
    ep_start = np.array([0] * 4 + [4] * 6)
    valid = np.ones(10, bool)
    valid[[0, 4]] = False
    ls = LatentSet(z, acts, ep_start, valid)
    assert 0 not in ls.targets and 4 not in ls.targets
    target, ctx, codes = ls.window(torch.tensor([6]), 3)
    assert target.flatten().tolist() == [6]
    assert ctx.flatten().tolist() == [4, 4, 5]  # padded with the episode's first frame
    # token k = action that led to context frame k (NOOP at/before the start), last = current action
    assert codes[0, :, 0].tolist() == [0, 0, 4, 5]
    # the newest frames alone (what a denoiser reading fewer than N sees), with all N+1 action tokens
    t2, ctx2, codes2 = ls.window(torch.tensor([6, 9]), 3, frames=2)
    assert ctx2.flatten().tolist() == [4, 5, 7, 8] and codes2.shape == (2, 4, 2)
    assert torch.equal(ctx2, ls.window(torch.tensor([6, 9]), 3)[1][:, -2:])
    assert torch.equal(codes2, ls.window(torch.tensor([6, 9]), 3)[2])


def test_engine_feeds_the_sampler_contiguous_tensors(tiny_checkpoint):
    # a compiled (AOTInductor) sampler assumes its example inputs' strides; the encoder returns
    # channels_last latents, which a compiled package silently misreads
    eng = NeuralEngine(Checkpoint(tiny_checkpoint), compile=False)
    seen = []

    def spy(noise, ctx, codes):
        seen.append(all(t.is_contiguous() for t in (noise, ctx, codes)))
        return eng.sampler(noise, ctx, codes)

    eng.run = spy
    eng.z = eng.z.to(memory_format=torch.channels_last)
    eng.step(A.NOOP)
    eng.step(A.Action.of("MOVE_FORWARD"))
    assert seen == [True, True]


def _frame_and_delta():
    """A tiny frame denoiser, the same weights as a delta one (scale 0.5), and one sampler input."""
    from dataclasses import replace

    from neuraldoom.denoiser import Denoiser

    dcfg = DenoiserConfig(**TINY_DENOISER)
    torch.manual_seed(0)
    frame = build_denoiser(dcfg, 4, (16, 20)).eval()
    delta = Denoiser(frame.unet, frame.action_encoder, replace(dcfg, target="delta", delta_scale=0.5)).eval()
    g = torch.Generator().manual_seed(1)
    noise, ctx = torch.randn(1, 4, 16, 20, generator=g), torch.randn(1, 4, 4, 16, 20, generator=g)
    codes = torch.randint(0, 4, (1, 5, 2), generator=g)
    return frame, delta, noise, ctx, codes


def test_delta_target_sampler_adds_the_change_to_the_last_context_frame():
    """A "delta" denoiser is the frame denoiser's output, scaled, plus the last context latent."""
    frame, delta, noise, ctx, codes = _frame_and_delta()
    with torch.no_grad():
        for cfg in (1.0, 1.5):
            a = DDIMSampler(frame, 4, cfg)(noise, ctx, codes)
            b = DDIMSampler(delta, 4, cfg)(noise, ctx, codes)
            torch.testing.assert_close(b, ctx[:, -1] + 0.5 * a)
    z = torch.randn(2, 4, 16, 20)
    torch.testing.assert_close(delta.from_target(delta.to_target(z, ctx[0, :2]), ctx[0, :2]), z)


def test_deadband_keeps_the_last_frame_exactly_where_the_predicted_change_is_small():
    frame, delta, noise, ctx, codes = _frame_and_delta()
    with torch.no_grad():
        free = DDIMSampler(delta, 4, 1.0)(noise, ctx, codes)
        change = (free - ctx[:, -1]) / 0.5  # in the target's units
        size = change.pow(2).mean(1, keepdim=True).sqrt()
        band = float(size.median())
        held = DDIMSampler(delta, 4, 1.0, deadband=band)(noise, ctx, codes)
        assert DDIMSampler(frame, 4, 1.0, deadband=band).deadband == 0.0  # a frame target has no change
    small = (size < band).expand_as(free)
    assert 0 < small.float().mean() < 1
    torch.testing.assert_close(held[small], ctx[:, -1][small], rtol=0, atol=0)  # exactly the last frame
    torch.testing.assert_close(held[~small], free[~small])  # the rest untouched
    torch.testing.assert_close(DDIMSampler(delta, 4, 1.0, deadband=0.0)(noise, ctx, codes), free)


def test_frame_bounds_leave_a_frame_in_range_exactly_and_pull_one_outside_to_the_edge():
    from neuraldoom.sampler import FrameBounds

    g = torch.Generator().manual_seed(2)
    z = torch.randn(2, 3, 8, 10, generator=g)
    mean, std = z.mean((2, 3)), z.std((2, 3))
    wide = FrameBounds(tuple(mean.min(0).values.tolist()), tuple(mean.max(0).values.tolist()),
                       tuple(std.max(0).values.tolist()))
    assert wide.hold(z) is z  # inside every bound: not even rounded
    tight = FrameBounds((-0.05,) * 3, (0.05,) * 3, (0.5,) * 3)
    shifted = z + torch.tensor([3.0, -3.0, 0.0]).view(1, 3, 1, 1)
    held = tight.hold(shifted)
    m, s = held.mean((2, 3)), held.std((2, 3))
    assert torch.all(m[:, 0] <= 0.05 + 1e-5) and torch.all(m[:, 1] >= -0.05 - 1e-5)
    torch.testing.assert_close(s, torch.full_like(s, 0.5))  # spread scaled down to the bound
    torch.testing.assert_close(tight.hold(held), held)  # held once, held for good
    # the pattern of each channel stays (only its offset and scale change)
    a, b = held - m[..., None, None], shifted - shifted.mean((2, 3), keepdim=True)
    torch.testing.assert_close(a / a.std((2, 3), keepdim=True), b / b.std((2, 3), keepdim=True))


def test_the_sampler_holds_its_frames_in_the_checkpoints_bounds():
    from neuraldoom.config import SamplerConfig
    from neuraldoom.sampler import FrameBounds

    _, delta, noise, ctx, codes = _frame_and_delta()
    assert FrameBounds.from_config(SamplerConfig()) is None  # no bounds: free
    with torch.no_grad():
        free = DDIMSampler(delta, 4, 1.0)(noise, ctx, codes)
        cfg = SamplerConfig(mean_lo=(-1e9,) * 4, mean_hi=(1e9,) * 4, std_hi=(1e9,) * 4)
        torch.testing.assert_close(DDIMSampler(delta, 4, 1.0, bounds=FrameBounds.from_config(cfg))(noise, ctx, codes),
                                   free, rtol=0, atol=0)
        top = float(free.std((2, 3)).min()) / 2
        held = DDIMSampler(delta, 4, 1.0, bounds=FrameBounds((-0.1,) * 4, (0.1,) * 4, (top,) * 4))(noise, ctx, codes)
    assert held.mean((2, 3)).abs().max() <= 0.1 + 1e-5
    assert held.std((2, 3)).max() <= top + 1e-5


def test_denoiser_reads_only_the_newest_frames():
    from dataclasses import replace

    dcfg = replace(DenoiserConfig(**TINY_DENOISER), reads=2)
    m = build_denoiser(dcfg, 4, (16, 20)).eval()
    assert m.unet.config.in_channels == 4 * 3
    g = torch.Generator().manual_seed(0)
    args = [torch.randn(1, 4, 16, 20, generator=g), torch.tensor([500]), torch.randn(1, 4, 4, 16, 20, generator=g),
            torch.randint(0, 4, (1, 5, 2), generator=g), torch.tensor([0])]
    with torch.no_grad():
        out = m(*args)
        args[2][:, :2] = 0  # the two oldest frames are not read
        torch.testing.assert_close(m(*args), out)
        args[2][:, -1] = 0
        assert not torch.allclose(m(*args), out)


def test_action_embedding_makes_the_current_action_change_the_output():
    from dataclasses import replace

    m = build_denoiser(replace(DenoiserConfig(**TINY_DENOISER), action_embed=True), 4, (16, 20)).eval()
    assert m.action_embed and not m.unet.time_embedding.cond_proj.weight.any()  # starts as a no-op
    g = torch.Generator().manual_seed(0)
    x, ctx = torch.randn(1, 4, 16, 20, generator=g), torch.randn(1, 4, 4, 16, 20, generator=g)
    codes = torch.zeros(1, 5, 2, dtype=torch.long)
    with torch.no_grad():
        # cross-attention off: the time embedding alone must carry the current action
        for blk in m.unet.modules():
            if blk.__class__.__name__ == "Attention" and blk.is_cross_attention:
                blk.to_out[0].weight.zero_()
        torch.nn.init.normal_(m.unet.time_embedding.cond_proj.weight)
        a = m(x, torch.tensor([500]), ctx, codes, torch.tensor([0]))
        codes[0, -1] = torch.tensor([A.Action.of("MOVE_FORWARD").buttons, 1])
        b = m(x, torch.tensor([500]), ctx, codes, torch.tensor([0]))
    assert not torch.allclose(a, b)


def test_the_action_path_grafts_onto_a_trained_denoiser_without_changing_it():
    from dataclasses import replace

    cfg = DenoiserConfig(**TINY_DENOISER)
    plain = build_denoiser(cfg, 4, (16, 20)).eval()
    grafted = build_denoiser(replace(cfg, action_embed=True), 4, (16, 20)).eval()
    missing, unexpected = grafted.load_state_dict(plain.state_dict(), strict=False)
    assert missing == ["unet.time_embedding.cond_proj.weight"] and not unexpected
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(2, 4, 16, 20, generator=g), torch.tensor([999, 249]),
            torch.randn(2, 4, 4, 16, 20, generator=g), torch.randint(0, 7, (2, 5, 2), generator=g),
            torch.tensor([0, 3]))
    with torch.no_grad():
        torch.testing.assert_close(grafted(*args), plain(*args))


def _warp_model(plain: bool = False, mode: str = "bicubic", fill: str = "border"):
    from dataclasses import replace

    cfg = replace(DenoiserConfig(**TINY_DENOISER), target="delta", delta_scale=0.5)
    warp = dict(turn_warp=tuple(2 * d for d in A.TURN_BUCKETS), warp_rows=12, warp_mode=mode,  # 12 view rows
                warp_fill=fill)
    torch.manual_seed(0)
    return build_denoiser(cfg if plain else replace(cfg, **warp), 4, (16, 20)).eval()


def test_a_turn_warp_turns_the_view_and_leaves_the_status_bar():
    m = _warp_model()
    ctx = torch.zeros(1, 4, 4, 16, 20)
    ctx[..., 10] = 1.0  # a wall edge at the middle column, also through the status-bar rows
    codes = torch.full((1, 5, 2), A.NO_TURN, dtype=torch.long)
    assert torch.equal(m.reference(ctx, codes), ctx[:, -1])  # no turn: the frame itself, exactly
    cols = {}
    for turn in (A.TURN_BUCKETS.index(8.0), A.TURN_BUCKETS.index(-8.0)):
        codes[0, -1, 1] = turn
        ref = m.reference(ctx, codes)
        assert torch.equal(ref[..., 12:, :], ctx[:, -1, :, 12:])  # the status bar does not turn
        cols[A.TURN_BUCKETS[turn]] = ref[0, 0, 6].argmax().item()
    # 16 degrees with a 90-degree view 20 cells wide: 10 * tan(16°) = 2.9 cells at the middle
    assert cols[8.0] in (7, 8) and cols[-8.0] in (12, 13)  # turning right moves the view's content left


def test_a_nearest_turn_warp_copies_whole_cells():
    m = _warp_model(mode="nearest")
    ctx = torch.randn(1, 4, 4, 16, 20, generator=torch.Generator().manual_seed(0))
    codes = torch.full((1, 5, 2), A.NO_TURN, dtype=torch.long)
    assert torch.equal(m.reference(ctx, codes), ctx[:, -1])
    codes[0, -1, 1] = A.TURN_BUCKETS.index(8.0)
    ref, last = m.reference(ctx, codes)[0], ctx[0, -1]
    cells = last.flatten(1)  # (C, h*w): every turned cell is one of the last frame's cells, nothing blended
    for row in range(16):
        for col in range(20):
            assert (cells == ref[:, row, col, None]).all(0).any()
    assert not torch.equal(ref, last)  # and it did turn
    with pytest.raises(ValueError, match="warp_mode"):
        _warp_model(mode="cubic")


def test_a_turn_fills_what_it_brings_in_from_the_last_frame_not_the_status_bar():
    ctx = torch.zeros(1, 4, 4, 16, 20)
    ctx[..., 12:, :] = 100.0  # the status bar's rows: a value no view cell holds
    ctx[..., :12, :] = torch.arange(20.0)  # the view: its column index
    codes = torch.full((1, 5, 2), A.NO_TURN, dtype=torch.long)
    codes[0, -1, 1] = A.TURN_BUCKETS.index(8.0)
    border = _warp_model()
    assert (border.reference(ctx, codes)[..., :12, :] > 50).any()  # the edge fill reads status-bar rows
    last = _warp_model(fill="last")
    ref = last.reference(ctx, codes)
    unseen = last.unseen[codes[0, -1, 1]]  # (view rows, w)
    assert unseen.shape == (12, 20) and unseen.any()
    assert torch.equal(ref[0, :, :12][:, unseen], ctx[0, -1, :, :12][:, unseen])  # unseen: the unturned frame
    assert (ref[..., :12, :] < 50).all()  # no status bar painted into the view
    assert torch.equal(ref[..., 12:, :], ctx[:, -1, :, 12:])  # and the status bar itself stays
    seen = ~unseen
    seen[9:] = False  # far from the view's bottom edge the bicubic kernel never reached the status bar
    torch.testing.assert_close(ref[0, :, :12][:, seen], border.reference(ctx, codes)[0, :, :12][:, seen])
    codes[0, -1, 1] = A.NO_TURN
    assert torch.equal(last.reference(ctx, codes), ctx[:, -1]) and not last.unseen[A.NO_TURN].any()
    with pytest.raises(ValueError, match="warp_fill"):
        _warp_model(fill="zeros")


def _flow_model(shift: float = 0.0):
    from dataclasses import replace

    from neuraldoom.flow import FlowNet

    cfg = replace(DenoiserConfig(**TINY_DENOISER), target="delta", delta_scale=0.5, flow=True,
                  turn_warp=tuple(2 * d for d in A.TURN_BUCKETS), warp_rows=12, warp_fill="last")
    torch.manual_seed(0)
    flow = FlowNet(latent_channels=4, frames=2, width=8)
    with torch.no_grad():
        flow.out.bias.copy_(torch.tensor([shift, 0.0]))  # every cell's source `shift` cells to the right
    return build_denoiser(cfg, 4, (16, 20), flow).eval()


def test_an_untrained_flow_is_the_turn_warp_alone():
    moved, turned = _flow_model(), _warp_model(fill="last")
    moved.unet.load_state_dict(turned.unet.state_dict())
    ctx = torch.randn(2, 4, 4, 16, 20, generator=torch.Generator().manual_seed(2))
    codes = torch.full((2, 5, 2), A.NO_TURN, dtype=torch.long)
    codes[1, -1, 1] = A.TURN_BUCKETS.index(4.0)
    torch.testing.assert_close(moved.reference(ctx, codes), turned.reference(ctx, codes), atol=1e-5, rtol=0)
    assert not any(p.requires_grad for p in moved.flow.parameters())  # frozen inside a denoiser


def test_the_flow_moves_the_view_by_its_offsets_and_keeps_the_status_bar():
    m = _flow_model(shift=1.0)
    ctx = torch.zeros(1, 4, 4, 16, 20)
    ctx[..., :12, :] = torch.arange(20.0)  # the view: its column index
    ctx[..., 12:, :] = 100.0  # the status bar
    codes = torch.full((1, 5, 2), A.NO_TURN, dtype=torch.long)
    ref = m.reference(ctx, codes)[0]
    torch.testing.assert_close(ref[:, :12, :19], ctx[0, -1, :, :12, 1:])  # one cell left: the source is one right
    assert torch.equal(ref[:, :12, 19], ctx[0, -1, :, :12, 19])  # no source: the last frame's cell
    assert torch.equal(ref[:, 12:], ctx[0, -1, :, 12:])
    # and the sampler's change is taken from the moved frame
    x = torch.randn(1, 4, 16, 20, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(DDIMSampler(m, 4, 1.0, deadband=1e9)(x, ctx, codes), ref[None])
    # offsets under the snap are no motion at all: the view stays
    small = _flow_model(shift=0.2)
    torch.testing.assert_close(small.reference(ctx, codes), ctx[:, -1], atol=1e-5, rtol=0)


def test_a_flow_needs_the_turn_warp_with_the_last_frame_fill():
    from dataclasses import replace

    from neuraldoom.flow import FlowNet

    cfg = replace(DenoiserConfig(**TINY_DENOISER), target="delta", flow=True,
                  turn_warp=tuple(2 * d for d in A.TURN_BUCKETS), warp_rows=12, warp_fill="border")
    with pytest.raises(ValueError, match="warp_fill 'last'"):
        build_denoiser(cfg, 4, (16, 20), FlowNet(latent_channels=4, width=8))


def test_the_warped_model_reads_and_keeps_the_turned_frame():
    warped, plain = _warp_model(), _warp_model(plain=True)
    g = torch.Generator().manual_seed(1)
    x, ctx = torch.randn(1, 4, 16, 20, generator=g), torch.randn(1, 4, 4, 16, 20, generator=g)
    codes = torch.full((1, 5, 2), A.NO_TURN, dtype=torch.long)
    t, bucket = torch.tensor([500]), torch.tensor([0])
    with torch.no_grad():
        torch.testing.assert_close(warped(x, t, ctx, codes, bucket), plain(x, t, ctx, codes, bucket))
        codes[0, -1, 1] = A.TURN_BUCKETS.index(-4.0)
        turned = ctx.clone()
        turned[:, -1] = warped.reference(ctx, codes)
        torch.testing.assert_close(warped(x, t, ctx, codes, bucket), plain(x, t, turned, codes, bucket))
        # the change is taken from the turned frame: with every predicted change dropped, play shows it
        out = DDIMSampler(warped, 4, 1.5, deadband=1e9)(x, ctx, codes)
    torch.testing.assert_close(out, turned[:, -1])
    assert not torch.allclose(out, ctx[:, -1])


def test_closing_the_engine_stops_a_background_compile(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("NEURALDOOM_CACHE", str(tmp_path / "cache"))
    eng = NeuralEngine(Checkpoint(tiny_checkpoint), compile=True, seed=0)
    builder = eng._builder
    assert builder.poll() is None and not eng.compiled  # building, playing eager meanwhile
    eng.step(A.NOOP)
    eng.close()
    assert builder.poll() is not None  # the build process is gone
    assert not list((tmp_path / "cache").rglob("*.pt2"))  # and left no package behind


def test_the_shipped_checkpoint_loads_and_plays():
    """`python main.py` plays checkpoints/e1m1: a matching autoencoder/denoiser pair that steps."""
    from pathlib import Path

    ck = Checkpoint(Path(__file__).resolve().parent.parent / "checkpoints" / "e1m1")
    eng = NeuralEngine(ck, compile=False, seed=0, cores=1)
    frames = [eng.step(A.Action.of("MOVE_FORWARD")) for _ in range(2)]
    assert all(f.shape == (ck.game.height, ck.game.width, 3) and f.dtype == np.uint8 for f in frames)
    assert all(np.isfinite(f).all() for f in frames)


def test_clean_reference_makes_a_static_scene_independent_of_context_noise():
    """With the delta taken against the clean last frame, a frame that did not change is a zero target at
    every context-noise level; taken against the noised frame it is not (the target holds the noise)."""
    from dataclasses import replace

    from diffusers import DDPMScheduler

    from neuraldoom.denoiser import Denoiser
    from training.train_diffusion import diffusion_loss, noise_augment

    dcfg = replace(DenoiserConfig(**TINY_DENOISER), target="delta", delta_scale=0.5)
    base = build_denoiser(dcfg, 4, (16, 20))

    class Zero(Denoiser):  # predicts v = 0: the loss is then the target's own size
        def forward(self, noisy, *rest):
            return torch.zeros_like(noisy)

    model = Zero(base.unet, base.action_encoder, dcfg)
    sched = DDPMScheduler(beta_schedule="linear", prediction_type="v_prediction")
    _, _, ctx, codes, _ = _batch(dcfg, B=4)
    static = (ctx[:, -1].clone(), ctx, codes)  # the next frame is the last one

    def loss(reference: str, clean_share: float) -> float:
        g = torch.Generator().manual_seed(3)
        return diffusion_loss(model, sched, static, dcfg, 0.0, g, torch.device("cpu"), reference, clean_share).item()

    assert loss("clean", 0.0) == pytest.approx(loss("clean", 1.0))
    assert loss("seen", 0.0) != pytest.approx(loss("seen", 1.0), rel=1e-3)
    assert loss("seen", 1.0) == pytest.approx(loss("clean", 1.0))  # no noise: the references agree
    g = torch.Generator().manual_seed(0)
    noised, bucket = noise_augment(ctx, dcfg, g, clean_share=1.0)
    assert torch.equal(noised, ctx) and not bucket.any()


def two_episodes_of_six(dcfg: DenoiserConfig):
    """A seeded tiny denoiser and a latent set of two 6-frame episodes (their first frames not targets)."""
    from training.latents import LatentSet

    torch.manual_seed(0)
    d = build_denoiser(dcfg, 4, (16, 20)).eval()
    z = torch.randn(12, 4, 16, 20).half()
    acts = np.stack([np.arange(12) % 4, np.full(12, 3)], 1)
    valid = np.ones(12, bool)
    valid[[0, 6]] = False
    return d, LatentSet(z, acts, np.array([0] * 6 + [6] * 6), valid)


def test_own_frames_replace_the_last_context_frame_with_the_models_sample():
    """--own-frames: a picked sample's last context frame is play's sampler run on the frames before it;
    the rest of the window, and samples whose previous frame opens its episode, stay real."""
    from dataclasses import replace

    from accelerate import Accelerator

    from training.train_diffusion import with_own_frames

    dcfg = replace(DenoiserConfig(**TINY_DENOISER), target="delta", delta_scale=0.5)
    d, ls = two_episodes_of_six(dcfg)
    idx = torch.tensor([3, 7, 9])  # 7: its previous frame (6) opens the episode, nothing to sample it from
    batch = ls.window(idx, dcfg.context)
    sampler = DDIMSampler(d, 4, 1.0)
    acc = Accelerator(cpu=True)  # its precision may be another test's (accelerate's state is shared)
    g0 = torch.Generator().manual_seed(0)
    target, ctx, codes = with_own_frames(denoiser_pass(d), sampler, ls, idx, batch, 1.0, g0, acc)
    assert torch.equal(target, batch[0]) and torch.equal(codes, batch[2])
    assert torch.equal(ctx[:, :-1], batch[1][:, :-1]) and torch.equal(ctx[1], batch[1][1])
    _, pctx, pcodes = ls.window(torch.tensor([8]), dcfg.context)
    g = torch.Generator().manual_seed(0)
    torch.rand(3, generator=g)  # the draw that picked the samples
    noise = torch.randn(2, 4, 16, 20, generator=g)[1:]
    with torch.no_grad(), acc.autocast():
        want = sampler(noise, pctx, pcodes).float()
    torch.testing.assert_close(ctx[2, -1], want[0])
    assert not torch.equal(ctx[0, -1], batch[1][0, -1])


def test_own_frames_unrolled_feed_each_generated_frame_to_the_next():
    """--own-unroll 2: a picked sample's two newest context frames are play's sampler run twice, the second
    from a context whose newest frame is the first; older frames stay real, and a sample whose window would
    reach back past its episode's first frame stays real throughout."""
    from accelerate import Accelerator

    from training.train_diffusion import with_own_frames

    dcfg = DenoiserConfig(**TINY_DENOISER)
    d, ls = two_episodes_of_six(dcfg)
    idx = torch.tensor([8, 4])  # 8 - 2 = 6 opens its episode: nothing to roll out from
    batch = ls.window(idx, dcfg.context)
    sampler = DDIMSampler(d, 4, 1.0)
    acc = Accelerator(cpu=True)
    _, ctx, _ = with_own_frames(denoiser_pass(d), sampler, ls, idx, batch, 1.0, torch.Generator().manual_seed(0), acc,
                                unroll=2)
    assert torch.equal(ctx[0], batch[1][0]) and torch.equal(ctx[1, :-2], batch[1][1, :-2])
    g = torch.Generator().manual_seed(0)
    torch.rand(2, generator=g)  # the draw that picked the samples
    first, second = (torch.randn(1, 4, 16, 20, generator=g) for _ in range(2))
    with torch.no_grad(), acc.autocast():
        _, c2, k2 = ls.window(torch.tensor([2]), dcfg.context)
        own2 = sampler(first, c2, k2).float()
        _, c3, k3 = ls.window(torch.tensor([3]), dcfg.context)
        c3[:, -1] = own2
        own3 = sampler(second, c3, k3).float()
    torch.testing.assert_close(ctx[1, -2], own2[0])
    torch.testing.assert_close(ctx[1, -1], own3[0])


def test_widening_keeps_what_the_denoiser_computes_and_splits_the_copies_unevenly():
    from dataclasses import replace

    from training.widen import widen

    torch.manual_seed(0)
    cfg = replace(DenoiserConfig(**TINY_DENOISER), block_out_channels=(32, 64), target="delta", delta_scale=0.5,
                  action_embed=True)
    m = build_denoiser(cfg, 4, (16, 20)).eval()
    torch.nn.init.normal_(m.unet.time_embedding.cond_proj.weight, std=0.1)  # trained, not its zero start
    wide, wcfg = widen(m, cfg, 4, (16, 20), 2, jitter=0.1)
    assert wcfg.block_out_channels == (64, 128)
    assert sum(p.numel() for p in wide.parameters()) > 3 * sum(p.numel() for p in m.parameters())
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, 16, 20, generator=g), torch.tensor([999, 500, 3]),
            torch.randn(3, 4, 4, 16, 20, generator=g), torch.randint(0, 7, (3, 5, 2), generator=g),
            torch.tensor([0, 4, 9]))
    with torch.no_grad():
        torch.testing.assert_close(wide.eval()(*args), m(*args), atol=1e-4, rtol=1e-4)
    w = wide.unet.conv_out.weight  # reads the copies of each channel: shares that differ, summing to the old
    assert not torch.allclose(w[:, 0::2], w[:, 1::2])
    torch.testing.assert_close(w[:, 0::2] + w[:, 1::2], m.unet.conv_out.weight)
    with pytest.raises(ValueError, match="groups"):  # (8, 16): 8 groups, (16, 32): 16 — not the same function
        widen(build_denoiser(DenoiserConfig(**TINY_DENOISER), 4, (16, 20)), DenoiserConfig(**TINY_DENOISER), 4,
              (16, 20), 2)


def test_deepening_keeps_what_the_denoiser_computes_and_the_new_layers_learn():
    from dataclasses import replace

    from training.widen import deepen

    torch.manual_seed(0)
    cfg = replace(DenoiserConfig(**TINY_DENOISER), block_out_channels=(16, 32, 32), target="delta", delta_scale=0.5)
    m = build_denoiser(cfg, 4, (16, 20)).eval()
    deep, dcfg = deepen(m, cfg, 4, (16, 20))
    assert dcfg.layers_per_block == cfg.layers_per_block + 1
    assert [len(b.resnets) for b in deep.unet.up_blocks] == [cfg.layers_per_block + 2] * 3
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, 16, 20, generator=g), torch.tensor([999, 500, 3]),
            torch.randn(3, 4, 4, 16, 20, generator=g), torch.randint(0, 7, (3, 5, 2), generator=g),
            torch.tensor([0, 4, 9]))
    with torch.no_grad():
        torch.testing.assert_close(deep.eval()(*args), m(*args))
    deep.train()
    deep(*args).square().mean().backward()  # the zeroed convolutions get gradients: the new layers can move
    assert deep.unet.down_blocks[0].resnets[-1].conv2.weight.grad.abs().sum() > 0
    assert deep.unet.up_blocks[-1].resnets[1].conv2.weight.grad.abs().sum() > 0


def test_a_widening_spread_makes_the_copies_differ_and_changes_the_function_only_at_second_order():
    from dataclasses import replace

    from training.widen import widen

    torch.manual_seed(0)
    cfg = replace(DenoiserConfig(**TINY_DENOISER), block_out_channels=(32, 64), target="delta")
    m = build_denoiser(cfg, 4, (16, 20)).eval()
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, 16, 20, generator=g), torch.tensor([999, 500, 3]),
            torch.randn(3, 4, 4, 16, 20, generator=g), torch.randint(0, 7, (3, 5, 2), generator=g),
            torch.tensor([0, 4, 9]))
    old = m.unet.down_blocks[0].resnets[0].conv1.weight
    with torch.no_grad():
        ref = m(*args)
        dev = {}
        for s in (0.01, 0.02):
            wide, _ = widen(m, cfg, 4, (16, 20), 2, spread=s)
            w = wide.unet.down_blocks[0].resnets[0].conv1.weight  # its output channels come in pairs of copies
            pair_mean = (w[0::2] + w[1::2]) / 2  # each input's copies read by halves: sum over them
            torch.testing.assert_close(pair_mean[:, 0::2] + pair_mean[:, 1::2], old)
            assert (w[0::2] - w[1::2]).abs().mean() > 0.1 * s * old.std()
            dev[s] = float((wide.eval()(*args) - ref).norm() / ref.norm())
    assert 0 < dev[0.01] < 1e-3
    assert 3 < dev[0.02] / dev[0.01] < 5  # quadratic: antithetic copies cancel at first order


@pytest.mark.parametrize("drop", [dict(only_cross_attention=True), dict(cross_only_levels=(1,))])
def test_a_denoiser_without_self_attention_grafts_on_as_the_old_one_without_it(drop):
    from dataclasses import replace

    from neuraldoom.denoiser import graft

    cfg = DenoiserConfig(**TINY_DENOISER)
    plain = build_denoiser(cfg, 4, (16, 20)).eval()
    for blk in plain.unet.modules():  # trained weights: the self-attention's output is not zero
        if blk.__class__.__name__ == "Attention" and not blk.is_cross_attention:
            torch.nn.init.normal_(blk.to_out[0].weight, std=0.2)
    cross = build_denoiser(replace(cfg, **drop), 4, (16, 20)).eval()
    cross.load_state_dict(graft(plain.state_dict(), cfg, cross))
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(2, 4, 16, 20, generator=g), torch.tensor([999, 249]),
            torch.randn(2, 4, 4, 16, 20, generator=g), torch.randint(0, 7, (2, 5, 2), generator=g),
            torch.tensor([0, 3]))
    kept = 0
    with torch.no_grad():
        before = plain(*args)
        for name, blk in plain.unet.named_modules():  # the old model with the dropped self-attention taken out
            if blk.__class__.__name__ == "Attention" and not blk.is_cross_attention:
                if name.startswith("mid_block"):
                    kept += 1  # the mid block keeps its self-attention (diffusers has no switch for it)
                    continue
                blk.to_out[0].weight.zero_()
                blk.to_out[0].bias.zero_()
        torch.testing.assert_close(cross(*args), plain(*args))
        assert not torch.allclose(cross(*args), before)
    assert kept == 1
