"""The generator: completions of a batch of prompts, sampled from the weights it is handed.

GRPO's rollouts and held-out evaluation, ``train.eval_generate`` and ``python -m training
generate`` all sample through a ``Generator``:

- **Weights.** ``load(model)`` hands the trained model's current weights to the sampler:
  ``training.rollout.generation_model.generation_model`` gathers a plain model (a collective for sharded
  models: every rank calls it), and from the second call on its values are copied into the
  sampler's own model, whose compiled decode step (and CUDA graph) stays valid. The command
  line builds its generator over the model it loaded (``Generator.over``) and hands nothing.
- **Randomness.** Sample ``j`` of prompt ``i`` is keyed ``SampleKey(seed, purpose, step, i, j)``
  (``models.generation.prompts.sample_prompts``), ``i`` the caller's index of the prompt (a global
  prompt row, a held-out prompt's index, a prompts file's line): a completion depends on its
  key and the sampler's settings only, not on the other prompts, the batch or the world size.
- **Static shape.** The sampler runs ``rows`` rows per forward whatever the number of prompts
  (models/generation/sampler.py: a row's arithmetic depends on that shape only), so callers pass a
  constant of the config, never of the world size.
- **Completions.** ``Decoder`` turns a sample into what training and the command line see: EOS
  and a one-token end-of-turn marker stop the sampler; a marker of several tokens is cut on the
  host (the tokens after it are dropped), and the text has neither stop tokens nor marker.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from data.chat_template import ChatTemplate
from models.generation.prompts import sample_prompts
from models.generation.sampler import Continuation, Sample, SampleKey, Sampler, SamplingParams, TurnEnd
from training.rollout.generation_model import generation_model


class Generator:
    """``rows`` rows per forward, contexts of ``max_len`` tokens, keys under ``seed`` (module docstring).

    ``dtype``: the sampler's weights; default the one the trained model's ``Numerics`` picks
    (``generation_dtype``: bf16 for a bf16 run on CUDA, else the parameters' own; under
    ``determinism.batch_invariant`` the trainer's, the sampler's forwards then under its autocast).
    """

    def __init__(self, *, rows: int, max_len: int, seed: int, dtype: torch.dtype | None = None) -> None:
        self.rows, self.max_len, self.seed, self.dtype = rows, max_len, seed, dtype
        self._sampler: Sampler | None = None  # built at the first load: it holds the compiled decode step

    @classmethod
    def over(cls, model: nn.Module, *, rows: int, max_len: int, seed: int) -> "Generator":
        """A generator sampling ``model`` itself, as it is (the command line's loaded model)."""
        generator = cls(rows=rows, max_len=max_len, seed=seed)
        generator._sampler = Sampler(model, max_batch=rows, max_len=max_len)
        return generator

    def load(self, model: nn.Module) -> None:
        """Hand ``model``'s current weights to the sampler (a collective for sharded models)."""
        plain = generation_model(model, dtype=self.dtype)
        if self._sampler is None:
            self._sampler = Sampler(plain, max_batch=self.rows, max_len=self.max_len)
        elif self._sampler.model is not plain:  # a fresh copy: into the sampler's model, in place
            kept_buffers = dict(self._sampler.model.named_buffers())
            with torch.no_grad():
                for kept, fresh in zip(self._sampler.model.parameters(), plain.parameters()):
                    kept.copy_(fresh)
                # The state a model moves outside its parameters (a router's balancing bias after each
                # update): under FSDP the sampler kept step 1's and routed by it ever after.
                for name, fresh in plain.named_buffers():
                    kept_buffers[name].copy_(fresh)

    def generate(self, prompts: Sequence[Sequence[int]], indices: Sequence[int], params: SamplingParams, *,
                 purpose: str, step: int = 0, samples: int = 1,
                 media: Optional[Sequence[Optional[dict]]] = None) -> list[tuple[int, int, Sample]]:
        """(prompt index, sample index, sample) for ``samples`` completions of each prompt, prompt-major,
        with the weights last loaded; ``media``: each prompt's images (``Sampler.generate``), None: text."""
        if self._sampler is None:
            raise RuntimeError("Generator.generate before any weights were loaded (call load(model) first)")
        return sample_prompts(self._sampler, prompts, indices, params, seed=self.seed, purpose=purpose, step=step,
                              samples_per_prompt=samples, media=media)

    def play_episodes(self, prompts: Sequence[Sequence[int]], key_of: Callable[[int, int], SampleKey],
                      params: SamplingParams, on_turns: Callable[[list[TurnEnd]], Sequence[Optional[Continuation]]],
                      budgets: Sequence[int]) -> None:
        """Multi-turn episodes with the weights last loaded, each continued in its cache row across
        turns (``Sampler.generate_episodes``): the episode runner's call (training/rollout/episodes.py)."""
        if self._sampler is None:
            raise RuntimeError("Generator.play_episodes before any weights were loaded (call load(model) first)")
        self._sampler.generate_episodes(prompts, key_of, params, on_turns, budgets)

    def generate_from(self, model: nn.Module, prompts: Sequence[Sequence[int]], indices: Sequence[int],
                      params: SamplingParams, *, purpose: str, step: int, samples: int,
                      media: Optional[Sequence[Optional[dict]]] = None) -> list[Sample]:
        """Training's path: ``model`` in eval mode, its weights loaded, ``samples`` completions of each
        prompt (prompt-major), and the model's mode restored. Every rank calls it, even with no prompts."""
        was_training = model.training
        model.eval()
        try:
            self.load(model)
            flat = self.generate(prompts, indices, params, purpose=purpose, step=step, samples=samples, media=media)
        finally:
            model.train(was_training)
        return [sample for _, _, sample in flat]


@dataclass(frozen=True)
class Completion:
    """One sample as training and the command line see it."""

    sample: Sample
    """Tokens and log-probs up to the end of the first end-of-turn marker (the tokens trained on)."""
    text: str
    """The decoded completion without stop tokens and end-of-turn marker (what rewards see)."""

    @property
    def truncated(self) -> bool:
        """It ran into max_new_tokens or the context with no stop."""
        return self.sample.finish_reason == "length"


class Decoder:
    """Stop tokens for a tokenizer and chat template, and samples decoded into ``Completion``s."""

    def __init__(self, tokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.stop_ids, self.marker = stop_tokens(tokenizer, template)

    def completion(self, sample: Sample) -> Completion:
        cut, text = cut_at_marker(sample, self.tokenizer, self.marker, self.stop_ids)
        return Completion(cut, text)


def stop_tokens(tokenizer, template: ChatTemplate) -> tuple[tuple[int, ...], Optional[str]]:
    """(stop token ids, end-of-turn marker of several tokens or None): EOS, and the template's
    end-of-turn marker where it is one token."""
    ids = [tokenizer.eos_id]
    marker = template.end_of_turn
    if marker:
        encoded = [int(t) for t in tokenizer.encode_array(marker)]
        if len(encoded) == 1:
            ids.append(encoded[0])
            marker = None
    return tuple(dict.fromkeys(ids)), marker


def cut_at_marker(sample: Sample, tokenizer, marker: Optional[str], stop_ids) -> tuple[Sample, str]:
    """The sample up to the end of its first end-of-turn marker (a string of several tokens),
    and its text without stop tokens and marker."""
    tokens = list(sample.tokens)
    if marker and marker in tokenizer.decode(tokens):
        lo, hi = 1, len(tokens)  # the shortest prefix whose text holds the marker
        while lo < hi:
            mid = (lo + hi) // 2
            if marker in tokenizer.decode(tokens[:mid]):
                hi = mid
            else:
                lo = mid + 1
        sample = Sample(tokens=tokens[:lo], logprobs=sample.logprobs[:lo], finish_reason="stop", routing=sample.routing)
        tokens = sample.tokens
    text = tokenizer.decode([t for t in tokens if t not in stop_ids])
    if marker:
        text = text.split(marker)[0]
    return sample, text
