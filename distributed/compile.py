"""torch.compile, one block at a time, every stack of the model's plan.

Per-block compilation keeps compile time independent of depth (the blocks of a stack
share their code, so later blocks reuse the first one's graph) and leaves the FSDP/DDP hooks between
blocks outside the compiled regions. ``Module.compile()`` compiles in place, so no
``_orig_mod`` appears in parameter or state_dict names (``torch.compile(module)`` would
wrap the block and add it).
"""

from __future__ import annotations

from torch import nn

from distributed.model_structure import plan_blocks


def apply_compile(model: nn.Module, mode: str = "default", *, backend: str = "inductor") -> None:
    """Compile every block of every stack in place; ``mode="reduce-overhead"`` also captures each compiled
    block's forward and backward as CUDA graphs (torch's cudagraph trees), so the host
    launches a block with one call instead of one per kernel. The loop then marks each step's
    start (``torch.compiler.cudagraph_mark_step_begin``).

    Data-dependent sizes are traced, not broken on: a block whose Python reads a tensor's values as
    sizes (Qwen3-MoE's expert loop splits its rows by the per-expert counts, models/qwen3_moe/moe.py)
    keeps one graph with the sizes as symbols, as the sampler's whole-graph compile traces it. Without
    this the read breaks the graph, dynamo specialises the rest of the block on each routing's sizes and
    compiles it again per step until its recompile limit sends the block back to eager, so which steps
    ran compiled code, and with it the bits, depended on the routing (compiled ``parallel.ep=2``
    differed from ``ep=1``). The setting is process-wide: the process compiles for training.

    ``backend``: torch.compile's (``"eager"`` traces with dynamo alone, for tests of what it traces).
    """
    import torch._dynamo  # only where blocks compile: not every process loads dynamo

    torch._dynamo.config.capture_scalar_outputs = True
    for _, _, block in plan_blocks(model):
        block.compile(backend=backend, mode=None if mode == "default" else mode)
