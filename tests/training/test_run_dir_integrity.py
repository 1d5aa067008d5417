"""A run directory is evidence: resume, replay, export and generate verify what they read.

- config.yaml is verified against the hash meta.json records (and the run ID's hash part)
  before anything it names is used: an edited ``train.lr`` is exit 4 naming the key, and an
  edited config naming a module written into the run's ``artifacts/`` is exit 4 without the
  module ever running; code is never imported from inside a run dir, and a relative reward
  name is a config error (exit 2);
- ledger lines whose checkpoints are gone (step dirs or checkpoints/ deleted) are exit 4,
  never a restart at step 1 over the record; a ledger with a deleted middle line or a torn
  line at a checkpointed step is exit 4 naming it;
- the ledger is fsynced at every checkpoint step's line, before that checkpoint is saved;
- a NaN answer in a prompt record is blamed on the record (file, record), not on a reward.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from core.config import load
from core.exceptions import CheckpointError, ConfigError, DataError, ResumeError
from core.layout import RunPaths
from core.run_context import load_recorded_config
from data.pipeline.pipeline import build
from tests import launch
from tests.e2e_config import e2e_args
from training.record import ledger as ledger_lib
from training.cli.export import export
from training.cli.generate import load_source
from training.rollout.rewards import numeric_tolerance, resolve_reward, score
from training.record.recorder import LedgerWriter

STEPS = 6  # checkpoints at steps 2, 4 and 6


@pytest.fixture(scope="module")
def reference(e2e_workdir):
    """A finished 6-step run (one process) with checkpoints at steps 2, 4 and 6."""
    result = launch.train(
        e2e_workdir,
        e2e_args(max_steps=STEPS, name="integrity", overrides=["checkpoint.interval=2", "run.root=runs-integrity"]),
        nproc=1,
    )
    assert result.returncode == 0, result.stderr
    return e2e_workdir / result.run_dir


def _copy(run_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "runs"
    shutil.copytree(run_dir, root / run_dir.name)
    return root, root / run_dir.name


def _resume(workdir: Path, root: Path, run_id: str, *extra: str, env: dict | None = None) -> launch.Result:
    command = launch.command(1, ["--resume", run_id, f"run.root={root}", *extra])
    proc = subprocess.run(command, cwd=workdir, env=env or launch.env(workdir), capture_output=True, text=True,
                          timeout=300)
    return launch.Result(proc.returncode, proc.stdout, proc.stderr)


def _edit_config(run_dir: Path, edit) -> None:
    raw = yaml.safe_load((run_dir / "config.yaml").read_text())
    edit(raw)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=True))


# --------------------------------------------------------------------------- config.yaml


@pytest.mark.slow  # the reference run trains in a subprocess
def test_an_edited_learning_rate_is_refused_by_resume_replay_export_and_generate(reference, e2e_workdir, tmp_path):
    root, copy = _copy(reference, tmp_path)
    _edit_config(copy, lambda raw: raw["train"].update(lr=0.3))
    ledger_before = (copy / "ledger.jsonl").read_bytes()
    resumed = _resume(e2e_workdir, root, copy.name, "train.max_steps=8")
    assert resumed.exit_code == 4, resumed.stdout + resumed.stderr
    assert "train.lr (0.003 -> 0.3)" in resumed.stderr
    assert (copy / "ledger.jsonl").read_bytes() == ledger_before
    replayed = launch.train(e2e_workdir, ["--replay", copy.name, "--step", "3", f"run.root={root}"], nproc=1)
    assert replayed.exit_code == 4 and "train.lr" in replayed.stderr, replayed.stderr
    with pytest.raises(ResumeError, match=r"train\.lr"):  # export and generate read it the same way
        export(RunPaths(copy), tmp_path / "hf")
    with pytest.raises(ResumeError, match=r"train\.lr"):
        load_source(str(copy), root=str(root), step=None, device=torch.device("cpu"))
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow  # the reference run trains in a subprocess
def test_a_module_written_into_the_run_dir_and_named_by_an_edited_config_never_runs(
        reference, e2e_workdir, tmp_path):
    root, copy = _copy(reference, tmp_path)
    marker = tmp_path / "evil-ran"
    (copy / "artifacts" / "evil.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).touch()\n\ndef fn(completion, answer, prompt):\n    return 1.0\n")

    def to_grpo(raw):  # a GRPO config whose reward is the planted module (importable from root's parent)
        raw["objective"]["kind"] = "grpo"
        raw["objective"]["grpo"]["rewards"] = [{"name": f"runs.{copy.name}.artifacts.evil:fn", "weight": 1.0,
                                                "pattern": "", "tol": 0.0}]
        raw["objective"]["grpo"]["kl_coef"] = 0.0
        raw["data"]["sources"] = [{**raw["data"]["sources"][0], "path": "datasets/tasks/rl/train",
                                   "record": "prompt"}]

    _edit_config(copy, to_grpo)
    env = launch.env(e2e_workdir)
    env["PYTHONPATH"] = os.pathsep.join([str(launch.ROOT), str(root.parent)])  # the run dir is importable
    resumed = _resume(e2e_workdir, root, copy.name, env=env)
    assert resumed.exit_code == 4, resumed.stdout + resumed.stderr
    assert "objective.kind ('causal_lm' -> 'grpo')" in resumed.stderr
    command = launch.command(1, ["--replay", copy.name, "--step", "3", f"run.root={root}"])
    replayed = subprocess.run(command, cwd=e2e_workdir, env=env, capture_output=True, text=True, timeout=300)
    assert replayed.returncode == 4, replayed.stderr
    assert not marker.exists()


def test_code_inside_a_run_dir_is_never_imported_even_from_a_verified_config(tmp_path, monkeypatch):
    run_dir = tmp_path / "runs" / "planted"
    (run_dir / "rewards").mkdir(parents=True)
    for name in ("config.yaml", "meta.json"):
        (run_dir / name).write_text("{}")
    marker = tmp_path / "ran"
    (run_dir / "rewards" / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    (run_dir / "rewards" / "score.py").write_text("def fn(completion, answer, prompt):\n    return 1.0\n")
    (run_dir / "loose").mkdir()  # namespace packages (no __init__.py) on the way, too
    (run_dir / "loose" / "score.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path / "runs"))
    for name in ("planted.rewards.score:fn", "planted.loose.score:fn"):
        with pytest.raises(ConfigError, match="inside the run directory") as info:
            resolve_reward(name, weight=1.0)
        assert info.value.exit_code == 2 and not marker.exists()
    assert "planted" not in sys.modules


def test_a_relative_reward_name_is_a_config_error():
    with pytest.raises(ConfigError, match="relative module path") as info:
        resolve_reward(".evil:fn", weight=1.0)
    assert info.value.exit_code == 2
    assert info.value.context["key"] == "objective.grpo.rewards.name"


@pytest.mark.slow  # the reference run trains in a subprocess
def test_a_run_dir_from_before_the_recorded_config_still_verifies(reference, tmp_path):
    _, copy = _copy(reference, tmp_path)
    meta = json.loads((copy / "meta.json").read_text())
    del meta["config"]  # meta.json as runs wrote it before the resolved config was recorded
    (copy / "meta.json").write_text(json.dumps(meta))
    assert load_recorded_config(RunPaths(copy)).hash == meta["config_hash"]
    _edit_config(copy, lambda raw: raw["train"].update(seed=7))
    with pytest.raises(ResumeError, match="cannot be named") as info:
        load_recorded_config(RunPaths(copy))
    assert info.value.exit_code == 4


@pytest.mark.slow  # the reference run trains in a subprocess
def test_meta_json_edited_along_with_config_yaml_is_caught_by_the_run_id(reference, tmp_path):
    _, copy = _copy(reference, tmp_path)
    _edit_config(copy, lambda raw: raw["train"].update(lr=0.3))
    meta = json.loads((copy / "meta.json").read_text())
    meta["config_hash"] = load(copy / "config.yaml").hash
    meta["config"]["train"]["lr"] = 0.3
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ResumeError, match="run ID's hash part"):
        load_recorded_config(RunPaths(copy))


@pytest.mark.slow  # the reference run trains in a subprocess
def test_a_frozen_run_source_with_an_edited_config_is_refused(reference, tmp_path):
    from training.objectives.frozen import frozen_tokenizer

    root, copy = _copy(reference, tmp_path)
    policy = load("tests/configs/e2e.yaml", [f"run.root={root}"])
    untouched = load_recorded_config(RunPaths(copy))
    assert frozen_tokenizer(policy, f"run:{copy.name}", key="objective.dpo.reference") == untouched.data.tokenizer
    _edit_config(copy, lambda raw: raw["model"].update(hidden_size=raw["model"]["hidden_size"] * 2))
    with pytest.raises(ResumeError, match="model.hidden_size") as info:
        frozen_tokenizer(policy, f"run:{copy.name}", key="objective.dpo.reference")
    assert info.value.exit_code == 4


# --------------------------------------------------------------------------- ledger and checkpoints


@pytest.mark.slow  # the reference run trains in a subprocess
def test_ledger_lines_whose_step_dirs_were_deleted_are_refused_not_restarted_at_step_1(
        reference, e2e_workdir, tmp_path):
    root, copy = _copy(reference, tmp_path)
    for path in (copy / "checkpoints").glob("step_*"):
        shutil.rmtree(path)
    before = (copy / "ledger.jsonl").read_bytes()
    result = _resume(e2e_workdir, root, copy.name, "train.max_steps=8")
    assert result.exit_code == 4, result.stdout + result.stderr
    assert "LATEST names step 6, whose directory step_00000006 is missing" in result.stderr
    assert "steps 1..6" in result.stderr
    assert (copy / "ledger.jsonl").read_bytes() == before


class _OneRank:
    is_main = True

    @staticmethod
    def broadcast_object(obj):
        return obj


@pytest.mark.slow  # the reference run trains in a subprocess
@pytest.mark.parametrize(("delete", "evidence"), [
    ("checkpoints_dir", "checkpoints is missing"),
    ("everything_in_checkpoints", "the checkpoint of step 2 was written"),
])
def test_ledger_lines_whose_checkpoints_dir_was_emptied_or_deleted_are_refused(reference, tmp_path, delete, evidence):
    _, copy = _copy(reference, tmp_path)
    checkpoints = copy / "checkpoints"
    if delete == "checkpoints_dir":
        shutil.rmtree(checkpoints)
    else:
        for path in checkpoints.iterdir():
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    before = (copy / "ledger.jsonl").read_bytes()
    writer = LedgerWriter(copy / "ledger.jsonl", _OneRank())
    checkpoints.mkdir(exist_ok=True)  # as the checkpoint manager, built after the writer, does
    with pytest.raises(CheckpointError, match=evidence) as info:
        writer.restored(0)  # what the trainer reports when no checkpoint is left
    assert "steps 1..6" in str(info.value) and info.value.exit_code == 4
    assert (copy / "ledger.jsonl").read_bytes() == before


@pytest.mark.slow  # the reference run trains in a subprocess
def test_ledger_lines_after_a_kept_checkpoint_are_still_replaced(reference, tmp_path):
    """A resume from the newest checkpoint (or one rolled back to through LATEST) drops the
    lines after it as before: only evidence of a lost newer checkpoint refuses it."""
    _, copy = _copy(reference, tmp_path)
    writer = LedgerWriter(copy / "ledger.jsonl", _OneRank())
    writer.restored(4)
    assert [r["step"] for r in ledger_lib.read(copy / "ledger.jsonl")] == [1, 2, 3, 4]


@pytest.mark.slow  # the reference run trains in a subprocess
def test_a_deleted_middle_ledger_line_is_refused_by_resume_and_replay(reference, e2e_workdir, tmp_path):
    root, copy = _copy(reference, tmp_path)
    lines = (copy / "ledger.jsonl").read_text().splitlines(keepends=True)
    gapped = "".join(lines[:2] + lines[3:])  # step 3's line deleted
    (copy / "ledger.jsonl").write_text(gapped)
    resumed = _resume(e2e_workdir, root, copy.name, "train.max_steps=8")
    assert resumed.exit_code == 4, resumed.stdout + resumed.stderr
    assert "ledger line 3 is step 4, expected step 3" in resumed.stderr
    assert (copy / "ledger.jsonl").read_text() == gapped
    replayed = launch.train(e2e_workdir, ["--replay", copy.name, "--step", "5", f"run.root={root}"], nproc=1)
    assert replayed.exit_code == 4 and "ledger line 3" in replayed.stderr, replayed.stderr


@pytest.mark.slow  # the reference run trains in a subprocess
def test_a_torn_ledger_line_at_a_checkpointed_step_is_refused(reference, e2e_workdir, tmp_path):
    root, copy = _copy(reference, tmp_path)
    data = (copy / "ledger.jsonl").read_bytes()
    torn = data[: len(data) - 20]  # step 6's line, which checkpoint step 6 covers, cut short
    (copy / "ledger.jsonl").write_bytes(torn)
    result = _resume(e2e_workdir, root, copy.name, "train.max_steps=8")
    assert result.exit_code == 4, result.stdout + result.stderr
    assert "ledger ends at step 5 but the checkpoint restored is of step 6" in result.stderr
    assert "torn last line" in result.stderr
    assert (copy / "ledger.jsonl").read_bytes() == torn


def test_ledger_sequence_and_checkpoint_evidence(tmp_path):
    path = tmp_path / "ledger.jsonl"
    records = [{"step": s} for s in (1, 2, 3)]
    ledger_lib.check_sequence(records, path)
    with pytest.raises(CheckpointError, match="a step repeats"):
        ledger_lib.check_sequence(records + [{"step": 3}], path)
    with pytest.raises(CheckpointError, match="a line is missing"):
        ledger_lib.check_sequence([{"step": 2}], path)
    # param_hash at checkpoint steps 2 and 4: only a line after step 4 proves step 2's save
    marked = [{"step": s, **({"param_hash": "h"} if s % 2 == 0 else {})} for s in range(1, 7)]
    assert ledger_lib.completed_checkpoint_step(marked[:4]) is None
    assert ledger_lib.completed_checkpoint_step(marked[:5]) == 2
    assert ledger_lib.completed_checkpoint_step(marked) == 2


def test_ledger_is_fsynced_at_every_checkpoint_line(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(Path(f"/proc/self/fd/{fd}").resolve().read_bytes().count(b"\n"))
        real_fsync(fd)

    monkeypatch.setattr(ledger_lib.os, "fsync", fsync)
    ledger = ledger_lib.Ledger(tmp_path / "ledger.jsonl", writer=True)
    for step in range(1, 8):  # checkpoints at steps 3 and 6, the last step 7
        ledger.append({"step": step, "loss": 1.0, **({"param_hash": "h"} if step in (3, 6, 7) else {})})
    # Each fsync covers the whole file: every line up to a checkpoint's is on disk before it is saved.
    assert synced == [3, 6, 7]


# --------------------------------------------------------------------------- records


def test_a_nan_answer_is_blamed_on_the_record(tmp_path):
    path = tmp_path / "prompts.jsonl"
    records = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(40)]
    records[3] = {"prompt": "What is 3 + 1?", "answer": float("nan")}  # written as NaN, as json allows
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = load(None, [f"data.sources=[{{path: {path}, record: prompt}}]", "data.seq_len=128",
                         "data.num_streams=1", "train.global_batch_size=2"])
    with pytest.raises(DataError, match="not a finite number") as info:
        with build(config.data, seed=0, global_batch_size=2, rank=0, world_size=1) as pipe:
            for _ in range(4):
                next(pipe)
    assert info.value.context["file"] == str(path) and info.value.context["record"] == 4  # line 4


def test_a_nan_answer_text_is_a_data_error_not_the_reward_functions(tmp_path):
    with pytest.raises(ValueError):
        numeric_tolerance("4", "nan")
    rewards = [resolve_reward("numeric_tolerance", weight=1.0)]
    with pytest.raises(DataError, match="the prompt's data record is bad") as info:
        score(rewards, "4", "nan", "What is 3 + 1?", where="step 1, prompt row 3, sample 0", on_error="zero")
    assert info.value.context == {"sample": "step 1, prompt row 3, sample 0"} and info.value.exit_code == 3


@pytest.mark.slow  # a GRPO step in a subprocess
def test_a_nan_answer_text_in_a_grpo_run_names_the_file_and_record(e2e_workdir, tmp_path):
    path = tmp_path / "prompts.jsonl"
    records = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    records.insert(1, {"prompt": "What is 0 + 0?", "answer": "nan"})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    result = launch.train(e2e_workdir, [
        "--config", str(launch.ROOT / "tests" / "configs" / "e2e-grpo.yaml"), "run.name=grpo-nan", "train.max_steps=1",
        f"data.sources=[{{path: {path}, record: prompt}}]", "data.num_streams=1", "train.global_batch_size=4",
        "objective.grpo.kl_coef=0", "objective.grpo.rewards=[{name: numeric_tolerance}]",
        "objective.grpo.on_reward_error=zero"], nproc=1)
    assert result.returncode == 3, result.stderr
    assert f"(file {path}, record 1)" in result.stderr and "data record is bad" in result.stderr, result.stderr
