"""Compute precision: fp32, bf16 autocast, fp16 autocast with a gradient scaler.

Under FSDP with bf16 the cast is done by FSDP's mixed-precision policy (bf16 parameters and
compute, fp32 master weights and gradient reduction), so autocast is not used there. The
precision and its dtype are the run's ``Numerics``' (models/numerics.py: ``precision``,
``compute_dtype``), the one object its forwards and its sampler run under.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from models.numerics import Numerics


class Precision:
    def __init__(self, numerics: Numerics, *, device: torch.device, wrapper_casts: bool) -> None:
        """``numerics``: the run's (training.determinism.numerics, which the model carries);
        ``wrapper_casts``: the model is wrapped by FSDP2 with a bf16 mixed-precision policy
        (only true where fully_shard was applied: a single process is not sharded)."""
        self.numerics = numerics
        self.name = numerics.precision
        self.dtype = numerics.compute_dtype
        self.device = device
        self.use_autocast = self.name != "fp32" and not (wrapper_casts and self.name == "bf16")
        self.scaler = (
            torch.amp.GradScaler(device.type) if self.name == "fp16" else None
        )

    def autocast(self) -> contextlib.AbstractContextManager:
        if not self.use_autocast:
            return contextlib.nullcontext()
        return self.numerics.autocast(self.device)  # the sampler's too, under batch_invariant

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
