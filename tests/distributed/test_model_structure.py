"""distributed/model_structure.py: parallelism applies the plan a model declares (models/qwen/plan.py)
and names no module of the model family itself."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import models
from core.config import ModelConfig
from distributed.activation_checkpoint import apply_activation_checkpointing
from distributed.model_structure import has_tied_embeddings, plan_blocks, plan_of, plan_stacks
from distributed.tp import block_plan

ROOT = Path(__file__).resolve().parents[2]
QWEN3 = ModelConfig(arch="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=8, attention="sdpa")
QWEN2 = dataclasses.replace(QWEN3, arch="qwen2", head_dim=None, tie_embeddings=False)
# Module names that are also plain words ("the block norms", "layers of the model"): matched only
# as code (string literals, attribute names), not in prose.
WORDS = {"layers", "norm"}


def qwen_module_names() -> set[str]:
    """Every segment of every module path of a Qwen2 and a Qwen3 model (indices aside)."""
    names = set()
    for config in (QWEN3, QWEN2):
        for path, _ in models.build(config).named_modules():
            names.update(part for part in path.split(".") if part and not part.isdigit())
    return names


def spelled_module_names(source: str, names: set[str]) -> set[str]:
    """The names ``source`` spells: distinctive ones anywhere, plain words as code only."""
    found = {name for name in names - WORDS if re.search(rf"\b{re.escape(name)}\b", source)}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in WORDS:
            found.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.update(WORDS & {node.value, *node.value.split(".")})  # "layers", "layers.0.norm"
    return found


# The modules of training/ that read module names from the model's plan (head, embedding, blocks).
TRAINING_READERS = ("training/objectives/critic.py", "training/objectives/frozen.py",
                    "training/optimizers/build.py", "training/record/replay.py")


def test_distributed_and_the_plan_readers_name_no_qwen_module():
    names = qwen_module_names()
    assert {"embed_tokens", "lm_head", "q_proj", "layers", "norm"} <= names  # the scan looks for real names
    spelled = {}
    for path in [*sorted((ROOT / "distributed").glob("*.py")), *(ROOT / name for name in TRAINING_READERS)]:
        hits = spelled_module_names(path.read_text(), names)
        if hits:
            spelled[str(path.relative_to(ROOT))] = sorted(hits)
    assert not spelled, f"these modules name the model family's modules (they belong in its plan): {spelled}"


def test_the_scan_sees_a_module_name():
    names = qwen_module_names()
    source = 'x = getattr(model, "layers")\ny = model.norm\n"""the lm_head is replicated"""\n'
    assert spelled_module_names(source, names) == {"layers", "norm", "lm_head"}
    assert spelled_module_names('"""the layers of a norm"""\n', names) == set()


@pytest.mark.parametrize("config", [QWEN3, QWEN2], ids=["qwen3", "qwen2"])
def test_every_name_of_the_qwen_plan_is_a_module_of_the_model(config):
    model = models.build(config)
    plan = plan_of(model)
    [(stack, blocks)] = plan_stacks(model)  # one stack of dense blocks
    assert blocks is model.layers and stack.experts is None and not plan.has_experts
    assert isinstance(model.get_submodule(plan.embedding), nn.Embedding)
    assert isinstance(model.get_submodule(plan.output), nn.Linear)
    assert all(isinstance(model.get_submodule(path), nn.Module) for path in plan.root_modules)
    assert has_tied_embeddings(model) == config.tie_embeddings
    assert [index for _, index, _ in plan_blocks(model)] == list(range(config.num_layers))
    for _, _, block in plan_blocks(model):
        for path in (*stack.colwise, *stack.rowwise):
            assert isinstance(block.get_submodule(path), nn.Linear), path
        for path in stack.head_projections:
            assert block.get_submodule(path).out_features % stack.head_dim == 0
    # Qwen2 has no per-head norms: the TP plan of a block shards its seven projections only.
    parts = block_plan(model.layers[0], stack)
    assert set(parts) == {*stack.colwise, *stack.rowwise} | (set(stack.head_norms) if config.arch == "qwen3" else set())


def test_a_model_without_a_plan_is_refused_by_name():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(4, 4)])

    with pytest.raises(TypeError, match="Bare declares no parallel_plan"):
        apply_activation_checkpointing(Bare(), "full")


def test_activation_checkpointing_wraps_the_plans_blocks():
    model = models.build(QWEN3, generator=torch.Generator().manual_seed(0))
    apply_activation_checkpointing(model, "selective")
    wrapped = [type(block).__name__ for _, _, block in plan_blocks(model)]
    assert wrapped == ["CheckpointWrapper", "QwenBlock"]
