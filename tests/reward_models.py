"""The guarantee table's rows with a trained reward model as a reward, and what their e2e files share
(tests/training/test_grpo_model_reward_e2e.py, test_ppo_model_reward_e2e.py).

``with_model_reward`` turns a row of the table (tests/methods.py) into the same method with a
reward model beside exact_answer: its ``prepare`` trains a 4-step reward-model run
(tests/configs/e2e-rm.yaml) on one rank and names it, by ``run:RUN_DIR`` or by its export (a
directory named after the run). ``changed_on_disk_refuses_the_resume`` is the check both files make
of a reward model whose weights change between a run and its resume.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

from tests import launch
from tests.guarantees import Method, References, run_dir

RM_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-rm.yaml"


def train_reward_model(workdir: Path, name: str) -> Path:
    """A 4-step reward-model run (tests/configs/e2e-rm.yaml) on one rank: its run dir."""
    result = launch.train(workdir, ["--config", str(RM_CONFIG), f"run.name={name}", "train.max_steps=4"], nproc=1)
    assert result.returncode == 0, result.stderr
    return run_dir(workdir, result)


def export(workdir: Path, run: Path, to: Path) -> Path:
    """``python -m training export`` of the reward model's run: its Hugging Face directory."""
    done = launch.run_module(workdir, ["training", "export", "--run", str(run), "--to", str(to)])
    assert done.returncode == 0, done.stderr
    return to


def rewards_override(kind: str, path: str) -> str:
    """``objective.<kind>.rewards``: exact_answer (weight 1) and the reward model at ``path`` (weight 0.5)."""
    return (f"objective.{kind}.rewards=[{{name: exact_answer, weight: 1.0}}, "
            f"{{name: model, path: '{path}', weight: 0.5}}]")


def with_model_reward(row: Method, *, kind: str, exported: bool, e2e_file: str, **changes) -> Method:
    """``row`` with a reward model as its second reward (``rewards_override``), named
    ``<row>-model-reward``: the reward-model run ``rm-<row>``, or its export when ``exported``."""
    def prepare(workdir: Path) -> tuple[str, ...]:
        run = train_reward_model(workdir, f"rm-{row.name}")
        path = str(export(workdir, run, workdir / f"{run.name}-hf")) if exported else f"run:{run}"
        return (rewards_override(kind, path),)

    return dataclasses.replace(row, name=f"{row.name}-model-reward", prepare=prepare, e2e_file=e2e_file, **changes)


def reward_model_path(refs: References, method: Method, *, kind: str) -> str:
    """The reward model's ``path`` that ``method``'s ``prepare`` gave (``run:RUN_DIR`` or an export)."""
    return yaml.safe_load(refs.prepared(method, f"objective.{kind}.rewards"))[1]["path"]


def exported_run(export_dir: Path) -> Path:
    """The reward-model run that ``with_model_reward(exported=True)`` exported to ``export_dir``."""
    return export_dir.parent / "runs" / export_dir.name.removesuffix("-hf")


def dist() -> SimpleNamespace:
    """The rank facts ``build_model_reward`` reads, for one CPU process."""
    return SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo")


def checkpoint_frozen(run: Path, step: int) -> dict[str, dict[str, str]]:
    """The frozen models' identities recorded in the run's checkpoint ``step``."""
    from training.checkpoint.load import OBJECTIVE_PART
    from training.checkpoint.manifest import state_file_name

    checkpoint = run / "checkpoints" / f"step_{step:08d}"
    return json.loads((checkpoint / state_file_name(OBJECTIVE_PART)).read_text())["frozen"]


def changed_on_disk_refuses_the_resume(workdir: Path, args: list[str], hf_dir: Path, *, config: Path,
                                       key: str) -> None:
    """``args`` (a 2-step run with the reward model ``hf_dir``, config key ``key``) on one rank; then
    the reward model's score head doubled on disk: the resume exits 4 naming the recorded hash and
    the changed one."""
    from safetensors.torch import load_file, save_file

    from core import config as config_lib
    from training.objectives.model_reward import build_model_reward

    result = launch.train(workdir, args, nproc=1)
    assert result.returncode == 0, result.stderr
    run = run_dir(workdir, result)
    tensors = load_file(str(hf_dir / "model.safetensors"))
    tensors["score.weight"] = tensors["score.weight"] * 2  # the reward model changes on disk
    save_file(tensors, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    resumed = launch.train(workdir, ["--resume", run.name, "train.max_steps=4"], nproc=1)
    assert resumed.returncode == 4, resumed.stderr
    before = checkpoint_frozen(run, 2)["reward"]["sha256"]
    after = build_model_reward(config_lib.load(str(config)), str(hf_dir), dist=dist(), key=key).identity["sha256"]
    assert before != after and before in resumed.stderr and after in resumed.stderr  # both hashes named
    assert "reward" in resumed.stderr
