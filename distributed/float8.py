"""FP8 training of the linear layers (``parallel.float8``) through torchao's float8 training.

torchao swaps each chosen ``nn.Linear`` for a ``Float8Linear``: its forward and backward
matmuls cast their inputs to FP8 with dynamic scales (``tensorwise``: one scale per tensor;
``rowwise``: one per row, more accurate, somewhat slower) and run ``torch._scaled_mm``. The
weights stay ordinary fp32 parameters (the master weights), under the same names, so the
optimizer, checkpoints and exports do not change and a checkpoint loads with FP8 off.
With FSDP and ``tensorwise`` scaling the all-gather sends the weights in FP8 too.

Which linears: all of the transformer blocks' projections whose two dimensions are multiples
of 16 (``torch._scaled_mm``'s requirement), never the output head (``lm_head``: its
logits feed the loss and are the most precision-sensitive matmul, and a large vocabulary
is rarely a multiple of 16 after sharding). ``float8_module_filter`` is that rule.

Needs a CUDA GPU with FP8 tensor cores (compute capability 8.9 or newer: L4, L40, H100,
H200, B200) and torchao; ``require_float8`` says so as a ConfigError (exit 2). The
conversion cannot run on the CPU test machine; its module selection is tested there
with torchao's emulation.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from core.config import ParallelConfig
from core.exceptions import ConfigError

MIN_CAPABILITY = (8, 9)
DIM_MULTIPLE = 16
SKIPPED_MODULES = frozenset({"lm_head"})


def require_float8(parallel: ParallelConfig, device: torch.device) -> None:
    """Raise a ConfigError naming ``parallel.float8`` unless FP8 training can run here."""
    if parallel.float8 == "none":
        return
    hint = "set parallel.float8=none, or run on CUDA GPUs of compute capability 8.9+ with torchao installed"
    if device.type != "cuda":
        raise ConfigError(
            f"parallel.float8={parallel.float8} needs a CUDA GPU with FP8 tensor cores; this rank runs on {device}",
            key="parallel.float8",
            hint=hint,
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ConfigError(
            f"parallel.float8={parallel.float8} needs compute capability >= 8.9 (FP8 matmuls); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}",
            key="parallel.float8",
            hint=hint,
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError as exc:
        raise ConfigError(
            f"parallel.float8={parallel.float8} needs torchao, which is not installed ({exc})",
            key="parallel.float8",
            hint="pip install torchao (the 'float8' extra of pyproject.toml), or set parallel.float8=none",
        ) from exc


def float8_module_filter(module: nn.Module, fqn: str) -> bool:
    """True for the linears converted to FP8 (see the module docstring for the rule)."""
    if not isinstance(module, nn.Linear) or fqn.rsplit(".", 1)[-1] in SKIPPED_MODULES:
        return False
    return module.in_features % DIM_MULTIPLE == 0 and module.out_features % DIM_MULTIPLE == 0


def apply_float8(model: nn.Module, parallel: ParallelConfig, *, fsdp: bool, emulate: bool = False) -> list[str]:
    """Convert ``model``'s eligible linears in place; returns their names.

    ``fsdp``: FSDP will shard the model, so tensorwise weights are all-gathered in FP8.
    ``emulate``: torchao's CPU emulation of the FP8 matmuls (tests only).
    """
    if parallel.float8 == "none":
        return []
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(parallel.float8)
    config = dataclasses.replace(
        config, enable_fsdp_float8_all_gather=fsdp and parallel.float8 == "tensorwise", emulate=emulate
    )
    converted = [name for name, module in model.named_modules() if float8_module_filter(module, name)]
    convert_to_float8_training(model, module_filter_fn=float8_module_filter, config=config)
    return converted
