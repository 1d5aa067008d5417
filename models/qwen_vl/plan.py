"""How a Qwen2.5-VL model is spread (``ModelFamily.parallel_plan``): two stacks, the vision blocks
(``visual.blocks``, run first) and the language model's (``layers``, Qwen's plan for its blocks).

Each block of either stack is one unit of FSDP, activation checkpointing and compile. The vision
blocks declare no tensor-parallel split (their q, k and v are one fused linear, whose output
columns interleave q, k and v across heads), so the row refuses ``parallel.tp > 1``
(models/qwen_vl/family.py). The patch embedding and the merger sit in FSDP's root unit with the
embedding, the final norm and the output head.
"""

from __future__ import annotations

from core.model_plan import ModelParallelPlan, Stack
from models.qwen.plan import qwen_parallel_plan
from models.qwen_vl.dims import QwenVLDims


def qwen_vl_parallel_plan(dims: QwenVLDims) -> ModelParallelPlan:
    """The plan of every Qwen2.5-VL model of these dimensions (module docstring)."""
    text = qwen_parallel_plan(dims.text)
    return ModelParallelPlan(stacks=(Stack(path="visual.blocks"), *text.stacks), embedding=text.embedding,
                             output=text.output,
                             root_modules=(*text.root_modules, "visual.patch_embed", "visual.merger"))
