"""Distillation keeps every guarantee of the loop, end to end on CPU ranks (tests/configs/e2e-distill.yaml):

- a larger tiny teacher is pretrained first (a Lockstep run); the student names it ``run:ID``;
- SIGKILL of the 2-rank student job at random moments, then resume, ends with a ledger
  identical to an uninterrupted run's; the teacher's identity is in every checkpoint;
- replay of a step before and after a checkpoint verifies;
- 2 ranks -> resume on 1 rank keeps the batch hashes;
- accumulation 8x1 vs 2x4 on one rank: the same loss;
- a teacher with another vocabulary is a config error naming both sizes (exit 2, no run dir).
"""

from __future__ import annotations

import json

import pytest

from tests import launch

pytestmark = pytest.mark.slow

STEPS = 8
E2E = launch.ROOT / "tests" / "configs" / "e2e.yaml"
DISTILL_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-distill.yaml"
TEACHER = ["model.hidden_size=96", "model.intermediate_size=192", "model.num_layers=3", "parallel.strategy=none"]


def _run_dir(workdir, result):
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


def _teacher(workdir, name, extra=()):
    result = launch.train(workdir, ["--config", str(E2E), f"run.name={name}", "train.max_steps=6", *TEACHER, *extra],
                          nproc=1)
    assert result.returncode == 0, result.stderr
    return _run_dir(workdir, result)


@pytest.fixture(scope="module")
def teacher(e2e_workdir):
    return _teacher(e2e_workdir, "teacher")


def distill_args(teacher, *, max_steps: int = STEPS, name: str = "distill", overrides=()) -> list[str]:
    return ["--config", str(DISTILL_CONFIG), f"run.name={name}", f"train.max_steps={max_steps}",
            f"objective.distill.teacher=run:{teacher.name}", *overrides]


@pytest.fixture(scope="module")
def reference(e2e_workdir, teacher):
    result = launch.train(e2e_workdir, distill_args(teacher), nproc=2)
    assert result.returncode == 0, result.stderr
    return _run_dir(e2e_workdir, result)


def test_distill_ledger_and_teacher_identity(reference, teacher):
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert all(r["trained_tokens"] == r["target_tokens"] > 0 for r in lines)
    assert lines[-1]["loss"] < lines[0]["loss"]
    state = json.loads(next((reference / "checkpoints").glob("step_*/objective_state.json")).read_text())
    assert state["frozen"]["teacher"]["path"] == f"run:{teacher.name}"
    assert len(state["frozen"]["teacher"]["sha256"]) == 64


def test_distill_sigkill_at_random_moments_then_resume_is_identical(e2e_workdir, teacher, reference):
    run_dir = launch.kill_and_resume(e2e_workdir, distill_args(teacher, name="distill-killed"), name="distill-killed", seed=11)
    assert launch.ledger(run_dir) == launch.ledger(reference)


def test_distill_replay_verifies_before_and_after_a_checkpoint(e2e_workdir, reference):
    for step in (3, 6):
        result = launch.train(e2e_workdir, ["--replay", reference.name, "--step", str(step)], nproc=2)
        assert result.returncode == 0, result.stderr
        assert "match" in result.stdout


def test_distill_resume_on_one_rank_keeps_the_batch_hashes(e2e_workdir, reference):
    launch.one_rank_resume_keeps_the_batches(e2e_workdir, reference)


def test_distill_accumulation_does_not_change_the_loss(e2e_workdir, teacher):
    runs = [launch.train(e2e_workdir, distill_args(teacher, max_steps=2, name=f"distill-acc{m}", overrides=[
        f"train.micro_batch_size={m}", "parallel.strategy=none"]), nproc=1) for m in (1, 4)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    a, b = (launch.ledger(_run_dir(e2e_workdir, r)) for r in runs)
    assert [r["batch_hash"] for r in a] == [r["batch_hash"] for r in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)


def test_a_teacher_with_another_vocabulary_is_a_config_error(e2e_workdir):
    other = _teacher(e2e_workdir, "teacher-vocab", ["model.vocab_size=384", "train.max_steps=1"])
    result = launch.train(e2e_workdir, distill_args(other, max_steps=1, name="distill-vocab"), nproc=1)
    assert result.returncode == 2, result.stderr
    assert "384" in result.stderr and "512" in result.stderr and "vocabulary" in result.stderr
    assert not list((e2e_workdir / "runs").glob("distill-vocab-*"))


def test_distill_gathered_embedding_grad_matches_dense(e2e_workdir, teacher):
    """parallel.ddp_embedding_grad=gathered (docs/parallelism.md) on the student."""
    small_step = ["parallel.strategy=ddp", "train.global_batch_size=4", "train.micro_batch_size=1"]
    launch.gathered_embedding_grad_matches_dense(e2e_workdir, lambda how: distill_args(
        teacher, max_steps=3, name=f"distill-embedding-{how}", overrides=[*small_step, f"parallel.ddp_embedding_grad={how}"]))
