"""Shared set-up of the data benchmarks: the prepared stdlib shards, the configs, the BPE tokenizers.

Not a benchmark itself (``data_*.py`` that start with ``data_`` and a verb are). Everything
lands under ``bench_out/`` (git-ignored).
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from core.config import Config, load  # noqa: E402
from data.prepare import DEFAULT_OUT, Layout, prepare  # noqa: E402
from data.qwen_vocab import DEFAULT_DIR as QWEN_DIR  # noqa: E402
from data.qwen_vocab import QWEN_SPEC  # noqa: E402

OUT = ROOT / "bench_out"
TINY = ROOT / "configs" / "tiny.yaml"


def ensure_stdlib() -> Path:
    """The default shards (python -m data prepare), relative to the repository root."""
    os.chdir(ROOT)
    prepare(DEFAULT_OUT, Layout(), inputs=[], input_format="auto", text_column="text",
            text_unit="file", force=False)
    return DEFAULT_OUT


def tiny_config(*overrides: str) -> Config:
    ensure_stdlib()
    return load(TINY, list(overrides))


def preset_config(name: str, *overrides: str) -> Config:
    """configs/<name>.yaml (a GPU preset: only its data and train sections matter here)."""
    ensure_stdlib()
    return load(ROOT / "configs" / f"{name}.yaml", list(overrides))


def qwen_tokenizer() -> str:
    """``qwen``: the real Qwen vocabulary (python -m data prepare --tokenizer qwen), built if missing."""
    os.chdir(ROOT)
    if not (QWEN_DIR / "tokenizer.json").is_file():
        from data.qwen_vocab import build

        build(QWEN_DIR)
    return QWEN_SPEC


def bpe_tokenizer(vocab_size: int = 8192) -> Path:
    """A byte-level BPE tokenizer.json trained here on stdlib files (a stand-in for a real
    Hugging Face tokenizer, which this machine cannot download)."""
    directory = OUT / f"bpe-{vocab_size}"
    if (directory / "tokenizer.json").is_file():
        return directory
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return directory


def write_report(name: str, report: dict) -> Path:
    OUT.mkdir(exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(report, indent=1) + "\n")
    return path
