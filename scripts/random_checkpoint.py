"""A random-init Hugging Face checkpoint of a real Qwen shape, written by ``transformers``.

    .venv/bin/python scripts/random_checkpoint.py --arch qwen3-0.6b --out weights/random-Qwen3-0.6B \
        [--tokenizer datasets/tokenizers/qwen] [--seed 0] [--dtype bf16|fp32]

The directory looks like one downloaded with ``hf download``: ``config.json`` with the published
model's values (``ARCHS``: sizes, layers, heads, vocabulary 151,936, tied embeddings, RoPE theta,
token ids), ``model.safetensors`` from ``transformers``' own initialization under ``torch``'s seed
``--seed``, and the tokenizer files of ``--tokenizer`` (the ``qwen`` tokenizer that ``python -m
data prepare --tokenizer qwen`` writes: the Qwen2/Qwen3 vocabulary). A Qwen3 directory's
``tokenizer_config.json`` gets what the Qwen3 release ships in its place: the Qwen3 chat template
(data/templates/qwen3.jinja) and ``<|im_end|>`` as its end-of-sequence token. So the recipes
(configs/qwen*-sft.yaml, -dpo, -grpo, -rm, -ppo) can be proven at their real size without
downloading weights (benchmarks/recipes.py); the weights mean nothing.

``--tiny`` (``write_checkpoint(arch, out, shape=TINY[arch])``) writes a 2-layer model of the same
family and vocabulary instead: what the CPU runs of the recipes start from.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.environment import require_dependencies  # noqa: E402

require_dependencies("scripts/random_checkpoint.py", ("torch", "transformers", "safetensors", "tokenizers"))

import torch  # noqa: E402

# The config.json values each model is published with (Qwen/Qwen3-0.6B, Qwen/Qwen2.5-0.5B,
# Qwen/Qwen3-1.7B), as transformers' Qwen3Config / Qwen2Config keyword arguments.
_QWEN_COMMON = dict(vocab_size=151936, hidden_act="silu", initializer_range=0.02, rms_norm_eps=1e-6,
                    rope_theta=1000000.0, attention_dropout=0.0, use_sliding_window=False, use_cache=True,
                    bos_token_id=151643, tie_word_embeddings=True)
ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": ("qwen3", dict(_QWEN_COMMON, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=40960, max_window_layers=28, attention_bias=False,
                                 sliding_window=None, eos_token_id=151645)),
    "qwen3-1.7b": ("qwen3", dict(_QWEN_COMMON, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                 max_position_embeddings=40960, max_window_layers=28, attention_bias=False,
                                 sliding_window=None, eos_token_id=151645)),
    "qwen2.5-0.5b": ("qwen2", dict(_QWEN_COMMON, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                                   max_window_layers=24, sliding_window=32768, eos_token_id=151643)),
}
"""--arch -> (transformers model_type, config keyword arguments)."""

TINY: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, head_dim=16, max_position_embeddings=256),
    "qwen2.5-0.5b": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=256),
    # The 1.7B recipe is QLoRA: every projection holds whole NF4 scale blocks of 64 x 256 weights
    # (8 heads of 32 over a width of 64: 256 x 64).
    "qwen3-1.7b": dict(hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
                       num_key_value_heads=8, head_dim=32, max_position_embeddings=256),
}
"""--tiny: a 2-layer model of the arch's family over the same vocabulary (the Qwen tokenizer's ids),
for CPU runs of the recipes (tests/training/test_recipes.py, benchmarks/recipes.py --tiny)."""

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
QWEN3_TEMPLATE = ROOT / "data" / "templates" / "qwen3.jinja"
QWEN3_EOS = "<|im_end|>"


def write_checkpoint(arch: str, out: Path, *, tokenizer: Path = ROOT / "datasets" / "tokenizers" / "qwen",
                     seed: int = 0, dtype: str = "bf16", shape: Optional[dict[str, Any]] = None) -> Path:
    """Write ``arch``'s random-init checkpoint (``shape`` replaces config values: a smaller model
    of the same family) and ``tokenizer``'s files to ``out``; returns ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, values = ARCHS[arch]
    config = AutoConfig.for_model(model_type, **{**values, **(shape or {})})
    # transformers initializes from the global RNG: fork it, so the seed neither leaks nor is read.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    model = model.to(DTYPES[dtype]).eval()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    _write_tokenizer(Path(tokenizer), out, qwen3=model_type == "qwen3")
    return out


def _write_tokenizer(source: Path, out: Path, *, qwen3: bool) -> None:
    missing = [name for name in TOKENIZER_FILES if not (source / name).is_file()]
    if missing:
        raise SystemExit(f"error: {source} has no {', '.join(missing)}; "
                         "hint: `.venv/bin/python -m data prepare --tokenizer qwen` writes datasets/tokenizers/qwen")
    shutil.copyfile(source / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((source / "tokenizer_config.json").read_text(encoding="utf-8"))
    if qwen3:  # what Qwen3's tokenizer_config.json holds in place of Qwen2.5's
        config["chat_template"] = QWEN3_TEMPLATE.read_text(encoding="utf-8")
        config["eos_token"] = QWEN3_EOS
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", required=True, choices=sorted(ARCHS))
    p.add_argument("--out", required=True, type=Path, help="the directory to write (created; files replaced)")
    p.add_argument("--tokenizer", type=Path, default=ROOT / "datasets" / "tokenizers" / "qwen",
                   help="a directory with tokenizer.json and tokenizer_config.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="the stored weights' dtype")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model of the arch's family (TINY), for CPU runs")
    args = p.parse_args(argv)
    out = write_checkpoint(args.arch, args.out, tokenizer=args.tokenizer, seed=args.seed, dtype=args.dtype,
                           shape=TINY[args.arch] if args.tiny else None)
    print(f"{out}: random {args.arch}{' (tiny)' if args.tiny else ''} (seed {args.seed}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
