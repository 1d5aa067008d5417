"""AdamW with parameter groups: no weight decay on norms, biases and other 1-D tensors."""

from __future__ import annotations

import torch
from torch import nn

from core.config import TrainConfig


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay, no_decay = [], []
    for _, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        if not param.requires_grad:
            continue
        # Norm weights and biases are 1-D; decaying them only fights the normalization.
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    kwargs = dict(lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps)
    if device.type == "cuda":
        kwargs["fused"] = True  # one kernel for all parameters; deterministic
    else:
        kwargs["foreach"] = True
    return torch.optim.AdamW(param_groups(model, config.weight_decay), **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
