"""Fine-tuning set-ups that cannot work are config errors (exit 2) before any run dir exists:
a chat template that renders no assistant span, a model vocabulary that does not cover the
tokenizer of the ``model.init_from`` directory. Both name the file."""

from __future__ import annotations

import json

from data.tokenizers import ByteTokenizer
from tests import launch

SFT = ["--config", str(launch.ROOT / "configs" / "tiny-sft.yaml"), "parallel.strategy=none", "parallel.device=cpu"]


def _train(cwd, args):
    return launch.train(cwd, args, nproc=1, timeout=120)


def test_a_template_without_an_assistant_span_exits_2_naming_the_file(tmp_path):
    template = tmp_path / "upper.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}")
    result = _train(tmp_path, [*SFT, f"data.chat_template={template}", f"run.root={tmp_path / 'runs'}"])
    assert result.returncode == 2, result.stderr
    assert "renders no assistant span" in result.stderr and str(template) in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_vocabulary_smaller_than_the_init_from_tokenizer_exits_2_naming_the_file(tmp_path):
    # A Hugging Face directory whose tokenizer has 258 + 400 ids, and a model of 512.
    from tokenizers import AddedToken, Tokenizer

    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    tok = Tokenizer.from_str(ByteTokenizer().hf_tokenizer_json())
    tok.add_tokens([AddedToken(f"<extra_{i}>") for i in range(400)])
    tok.save(str(model_dir / "tokenizer.json"))
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    result = _train(tmp_path, [*SFT, f"data.tokenizer={model_dir}", f"run.root={tmp_path / 'runs'}"])
    assert result.returncode == 2, result.stderr
    assert "model.vocab_size=512" in result.stderr and str(model_dir) in result.stderr
    assert not (tmp_path / "runs").exists()
