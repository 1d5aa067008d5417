"""Beam search (models/generation/beam.py): transformers' ``num_beams`` search on an export, token for
token; batch-invariant; keyed like sampling; bad settings refused naming the key or flag."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import models
from core.config import ModelConfig
from core.exceptions import ConfigError
from models.generation.sampler import SampleKey, Sampler, SamplingParams

CONFIG = ModelConfig(
    arch="qwen3", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, attention="sdpa",
)
PROMPTS = [[3, 17, 42, 8], [5], [60, 61, 62, 63, 64, 65, 66, 2, 9], [11, 12], [28, 28, 28], [40, 7, 1, 90, 33]]
MAX_NEW = 12
# Tokens the model below often continues with: as stop tokens, many beams end early.
STOPS = (55, 93)


@pytest.fixture(scope="module")
def model():
    """A random model whose matrices are scaled up: peaked next-token distributions, so beams part
    ways clearly and stop tokens come often."""
    ours = models.build(CONFIG, generator=torch.Generator().manual_seed(5)).eval()
    with torch.no_grad():
        for parameter in ours.parameters():
            if parameter.dim() == 2:
                parameter.mul_(8.0)
    return ours


@pytest.fixture(scope="module")
def exported(model, tmp_path_factory):
    """The model exported (models.save_pretrained) and loaded by transformers as its causal LM."""
    from transformers import AutoModelForCausalLM

    directory = tmp_path_factory.mktemp("beam-export")
    models.save_pretrained(model, directory)
    hf_model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    return hf_model.eval()


def _sampler(model, **kwargs) -> Sampler:
    return Sampler(model, max_batch=8, max_len=32, prefill_chunk=8, **kwargs)


def _keys(count: int, sample_index: int = 0) -> list[SampleKey]:
    return [SampleKey(0, "test", 0, i, sample_index) for i in range(count)]


def _theirs(hf_model, prompt: list[int], params: SamplingParams, returned: int = 1):
    """transformers' beams of one prompt: [(generated tokens, score)] best first."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        num_beams=params.num_beams, do_sample=False, max_new_tokens=params.max_new_tokens,
        length_penalty=params.length_penalty, early_stopping=params.early_stopping,
        eos_token_id=list(params.stop_token_ids) or None, pad_token_id=0, num_return_sequences=returned,
        return_dict_in_generate=True, output_scores=True,
    )
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                generation_config=config)
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()  # a beam's generated tokens
    return [(out.sequences[j, len(prompt): len(prompt) + lengths[j]].tolist(), float(out.sequences_scores[j]))
            for j in range(returned)]


def _search(beams: int, stops: tuple[int, ...] = STOPS, early=False, penalty: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=0, num_beams=beams, max_new_tokens=MAX_NEW, stop_token_ids=stops,
                          early_stopping=early, length_penalty=penalty)


SEARCHES = [
    _search(beams, stops, early, penalty)
    for beams in (2, 4)
    for stops, early, penalty in [((), False, 1.0), (STOPS[:1], False, 1.0), (STOPS, False, 1.0), (STOPS, True, 1.0),
                                  (STOPS, "never", 1.0), (STOPS, False, 0.0), (STOPS, "never", 2.0)]
]


@pytest.mark.parametrize("params", SEARCHES, ids=lambda p: f"beams{p.num_beams}-stops{len(p.stop_token_ids)}-"
                         f"early_{p.early_stopping}-lp{p.length_penalty}")
def test_best_beam_equals_transformers(model, exported, params):
    samples = _sampler(model).generate(PROMPTS, _keys(len(PROMPTS)), params)
    for prompt, sample in zip(PROMPTS, samples):
        [(tokens, score)] = _theirs(exported, prompt, params)
        assert sample.tokens == tokens, prompt
        assert sample.finish_reason == ("stop" if tokens[-1] in params.stop_token_ids else "length")
        ours = sum(sample.logprobs) / len(sample.tokens) ** params.length_penalty
        assert ours == pytest.approx(score, abs=1e-4)


def test_the_searches_above_are_not_greedy_decoding_and_finish_both_ways(model):
    """The comparison above would hold for a search that never leaves the greedy path or never stops early:
    these settings do leave it, end beams at stop tokens and differ by early_stopping."""
    greedy = _sampler(model).generate(PROMPTS, _keys(len(PROMPTS)), SamplingParams(temperature=0, max_new_tokens=MAX_NEW))
    beams = _sampler(model).generate(PROMPTS, _keys(len(PROMPTS)), _search(4))
    assert any(g.tokens != b.tokens for g, b in zip(greedy, beams))
    assert {b.finish_reason for b in beams} == {"stop", "length"}
    early = _sampler(model).generate(PROMPTS, _keys(len(PROMPTS)), _search(4, early=True))
    assert any(e.tokens != b.tokens for e, b in zip(early, beams))


@pytest.mark.parametrize("beams", [2, 4])
def test_sample_j_is_the_jth_best_beam(model, exported, beams):
    params = _search(beams)
    prompts = [p for p in PROMPTS[:3] for _ in range(beams)]
    keys = [SampleKey(0, "test", 0, i, j) for i in range(3) for j in range(beams)]
    samples = _sampler(model).generate(prompts, keys, params)
    for i, prompt in enumerate(PROMPTS[:3]):
        theirs = _theirs(exported, prompt, params, returned=beams)
        assert [s.tokens for s in samples[i * beams: (i + 1) * beams]] == [tokens for tokens, _ in theirs]


@pytest.mark.parametrize("beams", [2, 4])
def test_a_prompts_beams_do_not_depend_on_the_batch(model, beams):
    """Alone, among others, in another order, behind more prompts than the rows hold (slots refilled)."""
    params = _search(beams)
    sampler = _sampler(model)
    every = sampler.generate(PROMPTS, _keys(len(PROMPTS)), params)
    order = [4, 0, 5, 2, 1, 3]
    shuffled = sampler.generate([PROMPTS[i] for i in order], [_keys(6)[i] for i in order], params)
    for i, sample in zip(order, shuffled):
        assert sample == every[i]
    for i in (0, 2, 5):
        [alone] = _sampler(model).generate([PROMPTS[i]], [_keys(6)[i]], params)
        assert alone == every[i]  # tokens and log-probs, bitwise
    # The key names the sample: another seed, step or purpose searches the same beams.
    again = sampler.generate(PROMPTS[:2], [SampleKey(9, "other", 3, 0), SampleKey(9, "other", 3, 1)], params)
    assert again == every[:2]


def test_a_one_beam_search_is_not_a_search(model):
    """num_beams=1 is sampling (here greedy): the Sampler's usual path, unchanged."""
    params = SamplingParams(temperature=0, max_new_tokens=MAX_NEW, stop_token_ids=STOPS)
    assert params.num_beams == 1
    assert SamplingParams(temperature=0.7, top_p=0.9).num_beams == 1


@pytest.mark.parametrize("settings, key", [
    (dict(num_beams=0), "sampling.num_beams"),
    (dict(num_beams=2, temperature=1.0), "sampling.num_beams"),
    (dict(num_beams=2, temperature=0, top_p=0.9), "sampling.num_beams"),
    (dict(num_beams=2, temperature=0, top_k=5), "sampling.num_beams"),
    (dict(num_beams=2, temperature=0, length_penalty=float("nan")), "sampling.length_penalty"),
    (dict(num_beams=2, temperature=0, early_stopping="sometimes"), "sampling.early_stopping"),
])
def test_bad_beam_settings_are_refused_naming_the_key(settings, key):
    with pytest.raises(ConfigError) as error:
        SamplingParams(**settings)
    assert error.value.context["key"] == key


def test_searches_the_sampler_cannot_run_are_refused(model):
    params = SamplingParams(temperature=0, num_beams=4, max_new_tokens=4)
    with pytest.raises(ConfigError, match="max_batch=2") as error:
        Sampler(model, max_batch=2, max_len=16).generate([[1, 2]], _keys(1), params)
    assert error.value.context["key"] == "sampling.num_beams"
    with pytest.raises(ConfigError, match="hypothesis 5") as error:
        _sampler(model).generate([[1, 2]], _keys(1, sample_index=4), params)
    with pytest.raises(ConfigError, match="more than the vocabulary"):
        _sampler(model).generate([[1, 2]], _keys(1), SamplingParams(temperature=0, num_beams=4, stop_token_ids=range(30)))
    with pytest.raises(ConfigError, match="does not search beams"):
        _sampler(model).generate_episodes([[1, 2]], lambda e, t: SampleKey(0, "x", 0, e), params, lambda ends: [None])


def test_command_line_num_beams(model, tmp_path, capsys):
    """``python -m training generate --num-beams N`` on an export: the search the API runs, sample j the j-th
    best beam; the temperature is 0 unless given, and sampling flags beside it are refused naming the flag."""
    from data.tokenizers import ByteTokenizer
    from training.__main__ import main

    ours = models.build(dataclasses.replace(CONFIG, vocab_size=512, max_position_embeddings=64), generator=torch.Generator().manual_seed(3)).eval()
    with torch.no_grad():
        for parameter in ours.parameters():
            if parameter.dim() == 2:
                parameter.mul_(8.0)
    models.save_pretrained(ours, tmp_path / "export")
    (tmp_path / "export" / "tokenizer.json").write_text(ByteTokenizer().hf_tokenizer_json())
    (tmp_path / "export" / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}))

    def generate(*args: str) -> tuple[int, list[dict]]:
        out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.jsonl"
        code = main(["generate", "--from", str(tmp_path / "export"), "--device", "cpu", "--out", str(out),
                     "--prompt", "Hello", "--no-chat", "--max-new-tokens", "6", *args])
        return code, [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []

    code, records = generate("--num-beams", "3", "--samples", "2", "--batch", "4")
    assert code == 0 and [r["sample_index"] for r in records] == [0, 1]
    params = SamplingParams(temperature=0, num_beams=3, max_new_tokens=6, stop_token_ids=(ByteTokenizer.eos_id,))
    sampler = Sampler(ours, max_batch=4, max_len=64)  # the context: the model's 64 positions
    expected = sampler.generate([list(b"Hello")] * 2, [SampleKey(0, "generate", 0, 0, j) for j in (0, 1)], params)
    assert [r["token_ids"] for r in records] == [s.tokens for s in expected]
    assert records[0]["token_ids"] != records[1]["token_ids"]
    for args, flag in [(("--num-beams", "0"), "--num-beams"), (("--num-beams", "2", "--temperature", "0.7"), "--num-beams"),
                       (("--num-beams", "2", "--top-p", "0.5"), "--num-beams"), (("--num-beams", "2", "--samples", "3"), "--samples"),
                       (("--num-beams", "9"), "--batch")]:
        code, records = generate(*args)
        assert (code, records) == (2, []), args
        assert flag in capsys.readouterr().err
