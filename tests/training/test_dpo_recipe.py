"""The DPO recipe of configs/tiny-dpo.yaml does not collapse (docs/post_training.md, "Collapse").

The start: the e2e model fine-tuned on the chat tasks for 60 steps and exported (an SFT model in
small). Two 32-step one-rank DPO runs from it, each evaluated on the same held-out pairs (whose
``ref_*`` metrics are the start's: the reference is the initial weights) and on 16 held-out
prompts (``train.eval_generate``):

- the old settings (lr 1e-3, no NLL term) raise the preference accuracy while the held-out
  chosen answers' log-prob falls (the collapse, in the eval's ``policy_chosen_logps`` and the
  ledger's ``chosen_logps``), and the greedy answers stop ending their turn;
- the recipe's settings (lr, beta and ``nll_coef`` read from configs/tiny-dpo.yaml) raise the
  held-out chosen log-prob above the start's with a positive margin, and their greedy
  exact-answer accuracy is not below the old settings'.

The accuracy itself is measured from the real SFT model on three seeds in docs/post_training.md;
at this size and length it is near 0 (the checks that tell the settings apart are the log-probs
and the completion length). About 60 s on a loaded 2-core machine (three short 1-rank runs and
an export).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from core.config import load
from tests import launch

pytestmark = pytest.mark.slow

SFT_STEPS, STEPS = 60, 32
E2E = launch.ROOT / "tests" / "configs" / "e2e.yaml"
DPO_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-dpo.yaml"
COMMON = [f"train.max_steps={STEPS}", f"train.eval_interval={STEPS}", "train.eval_batches=2",
          "train.warmup_steps=2", "checkpoint.interval=0",
          "train.eval_generate={source: {path: datasets/tasks/rl/eval, record: prompt}, prompts: 16}"]


def _run_dir(workdir, result):
    assert result.returncode == 0, result.stderr
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


def _sft_start(workdir) -> Path:
    """The e2e model fine-tuned on the chat tasks for a few steps, exported: a start whose
    chosen answers already have some probability, as an SFT model's do."""
    result = launch.train(workdir, [
        "--config", str(E2E), "run.name=dpo-start", "objective.kind=sft", f"train.max_steps={SFT_STEPS}",
        "train.lr=3e-3", "data.seq_len=256", "data.packing=whole", "checkpoint.interval=0",
        "data.sources=[{path: datasets/tasks/sft/train, record: chat}]", "data.eval_source=null"], nproc=1)
    out = workdir / "dpo-start-export"
    export = launch.run_module(workdir, ["training", "export", "--run", str(_run_dir(workdir, result)), "--to", str(out)],
                               timeout=120)
    assert export.returncode == 0, export.stderr
    return out


def _run(workdir, name: str, start: Path, overrides: list[str]):
    result = launch.train(workdir, ["--config", str(DPO_CONFIG), f"run.name={name}", f"model.init_from={start}",
                                    *COMMON, *overrides], nproc=1)
    run_dir = _run_dir(workdir, result)
    evals = [e for e in launch.events(run_dir) if e["event"] == "eval"]
    return launch.ledger(run_dir), evals[-1]["metrics"]


def test_the_recipe_keeps_the_chosen_answers_while_the_old_settings_collapse(e2e_workdir):
    recipe = load(launch.ROOT / "configs" / "tiny-dpo.yaml")
    assert recipe.objective.dpo.nll_coef > 0
    start_dir = _sft_start(e2e_workdir)
    old_ledger, old = _run(e2e_workdir, "dpo-old", start_dir, ["train.lr=1e-3", "objective.dpo.beta=0.1",
                                                                "objective.dpo.nll_coef=0"])
    new_ledger, new = _run(e2e_workdir, "dpo-recipe", start_dir, [
        f"train.lr={recipe.train.lr}", f"objective.dpo.beta={recipe.objective.dpo.beta}",
        f"objective.dpo.nll_coef={recipe.objective.dpo.nll_coef}"])
    assert old["ref_chosen_logps"] == new["ref_chosen_logps"]  # the same start, the same held-out pairs
    start = old["ref_chosen_logps"]
    # The old settings: preference accuracy up, the chosen answers' log-prob down (collapse).
    assert old["accuracies"] > 0.5
    assert old["policy_chosen_logps"] < start - 5.0
    assert max(line["chosen_logps"] for line in old_ledger[-4:]) < old_ledger[0]["chosen_logps"] - 10.0
    # The recipe: the chosen answers become more likely, and the preference is learned too.
    assert new["policy_chosen_logps"] > start
    assert new["margins"] > 0 and new["accuracies"] > 0.5
    assert new["generate/prompts"] == old["generate/prompts"] == 16
    assert new["generate/accuracy"] >= old["generate/accuracy"]
    # collapsed answers stop ending their turn: they run to max_new_tokens
    assert old["generate/completion_len"] > new["generate/completion_len"]
    for line in new_ledger:
        assert {"chosen_logps", "rejected_logps"} <= set(line)
