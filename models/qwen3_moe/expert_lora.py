"""LoRA on a Qwen3-MoE block's experts (``model.qwen3_moe.lora_experts``): per-expert low-rank adapters
on the stacked ``gate_proj``, ``up_proj`` and ``down_proj``.

Each stacked weight W (E, out, in) gets ``lora_A[name]`` (E, rank, in) and ``lora_B[name]`` (E, out, rank),
held by the ``Experts`` module as two ``ParameterDict``s, so the adapters are
``layers.N.mlp.experts.lora_A.gate_proj`` and the base weights keep the plain model's names. Expert e
computes ``x @ W_e.T + (x @ A_e.T) @ B_e.T * alpha / rank`` (the order of models/lora.py's
``LoRALinear``), in the experts' loop or grouped kernel alike. ``B`` starts at zero; each ``A`` is drawn
from a CPU generator keyed by its canonical name (``lora:<name>``, uniform +-1/sqrt(in), fp32, then cast),
as every adapter of models/lora.py is, so it does not depend on the other adapters, the device or the
world size. ``merge`` folds ``alpha / rank * B_e @ A_e`` into each W_e (fp32, then the weight's dtype)
and removes the adapters: the plain model an export writes.

models/lora.py adds, disables and merges them through the ``Experts`` module (``wants_adapters``,
``add_adapters``, ``adapter_disabled``, ``merge_adapters``); PEFT has no form for them
(docs/models.md, Qwen3-MoE).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from core.exceptions import ConfigError
from core.seeding import derive_seed

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
"""The stacked weights that take adapters, in the experts' order."""
KEY = "model.qwen3_moe.lora_experts"
"""The config key that asks for them."""

Adapter = tuple[torch.Tensor, torch.Tensor]
"""One stacked weight's (A (E, rank, in), B (E, out, rank))."""


def add(experts: nn.Module, *, rank: int, alpha: float, dropout: float, seed: int, name: str) -> None:
    """Give ``experts`` (plain, its weights whole) adapters of ``rank`` on each of ``PROJECTIONS``; in place."""
    if dropout:
        raise ConfigError(f"{KEY}: the experts' adapters take no dropout, but model.lora.dropout={dropout}",
                          key="model.lora.dropout", hint="set model.lora.dropout to 0 with adapters on the experts")
    if "lora_A" in experts._modules:
        raise ValueError(f"{name} already has adapters; apply_lora adds them once")
    lora_a, lora_b = nn.ParameterDict(), nn.ParameterDict()
    for projection in PROJECTIONS:
        weight = getattr(experts, projection)  # (E, out, in)
        count, out_features, in_features = weight.shape
        generator = torch.Generator(device="cpu").manual_seed(derive_seed(seed, f"lora:{name}.lora_A.{projection}"))
        bound = 1.0 / math.sqrt(in_features)
        drawn = torch.empty(count, rank, in_features, dtype=torch.float32).uniform_(-bound, bound, generator=generator)
        lora_a[projection] = nn.Parameter(drawn.to(device=weight.device, dtype=weight.dtype))
        lora_b[projection] = nn.Parameter(torch.zeros(count, out_features, rank, device=weight.device,
                                                      dtype=weight.dtype))
    experts.lora_A, experts.lora_B = lora_a, lora_b
    experts.rank, experts.alpha, experts.scaling = rank, alpha, alpha / rank


def active(experts: nn.Module) -> tuple[Adapter, Adapter, Adapter] | None:
    """The adapters of gate, up and down that the forward adds, or None (none added, or disabled)."""
    if experts.adapter_disabled or "lora_A" not in experts._modules:
        return None
    return tuple((experts.lora_A[p], experts.lora_B[p]) for p in PROJECTIONS)


def project(rows: torch.Tensor, weight: torch.Tensor, adapter: Adapter | None, scaling: float) -> torch.Tensor:
    """One expert's ``rows @ weight.T``, plus its low-rank update where ``adapter`` (its A (r, in), B (out, r))."""
    out = F.linear(rows, weight)
    if adapter is None:
        return out
    return out + F.linear(F.linear(rows, adapter[0]), adapter[1]) * scaling


def project_grouped(rows: torch.Tensor, weight_t: torch.Tensor, adapter: Adapter | None, scaling: float,
                    offsets: torch.Tensor) -> torch.Tensor:
    """``project`` over the experts' contiguous groups (``torch._grouped_mm``); ``weight_t`` (E, in, out)."""
    out = torch._grouped_mm(rows, weight_t, offs=offsets)
    if adapter is None:
        return out
    a, b = (t.to(rows.dtype).transpose(-2, -1) for t in adapter)  # (E, in, r), (E, r, out)
    return out + torch._grouped_mm(torch._grouped_mm(rows, a, offs=offsets), b, offs=offsets) * scaling


@torch.no_grad()
def merge(experts: nn.Module) -> None:
    """Fold each adapter into its stacked weight, ``W + alpha / rank * B @ A`` per expert, and drop the adapters."""
    for projection in PROJECTIONS:
        weight = getattr(experts, projection)
        delta = torch.bmm(experts.lora_B[projection].float(), experts.lora_A[projection].float()) * experts.scaling
        weight.copy_((weight.float() + delta).to(weight.dtype))
    del experts.lora_A, experts.lora_B
