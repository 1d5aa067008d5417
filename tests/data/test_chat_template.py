"""Chat records -> ids and loss masks (data/chat_template.py), checked against transformers.

The ids must equal ``transformers``' ``apply_chat_template`` for the same messages, template
and tokenizer: Qwen2-style (a default system prompt when none is given) and Qwen3-style
(reasoning blocks on the latest assistant turn) templates, multi-turn, with and without a
system prompt. The trained tokens are exactly the assistant contents with their end-of-turn
marker.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.exceptions import ConfigError
from data.chat_template import CHATML_TEMPLATE, ChatEncoder, ChatTemplate, RecordError
from data.tokenizers import ByteTokenizer, HFTokenizer

# A Qwen2.5-style template: ChatML, with a default system prompt when the conversation has none.
QWEN2_STYLE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# A Qwen3-style template: the latest assistant turn carries a (possibly empty) think block,
# earlier ones drop it; whitespace control and a namespace as the real templates use.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_query=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}"
    "{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if message.role == 'user' and ns.last_query == messages|length - 1 %}"
    "{%- set ns.last_query = index %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{%- set content = message.content %}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + content.lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"}, {"role": "assistant", "content": "42"}],
    [{"role": "system", "content": "Answer with the number only."},
     {"role": "user", "content": "What is 7 * 6?"}, {"role": "assistant", "content": "42"}],
    [{"role": "user", "content": "Reverse 'abc'."}, {"role": "assistant", "content": "cba"},
     {"role": "user", "content": "Upper-case 'dog'."}, {"role": "assistant", "content": "DOG"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count the a's in 'banana'."},
     {"role": "assistant", "content": "3"}, {"role": "user", "content": "And the n's?"},
     {"role": "assistant", "content": "2 — zwei, 二 🙂"}],
]


@pytest.fixture(scope="module")
def bpe_dir(tmp_path_factory):
    """A small byte-level BPE tokenizer with ChatML special tokens, as a Hugging Face directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for c in CONVERSATIONS for m in c] * 20 + ["system user assistant helpful"] * 20
    tok.train_from_iterator(corpus, trainer)
    directory = tmp_path_factory.mktemp("bpe")
    tok.save(str(directory / "tokenizer.json"))
    return directory


def _write_config(directory, template):
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "chat_template": template,
    }))


def _hf_ids(directory, messages):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(directory))
    out = tok.apply_chat_template(messages, tokenize=True)
    ids = out["input_ids"] if not isinstance(out, list) else out
    return list(ids)


@pytest.mark.parametrize("template", [QWEN2_STYLE, QWEN3_STYLE, CHATML_TEMPLATE], ids=["qwen2", "qwen3", "chatml"])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_ids_equal_transformers_apply_chat_template(bpe_dir, template, conversation):
    _write_config(bpe_dir, template)
    messages = CONVERSATIONS[conversation]
    encoder = ChatEncoder(ChatTemplate.for_tokenizer(str(bpe_dir)), HFTokenizer(bpe_dir / "tokenizer.json"),
                          kind="chat", loss_on="assistant")
    ids, mask = encoder.encode({"messages": messages})
    assert ids.tolist() == _hf_ids(bpe_dir, messages)
    # The trained tokens are the assistant contents, each with its <|im_end|>.
    tok = HFTokenizer(bpe_dir / "tokenizer.json")
    trained = _runs(ids, mask, tok)
    assert trained == [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]


def _runs(ids, mask, tok):
    runs, current = [], []
    for token, on in zip(ids.tolist(), mask.tolist()):
        if on:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    if current:
        runs.append(tok.decode(current))
    return runs


def test_loss_on_completion_trains_the_last_assistant_turn_only(bpe_dir):
    _write_config(bpe_dir, CHATML_TEMPLATE)
    tok = HFTokenizer(bpe_dir / "tokenizer.json")
    encoder = ChatEncoder(ChatTemplate.for_tokenizer(str(bpe_dir)), tok, kind="chat", loss_on="completion")
    ids, mask = encoder.encode({"messages": CONVERSATIONS[2]})
    assert _runs(ids, mask, tok) == ["DOG<|im_end|>"]
    everything = ChatEncoder(ChatTemplate.for_tokenizer(str(bpe_dir)), tok, kind="chat", loss_on="all")
    assert everything.encode({"messages": CONVERSATIONS[2]})[1].all()


def test_prompt_completion_strings_train_the_completion():
    encoder = ChatEncoder(ChatTemplate.for_tokenizer("byte"), ByteTokenizer(), kind="prompt_completion",
                          loss_on="completion")
    ids, mask = encoder.encode({"prompt": "2+2=", "completion": "4"})
    assert bytes(ids.tolist()) == b"2+2=4"
    assert mask.tolist() == [False] * 4 + [True]


def test_prompt_completion_messages_render_through_the_template():
    encoder = ChatEncoder(ChatTemplate.for_tokenizer("byte"), ByteTokenizer(), kind="prompt_completion",
                          loss_on="completion")
    ids, mask = encoder.encode({"prompt": [{"role": "user", "content": "hi"}],
                                "completion": [{"role": "assistant", "content": "yo"}]})
    text = bytes(ids.tolist()).decode()
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    assert bytes(ids[mask].tolist()).decode() == "yo<|im_end|>"


@pytest.mark.parametrize(("record", "message"), [
    ({"messages": [{"role": "robot", "content": "x"}]}, "unknown role 'robot'"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "  "}]}, "empty content"),
    ({"messages": "hello"}, "non-empty list"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "user", "content": 3}]}, "not a string"),
    ({"text": "x"}, "no 'messages'"),
    ({"messages": [{"role": "user", "content": "only a question"}]}, "no assistant turn"),
])
def test_bad_chat_records_are_record_errors(record, message):
    encoder = ChatEncoder(ChatTemplate.for_tokenizer("byte"), ByteTokenizer(), kind="chat", loss_on="assistant")
    with pytest.raises(RecordError, match=message):
        encoder.encode(record)


def test_a_template_that_hides_the_assistant_content_is_a_config_error(tmp_path):
    (tmp_path / "tokenizer.json").write_text(ByteTokenizer().hf_tokenizer_json())
    _write_config(tmp_path, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}")
    encoder = ChatEncoder(ChatTemplate.for_tokenizer(str(tmp_path)), HFTokenizer(tmp_path / "tokenizer.json"),
                          kind="chat", loss_on="assistant")
    with pytest.raises(ConfigError, match="renders no assistant span") as info:
        encoder.check()
    assert str(tmp_path / "tokenizer_config.json") in str(info.value)


def test_byte_offsets_cover_multibyte_characters():
    ids, offsets = ByteTokenizer().encode_offsets("a二🙂")
    assert len(ids) == 1 + 3 + 4
    assert offsets[:, 0].tolist() == [0, 1, 1, 1, 2, 2, 2, 2]
    assert np.all(offsets[:, 1] == offsets[:, 0] + 1)


@pytest.mark.parametrize("template", [QWEN2_STYLE, QWEN3_STYLE, CHATML_TEMPLATE], ids=["qwen2", "qwen3", "chatml"])
def test_observation_text_is_what_the_whole_conversation_renders_after_a_sampled_turn(template):
    """prefix + sampled turn (up to its end-of-turn marker) + observation text == the template's
    rendering of the whole conversation with the generation prompt: what an episode appends.
    The sampled turn is what the template renders for it (Qwen3-style: with its think block,
    which the model writes itself after the generation prompt)."""
    chat = ChatTemplate(template, origin="test")
    results = [{"role": "tool", "content": "178377"}, {"role": "tool", "content": "error: division by zero"}]
    question = [{"role": "user", "content": "What is 4821 * 37?"}]
    turn = "Calling the calculator."
    prefix = chat.render(question, add_generation_prompt=True)
    whole = chat.render([*question, {"role": "assistant", "content": turn}, *results], add_generation_prompt=True)
    observation = chat.observation_text(results)
    sampled = whole[len(prefix):len(whole) - len(chat.end_of_turn + observation)]
    assert whole == prefix + sampled + chat.end_of_turn + observation
    assert sampled.endswith(turn) and chat.end_of_turn not in sampled
    assert observation.startswith("\n")
