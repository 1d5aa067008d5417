"""Sampler.generate_episodes: multi-turn episodes continued in their cache rows. A turn's ids and
log-probs depend on its own episode only (not on batch-mates, order, row or refill interval), turn 0
is generate's sample, greedy turns are the full forward's argmax over the whole episode (appended
ids included), only prompts are prefilled, and bad continuations are data errors naming the episode."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.exceptions import DataError
from models.generation.sampler import Continuation, SampleKey, Sampler, SamplingParams
from tests.models.sampler_model import QWEN3

STOPS = tuple(range(0, QWEN3.vocab_size, 8))  # turns end after ~8 ids, at different steps
LENGTHS = (3, 9, 1, 17, 5, 12, 7)  # 7 episodes through 4 rows: refilled
TURNS = 3
RULES = {
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=10, stop_token_ids=STOPS),
    "sampled": SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=STOPS),
    "filtered": SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=10, stop_token_ids=STOPS),
}


def _sampler(model, **kwargs):
    return Sampler(model, max_batch=4, max_len=96, prefill_chunk=8, **kwargs)


def _prompts():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, QWEN3.vocab_size, (n,), generator=generator).tolist() for n in LENGTHS]


def _observation(kept: list[int]) -> list[int]:
    """What a deterministic tool answers to a turn: 1..13 ids computed from the turn's ids (from the
    sampler's extend_chunk=8 on they go in by chunks, below by forced decode steps)."""
    return [(sum(kept) + 7 * k) % QWEN3.vocab_size for k in range(1 + (5 * len(kept)) % 13)]


def _play(sampler, params, episodes=range(len(LENGTHS))):
    """Play ``episodes`` (indices into _prompts, in the order given): turn 1 keeps only its first 3
    ids (a turn cut by its caller), each turn is followed by _observation's ids, and turn t's budget
    is 10 - 3t. -> ({episode: [Sample per turn]}, {episode: final ids}, {"prefilled": the prompts
    prefilled, "extended": how many continuations went in by chunks})."""
    episodes, prompts = list(episodes), _prompts()
    turns, ids = {e: [] for e in episodes}, {e: list(prompts[e]) for e in episodes}

    def key_of(i, turn):
        return SampleKey(1, "test" if turn == 0 else f"test.turn{turn}", 3, episodes[i], 0)

    def on_turns(ended):
        answers = []
        for end in ended:
            e = episodes[end.episode]
            assert end.turn == len(turns[e])
            turns[e].append(end.sample)
            assert len(end.sample.tokens) <= 10 - 3 * end.turn
            if end.turn + 1 == TURNS:
                ids[e] += end.sample.tokens
                answers.append(None)
                continue
            kept = end.sample.tokens[:3] if end.turn == 1 else end.sample.tokens
            ids[e] += kept + _observation(kept)
            answers.append(Continuation(ids[e], budget=10 - 3 * (end.turn + 1)))
        return answers

    fed = {"prefilled": [], "extended": 0}
    prefill, extend = sampler._prefill, sampler._extend
    sampler._prefill = lambda rows, prompts: (fed["prefilled"].extend(prompts), prefill(rows, prompts))
    sampler._extend = lambda rows, *args: (fed.__setitem__("extended", fed["extended"] + len(rows)), extend(rows, *args))
    try:
        sampler.generate_episodes([prompts[e] for e in episodes], key_of, params, on_turns)
    finally:
        del sampler._prefill, sampler._extend
    return turns, ids, fed


@pytest.mark.parametrize("rule", sorted(RULES))
def test_an_episode_does_not_depend_on_its_batch_mates_their_order_or_the_refill_interval(sampler_model, rule):
    sampler, params = _sampler(sampler_model), RULES[rule]
    batched, _, _ = _play(sampler, params)
    shuffled, _, _ = _play(sampler, params, [5, 2, 6, 0, 3, 1, 4])
    every_step, _, _ = _play(_sampler(sampler_model, refill_every=1), params)
    assert shuffled == batched and every_step == batched  # Sample equality: ids, exact log-probs, finish
    for e in (3, 0, 6):
        alone, _, _ = _play(sampler, params, [e])
        assert alone[e] == batched[e], e
    lengths = {len(s.tokens) for turns in batched.values() for s in turns}
    assert all(len(turns) == TURNS for turns in batched.values()) and len(lengths) > 2
    assert any(len(turns[1].tokens) > 3 for turns in batched.values())  # some turn was cut by its caller


@pytest.mark.parametrize("rule", ["sampled", "filtered"])
def test_turn_0_is_the_sample_generate_gives_and_later_turns_have_keys_of_their_own(sampler_model, rule):
    sampler, params = _sampler(sampler_model), RULES[rule]
    turns, _, _ = _play(sampler, params)
    keys = [SampleKey(1, "test", 3, e, 0) for e in range(len(LENGTHS))]
    assert [turns[e][0] for e in range(len(LENGTHS))] == sampler.generate(_prompts(), keys, params)
    other = dataclasses.replace(params, stop_token_ids=())
    first, _, _ = _play(sampler, other)
    assert all(len({tuple(s.tokens[:3]) for s in first[e]}) == TURNS for e in first)


def test_greedy_turns_are_the_argmax_of_a_full_forward_over_the_whole_episode(sampler_model):
    """The appended ids and the kept ids before each turn are in the cache exactly as a forward of
    the whole sequence sees them; the cut-off ids of turn 1 are not."""
    turns, ids, _ = _play(_sampler(sampler_model), RULES["greedy"])
    prompts = _prompts()
    for e, sequence in ids.items():
        with torch.no_grad():
            logits = sampler_model(torch.tensor([sequence]))[0]
        at = len(prompts[e])
        for t, sample in enumerate(turns[e]):
            kept = sample.tokens[:3] if t == 1 else sample.tokens
            window = logits[at - 1: at - 1 + len(kept)]
            assert window.argmax(dim=-1).tolist() == kept, (e, t)
            expected = torch.log_softmax(window, dim=-1).gather(-1, torch.tensor(kept)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(sample.logprobs[:len(kept)]), expected, rtol=0, atol=1e-5)
            at += len(kept) + (len(_observation(kept)) if t + 1 < TURNS else 0)
        assert at == len(sequence)


def test_only_prompts_are_prefilled_and_long_continuations_go_in_by_chunks(sampler_model):
    sampler = _sampler(sampler_model)
    assert sampler.extend_chunk == 8  # gcd(16, prefill_chunk=8)
    turns, _, fed = _play(sampler, RULES["sampled"])
    assert sorted(map(tuple, fed["prefilled"])) == sorted(map(tuple, _prompts()))
    # A continuation feeds from the first id the row's cache does not hold (the turn's last sampled
    # id, or the first appended id after a cut) up to its last id but one: by chunks from
    # extend_chunk ids on, by forced decode steps below.
    fed_ids = []
    for samples in turns.values():
        for t, sample in enumerate(samples[:-1]):
            kept = sample.tokens[:3] if t == 1 else sample.tokens
            now = kept + _observation(kept)
            common = next((i for i, (a, b) in enumerate(zip(now, sample.tokens)) if a != b), len(now))
            fed_ids.append(len(now) - 1 - min(len(sample.tokens) - 1, common))
    assert fed["extended"] == sum(n >= 8 for n in fed_ids) and 0 < fed["extended"] < len(fed_ids)


@pytest.mark.parametrize("answer, what", [
    (lambda ids: Continuation([ids[0] + 1] + ids[1:], 4), "does not start with the episode's ids"),
    (lambda ids: Continuation(ids + [1], 0), "budget 0"),
    (lambda ids: Continuation(ids + [1] * 96, 4), "no room"),
    (lambda ids: Continuation(ids + [QWEN3.vocab_size], 4), "outside the vocabulary"),
])
def test_a_bad_continuation_is_a_data_error_naming_the_episode(sampler_model, answer, what):
    prompts = _prompts()[:2]

    def on_turns(ended):
        return [answer(prompts[end.episode] + end.sample.tokens) if end.episode == 1 else None for end in ended]

    with pytest.raises(DataError, match=what) as error:
        _sampler(sampler_model).generate_episodes(prompts, lambda e, t: SampleKey(1, "test", 3, e, t), RULES["sampled"],
                                          on_turns)
    assert "episode 1's continuation after turn 0" in str(error.value) and error.value.context["record"] == 1
