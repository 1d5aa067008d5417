"""Held-out generation evaluation (``train.eval_generate``): does the model *answer* better?

Losses and preference metrics can improve while the answers get worse (a DPO run can raise its
preference accuracy while its greedy answers turn to noise; docs/post_training.md). This
evaluation decodes held-out prompts with checkable answers (``record: prompt`` records,
``{"prompt", "answer"}``, e.g. datasets/tasks/rl/eval) with the current weights and scores the
completions with ``exact_answer``; the loop runs it at every evaluation step, for any objective
but GRPO (whose own evaluation does the same on ``data.eval_source``), and adds its numbers to
the ``eval`` event's metrics:

- ``generate/accuracy``: the fraction of prompts whose greedy completion (temperature 0) is the
  exact answer;
- ``generate/completion_len``: the greedy completions' mean length in tokens (a collapsing model
  often stops ending its turn and runs to ``max_new_tokens``);
- with ``samples = k > 0``, ``generate/sampled_accuracy``: pass@1 estimated from ``k`` samples per
  prompt at ``temperature``, the fraction of the ``N k`` sampled completions that are exact.

The prompts are the first ``prompts`` of the source in the pipeline's order (global batches of
``train.global_batch_size``; prompt ``i`` is row ``i mod B`` of batch ``i // B``), each rank
decoding its own rows; sums go through the loop's all-reduce, so the numbers do not depend on
the world size. Sample ``j`` of prompt ``i`` is keyed ``(train.seed, "eval-generate", 0, i, j)``:
every evaluation draws the same random numbers, so evaluations at different steps compare the
weights, not the draws. The sampler runs ``max(1, samples) * global_batch_size / num_streams``
rows per forward whatever the world size (models/generation/sampler.py: a row's arithmetic depends on
that shape only).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional
import numpy as np
import torch
from torch import nn

from core.config import Config
from core.exceptions import DataError
from data.batch import Batch, prompt_and_answer
from data.chat_template import ChatTemplate
from data.sources.source import Source
from data.tokenizers import build_tokenizer
from models.generation.sampler import SamplingParams
from training.rollout.generator import Decoder, Generator
from training.rollout.rewards import exact_answer

PURPOSE = "eval-generate"


class GenerationEvaluation:
    """Greedy (and sampled) exact-answer accuracy on held-out prompts, as metric sums per rank."""

    PREFIX = "generate/"
    COUNT = "generate/prompts"
    """The sum every other metric is divided by (the prompts decoded, over all ranks)."""

    def __init__(self, config: Config, *, rank: int, world_size: int, device: torch.device) -> None:
        from data.pipeline import build as build_pipeline

        self.config = config
        self.settings = config.train.eval_generate
        self.rank, self.world_size, self.device = rank, world_size, device
        self.tokenizer = build_tokenizer(config.data.tokenizer)
        self.decoder = Decoder(self.tokenizer, ChatTemplate.for_tokenizer(config.data.tokenizer,
                                                                           config.data.chat_template))
        s, stop = self.settings, self.decoder.stop_ids
        self.greedy = SamplingParams(temperature=0.0, max_new_tokens=s.max_new_tokens, stop_token_ids=stop)
        self.sampled = SamplingParams(temperature=s.temperature, max_new_tokens=s.max_new_tokens, stop_token_ids=stop)
        batch = config.train.global_batch_size
        self.batches = -(-s.prompts // batch)  # enough global batches to hold the prompts
        self.generator = Generator(rows=max(1, s.samples) * batch // config.data.num_streams,
                                   max_len=config.data.seq_len, seed=config.train.seed)
        # The run's data settings with the prompt source as the held-out one (whole packing: one
        # prompt per row); a derived value, the run's config is untouched.
        data = dataclasses.replace(config.data, eval_source=s.source, packing="whole")
        self._pipeline = lambda: build_pipeline(
            data, seed=config.train.seed, global_batch_size=batch, rank=rank, world_size=world_size, split="eval")
        _check_source(s.source)

    def evaluate(self, model: nn.Module, *, on_batch: Callable[[], None] = lambda: None) -> dict[str, float]:
        """This rank's metric sums (``generate/*``; each mean is its sum over the ranks divided by the
        summed ``generate/prompts``) over its data-parallel share of the held-out prompts. Call on
        every rank (sharded weights are gathered collectively), under no_grad. ``on_batch`` is called
        after each global batch of prompts (the loop's watchdog heartbeat: decoding is slow on a CPU)."""
        sums = {"accuracy": 0.0, "completion_len": 0.0, "prompts": 0.0}
        if self.settings.samples > 0:
            sums["sampled_accuracy"] = 0.0
        self.generator.load(model)  # a collective for sharded models: every rank
        with self._pipeline() as data:
            for b in range(self.batches):
                try:
                    batch = next(data)
                except StopIteration:
                    break
                prompts = [p for p in self._prompts(batch, b) if p[0] < self.settings.prompts]
                self._score(prompts, sums)
                on_batch()
        return {f"{self.PREFIX}{k}": v for k, v in sums.items()}

    def _score(self, prompts: list[tuple[int, list[int], str, Optional[dict]]], sums: dict[str, float]) -> None:
        ids, indices, media = [p[1] for p in prompts], [p[0] for p in prompts], [p[3] for p in prompts]
        greedy = self._generate(ids, indices, self.greedy, samples=1, media=media)
        for (_, _, answer, _), (tokens, text) in zip(prompts, greedy):
            sums["accuracy"] += exact_answer(text, answer)
            sums["completion_len"] += len(tokens)
        sums["prompts"] += len(prompts)
        k = self.settings.samples
        if k > 0:
            sampled = self._generate(ids, indices, self.sampled, samples=k, media=media)
            scores = np.array([exact_answer(text, prompts[i // k][2]) for i, (_, text) in enumerate(sampled)])
            sums["sampled_accuracy"] += float(scores.reshape(len(prompts), k).mean(axis=1).sum()) if prompts else 0.0

    def _prompts(self, batch: Batch, number: int) -> list[tuple[int, list[int], str, Optional[dict]]]:
        """(held-out prompt index, prompt ids, answer text, the row's media or None) of every row of this
        rank's batch."""
        out = []
        for r, row in enumerate(batch.sequence_index):
            span = batch.provenance[r][0]
            prompt, answer = prompt_and_answer(batch, r)
            if not prompt:
                raise DataError("prompt record renders to no prompt token", file=span.shard, record=span.record + 1,
                                hint="train.eval_generate.source needs non-empty prompts")
            media = {name: list(rows[r]) for name, rows in batch.media.items()}
            out.append((number * self.config.train.global_batch_size + row, prompt, self.tokenizer.decode(answer),
                        media if any(media.values()) else None))
        return out

    def _generate(self, ids: list[list[int]], indices: list[int], params: SamplingParams, *,
                  samples: int, media: list[Optional[dict]]) -> list[tuple[list[int], str]]:
        """(tokens, text without stop tokens and end-of-turn marker) per completion, prompt-major."""
        if not ids:
            return []
        flat = self.generator.generate(ids, indices, params, purpose=PURPOSE, samples=samples, media=media)
        completions = [self.decoder.completion(sample) for _, _, sample in flat]
        return [(list(c.sample.tokens), c.text) for c in completions]


def _check_source(source) -> None:
    """A missing or empty prompt source fails when the trainer is built, before the first step (as
    a missing training source does), not at the first evaluation after hours of training."""
    key = "train.eval_generate.source"
    try:
        Source(source, label=key)
    except DataError as exc:
        raise DataError(exc.message, file=source.path, hint=f"check {key}.path (python -m data prepare writes "
                        "datasets/tasks/rl/eval), or turn it off with train.eval_generate.source=null") from None
