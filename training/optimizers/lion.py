"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms").

Per parameter, with momentum ``m`` (``exp_avg``):

    u <- sign(beta1 m + (1 - beta1) g)
    W <- W (1 - lr wd) - lr u
    m <- beta2 m + (1 - beta2) g

Every coordinate moves by exactly ``lr`` (the sign), so Lion wants a learning rate several
times smaller than AdamW's and a weight decay as many times larger (the paper: 3-10x).
One moment instead of AdamW's two. All operations are elementwise, so FSDP shards update
independently and exactly, on their local tensors (``on_local_shards``).
"""

from __future__ import annotations

import torch

from training.optimizers.local_shards import on_local_shards


class Lion(torch.optim.Optimizer):
    """Lion; state ``exp_avg`` per parameter, created with the optimizer."""

    def __init__(self, params, *, lr: float, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Lion betas must lie in [0, 1), got {betas}")
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @on_local_shards
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2) = group["lr"], group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self._init_state(p)["exp_avg"]
                direction = m.lerp(p.grad, 1 - beta1).sign_()
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(direction, alpha=-lr)
                m.lerp_(p.grad, 1 - beta2)
        return loss
