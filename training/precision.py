"""Compute precision: fp32, bf16 autocast, fp16 autocast with a gradient scaler.

Under FSDP with bf16 the cast is done by FSDP's mixed-precision policy (bf16 parameters and
compute, fp32 master weights and gradient reduction), so autocast is not used there. The dtype
of each precision is the one ``Numerics.compute_dtype`` gives (models/numerics.py).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from core.config import ParallelConfig
from models.numerics import DTYPES


class Precision:
    def __init__(self, config: ParallelConfig, *, device: torch.device, wrapper_casts: bool) -> None:
        """``wrapper_casts``: the model is wrapped by FSDP2 with a bf16 mixed-precision policy
        (only true where fully_shard was applied: a single process is not sharded)."""
        self.name = config.precision
        self.dtype = DTYPES[config.precision]
        self.device = device
        self.use_autocast = self.name != "fp32" and not (wrapper_casts and self.name == "bf16")
        self.scaler = (
            torch.amp.GradScaler(device.type) if self.name == "fp16" else None
        )

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.use_autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, *optimizers: torch.optim.Optimizer) -> None:
        """Step every optimizer of a step (one per trained part); the scaler updates once, after
        all of them."""
        if self.scaler is not None:
            for optimizer in optimizers:
                self.scaler.step(optimizer)
            self.scaler.update()
        else:
            for optimizer in optimizers:
                optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, "name": self.name, "scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
