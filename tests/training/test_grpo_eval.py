"""GRPO's held-out evaluation (training/objectives/grpo.py, "Evaluation"): in eval mode ``prepare``
decodes every held-out prompt greedily and ``loss`` reports, per prompt, the configured reward and
the exact-answer score. Checked against a hand computation (the sampler's greedy completions of the
same chat-rendered prompts, scored by the reward functions), on one and on two data-parallel ranks.
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
from models.generation import sample_prompts
from models.qwen.sampler import Sampler, SamplingParams
from training.generate import cut_at_marker, stop_tokens
from training.objectives.base import ObjectiveContext
from training.objectives.grpo import GRPOObjective
from training.objectives.rewards import exact_answer
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
    tokenizer = build_tokenizer(config.data.tokenizer)
    template = ChatTemplate.for_tokenizer(config.data.tokenizer, config.data.chat_template)
    stop_ids, marker = stop_tokens(tokenizer, template)
    ids = [list(tokenizer.encode_array(template.render([{"role": "user", "content": p}], add_generation_prompt=True)))
           for p in PROMPTS]
    sampler = Sampler(model.eval(), max_batch=config.objective.grpo.group_size * BATCH // STREAMS,
                      max_len=config.data.seq_len)
    params = SamplingParams(temperature=0.0, max_new_tokens=config.objective.grpo.max_new_tokens,
                            stop_token_ids=stop_ids)
    samples = sample_prompts(sampler, ids, list(range(len(ids))), params, seed=0, purpose="hand")
    return [cut_at_marker(sample, tokenizer, marker, stop_ids)[1] for _, _, sample in samples]


def _write_eval(root, answers: list[str]):
    """The prompts with these answers, record i in shard i % STREAMS (each stream reads one shard)."""
    root.mkdir(exist_ok=True)
    for k in range(STREAMS):
        lines = [json.dumps({"prompt": p, "answer": a}) for p, a in zip(PROMPTS[k::STREAMS], answers[k::STREAMS])]
        (root / f"part-{k:03d}.jsonl").write_text("\n".join(lines) + "\n")


def _evaluate(config, model, *, world_size: int) -> dict[str, float]:
    """The loop's evaluation (Trainer.maybe_evaluate) by hand: every rank's eval batches through
    prepare (model in eval mode) and loss, sums over micro-batches and ranks, divided by the count."""
    objective = _objective(config, model)
    model.eval()
    sums = {"loss": 0.0, "count": 0, "reward_mean": 0.0, "accuracy": 0.0}
    with torch.no_grad():
        for rank in range(world_size):
            plan = make_plan(config.data, seed=config.train.seed, global_batch_size=BATCH, rank=rank,
                             world_size=world_size, split="eval")
            for _, batch in zip(range(EVAL_BATCHES), iterate_serial(plan)):
                for micro in objective.prepare(batch).micro_batches(config.train.micro_batch_size):
                    out = objective.loss(model, micro)
                    sums["loss"] += float(out.sum)
                    sums["count"] += out.count
                    for name, value in out.metrics.items():
                        sums[name] += float(value)
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
    with torch.no_grad():
        scored = objective.prepare(batch)
    assert model.training is False and objective._local == {}
    assert torch.equal(scored.input_ids, batch.input_ids)  # the prompt rows themselves, one per prompt
    assert scored.extras["eval_exact"].shape == (len(batch.sequence_index),)


def test_a_non_prompt_eval_source_is_a_config_error(tmp_path):
    _write_eval(tmp_path / "eval", ["7"] * len(PROMPTS))
    chat = f"data.eval_source={{path: {tmp_path / 'eval'}, record: chat}}"
    with pytest.raises(ConfigError) as error:
        GRPOObjective.check_config(_config(tmp_path / "eval", [chat, "train.eval_interval=5"]))
    assert "data.eval_source.record" in str(error.value)
    GRPOObjective.check_config(_config(tmp_path / "eval", [chat, "train.eval_interval=0"]))  # never read: no error
