"""How every family's model gets storage and its first values: one home for what ``models.build`` calls.

``empty_model`` builds a family's model on the meta device, gives it storage with ``to_empty``,
re-ties its output head and casts it; ``init_weights`` draws every parameter from a CPU generator in
fp32, in registration order, and copies it into the parameter (each rank its own slice of a
DTensor, ``copy_full_into``), so equal generators give equal models on any device and sharding.
A family's model keeps its own ``init_weights(generator)`` method (what ``models.build`` calls) and
passes it here with its norm classes and its standard deviation.
"""

from __future__ import annotations

from typing import Callable, TypeVar

import torch
from torch import nn

M = TypeVar("M", bound=nn.Module)


def empty_model(make: Callable[[], M], *, device: torch.device | str | None = None,
                dtype: torch.dtype = torch.float32) -> M:
    """``make()`` built on the meta device, then given storage on ``device`` (default CPU) with undefined
    values, its head re-tied (``tie_weights``: ``to_empty`` breaks a tie) and cast to ``dtype``."""
    with torch.device("meta"):
        model = make()
    model.to_empty(device=device if device is not None else "cpu")
    model.tie_weights()
    if dtype != torch.float32:
        model.to(dtype)
    return model


@torch.no_grad()
def init_weights(model: nn.Module, generator: torch.Generator, *, std: float,
                 norms: tuple[type[nn.Module], ...]) -> None:
    """Every parameter of ``model`` from ``generator`` (a CPU generator): the weights of ``norms`` modules 1,
    biases 0, the rest (linears, embeddings, convolutions, stacked experts) N(0, ``std``).

    Drawn on the CPU in fp32, parameter by parameter in registration order (a tied weight once, after
    ``model.tie_weights()``), then copied to each parameter's device and dtype, so a CPU and a GPU model
    built from equal generators start bit-identical; a DTensor parameter keeps its shard of the same
    full draw. ValueError for a generator off the CPU or a parameter still on the meta device."""
    if generator.device.type != "cpu":
        raise ValueError(f"init_weights needs a CPU torch.Generator, got one on {generator.device}")
    model.tie_weights()
    norm_weights = {id(m.weight) for m in model.modules() if isinstance(m, norms)}
    for name, param in model.named_parameters():  # a tied weight appears once
        if param.is_meta:
            raise ValueError(f"{name} is on the meta device; call model.to_empty(device=...) first")
        if id(param) in norm_weights:
            full = torch.ones(param.shape, dtype=torch.float32)
        elif name.endswith(".bias"):
            full = torch.zeros(param.shape, dtype=torch.float32)
        else:
            full = torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
        copy_full_into(param, full)


def copy_full_into(param: torch.Tensor, full: torch.Tensor) -> None:
    """param.copy_(full), where param may be a DTensor shard of the full tensor.

    Every rank holds the same full tensor, so each slices its own shard locally
    (``src_data_rank=None``) instead of receiving it from rank 0."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        full = distribute_tensor(full.to(param.device_mesh.device_type), param.device_mesh, param.placements,
                                 src_data_rank=None)
    param.copy_(full)
