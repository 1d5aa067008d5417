"""torch.compile, one transformer block at a time.

Per-block compilation keeps compile time independent of depth (every block has the same
code, so later blocks reuse the first one's graph) and leaves the FSDP/DDP hooks between
blocks outside the compiled regions. ``Module.compile()`` compiles in place, so no
``_orig_mod`` appears in parameter or state_dict names (``torch.compile(module)`` would
wrap the block and add it).
"""

from __future__ import annotations

from torch import nn

from distributed.model_structure import transformer_blocks


def apply_compile(model: nn.Module) -> None:
    for block in transformer_blocks(model):
        block.compile()
