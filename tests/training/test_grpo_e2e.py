"""GRPO end to end on 2 CPU ranks (tests/configs/e2e-grpo.yaml). The four guarantees are the
``grpo`` row of tests/training/test_guarantees.py: SIGKILL at random moments (mostly mid-rollout:
rollouts are most of a step) then resume gives the uninterrupted ledger, ``rollout_hash`` and
the reward statistics included; replay regenerates a step's rollouts and verifies them, then
the config's two updates per rollout batch (``inner_updates: 2``); a 2-rank run resumed on 1
rank consumes the same prompts and samples the same rollouts and batch at the first step after
its checkpoint; accumulation keeps the batch and loss. Here, what is particular to GRPO:

- the ledger holds the rollouts' and rewards' statistics, and both inner updates;
- the held-out evaluation (greedy completions, reward mean and exact-answer accuracy, and the
  sampled pass@1 of ``eval_samples`` completions per prompt, in the
  ``eval`` event) is the same on 1 and 2 ranks and equals the rewards of ``python -m training
  generate --temperature 0`` on the same prompts;
- bad inputs are typed errors: an unknown reward function (exit 2, before any run dir), a
  reward function that raises (exit 3, naming the function and the sample), a prompt longer
  than the context (exit 3, naming the record).
"""

from __future__ import annotations

import json

import pytest

from tests import launch
from tests.methods import GRPO

pytestmark = pytest.mark.slow

STEPS = GRPO.steps
GRPO_CONFIG = GRPO.config_path


def grpo_args(*, max_steps: int = STEPS, name: str = "grpo", overrides=()) -> list[str]:
    return ["--config", str(GRPO_CONFIG), f"run.name={name}", f"train.max_steps={max_steps}", *overrides]


def _run_dir(workdir, result):
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


@pytest.fixture
def reference(reference_runs):
    return reference_runs.run(GRPO)


def test_grpo_ledger_has_rollouts_and_rewards(reference):
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert len({r["rollout_hash"] for r in lines}) == STEPS
    for line in lines:
        assert 0.0 <= line["reward_zero_var_groups"] <= 1.0 and line["reward_errors"] == 0
        assert 1.0 <= line["completion_len_mean"] <= 6.0
        assert line["logprob_parity"] < 1e-4  # the same kernels on the CPU: float rounding only
    # the format reward varies on these completions: some groups have something to learn
    assert any(line["reward_std"] > 0 and line["loss"] != 0.0 for line in lines)
    # inner_updates: 2: the first update's loss is the step's; the second sees a moved policy
    assert all(len(line["inner_losses"]) == 2 == len(line["inner_grad_norms"]) for line in lines)
    assert all(line["inner_losses"][0] == line["loss"] for line in lines)
    assert any(line["inner_losses"][1] != line["loss"] for line in lines)


def completion_chars(completion: str, answer: str, *, prompt: str) -> float:
    """A reward that differs between completions of an untrained model (their exact answers are all wrong)."""
    return float(len(completion))


EVAL_PROMPTS = ["What is 2 + 3?", "Reverse the word 'cat'.", "How many letters are in 'moon'?", "What is 9 * 4?"]


def test_grpo_eval_is_world_size_independent_and_equals_generate(e2e_workdir, tmp_path):
    # lr 0: step 1 leaves the weights as they were, so both world sizes evaluate the same weights
    # (after a real update they would differ by the order of the gradient reduction).
    held_out = tmp_path / "held-out"
    held_out.mkdir()
    answers = ["5", "tac", "4", "36"]
    for k, (prompt, answer) in enumerate(zip(EVAL_PROMPTS, answers)):  # one record per stream
        (held_out / f"part-{k:03d}.jsonl").write_text(json.dumps({"prompt": prompt, "answer": answer}) + "\n")
    overrides = [f"data.eval_source={{path: {held_out}, record: prompt}}", "train.eval_interval=1",
                 "train.eval_batches=1", "train.lr=0", "objective.grpo.kl_coef=0", "objective.grpo.eval_samples=3",
                 f'objective.grpo.rewards=[{{name: exact_answer}}, {{name: "{__name__}:completion_chars", weight: 0.5}}]']
    evals = {}
    for nproc in (1, 2):
        result = launch.train(e2e_workdir, grpo_args(max_steps=1, name=f"grpo-eval-{nproc}", overrides=overrides),
                              nproc=nproc, timeout=600)
        assert result.returncode == 0, result.stderr
        run_dir = _run_dir(e2e_workdir, result)
        [event] = [e for e in launch.events(run_dir) if e.get("event") == "eval"]
        evals[nproc] = {k: event[k] for k in ("step", "loss", "tokens", "metrics")}
    assert evals[1] == evals[2]  # greedy and sampled metrics alike: the sampled draws are keyed per prompt
    assert {"sampled_accuracy", "sampled_reward_mean"} <= set(evals[2]["metrics"])
    assert evals[2]["tokens"] == len(EVAL_PROMPTS)  # one unit per prompt
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in EVAL_PROMPTS))
    out = tmp_path / "greedy.jsonl"
    result = launch.run_module(e2e_workdir, ["training", "generate", "--from", str(run_dir), "--prompts", str(prompts),
                                             "--temperature", "0", "--max-new-tokens", "6", "--device", "cpu",
                                             "--out", str(out)])
    assert result.returncode == 0, result.stderr
    completions = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    exact = [float(c.strip() == a) for c, a in zip(completions, answers)]
    rewards = [e + 0.5 * len(c) for e, c in zip(exact, completions)]
    metrics = evals[2]["metrics"]
    assert metrics["accuracy"] == pytest.approx(sum(exact) / len(exact), abs=1e-9)
    assert metrics["reward_mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
    assert evals[2]["loss"] == pytest.approx(-metrics["reward_mean"], abs=1e-6)


def test_unknown_reward_function_is_a_config_error_before_any_run_dir(e2e_workdir):
    result = launch.train(e2e_workdir, grpo_args(name="grpo-badpath", overrides=[
        'objective.grpo.rewards=[{name: "tests.training.no_such_module:f"}]']), nproc=1)
    assert result.returncode == 2, result.stderr
    assert "objective.grpo.rewards[0].name" in result.stderr
    assert not list((e2e_workdir / "runs").glob("grpo-badpath-*"))


def test_reward_function_exception_names_the_function_and_sample(e2e_workdir):
    name = "tests.training.grpo_rewards:fails_on_third_sample"
    result = launch.train(e2e_workdir, grpo_args(max_steps=1, name="grpo-raises", overrides=[
        f'objective.grpo.rewards=[{{name: "{name}"}}]', "objective.grpo.kl_coef=0"]), nproc=1)
    assert result.returncode == 3, result.stderr
    assert name in result.stderr and "step 1, prompt row 0, sample 2" in result.stderr
    result = launch.train(e2e_workdir, grpo_args(max_steps=1, name="grpo-zero", overrides=[
        f'objective.grpo.rewards=[{{name: "{name}"}}]', "objective.grpo.kl_coef=0",
        "objective.grpo.on_reward_error=zero"]), nproc=1)
    assert result.returncode == 0, result.stderr
    assert launch.ledger(_run_dir(e2e_workdir, result))[0]["reward_errors"] == 1


def test_bad_prompt_records_are_data_errors_naming_the_record(e2e_workdir):
    data = e2e_workdir / "bad-prompts"
    data.mkdir(exist_ok=True)
    for label, record in (("empty", {"prompt": "", "answer": "1"}),
                          ("long", {"prompt": "What is " + "1 + " * 60 + "1?", "answer": "61"})):
        lines = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
        lines.insert(2, record)
        path = data / f"{label}.jsonl"
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        result = launch.train(e2e_workdir, grpo_args(max_steps=1, name=f"grpo-{label}", overrides=[
            f"data.sources=[{{path: {path}, record: prompt}}]", "data.num_streams=1", "train.global_batch_size=4",
            "objective.grpo.kl_coef=0"]), nproc=1)
        assert result.returncode == 3, result.stderr
        assert "record=3" in result.stderr and f"{label}.jsonl" in result.stderr, result.stderr  # line 3


def test_generate_from_the_run_samples_its_checkpoint(e2e_workdir, reference, tmp_path):
    out = tmp_path / "samples.jsonl"
    args = ["training", "generate", "--from", str(reference), "--step", "4", "--prompt", "What is 2 + 3?",
            "--temperature", "0", "--max-new-tokens", "6", "--device", "cpu", "--out", str(out)]
    result = launch.run_module(e2e_workdir, args)
    assert result.returncode == 0, result.stderr
    [record] = [json.loads(line) for line in out.read_text().splitlines()]
    # a GRPO run was trained on chat-rendered prompts: text prompts are rendered the same way
    assert record["prompt"] == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"
    assert 1 <= len(record["token_ids"]) <= 6
    # --out names a new file: an existing one is refused before the step is looked up
    result = launch.run_module(e2e_workdir, args[:5] + ["99"] + args[6:-1] + [str(tmp_path / "none.jsonl")])
    assert result.returncode == 2 and "no checkpoint at step 99" in result.stderr
