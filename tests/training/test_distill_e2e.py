"""Distillation end to end on CPU ranks (tests/configs/e2e-distill.yaml). A larger tiny teacher
is pretrained first (a Lockstep run, tests/methods.py); the student names it ``run:ID``. The four
guarantees are the ``distill`` row of tests/training/test_guarantees.py; here, what is
particular to distillation:

- the teacher's identity (path and sha256) is in every checkpoint;
- a teacher with another vocabulary is a config error naming both sizes (exit 2, no run dir);
- the gathered embedding gradient matches the dense one on the student.
"""

from __future__ import annotations

import json

import pytest

from tests import launch
from tests.methods import DISTILL, train_teacher

pytestmark = pytest.mark.slow

STEPS = DISTILL.steps
DISTILL_CONFIG = DISTILL.config_path


@pytest.fixture
def teacher(e2e_workdir, reference_runs):
    """The ``distill`` row's teacher run (``objective.distill.teacher=run:<its ID>``)."""
    run_id = reference_runs.prepared(DISTILL, "objective.distill.teacher").removeprefix("run:")
    return e2e_workdir / "runs" / run_id


def distill_args(teacher, *, max_steps: int = STEPS, name: str = "distill", overrides=()) -> list[str]:
    return ["--config", str(DISTILL_CONFIG), f"run.name={name}", f"train.max_steps={max_steps}",
            f"objective.distill.teacher=run:{teacher.name}", *overrides]


@pytest.fixture
def reference(reference_runs):
    return reference_runs.run(DISTILL)


def test_distill_ledger_and_teacher_identity(reference, teacher):
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert all(r["trained_tokens"] == r["target_tokens"] > 0 for r in lines)
    assert lines[-1]["loss"] < lines[0]["loss"]
    state = json.loads(next((reference / "checkpoints").glob("step_*/objective_state.json")).read_text())
    assert state["frozen"]["teacher"]["path"] == f"run:{teacher.name}"
    assert len(state["frozen"]["teacher"]["sha256"]) == 64


def test_a_teacher_with_another_vocabulary_is_a_config_error(e2e_workdir):
    other = train_teacher(e2e_workdir, "teacher-vocab", ["model.vocab_size=384", "train.max_steps=1"])
    result = launch.train(e2e_workdir, distill_args(other, max_steps=1, name="distill-vocab"), nproc=1)
    assert result.returncode == 2, result.stderr
    assert "384" in result.stderr and "512" in result.stderr and "vocabulary" in result.stderr
    assert not list((e2e_workdir / "runs").glob("distill-vocab-*"))


def test_distill_gathered_embedding_grad_matches_dense(e2e_workdir, teacher):
    """parallel.ddp_embedding_grad=gathered (docs/parallelism.md) on the student."""
    small_step = ["parallel.strategy=ddp", "train.global_batch_size=4", "train.micro_batch_size=1"]
    launch.gathered_embedding_grad_matches_dense(e2e_workdir, lambda how: distill_args(
        teacher, max_steps=3, name=f"distill-embedding-{how}", overrides=[*small_step, f"parallel.ddp_embedding_grad={how}"]))
