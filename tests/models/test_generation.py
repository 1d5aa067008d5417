"""models/generation/prompts.py: prompts files, context length, keyed samples per prompt, output records."""

from __future__ import annotations

import json

import pytest
import torch

import models
from core.config import ModelConfig
from core.exceptions import DataError
from models.generation.prompts import Prompt, context_length, read_prompts, sample_prompts, sample_record
from models.generation.sampler import Sampler, SamplingParams

CONFIG = ModelConfig(
    arch="qwen3", vocab_size=96, hidden_size=48, intermediate_size=80, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, attention="sdpa",
)


def test_read_prompts_text_and_chat_with_line_indices(tmp_path):
    path = tmp_path / "prompts.jsonl"
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    path.write_text("\n".join([json.dumps({"prompt": "Hello"}), "", json.dumps({"messages": chat}),
                               json.dumps({"prompt": chat[1:]})]) + "\n")
    assert read_prompts(path) == [
        Prompt(0, text="Hello"), Prompt(2, messages=tuple(chat)), Prompt(3, messages=(chat[1],))
    ]


@pytest.mark.parametrize(
    "line, message",
    [("not json", "line 2: not JSON"), ("[1]", "line 2: a list"), ('{"prompt": ""}', "line 2: the prompt is empty"),
     ('{"text": "x"}', "line 2: has no non-empty"), ('{"messages": [{"role": "bot", "content": "x"}]}', "message 0")],
)
def test_a_bad_prompt_line_is_a_data_error_naming_the_line(tmp_path, line, message):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "ok"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message) as caught:
        read_prompts(path)
    assert caught.value.context == {"file": str(path), "record": 2}
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="holds no prompt"):
        read_prompts(tmp_path / "empty.jsonl")


def test_context_length_rounds_up_within_the_limit():
    assert context_length([10, 300], 128, limit=4096) == 512
    assert context_length([10], 118, limit=4096) == 256
    assert context_length([4000], 512, limit=4096) == 4096


def test_samples_are_keyed_by_prompt_index_not_by_position():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: extra threads only wait on a busy machine
    try:
        _check_keyed_samples()
    finally:
        torch.set_num_threads(threads)


def _check_keyed_samples():
    model = models.build(CONFIG).eval()
    sampler = Sampler(model, max_batch=4, max_len=32, prefill_chunk=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=6)
    ids = [[1, 2, 3], [4, 5], [6]]
    both = sample_prompts(sampler, ids, [0, 7, 9], params, seed=3, samples_per_prompt=2)
    assert [(p, s) for p, s, _ in both] == [(0, 0), (0, 1), (7, 0), (7, 1), (9, 0), (9, 1)]
    assert both[0][2].tokens != both[1][2].tokens  # two samples of one prompt differ
    alone = sample_prompts(sampler, ids[1:2], [7], params, seed=3, samples_per_prompt=2)
    assert [x[2] for x in alone] == [both[2][2], both[3][2]]  # line 7's samples without the other lines
    record = sample_record(7, 1, both[3][2], completion="text")
    assert record["token_ids"] == both[3][2].tokens and record["finish_reason"] == "length"
    assert json.loads(json.dumps(record)) == record
