"""Distillation (training.distill): the target's algebra, guidance and progressive students on the tiny
checkpoint and real collected data, resuming, what plays them, and what export lets ship together."""

from __future__ import annotations

import json

import pytest
import torch

from neuraldoom import actions as A
from neuraldoom.checkpoint import Checkpoint, weights_digest
from neuraldoom.engine import NeuralEngine
from neuraldoom.sampler import DDIMSampler, ddim_scheduler
from training import distill, export

FAST = ["--batch", "4", "--max-frames", "300", "--eval-every", "5", "--save-every", "0", "--no-compile"]


def run(ckpt, data, out, *extra: str) -> int:
    return distill.main(["--checkpoint", str(ckpt), "--data", str(data), "--out", str(out), *FAST, *extra])


def test_the_student_target_takes_one_ddim_step_to_where_the_teacher_landed():
    sched = ddim_scheduler()
    g = torch.Generator().manual_seed(0)
    x, x_end = torch.randn(3, 4, 5, 6, generator=g), torch.randn(3, 4, 5, 6, generator=g)
    for t, t2 in [(999, 499), (749, 249), (499, None)]:  # None: the last step, to the clean latent
        at = sched.alphas_cumprod[t].item()
        ap = 1.0 if t2 is None else sched.alphas_cumprod[t2].item()
        v = distill.student_target(x, x_end, at, ap)
        assert torch.allclose(distill.ddim_step(x, v, at, ap), x_end, atol=1e-3, rtol=1e-4)


def test_a_teacher_step_is_the_samplers_step(tiny_checkpoint):
    """The distillation teacher's guided step is exactly what the engine's sampler does (same plan)."""
    ck = Checkpoint(tiny_checkpoint)
    teacher = distill.Teacher(ck, 4)
    g = torch.Generator().manual_seed(1)
    C, h, w = 4, 16, 20
    noise, ctx = torch.randn(1, C, h, w, generator=g), torch.randn(1, 4, C, h, w, generator=g)
    codes = torch.randint(0, 7, (1, 5, 2), generator=g)
    want = DDIMSampler(ck.denoiser, 4, ck.sampler_cfg.cfg)(noise, ctx, codes)
    x = noise
    with torch.no_grad():
        for t, at, ap in teacher.plan:
            v = teacher.v(x, torch.full((1,), t), ctx, codes)
            x0 = at**0.5 * x - (1 - at) ** 0.5 * v
            x = distill.ddim_step(x, v, at, ap)
    assert torch.allclose(ck.denoiser.from_target(x0, ctx[:, -1]), want, atol=1e-5)


def test_guidance_distillation_plays_as_the_default(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    out = tmp_path / "g4"
    assert run(tiny_checkpoint, tiny_dataset, out, "--steps", "4", "--iterations", "3") == 0
    ck = Checkpoint(out / "checkpoint")
    info = ck.students[4]
    assert info["teacher"] == "4-step DDIM, CFG 1.5" and info["base"] == weights_digest(ck.denoiser)
    assert weights_digest(ck.student(4)) != info["base"]
    eng = NeuralEngine(ck, compile=False)  # the default 4 steps: the student, one pass a step
    assert eng.student == 4 and not eng.sampler.guided and "4-step student" in eng.label
    assert eng.step(A.Action.of("MOVE_FORWARD")).shape == (120, 160, 3)
    teacher = NeuralEngine(ck, compile=False, teacher=True)
    assert teacher.student == 0 and teacher.sampler.cfg == 1.5
    assert NeuralEngine(ck, compile=False, guidance=2.0).student == 0  # an explicit guidance: the teacher
    from neuraldoom import bench

    capsys.readouterr()
    assert bench.main(["--checkpoint", str(out / "checkpoint"), "--quick", "--no-compile", "--frames", "2"]) == 0
    rows = capsys.readouterr().out.splitlines()
    default = [r for r in rows if r.endswith("<")]
    assert len(default) == 1 and " student " in default[0]  # main.py's default is the student's row
    assert rows[-1].startswith("fps=")


def test_a_turn_warped_teachers_student_turns_its_reference_too(tiny_checkpoint, tiny_dataset, tmp_path):
    from training import train_diffusion

    warped = tmp_path / "warp"
    assert train_diffusion.main(["--data", str(tiny_dataset), "--init-from", str(tiny_checkpoint), "--out",
                                 str(warped), "--steps", "1", "--batch", "2", "--max-frames", "300",
                                 "--turn-warp", "--no-compile"]) == 0
    out = tmp_path / "s4"
    assert run(warped / "checkpoint", tiny_dataset, out, "--steps", "4", "--iterations", "2") == 0
    ck = Checkpoint(out / "checkpoint")
    assert ck.denoiser_cfg.turn_warp and ck.student(4).grids is not None
    eng = NeuralEngine(ck, compile=False)
    assert eng.student == 4
    assert eng.step(A.Action.of("MOVE_FORWARD", turn=8.0)).shape == (120, 160, 3)


def test_progressive_chain_then_export_gathers_students_of_one_teacher(tiny_checkpoint, tiny_dataset, tmp_path,
                                                                        capsys):
    p2, p1 = tmp_path / "p2", tmp_path / "p1"
    assert run(tiny_checkpoint, tiny_dataset, p2, "--steps", "2", "--iterations", "20", "--lr", "1e-3") == 0
    log = [json.loads(x)["held_loss"] for x in (p2 / "log.jsonl").read_text().splitlines()]
    assert len(log) == 4 and log[-1] < 0.95 * log[0]  # one step learns to land where the teacher's two do
    # 1 step needs a 2-step sampler to learn from: the tiny checkpoint has none, p2's has
    assert run(tiny_checkpoint, tiny_dataset, tmp_path / "bad", "--steps", "1", "--iterations", "1") == 2
    assert "distil that one first" in capsys.readouterr().err
    assert run(p2 / "checkpoint", tiny_dataset, p1, "--steps", "1", "--iterations", "3",
               "--latents", str(p2 / "latents")) == 0
    ck = Checkpoint(p1 / "checkpoint")
    assert sorted(ck.students) == [1, 2] and ck.students[1]["teacher"] == "2-step student"
    assert ck.students[1]["base"] == ck.students[2]["base"] == weights_digest(ck.denoiser)
    # the 1-step student reused p2's latent cache: nothing was encoded into p1
    assert not (p1 / "latents").exists()
    eng = NeuralEngine(ck, compile=False, steps=1)
    assert eng.student == 1 and len(eng.sampler.plan) == 1
    shipped = tmp_path / "shipped"
    assert export.main(["--checkpoint", str(tiny_checkpoint), "--students", str(p1 / "checkpoint"),
                        "--out", str(shipped)]) == 0
    assert sorted(Checkpoint(shipped).students) == [1, 2]
    assert torch.equal(next(iter(Checkpoint(shipped).student(1).parameters())),
                       next(iter(ck.student(1).parameters())))
    # a student of other weights is refused: one line, exit 2, nothing written
    other = tmp_path / "other"
    assert export.main(["--checkpoint", str(p1 / "checkpoint"), "--out", str(other)]) == 0
    ck2 = Checkpoint(other)
    with torch.no_grad():
        next(iter(ck2.denoiser.parameters())).add_(1.0)
    from neuraldoom.checkpoint import save_checkpoint

    save_checkpoint(other, ck2.ae, ck2.denoiser, ck2.game, ck2.denoiser_cfg, ck2.sampler_cfg, ck2.context_frames,
                    ck2.context_actions)
    capsys.readouterr()
    assert export.main(["--checkpoint", str(other), "--students", str(p1 / "checkpoint"),
                        "--out", str(tmp_path / "mixed")]) == 2
    assert "distilled from other weights" in capsys.readouterr().err
    assert not (tmp_path / "mixed").exists()


def test_distill_resumes_with_the_same_weights_and_refuses_other_flags(tiny_checkpoint, tiny_dataset, tmp_path,
                                                                       capsys):
    out = tmp_path / "d"
    assert run(tiny_checkpoint, tiny_dataset, out, "--steps", "2", "--iterations", "4") == 0
    before = {k: v.clone() for k, v in Checkpoint(out / "checkpoint").student(2).state_dict().items()}
    assert run(tiny_checkpoint, tiny_dataset, out, "--steps", "2", "--iterations", "4") == 0  # spent: no steps
    assert "resuming at step 4" in capsys.readouterr().out
    after = Checkpoint(out / "checkpoint").student(2).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert run(tiny_checkpoint, tiny_dataset, out, "--steps", "4", "--iterations", "5") == 2
    assert "--steps 2" in capsys.readouterr().err


@pytest.mark.parametrize("bad", [["--steps", "0"], ["--steps", "2", "--teacher-steps", "3"],
                                 ["--steps", "3", "--teacher-steps", "3"]])
def test_bad_step_counts_are_one_line(tiny_checkpoint, tiny_dataset, tmp_path, capsys, bad):
    assert run(tiny_checkpoint, tiny_dataset, tmp_path / "x", *bad) == 2
    err = capsys.readouterr().err
    assert err.startswith("distill: ") and err.count("\n") == 1


def test_a_students_compiled_pass_has_its_own_cache_entry(tiny_checkpoint, tiny_dataset, tmp_path):
    from neuraldoom.sampler import package_path

    out = tmp_path / "g4"
    assert run(tiny_checkpoint, tiny_dataset, out, "--steps", "4", "--iterations", "2") == 0
    ck = out / "checkpoint"
    teacher, student = package_path(ck, torch.float32, 1), package_path(ck, torch.float32, 1, student=4)
    assert teacher != student  # never the teacher's package for the student's weights, nor the reverse


def test_the_critic_learns_real_from_fake_and_its_state_round_trips():
    from training.adversarial import Critic, LatentDiscriminator

    torch.manual_seed(0)
    C, h, w = 4, 8, 10
    last = torch.randn(16, C, h, w)
    action = torch.randint(0, 4, (16, 2))
    real = last + 0.1 * torch.randn(16, C, h, w)  # the next frame: a small change of the last one
    fake = torch.randn(16, C, h, w)  # unrelated to it
    critic = Critic(LatentDiscriminator(C, width=16), lr=1e-3)
    assert critic.disc(real, last, action).shape == (16, 1, h // 2, w // 2)
    first = critic.update(real, fake, last, action)
    for _ in range(40):
        loss = critic.update(real, fake, last, action)
    assert first > 1.5 and loss < 0.5 * first  # hinge loss 2 is chance
    assert critic.generator_loss(fake, last, action) > critic.generator_loss(real, last, action)
    t, m = critic.tensors()
    other = Critic(LatentDiscriminator(C, width=16), lr=1e-3)
    assert other.load(t, m) and not Critic(LatentDiscriminator(C, width=16), lr=1e-3).load({}, {})
    assert all(torch.equal(v, other.disc.state_dict()[k]) for k, v in critic.disc.state_dict().items())
    assert torch.equal(other.opt.state_dict()["state"][0]["exp_avg"], critic.opt.state_dict()["state"][0]["exp_avg"])


def test_adversarial_distillation_trains_a_critic_and_resumes_it(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    from neuraldoom.checkpoint import load_state

    out = tmp_path / "adv"
    assert run(tiny_checkpoint, tiny_dataset, out, "--steps", "4", "--iterations", "5", "--adv-weight", "0.5") == 0
    tensors, _ = load_state(out / "train_state.safetensors")
    disc = {k: v for k, v in tensors.items() if k.startswith("disc.")}
    assert disc and any(k.startswith("dopt.") for k in tensors)
    rec = json.loads((out / "log.jsonl").read_text().splitlines()[-1])
    assert {"d_loss", "g_loss", "adv_lambda"} <= rec.keys() and rec["adv_lambda"] > 0
    assert Checkpoint(out / "checkpoint").students[4]["teacher"] == "4-step DDIM, CFG 1.5"
    assert run(tiny_checkpoint, tiny_dataset, out, "--steps", "4", "--iterations", "7", "--adv-weight", "0.5") == 0
    assert "resuming at step 5" in capsys.readouterr().out
    after, _ = load_state(out / "train_state.safetensors")
    assert any(not torch.equal(after[k], v) for k, v in disc.items())  # the critic kept training,
    assert float(after["dopt.0.step"]) == 7  # from its saved state, not from a fresh one
    assert run(tiny_checkpoint, tiny_dataset, tmp_path / "bad", "--adv-weight", "-1") == 2
    err = capsys.readouterr().err
    assert err.startswith("distill: ") and "--adv-weight" in err and err.count("\n") == 1


def test_own_frames_train_the_student_on_what_it_drew(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    """--own-frames 1: every sample's last context frame is the student's own sample of it, so the same seed
    trains other weights than real contexts do; a share outside [0, 1] is one line and exit 2."""
    weights = {}
    for share in ("0", "1"):
        out = tmp_path / f"own{share}"
        assert run(tiny_checkpoint, tiny_dataset, out, "--steps", "1", "--teacher-steps", "4",
                   "--iterations", "3", "--own-frames", share) == 0
        weights[share] = Checkpoint(out / "checkpoint").student(1).state_dict()
    assert any(not torch.equal(weights["0"][k], weights["1"][k]) for k in weights["0"])
    capsys.readouterr()
    assert run(tiny_checkpoint, tiny_dataset, tmp_path / "bad", "--steps", "1", "--own-frames", "1.5") == 2
    err = capsys.readouterr().err
    assert err.startswith("distill: ") and "--own-frames" in err and err.count("\n") == 1


def test_the_gradient_difference_sees_edge_strength_not_level():
    a = torch.randn(2, 3, 6, 8, generator=torch.Generator().manual_seed(0))
    assert distill.gradient_difference(a, a + 5.0).abs().max() < 1e-5  # a shifted level: the same edges
    assert distill.gradient_difference(a, -a).abs().max() < 1e-5  # edges of the same strength, either sign
    blurred = torch.nn.functional.avg_pool2d(a, 3, 1, 1, count_include_pad=False)
    assert (distill.gradient_difference(blurred, a) > 0.1).all()  # a blur loses edge strength


def test_sharp_weight_changes_what_the_student_learns(tiny_checkpoint, tiny_dataset, tmp_path, capsys):
    weights = {}
    for w in ("0", "1"):
        out = tmp_path / f"sharp{w}"
        assert run(tiny_checkpoint, tiny_dataset, out, "--steps", "2", "--iterations", "2", "--sharp-weight", w) == 0
        weights[w] = Checkpoint(out / "checkpoint").student(2).state_dict()
    assert any(not torch.equal(weights["0"][k], weights["1"][k]) for k in weights["0"])
    capsys.readouterr()
    assert run(tiny_checkpoint, tiny_dataset, tmp_path / "bad", "--steps", "2", "--sharp-weight", "-1") == 2
    assert capsys.readouterr().err.startswith("distill: --sharp-weight")
