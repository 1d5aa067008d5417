"""Schedule-free AdamW (Defazio et al., 2024, "The Road Less Scheduled"), Algorithm 1.

Three sequences replace the learning-rate decay: ``z`` takes the AdamW steps, ``x`` is a
weighted running average of ``z`` (the weights to evaluate and export), and the gradient is
taken at their interpolation ``y``:

    y_t     = (1 - beta1) z_t + beta1 x_t                 (the model's weights while training)
    v_t     = beta2 v_{t-1} + (1 - beta2) g_t^2           (g_t taken at y_t)
    gamma_t = lr_t sqrt(1 - beta2^t)                      (lr_t: the run's schedule, i.e. warmup)
    d_t     = g_t / (sqrt(v_t) + eps) + wd y_t
    z_{t+1} = z_t - gamma_t d_t
    c_{t+1} = gamma_t^r / sum_{i<=t} gamma_i^r            (r = weight_lr_power, 2 in the paper)
    x_{t+1} = (1 - c_{t+1}) x_t + c_{t+1} z_{t+1}

``x`` is not stored: the parameters hold ``y``, the state holds ``z`` and ``v``, and
substituting ``x_t = (y_t - (1 - beta1) z_t) / beta1`` gives the update of ``y`` directly:

    y_{t+1} = lerp(y_t, z_t, c_{t+1}) - gamma_t (1 - beta1 (1 - c_{t+1})) d_t

**Weight modes.** ``train()`` (the default) keeps ``y`` in the parameters; ``eval()`` puts
``x = lerp(y, z, 1 - 1/beta1)`` there, after keeping a copy of ``y``, and ``train()`` copies
``y`` back. The round trip through ``x`` is not exact in floating point, so the copy is what
keeps an evaluation from changing the run. Checkpoints hold the *train* mode weights (``y``)
and ``z``, ``v``: resuming restores the training state exactly. The loop must therefore
save checkpoints in train mode, and evaluate inside ``training.optimizers.build.evaluation_weights``.
A model exported from a checkpoint holds ``y``; ``x`` follows from ``y`` and ``z`` as above.

The schedule is only the warmup: ``train.schedule`` must be ``constant`` (checked at config
load), because the averaging already does what a decay would.
"""

from __future__ import annotations

import math

import torch

from training.optimizers.local_shards import on_local_shards

_STASH = "train_weights"  # an attribute, not state: a copy of y while in eval mode


class ScheduleFreeAdamW(torch.optim.Optimizer):
    """Schedule-free AdamW. State per parameter: ``z``, ``exp_avg_sq`` (``v``), ``step`` and
    ``weight_sum`` (CPU scalars: the step count and ``sum gamma_i^r``)."""

    def __init__(
        self,
        params,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        weight_lr_power: float = 2.0,
    ) -> None:
        if not 0.0 < betas[0] < 1.0:
            raise ValueError(f"schedule-free beta1 must lie in (0, 1), got {betas[0]}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, weight_lr_power=weight_lr_power)
        super().__init__(params, defaults)
        self._stash: dict[torch.Tensor, torch.Tensor] | None = None
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)

    @property
    def training(self) -> bool:
        return self._stash is None

    def _init_state(self, p: torch.Tensor) -> dict:
        state = self.state[p]
        if not state:  # z_1 = x_1 = y_1: the weights the run starts from
            state["z"] = p.detach().clone(memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = torch.zeros((), dtype=torch.float32)
            # fp32 like the parameter: Optimizer.load_state_dict casts every state tensor
            # but "step" to the parameter's dtype, so a float64 sum would not survive a resume.
            state["weight_sum"] = torch.zeros((), dtype=torch.float32)
        return state

    @torch.no_grad()
    def eval(self) -> None:
        """Put the averaged weights ``x`` into the parameters (a copy of ``y`` is kept)."""
        if not self.training:
            return
        self._stash = {}
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                self._stash[p] = p.detach().clone()
                p.lerp_(self._init_state(p)["z"], 1 - 1 / beta1)

    @torch.no_grad()
    def train(self) -> None:
        """Put the training weights ``y`` back, bit for bit."""
        if self.training:
            return
        for p, y in self._stash.items():
            p.copy_(y)
        self._stash = None

    @on_local_shards
    @torch.no_grad()
    def step(self, closure=None):
        if not self.training:
            raise RuntimeError("ScheduleFreeAdamW.step() in eval mode: call train() first")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, p.grad, self._init_state(p), group)
        return loss

    @staticmethod
    def _update(y: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        (beta1, beta2), eps = group["betas"], group["eps"]
        state["step"] += 1
        t = float(state["step"])
        gamma = group["lr"] * math.sqrt(1 - beta2**t)
        weight = gamma ** group["weight_lr_power"]
        state["weight_sum"] += weight
        total = float(state["weight_sum"])
        c = weight / total if total > 0 else 0.0

        z, v = state["z"], state["exp_avg_sq"]
        v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        d = grad / v.sqrt().add_(eps)
        if group["weight_decay"]:
            d.add_(y, alpha=group["weight_decay"])
        y.lerp_(z, c)
        y.add_(d, alpha=-gamma * (1 - beta1 * (1 - c)))
        z.sub_(d, alpha=gamma)
