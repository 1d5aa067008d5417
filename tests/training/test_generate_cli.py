"""``python -m training generate`` (training/cli/generate.py) on a tiny Hugging Face directory with the
byte tokenizer and the ChatML template, as ``python -m training export`` writes them."""

from __future__ import annotations

import json
import os

import pytest
import torch

import models
from core import seeding
from core.config import ModelConfig
from data.chat_template import CHATML_TEMPLATE
from data.tokenizers import ByteTokenizer
from models.hf_weights import load_pretrained, save_pretrained
from training.__main__ import main

CONFIG = ModelConfig(
    arch="qwen3", vocab_size=512, hidden_size=48, intermediate_size=80, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, attention="sdpa", max_position_embeddings=96,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-hf")
    model = models.build(CONFIG, generator=seeding.generator(3, "model_init"))
    save_pretrained(model, path)
    (path / "tokenizer.json").write_text(ByteTokenizer().hf_tokenizer_json())
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>", "pad_token": "<|pad|>",
        "chat_template": CHATML_TEMPLATE}))
    return path


def generate(model_dir, tmp_path, *args) -> tuple[int, list[dict]]:
    out = tmp_path / f"out-{len(list(tmp_path.iterdir()))}.jsonl"
    code = main(["generate", "--from", str(model_dir), "--device", "cpu", "--out", str(out), *args])
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    return code, lines


def test_greedy_equals_argmax_decoding(model_dir, tmp_path):
    code, [record] = generate(model_dir, tmp_path, "--prompt", "Hello", "--no-chat", "--temperature", "0",
                              "--max-new-tokens", "12")
    assert code == 0 and record["prompt"] == "Hello" and record["prompt_index"] == 0
    model = load_pretrained(model_dir).eval()
    ids = list(b"Hello")
    expected = []
    with torch.no_grad():
        for _ in range(12):
            token = int(model(torch.tensor([ids]))[0, -1].argmax())
            expected.append(token)
            ids.append(token)
            if token == ByteTokenizer.eos_id:
                break
    assert record["token_ids"] == expected
    assert len(record["logprobs"]) == len(expected) and all(lp <= 0 for lp in record["logprobs"])
    assert record["finish_reason"] == ("stop" if expected[-1] == ByteTokenizer.eos_id else "length")


def test_prompts_file_chat_template_and_keyed_samples(model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompts.write_text(json.dumps({"prompt": "What is 2 + 2?"}) + "\n\n" + json.dumps({"messages": messages}) + "\n")
    code, records = generate(model_dir, tmp_path, "--prompts", str(prompts), "--samples", "2", "--seed", "5",
                             "--max-new-tokens", "8", "--temperature", "1.0")
    assert code == 0
    assert [(r["prompt_index"], r["sample_index"]) for r in records] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    # the directory has a chat template: text prompts are rendered as a user turn by default
    assert records[0]["prompt"] == "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    assert records[2]["prompt"].startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert records[0]["token_ids"] != records[1]["token_ids"]  # two keys, two samples
    # a sample depends on its key only, not on the other prompts of the file
    code, [alone] = generate(model_dir, tmp_path, "--prompt", "What is 2 + 2?", "--seed", "5",
                             "--max-new-tokens", "8", "--temperature", "1.0")
    assert alone["token_ids"] == records[0]["token_ids"] and alone["logprobs"] == records[0]["logprobs"]
    code, [raw] = generate(model_dir, tmp_path, "--prompt", "What is 2 + 2?", "--no-chat", "--max-new-tokens", "2")
    assert raw["prompt"] == "What is 2 + 2?"


@pytest.mark.parametrize("recorded, expected", [
    (False, "Hi"),  # an export of a pretraining run: raw, as the run generates, though it has a template
    (True, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    ("yes", "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),  # not a record: the template decides
])
def test_an_exports_marker_decides_whether_text_prompts_are_chat(model_dir, tmp_path, recorded, expected):
    import shutil

    from training.cli.export_target import EXPORT_MARKER

    export = tmp_path / "export"
    shutil.copytree(model_dir, export)
    (export / EXPORT_MARKER).write_text(json.dumps({"lockstep_export": 1, "chat_model": recorded, "files": []}))
    code, [record] = generate(export, tmp_path, "--prompt", "Hi", "--max-new-tokens", "2")
    assert code == 0 and record["prompt"] == expected


@pytest.mark.parametrize("recorded, expected", [
    (False, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    (True, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),
    (None, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"),  # not recorded: the template's default
])
def test_an_exports_recorded_template_thinking_renders_as_its_run_did(model_dir, tmp_path, recorded, expected):
    """An export of a run that set data.template_thinking renders Qwen3's template with it
    (enable_thinking), as training rendered the run's prompts."""
    import shutil

    from data.templates import preset_path
    from training.cli.export_target import EXPORT_MARKER

    export = tmp_path / "export"
    shutil.copytree(model_dir, export)
    tokenizer_config = json.loads((export / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = preset_path("qwen3").read_text()
    (export / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    marker = {"lockstep_export": 1, "chat_model": True, "files": []}
    if recorded is not None:
        marker["template_thinking"] = recorded
    (export / EXPORT_MARKER).write_text(json.dumps(marker))
    code, [record] = generate(export, tmp_path, "--prompt", "Hi", "--max-new-tokens", "2")
    assert code == 0 and record["prompt"] == expected


@pytest.mark.parametrize("args, exit_code", [
    (["--max-new-tokens", "4"], 2),  # neither --prompt nor --prompts
    (["--prompt", "", "--max-new-tokens", "4"], 3),  # empty prompt
    (["--prompt", "x" * 120, "--no-chat", "--max-new-tokens", "4"], 3),  # longer than the context (96)
    (["--prompt", "Hi", "--temperature", "-1"], 2),
    (["--prompt", "Hi", "--step", "3"], 2),  # --step names a run's checkpoint
])
def test_bad_input_is_a_typed_error(model_dir, tmp_path, capsys, args, exit_code):
    code, records = generate(model_dir, tmp_path, *args)
    assert (code, records) == (exit_code, [])
    assert capsys.readouterr().err.strip()


def test_bad_prompts_file_line_and_unknown_source(model_dir, tmp_path, capsys):
    prompts = tmp_path / "bad.jsonl"
    prompts.write_text(json.dumps({"prompt": "ok"}) + "\n" + "{not json\n")
    code, _ = generate(model_dir, tmp_path, "--prompts", str(prompts))
    assert code == 3 and "bad.jsonl line 2" in capsys.readouterr().err
    code = main(["generate", "--from", "no-such-run", "--root", str(tmp_path), "--prompt", "Hi"])
    assert code in (2, 4) and "no-such-run" in capsys.readouterr().err


def _poison(path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    tensors["model.norm.weight"][0] = float("nan")
    save_file(tensors, str(path), metadata={"format": "pt"})


def _damaged_copy(model_dir, tmp_path, name, damage):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(model_dir, copy)
    damage(copy / name)
    return copy


@pytest.mark.parametrize("name, damage, exit_code, words", [
    ("model.safetensors", lambda p: p.write_bytes(p.read_bytes()[:500]), 2, "not a readable safetensors file"),
    ("model.safetensors", lambda p: p.write_bytes(b"\x00" * 64), 2, "not a readable safetensors file"),
    ("model.safetensors", lambda p: _poison(p), 2, "non-finite"),
    ("tokenizer_config.json", lambda p: p.write_text('{"eos_token": "<|endoftext|>",'), 3, "not valid JSON"),
    ("tokenizer_config.json", lambda p: p.write_text('["a list"]'), 3, "must hold a JSON object"),
], ids=["truncated-weights", "garbage-weights", "nan-weight", "truncated-tokenizer-config", "tokenizer-config-not-an-object"])
def test_a_damaged_model_directory_is_one_line_with_its_exit_code(model_dir, tmp_path, capsys, name, damage,
                                                                    exit_code, words):
    copy = _damaged_copy(model_dir, tmp_path, name, damage)
    code, records = generate(copy, tmp_path, "--prompt", "Hi", "--max-new-tokens", "2")
    err = capsys.readouterr().err.strip()
    assert (code, records) == (exit_code, [])
    assert words in err and name in err and "\n" not in err and "Traceback" not in err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (no space left)")
@pytest.mark.parametrize("out, exit_code, words", [
    ("/dev/full", 1, "No space left on device"),  # the disk fills up while the samples are written
    ("{tmp}", 2, "is a directory"),
    ("{tmp}/missing/samples.jsonl", 2, "does not exist"),
])
def test_an_out_path_that_cannot_be_written_is_one_line(model_dir, tmp_path, capsys, out, exit_code, words):
    code = main(["generate", "--from", str(model_dir), "--device", "cpu", "--prompt", "hi", "--no-chat",
                 "--max-new-tokens", "2", "--out", out.format(tmp=tmp_path)])
    err = capsys.readouterr().err.strip()
    assert code == exit_code and words in err, err
    assert "\n" not in err and "Traceback" not in err


# --------------------------------------------------------------------------- what --out may replace


def _fake_run_dir(path):
    path.mkdir(parents=True)
    (path / "config.yaml").write_text("run: {name: r}\n")
    (path / "ledger.jsonl").write_text('{"step": 1, "loss": 2.5}\n')
    return path


def _main_err(capsys, *args) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(args))
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return code, err


def test_an_existing_out_file_is_replaced_only_with_overwrite(model_dir, tmp_path, capsys):
    out = tmp_path / "samples.jsonl"
    out.write_text("earlier samples\n")
    base = ["generate", "--from", str(model_dir), "--device", "cpu", "--prompt", "hi", "--no-chat",
            "--max-new-tokens", "2", "--out", str(out)]
    code, err = _main_err(capsys, *base)
    assert code == 2 and f"--out {out} exists" in err and "--overwrite" in err
    assert out.read_text() == "earlier samples\n"
    code, _ = _main_err(capsys, *base, "--overwrite")
    assert code == 0 and json.loads(out.read_text())["prompt"] == "hi"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["samples.jsonl"]  # no staging left


def test_out_inside_a_run_directory_is_refused_even_with_overwrite(model_dir, tmp_path, capsys):
    """The probe: --out runs/<id>/ledger.jsonl replaced the run's ledger."""
    run_dir = _fake_run_dir(tmp_path / "runs" / "user-20260101-000000-abcd1234")
    ledger = run_dir / "ledger.jsonl"
    (tmp_path / "link.jsonl").symlink_to(ledger)
    for out in (ledger, run_dir / "artifacts" / "samples.jsonl", tmp_path / "link.jsonl"):
        out.parent.mkdir(exist_ok=True)
        code, err = _main_err(capsys, "generate", "--from", str(model_dir), "--device", "cpu", "--prompt", "hi",
                              "--max-new-tokens", "2", "--out", str(out), "--overwrite")
        assert code == 2 and f"inside the run directory {run_dir.resolve()}" in err, err
    assert ledger.read_text() == '{"step": 1, "loss": 2.5}\n'
    assert not (run_dir / "artifacts" / "samples.jsonl").exists()


def test_a_failed_write_leaves_the_previous_file_whole(model_dir, tmp_path, capsys, monkeypatch):
    import errno

    import training.cli.generate as generate_cli

    def failing(*args):
        yield '{"partial": true}'
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(generate_cli, "_record_lines", failing)
    out = tmp_path / "samples.jsonl"
    out.write_text("earlier samples\n")
    code, err = _main_err(capsys, "generate", "--from", str(model_dir), "--device", "cpu", "--prompt", "hi",
                          "--max-new-tokens", "2", "--out", str(out), "--overwrite")
    assert code == 1 and "No space left on device" in err
    assert out.read_text() == "earlier samples\n" and sorted(p.name for p in tmp_path.iterdir()) == ["samples.jsonl"]


# --------------------------------------------------------------------------- prompts that are not text


@pytest.mark.parametrize("line, words", [
    ('{"prompt": "a\\ud83d b"}', "line 2: the prompt holds a lone surrogate U+D83D at character 1"),
    ('{"messages": [{"role": "user", "content": "\\udc00"}]}', "line 2: message 0's content holds a lone surrogate"),
    (b'{"prompt": "caf\xe9"}', "line 2: not UTF-8"),
], ids=["prompt", "message", "latin-1"])
def test_a_prompt_that_is_not_text_is_one_line_naming_file_and_line(model_dir, tmp_path, capsys, line, words):
    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "ok"}\n' + (line if isinstance(line, bytes) else line.encode()) + b"\n")
    code, err = _main_err(capsys, "generate", "--from", str(model_dir), "--device", "cpu", "--prompts", str(prompts),
                          "--max-new-tokens", "2")
    assert code == 3 and f"p.jsonl {words}" in err and f"file={prompts}" in err, err


def test_a_prompt_argument_that_is_not_text_is_one_line(model_dir, capsys):
    for prompt in ("\ud83d", "a" + os.fsdecode(b"\xff")):  # a lone surrogate; a non-UTF-8 byte of argv
        code, err = _main_err(capsys, "generate", "--from", str(model_dir), "--device", "cpu", "--prompt", prompt,
                              "--max-new-tokens", "2")
        assert code == 3 and "--prompt holds a character that is not text" in err, err


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero (an endless file)")
def test_an_endless_or_huge_prompts_file_is_refused(model_dir, capsys):
    code, err = _main_err(capsys, "generate", "--from", str(model_dir), "--device", "cpu", "--prompts", "/dev/zero",
                          "--max-new-tokens", "2")
    assert code == 3 and "prompts file /dev/zero is larger than 64 MiB" in err and "split it" in err, err
