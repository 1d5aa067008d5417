"""benchmarks/recipes.py: the proof of the real-checkpoint recipes, its CPU path (--tiny) end to end
for one recipe (random checkpoint, reference run, SIGKILL + resume with the same ledger, export,
transformers' load), and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import recipes as bench
from tests import launch


def test_every_recipe_config_has_a_proof():
    configs = {p.stem for p in (launch.ROOT / "configs").glob("qwen*.yaml")
               if p.stem.endswith(("-sft", "-dpo", "-grpo", "-rm", "-ppo"))}
    assert set(bench.RECIPES) == configs


def test_an_unknown_recipe_or_missing_data_is_refused_naming_it(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", str(tmp_path), "--recipes", "qwen3-0.6b-sftt"])
    assert exit_info.value.code == 2 and "qwen3-0.6b-sftt" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", str(tmp_path), "--workdir", str(tmp_path)])
    assert exit_info.value.code == 2 and "datasets/tasks/sft/train" in capsys.readouterr().err


@pytest.mark.slow
def test_the_proof_of_a_recipe_runs_whole_on_cpu(tmp_path, qwen_vocabulary, monkeypatch, capsys):
    """The proof's ``main`` runs here; each command it starts (the random checkpoint, the runs,
    the export and its check) starts as tests/launch.py starts a job, with the suite's environment:
    a fork of the zygote's import where it is ``python SCRIPT.py`` (about 4 CPU-s less each)."""
    from data.tasks import write_task_datasets

    def start(cmd: list[str], log: bench.Log, cwd: Path):
        log.command(cmd)
        with log.path.open("a") as handle:
            return launch.popen(cmd, cwd, launch.env(cwd), output=handle.fileno())

    monkeypatch.setattr(bench, "start", start)
    write_task_datasets(tmp_path / "datasets" / "tasks", seed=0, train_n=128, eval_n=8, shards=8)
    out = tmp_path / "out"
    code = bench.main(["--tiny", "--steps", "6", "--recipes", "qwen3-0.6b-sft", "--out", str(out), "--work",
                       str(tmp_path / "work"), "--workdir", str(tmp_path), "--tokenizer",
                       str(launch.ROOT / qwen_vocabulary)])
    log = out / "qwen3-0.6b-sft.log"
    assert code == 0, capsys.readouterr().out[-3000:] + (log.read_text() if log.is_file() else "")
    result = json.loads((out / "recipes.json").read_text())["recipes"]["qwen3-0.6b-sft"]
    assert result["reference"]["step_time_s"] > 0
    assert any(line.startswith("step 1/6") for line in result["reference"]["console"]["head"])
    killed = result["kill_resume"]
    # Killed after its checkpoint at step 3 and before the end: the resume restored it.
    assert killed["ledger_identical"] and killed["latest_at_kill"] == "step_00000003"
    assert 3 < killed["killed_after_lines"] < 6
    loaded = result["export"]["transformers"]
    assert loaded["class"] == "Qwen3ForCausalLM" and loaded["finite"] and loaded["generated_tokens"] == 8
    assert loaded["max_abs_logit_diff"] <= 1e-5
