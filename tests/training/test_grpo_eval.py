"""GRPO's held-out evaluation (training/objectives/grpo.py, "Evaluation"): for a batch marked held
out (``Batch.evaluation``) ``prepare`` decodes every held-out prompt greedily and ``loss`` reports, per prompt, the configured reward and
the exact-answer score. Checked against a hand computation (the sampler's greedy completions of the
same chat-rendered prompts, scored by the reward functions), on one and on two data-parallel ranks.
With ``objective.grpo.eval_samples = k`` it also samples k completions per prompt, keyed by the
prompt's index in the evaluation and not by the step: checked against the sampler's completions
with the same keys, on one and two ranks, and across evaluations with a training step between.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch

import models
from core import seeding
from core.config import load
from core.exceptions import ConfigError
from data.chat_template import ChatTemplate
from data.pipeline.plan import make_plan
from data.pipeline.serial import iterate_serial
from data.tokenizers import build_tokenizer
from models.generation.sampler import SampleKey, Sampler, SamplingParams
from training.rollout.generator import cut_at_marker, stop_tokens
from training.objectives.base import ObjectiveContext
from training.objectives.grpo import GRPOObjective
from training.rollout.rewards import exact_answer
from tests import launch

STREAMS, BATCH, EVAL_BATCHES = 2, 4, 2
PROMPTS = [f"What is {a} + {b}?" for a, b in ((3, 4), (12, 9), (25, 25), (7, 70), (41, 2), (8, 8), (60, 1), (5, 33))]
FORMAT = ".*[a-z].*"


def _config(eval_dir, overrides=()):
    return load(launch.ROOT / "tests" / "configs" / "e2e-grpo.yaml", [
        f"data.sources=[{{path: {eval_dir}, record: prompt}}]",
        f"data.eval_source={{path: {eval_dir}, record: prompt}}",
        f"data.num_streams={STREAMS}", f"train.global_batch_size={BATCH}", f"train.eval_batches={EVAL_BATCHES}",
        "objective.grpo.kl_coef=0", "parallel.strategy=none", *overrides])


def _model(config):
    """A seeded tiny model, its weights shaken so that greedy completions differ between prompts
    (the plain init answers every prompt with newlines)."""
    model = models.build(config.model, generator=seeding.generator(5, "model_init"))
    with torch.no_grad():
        noise = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise))
    return model


def _objective(config, model):
    dist = SimpleNamespace(rank=0, world_size=1, is_distributed=False, device=torch.device("cpu"), backend="gloo")
    objective = GRPOObjective(config)
    objective.setup(model, ObjectiveContext(config=config, dist=dist, parallel=SimpleNamespace(device=dist.device),
                                            place=lambda t: t))
    return objective


def _greedy_by_hand(config, model) -> list[str]:
    """Each prompt's greedy completion text: chat-rendered, the sampler at the objective's shape."""
    # greedy decoding draws nothing from its keys: any prompt indices do
    return [texts[0] for texts in _completions_by_hand(config, model, range(len(PROMPTS)), temperature=0.0,
                                                       samples=1)]


def _completions_by_hand(config, model, held_out, *, temperature: float, samples: int) -> list[list[str]]:
    """Per prompt of PROMPTS, ``samples`` completion texts at ``temperature`` (the rollouts' filters,
    the sampler at the objective's shape); sample j of the prompt whose index in the evaluation is
    ``held_out[p]`` keyed SampleKey(seed, "grpo-eval", 0, held_out[p], j), as the objective documents."""
    tokenizer = build_tokenizer(config.data.tokenizer)
    template = ChatTemplate.for_tokenizer(config.data.tokenizer, config.data.chat_template)
    stop_ids, marker = stop_tokens(tokenizer, template)
    ids = [list(tokenizer.encode_array(template.render([{"role": "user", "content": p}], add_generation_prompt=True)))
           for p in PROMPTS]
    g = config.objective.grpo
    sampler = Sampler(model.eval(), max_batch=g.group_size * BATCH // STREAMS, max_len=config.data.seq_len)
    params = SamplingParams(temperature=temperature, top_p=g.top_p, top_k=g.top_k, max_new_tokens=g.max_new_tokens,
                            stop_token_ids=stop_ids)
    keys = [SampleKey(config.train.seed, "grpo-eval", 0, held_out[p], j) for p in range(len(PROMPTS))
            for j in range(samples)]
    flat = sampler.generate([ids[p] for p in range(len(PROMPTS)) for _ in range(samples)], keys, params)
    texts = [cut_at_marker(sample, tokenizer, marker, stop_ids)[1] for sample in flat]
    return [texts[p * samples:(p + 1) * samples] for p in range(len(PROMPTS))]


def _held_out_index(config) -> list[int]:
    """Per prompt of PROMPTS, its index in the evaluation: (eval batch - 1) * BATCH + its row in
    the global batch, read from the one-rank plan (record r of shard k is PROMPTS[r * STREAMS + k])."""
    plan = make_plan(config.data, seed=config.train.seed, global_batch_size=BATCH, rank=0, world_size=1, split="eval")
    index = {}
    for _, batch in zip(range(EVAL_BATCHES), iterate_serial(plan)):
        for row, spans in zip(batch.sequence_index, batch.provenance):
            shard = int(spans[0].shard.rsplit("part-", 1)[1].split(".")[0])
            index[spans[0].record * STREAMS + shard] = (batch.step - 1) * BATCH + row
    assert sorted(index) == list(range(len(PROMPTS)))
    return [index[p] for p in range(len(PROMPTS))]


def _write_eval(root, answers: list[str]):
    """The prompts with these answers, record i in shard i % STREAMS (each stream reads one shard)."""
    root.mkdir(exist_ok=True)
    for k in range(STREAMS):
        lines = [json.dumps({"prompt": p, "answer": a}) for p, a in zip(PROMPTS[k::STREAMS], answers[k::STREAMS])]
        (root / f"part-{k:03d}.jsonl").write_text("\n".join(lines) + "\n")


def _evaluate(config, model, *, world_size: int, objective=None) -> dict[str, float]:
    """The loop's evaluation (Trainer.maybe_evaluate) by hand: every rank's eval batches, marked held
    out, through prepare (model in eval mode) and loss, sums over micro-batches and ranks, divided by
    the count."""
    objective = objective or _objective(config, model)
    model.eval()
    sums = {"loss": 0.0, "count": 0}
    with torch.no_grad():
        for rank in range(world_size):
            plan = make_plan(config.data, seed=config.train.seed, global_batch_size=BATCH, rank=rank,
                             world_size=world_size, split="eval")
            for _, batch in zip(range(EVAL_BATCHES), iterate_serial(plan)):
                for micro in objective.prepare(batch.for_evaluation()).micro_batches(config.train.micro_batch_size):
                    out = objective.loss(model, micro)
                    sums["loss"] += float(out.sum)
                    sums["count"] += out.count
                    for name, value in out.metrics.items():
                        sums[name] = sums.get(name, 0.0) + float(value)
    model.train()
    count = sums.pop("count")
    return {"count": count, **{name: value / count for name, value in sums.items()}}


def test_eval_scores_greedy_completions_as_by_hand_on_one_and_two_ranks(tmp_path):
    config = _config(tmp_path / "eval")
    model = _model(config)
    completions = _greedy_by_hand(config, model)
    tokenizer = build_tokenizer(config.data.tokenizer)
    # usable as answers: not blank, and the objective decodes the answer's tokens back to the same text
    assert all(c.strip() and tokenizer.decode(list(tokenizer.encode_array(c))) == c for c in completions)
    assert len(set(completions)) > 1
    # Half the answers are the model's own greedy completion: accuracy must be exactly 1/2.
    answers = [c if i % 2 == 0 else "no such answer" for i, c in enumerate(completions)]
    _write_eval(tmp_path / "eval", answers)
    # e2e-grpo.yaml's rewards: exact_answer (weight 1) + format_regex FORMAT (weight 0.5)
    rewards = [exact_answer(c, a) + 0.5 * float(re.fullmatch(FORMAT, c.strip(), re.DOTALL) is not None)
               for c, a in zip(completions, answers)]
    expected_reward = sum(rewards) / len(rewards)
    one = _evaluate(config, model, world_size=1)
    assert one["count"] == len(PROMPTS)
    assert one["accuracy"] == 0.5
    assert one["reward_mean"] == pytest.approx(expected_reward, abs=1e-6)
    assert one["loss"] == pytest.approx(-expected_reward, abs=1e-6)
    two = _evaluate(config, model, world_size=2)
    assert two == one  # greedy, keyed by nothing, at the sampler's static shape: bitwise the same


def test_eval_leaves_training_state_alone(tmp_path):
    _write_eval(tmp_path / "eval", ["7"] * len(PROMPTS))
    config = _config(tmp_path / "eval")
    model = _model(config)
    objective = _objective(config, model)
    plan = make_plan(config.data, seed=0, global_batch_size=BATCH, rank=0, world_size=1, split="eval")
    batch = next(iterate_serial(plan))
    model.eval()
    before = dict(vars(objective))
    with torch.no_grad():
        scored = objective.prepare(batch.for_evaluation())
    assert model.training is False and vars(objective) == before  # nothing parked on the objective
    assert scored.evaluation and scored.prepared is None
    assert torch.equal(scored.input_ids, batch.input_ids)  # the prompt rows themselves, one per prompt
    assert scored.extras["eval_exact"].shape == (len(batch.sequence_index),)


def test_a_non_prompt_eval_source_is_a_config_error(tmp_path):
    _write_eval(tmp_path / "eval", ["7"] * len(PROMPTS))
    chat = f"data.eval_source={{path: {tmp_path / 'eval'}, record: chat}}"
    with pytest.raises(ConfigError) as error:
        GRPOObjective.check_config(_config(tmp_path / "eval", [chat, "train.eval_interval=5"]))
    assert "data.eval_source.record" in str(error.value)
    GRPOObjective.check_config(_config(tmp_path / "eval", [chat, "train.eval_interval=0"]))  # never read: no error


SAMPLES, EVAL_TEMPERATURE = 4, 1.5
SAMPLED = [f"objective.grpo.eval_samples={SAMPLES}", f"objective.grpo.eval_temperature={EVAL_TEMPERATURE}"]


def _sampled_setup(tmp_path):
    """The config with SAMPLES completions per held-out prompt, the model, each prompt's sampled
    texts by hand and the answers written: an even prompt's answer is its first usable sampled
    completion (so sampled accuracy is neither 0 nor 1), an odd prompt's matches nothing."""
    _write_eval(tmp_path / "eval", ["7"] * len(PROMPTS))  # replaced below; the config needs the files
    config = _config(tmp_path / "eval", SAMPLED)
    model = _model(config)
    sampled = _completions_by_hand(config, model, _held_out_index(config), temperature=EVAL_TEMPERATURE,
                                   samples=SAMPLES)
    tokenizer = build_tokenizer(config.data.tokenizer)
    # usable as answers: not blank, and the objective decodes the answer's tokens back to the same text
    usable = [[t for t in texts if t.strip() and tokenizer.decode(list(tokenizer.encode_array(t))) == t]
              for texts in sampled]
    assert all(usable[i] for i in range(0, len(PROMPTS), 2))
    answers = [usable[i][0] if i % 2 == 0 else "no such answer" for i in range(len(PROMPTS))]
    _write_eval(tmp_path / "eval", answers)
    return config, model, sampled, answers


def test_sampled_eval_scores_the_keyed_samples_as_by_hand_on_one_and_two_ranks(tmp_path):
    config, model, sampled, answers = _sampled_setup(tmp_path)
    assert sum(len(set(texts)) for texts in sampled) > len(PROMPTS)  # the samples are not all one completion
    exact = [exact_answer(t, a) for texts, a in zip(sampled, answers) for t in texts]
    rewards = [e + 0.5 * float(re.fullmatch(FORMAT, t.strip(), re.DOTALL) is not None)
               for e, t in zip(exact, (t for texts in sampled for t in texts))]
    one = _evaluate(config, model, world_size=1)
    assert 0 < one["sampled_accuracy"] < 1
    assert one["sampled_accuracy"] == pytest.approx(sum(exact) / len(exact), abs=1e-6)
    assert one["sampled_reward_mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-6)
    assert one["count"] == len(PROMPTS)  # the unit is still the prompt; its samples are averaged
    two = _evaluate(config, model, world_size=2)
    assert two == one  # keys per held-out prompt, the sampler's static shape: bitwise the same


def test_sampled_eval_repeats_exactly_with_a_training_step_between(tmp_path):
    config, model, _, _ = _sampled_setup(tmp_path)
    objective = _objective(config, model)
    first = _evaluate(config, model, world_size=1, objective=objective)
    # A training step's rollouts in between (keyed by their step, on the same sampler): the
    # evaluation's streams depend on neither, so the same weights score the same numbers.
    plan = make_plan(config.data, seed=config.train.seed, global_batch_size=BATCH, rank=0, world_size=1)
    with torch.no_grad():
        objective.prepare(next(iterate_serial(plan)))
    assert _evaluate(config, model, world_size=1, objective=objective) == first


def test_no_eval_samples_leaves_the_greedy_metrics_as_they_were(tmp_path):
    config, model, _, _ = _sampled_setup(tmp_path)
    greedy_only = _config(tmp_path / "eval")
    assert greedy_only.objective.grpo.eval_samples == 0  # the default
    before = _evaluate(greedy_only, model, world_size=1)
    assert set(before) == {"count", "loss", "reward_mean", "accuracy"}
    with_samples = _evaluate(config, model, world_size=1)
    assert {k: with_samples[k] for k in before} == before


@pytest.mark.parametrize("override", ["objective.grpo.eval_samples=-1", "objective.grpo.eval_temperature=0",
                                      "objective.grpo.eval_temperature=.nan"])
def test_bad_eval_sampling_settings_are_config_errors_naming_the_key(tmp_path, override):
    _write_eval(tmp_path / "eval", ["7"] * len(PROMPTS))
    with pytest.raises(ConfigError) as error:
        _config(tmp_path / "eval", [override])
    assert error.value.context["key"] == override.split("=")[0]
