"""What a user sees of a DPO and a GRPO run, end to end on one CPU process: the step and eval
lines carry each method's fields with their true units (pairs, completions, prompts), equal to
the ledger and the eval events; ``runs plot`` draws those same numbers, eval curves included,
per run and compared."""

from __future__ import annotations

import json
import re

import pytest

from tests import launch

pytestmark = pytest.mark.slow

CONFIGS = launch.ROOT / "tests" / "configs"
EVAL = ["train.max_steps=2", "train.eval_interval=2", "train.eval_batches=1"]
RUNS = {
    "dpo": ["--config", str(CONFIGS / "e2e-dpo.yaml"), "run.name=console-dpo", *EVAL],
    "grpo": ["--config", str(CONFIGS / "e2e-grpo.yaml"), "run.name=console-grpo", *EVAL,
             "data.eval_source={path: datasets/tasks/rl/eval, record: prompt}", "objective.grpo.eval_samples=2"],
}


@pytest.fixture(scope="module")
def runs(e2e_workdir):
    out = {}
    for kind, args in RUNS.items():
        result = launch.train(e2e_workdir, args, nproc=1, timeout=300)
        assert result.returncode == 0, result.stderr
        run_dir = result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir
        out[kind] = (result.stdout, run_dir)
    return out


def _step_lines(stdout: str) -> dict[int, dict[str, str]]:
    """``step 2/2 | loss 0.6961 per pair | accuracy 0.2500 | ...`` -> {2: {"loss": "0.6961 per pair", ...}}."""
    lines = {}
    for line in stdout.splitlines():
        match = re.fullmatch(r"step (\d+)/\d+ \| (.*)", line)
        if match:
            lines[int(match[1])] = _fields(match[2])
    return lines


def _eval_line(stdout: str) -> tuple[int, int, str, dict[str, str]]:
    (match,) = [m for m in map(lambda l: re.fullmatch(r"eval step (\d+) over (\d+) (\w+): (.*)", l),
                                stdout.splitlines()) if m]
    return int(match[1]), int(match[2]), match[3], _fields(match[4])


def _fields(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(" | "):
        label, _, value = part.partition(" ") if part.startswith("loss ") else part.rpartition(" ")
        out[label] = value
    return out


def test_dpo_lines_count_pairs_and_show_the_preference_fields(runs):
    stdout, run_dir = runs["dpo"]
    steps, ledger = _step_lines(stdout), launch.ledger(run_dir)
    assert sorted(steps) == [1, 2]
    for line in ledger:
        shown = steps[line["step"]]
        assert shown["loss"] == f"{line['loss']:.4f} per pair"
        assert shown["accuracy"] == f"{line['accuracy']:.4f}" and shown["margin"] == f"{line['rewards_margin']:.4f}"
        assert float(shown["logp chosen"]) < 0 and float(shown["logp rejected"]) < 0
    (event,) = [e for e in launch.events(run_dir) if e["event"] == "eval"]
    step, count, unit, shown = _eval_line(stdout)
    assert (step, count, unit) == (2, event["tokens"], "pairs") and event["unit"] == "pair"
    assert shown["loss"] == f"{event['loss']:.4f}"
    assert shown["accuracy"] == f"{event['metrics']['accuracies']:.4f}"
    assert shown["margin"] == f"{event['metrics']['margins']:.4f}"
    assert "tokens" not in [l for l in stdout.splitlines() if l.startswith("eval step")][0]


def test_grpo_lines_show_rewards_and_kl_and_the_eval_counts_prompts_without_a_loss(runs):
    stdout, run_dir = runs["grpo"]
    steps, ledger = _step_lines(stdout), launch.ledger(run_dir)
    for line in ledger:
        shown = steps[line["step"]]
        assert shown["loss"] == f"{line['loss']:.4f} per completion"  # loss_norm: sequence
        assert shown["reward"] == f"{line['reward_mean']:.4f}" and shown["reward std"] == f"{line['reward_std']:.4f}"
        assert shown["len"] == f"{line['completion_len_mean']:.1f}" and "kl" in shown and "clip" in shown
    (event,) = [e for e in launch.events(run_dir) if e["event"] == "eval"]
    step, count, unit, shown = _eval_line(stdout)
    assert (step, count, unit) == (2, event["tokens"], "prompts")
    assert "loss" not in shown  # minus the reward: the reward says it
    metrics = event["metrics"]
    assert shown == {"reward": f"{metrics['reward_mean']:.4f}", "accuracy": f"{metrics['accuracy']:.4f}",
                     "sampled reward": f"{metrics['sampled_reward_mean']:.4f}",
                     "pass@1": f"{metrics['sampled_accuracy']:.4f}"}


def test_runs_plot_draws_the_ledger_and_eval_series_of_each_run_and_compares_them(e2e_workdir, runs):
    dpo, grpo = runs["dpo"][1], runs["grpo"][1]
    out = e2e_workdir / "console-compare.png"
    result = launch.run_module(e2e_workdir, ["experiments", "runs", "plot", dpo.name, grpo.name,
                                             "--root", str(dpo.parent), "--out", str(out)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(dpo / "artifacts" / "plots.png"), str(grpo / "artifacts" / "plots.png"),
                                     str(out)]

    def drawn(png):
        return {p["series"]: p for p in json.loads(png.with_suffix(".json").read_text())["panels"]}

    for run_dir, twin in ((dpo, "objective/accuracies"), (grpo, "reward_mean")):
        panels, ledger = drawn(run_dir / "artifacts" / "plots.png"), launch.ledger(run_dir)
        (event,) = [e for e in launch.events(run_dir) if e["event"] == "eval"]
        assert panels["loss"]["lines"]["train"] == [[r["step"], r["loss"]] for r in ledger]
        assert panels["eval/loss"]["lines"]["eval"] == [[2, event["loss"]]]
        assert panels[twin]["lines"]["eval"] == [[2, event["metrics"][twin.split("/")[-1]]]]
        assert panels["tokens_per_s"]["group"] == "throughput and time"
    assert drawn(grpo / "artifacts" / "plots.png")["reward_mean"]["lines"]["train"] == [
        [r["step"], r["reward_mean"]] for r in launch.ledger(grpo)]
    assert drawn(dpo / "artifacts" / "plots.png")["accuracy"]["group"] == "rewards and accuracy"
    compared = drawn(out)
    assert set(compared["loss"]["lines"]) == {dpo.name, grpo.name}
    assert set(compared["reward_mean"]["lines"]) == {grpo.name}
