"""models/generation/ is family-agnostic: it imports no model family and names no family's class;
the Qwen family implements its ``GenerationModel`` protocol."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from models.generation.kv_cache import KVCache
from models.generation.protocol import GenerationModel, GenerationSpec
from tests.models.sampler_model import QWEN3, build_sampler_model

MODELS = Path(__file__).resolve().parents[2] / "models"
PACKAGE = MODELS / "generation"


def families() -> set[str]:
    """The model families: the packages under models/ but the generation engine."""
    return {p.parent.name for p in MODELS.glob("*/__init__.py")} - {"generation"}


def test_the_generation_package_imports_no_model_family():
    assert families(), "no model family package found under models/"
    found = []
    for path in sorted(PACKAGE.glob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            else:
                modules = []
            for module in modules:
                parts = module.split(".")
                if parts[0] == "models" and len(parts) > 1 and parts[1] in families():
                    found.append(f"{path.name}:{node.lineno}: {module}")
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        found += [f"{path.name}: names {name}" for name in sorted(names) if "Qwen" in name]
    assert not found, "the generation engine reaches into a model family:\n" + "\n".join(found)


def test_the_qwen_model_implements_the_protocol_and_its_cache_has_the_model_shape():
    model = build_sampler_model()
    assert isinstance(model, GenerationModel)
    spec = model.generation_spec()
    assert spec == GenerationSpec(vocab_size=QWEN3.vocab_size, num_layers=QWEN3.num_layers,
                                  num_kv_heads=QWEN3.num_kv_heads, head_dim=QWEN3.head_dim,
                                  device=torch.device("cpu"), dtype=torch.float32)
    cache = KVCache.for_spec(spec, batch=3, slots=10)
    keys, values = cache.read(QWEN3.num_layers - 1)
    assert keys.shape == values.shape == (3, QWEN3.num_kv_heads, 10, QWEN3.head_dim)  # the scratch row left out
    assert len(cache.tensors()) == 2 * QWEN3.num_layers and cache.k0.shape[0] == 4
