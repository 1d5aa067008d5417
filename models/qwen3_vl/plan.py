"""How a Qwen3-VL model is spread (``ModelFamily.parallel_plan``): two stacks, the vision blocks
(``visual.blocks``, run first) and the language model's (``layers``, Qwen's plan for its blocks).

Each block of either stack is one unit of FSDP, activation checkpointing and compile. The vision
blocks declare no tensor-parallel split (their q, k and v are one fused linear, as Qwen2.5-VL's),
so the row refuses ``parallel.tp > 1`` (models/qwen3_vl/family.py). The patch embedding, the
learned positions, the merger and the DeepStack mergers sit in FSDP's root unit with the
embedding, the final norm and the output head.
"""

from __future__ import annotations

from core.model_plan import ModelParallelPlan, Stack
from models.qwen.plan import qwen_parallel_plan
from models.qwen3_vl.dims import Qwen3VLDims


def qwen3_vl_parallel_plan(dims: Qwen3VLDims) -> ModelParallelPlan:
    """The plan of every Qwen3-VL model of these dimensions (module docstring)."""
    text = qwen_parallel_plan(dims.text)
    deepstack = tuple(f"visual.deepstack_merger_list.{i}" for i in range(len(dims.vision.deepstack_visual_indexes)))
    return ModelParallelPlan(stacks=(Stack(path="visual.blocks"), *text.stacks), embedding=text.embedding,
                             output=text.output,
                             root_modules=(*text.root_modules, "visual.patch_embed", "visual.pos_embed",
                                           "visual.merger", *deepstack))
