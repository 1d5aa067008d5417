"""Held-out generation evaluation (training/generation_eval.py, ``train.eval_generate``) for the
methods other than GRPO: greedy and sampled exact-answer accuracy on prompt records, checked
against a hand computation (the sampler's completions of the same chat-rendered prompts at the
evaluation's shape, keys ``(seed, "eval-generate", 0, prompt index, sample index)``), on one and
on two data-parallel ranks; ``prompts`` bounds the prompts decoded; bad settings are config errors.
"""

from __future__ import annotations

import json

import pytest
import torch

import models
from core import seeding
from core.config import load
from core.exceptions import ConfigError
from data.chat_template import ChatTemplate
from data.tokenizers import build_tokenizer
from models.generation.sampler import SampleKey, Sampler, SamplingParams
from training.rollout.generator import cut_at_marker, stop_tokens
from training.generation_eval import PURPOSE, GenerationEvaluation
from training.rollout.rewards import exact_answer
from tests import launch

STREAMS, BATCH, SAMPLES, TEMPERATURE = 2, 4, 3, 1.5
PROMPTS = [f"What is {a} + {b}?" for a, b in ((3, 4), (12, 9), (25, 25), (7, 70), (41, 2), (8, 8), (60, 1), (5, 33))]


def _config(source, overrides=()):
    """e2e-dpo.yaml (a DPO run) with the prompts as its generation evaluation."""
    return load(launch.ROOT / "tests" / "configs" / "e2e-dpo.yaml", [
        f"train.eval_generate={{source: {{path: {source}, record: prompt}}, prompts: {len(PROMPTS)}}}",
        f"data.num_streams={STREAMS}", f"train.global_batch_size={BATCH}", "train.micro_batch_size=2",
        "data.process_pool=false", "parallel.strategy=none", *overrides])


def _model(config):
    """A seeded tiny model, its weights shaken so that greedy completions differ between prompts."""
    model = models.build(config.model, generator=seeding.generator(5, "model_init"))
    with torch.no_grad():
        noise = torch.Generator().manual_seed(1)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise))
    return model.eval()


def _write(root, answers: list[str]):
    """Record i in shard i % STREAMS: each stream reads one shard, so prompt i is row i % BATCH of
    global batch i // BATCH (streams in order, each contributing BATCH / STREAMS rows)."""
    root.mkdir(exist_ok=True)
    for k in range(STREAMS):
        lines = [json.dumps({"prompt": p, "answer": a}) for p, a in zip(PROMPTS[k::STREAMS], answers[k::STREAMS])]
        (root / f"part-{k:03d}.jsonl").write_text("\n".join(lines) + "\n")


def _held_out_index() -> list[int]:
    """Per prompt of PROMPTS (record r of shard k is prompt r * STREAMS + k), its index in the
    evaluation: global batch b holds records b * (BATCH / STREAMS) ... of every stream, in stream order."""
    per_stream = BATCH // STREAMS
    index = []
    for p in range(len(PROMPTS)):
        record, shard = divmod(p, STREAMS)
        batch, slot = divmod(record, per_stream)
        index.append(batch * BATCH + shard * per_stream + slot)
    return index


def _by_hand(config, model, *, temperature: float, samples: int, lengths: list | None = None) -> list[list[str]]:
    """Per prompt, ``samples`` completion texts: chat-rendered prompts, the sampler at the
    evaluation's shape (max(1, samples) * BATCH / STREAMS rows), the documented keys. Each
    completion's token count goes to ``lengths`` where given."""
    tokenizer = build_tokenizer(config.data.tokenizer)
    template = ChatTemplate.for_tokenizer(config.data.tokenizer, config.data.chat_template)
    stop_ids, marker = stop_tokens(tokenizer, template)
    ids = [list(tokenizer.encode_array(template.render([{"role": "user", "content": p}], add_generation_prompt=True)))
           for p in PROMPTS]
    sampler = Sampler(model, max_batch=max(1, samples) * BATCH // STREAMS, max_len=config.data.seq_len)
    params = SamplingParams(temperature=temperature, max_new_tokens=config.train.eval_generate.max_new_tokens,
                            stop_token_ids=stop_ids)
    held_out = _held_out_index()
    keys = [SampleKey(config.train.seed, PURPOSE, 0, held_out[p], j) for p in range(len(PROMPTS))
            for j in range(samples)]
    flat = sampler.generate([ids[p] for p in range(len(PROMPTS)) for _ in range(samples)], keys, params)
    cut = [cut_at_marker(sample, tokenizer, marker, stop_ids) for sample in flat]
    if lengths is not None:
        lengths.extend(len(sample.tokens) for sample, _ in cut)
    texts = [text for _, text in cut]
    return [texts[p * samples:(p + 1) * samples] for p in range(len(PROMPTS))]


def _evaluate(config, model, *, world_size: int) -> dict[str, float]:
    """Every rank's sums added (the loop's all-reduce), then divided by the prompts, as the loop does."""
    sums: dict[str, float] = {}
    with torch.no_grad():
        for rank in range(world_size):
            evaluation = GenerationEvaluation(config, rank=rank, world_size=world_size, device=torch.device("cpu"))
            for name, value in evaluation.evaluate(model).items():
                sums[name] = sums.get(name, 0.0) + value
    prompts = sums[GenerationEvaluation.COUNT]
    return {n: (v if n == GenerationEvaluation.COUNT else v / prompts) for n, v in sums.items()}


def _usable(config, texts: list[str]) -> list[str]:
    """Texts usable as answers: not blank, and decoding the answer's tokens gives them back."""
    tokenizer = build_tokenizer(config.data.tokenizer)
    return [t for t in texts if t.strip() and tokenizer.decode(list(tokenizer.encode_array(t))) == t]


def test_greedy_accuracy_is_the_fraction_of_exact_completions_on_one_and_two_ranks(tmp_path):
    _write(tmp_path / "eval", ["7"] * len(PROMPTS))  # replaced below; the config needs the files
    config = _config(tmp_path / "eval")
    model = _model(config)
    lengths: list[int] = []
    greedy = [texts[0] for texts in _by_hand(config, model, temperature=0.0, samples=1, lengths=lengths)]
    assert _usable(config, greedy) == greedy and len(set(greedy)) > 1
    # Three of the eight answers are the model's own greedy completion: accuracy must be exactly 3/8.
    answers = [c if i in (0, 3, 6) else "no such answer" for i, c in enumerate(greedy)]
    _write(tmp_path / "eval", answers)
    one = _evaluate(config, model, world_size=1)
    assert one["generate/prompts"] == len(PROMPTS)
    assert one["generate/accuracy"] == 3 / 8
    assert one["generate/completion_len"] == pytest.approx(sum(lengths) / len(lengths), abs=1e-12)
    assert "generate/sampled_accuracy" not in one  # samples: 0
    assert _evaluate(config, model, world_size=2) == one  # greedy at a static shape: bitwise the same
    # prompts bounds the evaluation to the first ones in the pipeline's order (indices 0..4)
    first = _config(tmp_path / "eval", ["train.eval_generate.prompts=5"])
    held_out = _held_out_index()
    expected = sum(exact_answer(greedy[p], answers[p]) for p in range(len(PROMPTS)) if held_out[p] < 5)
    bounded = _evaluate(first, model, world_size=1)
    assert bounded["generate/prompts"] == 5 and bounded["generate/accuracy"] == expected / 5


def test_sampled_accuracy_scores_the_keyed_samples_on_one_and_two_ranks(tmp_path):
    _write(tmp_path / "eval", ["7"] * len(PROMPTS))
    overrides = [f"train.eval_generate.samples={SAMPLES}", f"train.eval_generate.temperature={TEMPERATURE}"]
    config = _config(tmp_path / "eval", overrides)
    model = _model(config)
    sampled = _by_hand(config, model, temperature=TEMPERATURE, samples=SAMPLES)
    assert sum(len(set(texts)) for texts in sampled) > len(PROMPTS)  # not one completion per prompt
    answers = [(_usable(config, texts) or ["no such answer"])[0] if i % 2 == 0 else "no such answer"
               for i, texts in enumerate(sampled)]
    _write(tmp_path / "eval", answers)
    exact = [exact_answer(t, a) for texts, a in zip(sampled, answers) for t in texts]
    one = _evaluate(config, model, world_size=1)
    assert 0 < one["generate/sampled_accuracy"] < 1
    assert one["generate/sampled_accuracy"] == pytest.approx(sum(exact) / len(exact), abs=1e-12)
    assert _evaluate(config, model, world_size=2) == one
    assert _evaluate(config, model, world_size=1) == one  # the same keys at every evaluation


@pytest.mark.parametrize("override, key", [
    ("train.eval_generate.source.record=chat", "train.eval_generate.source.record"),
    ("train.eval_generate.samples=-1", "train.eval_generate.samples"),
    ("train.eval_generate.temperature=0", "train.eval_generate.temperature"),
    ("train.eval_generate.prompts=0", "train.eval_generate.prompts"),
    ("train.eval_generate.max_new_tokens=0", "train.eval_generate.max_new_tokens"),
])
def test_bad_settings_are_config_errors_naming_the_key(tmp_path, override, key):
    _write(tmp_path / "eval", ["7"] * len(PROMPTS))
    with pytest.raises(ConfigError) as error:
        _config(tmp_path / "eval", [override])
    assert error.value.context["key"] == key


def test_unset_it_is_off_and_leaves_every_config_hash_alone(tmp_path):
    _write(tmp_path / "eval", ["7"] * len(PROMPTS))
    plain = load(launch.ROOT / "tests" / "configs" / "e2e-dpo.yaml")
    assert plain.train.eval_generate.source is None
    assert load(launch.ROOT / "tests" / "configs" / "e2e-dpo.yaml", ["train.eval_generate.prompts=128"]).hash \
        == plain.hash  # the defaults: not hashed
    assert _config(tmp_path / "eval").hash != load(launch.ROOT / "tests" / "configs" / "e2e-dpo.yaml", [
        f"data.num_streams={STREAMS}", f"train.global_batch_size={BATCH}", "train.micro_batch_size=2",
        "data.process_pool=false", "parallel.strategy=none"]).hash


def test_a_missing_prompt_source_fails_when_the_evaluation_is_built(tmp_path):
    """Before the first training step, naming the key, not at the first evaluation."""
    from core.exceptions import DataError

    config = _config(tmp_path / "nowhere")
    with pytest.raises(DataError) as error:
        GenerationEvaluation(config, rank=0, world_size=1, device=torch.device("cpu"))
    assert "train.eval_generate.source.path" in str(error.value) and str(tmp_path / "nowhere") in str(error.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="train.eval_generate.source"):
        GenerationEvaluation(_config(tmp_path / "empty"), rank=0, world_size=1, device=torch.device("cpu"))
