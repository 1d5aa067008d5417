"""``data.template_thinking``: the chat template's ``enable_thinking`` variable (data/chat_template.py).

- Qwen3's template (the ``qwen3`` preset) renders prompts and conversations with it set false, set
  true and unset exactly as ``transformers``' ``apply_chat_template(..., enable_thinking=...)`` does,
  text and ids; false puts an empty think block into the generation prompt, and the GRPO/PPO prompt
  encoder's prompt ids carry it;
- a template that never reads ``enable_thinking`` (Qwen2.5's, ChatML) refuses the setting with a
  ConfigError naming ``data.template_thinking``, as train.py's check of a config reports it (exit 2);
- the key is hashed only when set (every earlier config keeps its hash), and an unset key leaves the
  template's fingerprint (what a data state records) as it was.
"""

from __future__ import annotations

import json
import pickle
import shutil

import pytest

from core.config import config_hash, load
from core.exceptions import ConfigError
from data import qwen_vocab
from data.chat_template import CHATML_PRESET, ChatEncoder, ChatTemplate
from data.pipeline.plan import check_chat_config
from data.templates import preset_path
from data.tokenizers import HFTokenizer

transformers = pytest.importorskip("transformers")

EMPTY_THINK = "<think>\n\n</think>\n\n"
QUESTION = {"role": "user", "content": "What is 6 times 7?"}
REASONED = {"role": "assistant", "content": "<think>\n6 sevens are 42.\n</think>\n\n42"}
CONVERSATIONS = {
    "question": [QUESTION],
    "system": [{"role": "system", "content": "Answer with a number."}, QUESTION],
    "second-turn": [QUESTION, REASONED, {"role": "user", "content": "And 6 times 8?"}],
}


@pytest.fixture(scope="module")
def qwen3(qwen_vocabulary, tmp_path_factory):
    """(our tokenizer, transformers' tokenizer of a directory holding Qwen3's template)."""
    directory = tmp_path_factory.mktemp("qwen3")
    shutil.copy(qwen_vocabulary / "tokenizer.json", directory / "tokenizer.json")
    config = qwen_vocab.tokenizer_config_json()
    config["chat_template"] = preset_path("qwen3").read_text()
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return qwen_vocabulary, HFTokenizer(directory / "tokenizer.json"), \
        transformers.AutoTokenizer.from_pretrained(str(directory))


def _theirs(auto, messages, thinking, **kwargs):
    extra = {} if thinking is None else {"enable_thinking": thinking}
    return auto.apply_chat_template(messages, **kwargs, **extra)


@pytest.mark.parametrize("thinking", [False, True, None], ids=["false", "true", "unset"])
@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [True, False], ids=["prompt", "chat"])
def test_qwen3_renders_as_transformers_with_enable_thinking(qwen3, thinking, name, generation_prompt):
    vocabulary, tokenizer, auto = qwen3
    messages = CONVERSATIONS[name] + ([] if generation_prompt else [REASONED])
    ours = ChatTemplate.for_tokenizer(str(vocabulary), "qwen3", thinking=thinking)
    text = ours.render(messages, add_generation_prompt=generation_prompt)
    assert text == _theirs(auto, messages, thinking, tokenize=False, add_generation_prompt=generation_prompt)
    ids = _theirs(auto, messages, thinking, tokenize=True, add_generation_prompt=generation_prompt)
    assert tokenizer.encode(text) == list(ids["input_ids"] if not isinstance(ids, list) else ids)
    if generation_prompt:  # false: the model is handed an empty think block and answers directly
        assert text.endswith("<|im_start|>assistant\n" + (EMPTY_THINK if thinking is False else ""))


def test_the_prompt_encoder_carries_the_empty_think_block_into_the_prompt_ids(qwen3):
    vocabulary, tokenizer, auto = qwen3
    record = {"prompt": QUESTION["content"], "answer": "42"}
    encoded = {}
    for thinking in (False, None):
        template = ChatTemplate.for_tokenizer(str(vocabulary), "qwen3", thinking=thinking)
        ids, mask = ChatEncoder(template, tokenizer, kind="prompt", loss_on="assistant").encode(record)
        expected = _theirs(auto, [QUESTION], thinking, tokenize=False, add_generation_prompt=True)
        assert tokenizer.decode(ids[~mask].tolist()) == expected and tokenizer.decode(ids[mask].tolist()) == "42"
        encoded[thinking] = tokenizer.decode(ids[~mask].tolist())
    assert encoded[False] == encoded[None] + EMPTY_THINK


@pytest.mark.parametrize("preset", ["qwen2.5", CHATML_PRESET])
@pytest.mark.parametrize("thinking", [False, True])
def test_a_template_that_never_reads_enable_thinking_refuses_the_setting(qwen_vocabulary, preset, thinking):
    template = ChatTemplate.for_tokenizer(str(qwen_vocabulary), preset, thinking=thinking)
    with pytest.raises(ConfigError) as info:
        template.render([QUESTION], add_generation_prompt=True)
    assert info.value.context["key"] == "data.template_thinking"
    assert f"data.template_thinking={str(thinking).lower()}" in str(info.value)
    assert "never reads it" in str(info.value) and "data.chat_template=qwen3" in info.value.hint
    ChatTemplate.for_tokenizer(str(qwen_vocabulary), preset).render([QUESTION])  # unset: as before


def test_a_run_config_with_such_a_template_is_refused_before_it_starts():
    """tiny-grpo.yaml renders its prompts with ChatML (byte tokenizer): the check train.py runs first."""
    config = load("configs/tiny-grpo.yaml", ["data.template_thinking=false"])
    with pytest.raises(ConfigError) as info:
        check_chat_config(config.data)
    assert info.value.context["key"] == "data.template_thinking" and info.value.exit_code == 2
    check_chat_config(load("configs/tiny-grpo.yaml", []).data)


def test_the_key_is_hashed_only_when_set_and_the_fingerprint_moves_only_when_set(qwen_vocabulary):
    plain = load("configs/tiny-grpo.yaml", [])
    unset = load("configs/tiny-grpo.yaml", ["data.template_thinking=null"])
    off = load("configs/tiny-grpo.yaml", ["data.template_thinking=false"])
    on = load("configs/tiny-grpo.yaml", ["data.template_thinking=true"])
    assert plain.data.template_thinking is None and off.data.template_thinking is False
    assert config_hash(unset) == config_hash(plain)
    assert len({config_hash(plain), config_hash(off), config_hash(on)}) == 3
    with pytest.raises(ConfigError, match="data.template_thinking"):
        load("configs/tiny-grpo.yaml", ["data.template_thinking=maybe"])
    prints = {t: ChatTemplate.for_tokenizer(str(qwen_vocabulary), "qwen3", thinking=t).fingerprint
              for t in (None, False, True)}
    source = preset_path("qwen3").read_text()
    assert prints[None] == ChatTemplate(source, origin="qwen3").fingerprint and len(set(prints.values())) == 3


def test_the_setting_survives_the_trip_to_a_worker_process(qwen_vocabulary):
    template = ChatTemplate.for_tokenizer(str(qwen_vocabulary), "qwen3", thinking=False)
    copy = pickle.loads(pickle.dumps(template))
    assert copy.thinking is False and copy.fingerprint == template.fingerprint
    assert copy.render([QUESTION], add_generation_prompt=True).endswith(EMPTY_THINK)
