"""Muon for the hidden matrices, AdamW for every other parameter, in one optimizer.

Muon (Jordan et al., 2024) keeps a momentum buffer per matrix and replaces the update by an
approximately orthogonal matrix of the same shape, from a few Newton-Schulz iterations:

    B <- mu B + (1 - mu) g                   (momentum, as a lerp)
    U <- lerp(g, B, mu) if nesterov else B
    O <- NS_k(U)                             (k quintic iterations in bf16)
    W <- W (1 - lr wd) - lr' O               (lr' = lr scaled by the matrix shape)

One optimizer holds both kinds of group (``"use_muon"``), so the loop, the LR schedule and
checkpoints see a single ``torch.optim.Optimizer``. ``training.optimizers.build.param_groups`` decides
which parameters are Muon's.

**Whole matrices under sharding.** Newton-Schulz is not elementwise: on a shard it would
orthogonalize the wrong matrix. A parameter that is a DTensor (FSDP2's ``Shard(0)``, TP) has
its update gathered in full (``full_tensor()``, in bf16, which is what Newton-Schulz casts
to first anyway, so the gather changes no bit), every rank runs the iteration on the same full
matrix, and each keeps its own shard of the result. Parameters are visited in group order,
the same on every rank, so the gathers line up. The result is bit-identical to one process
(tests/training/test_optimizers.py). Cost per step: one all-gather of every hidden matrix in
bf16 (half the bytes of FSDP's forward all-gather in fp32) and the Newton-Schulz FLOPs of the
whole model on every rank, instead of 1/world of them.

The iteration itself is torch's (``torch.optim.Muon``'s) where the installed torch has it;
older torch uses ``newton_schulz`` below, the same arithmetic, tested equal where both exist.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate

# The quintic's coefficients and the normalization floor, from Keller Jordan's Muon post
# (also torch.optim.Muon's defaults).
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7

try:  # torch >= 2.9 ships Muon; its iteration is private, so look for it defensively
    from torch.optim._muon import _zeropower_via_newtonschulz as _torch_newton_schulz
except ImportError:  # pragma: no cover - depends on the installed torch
    _torch_newton_schulz = None


def newton_schulz(matrix: torch.Tensor, steps: int, eps: float = NS_EPS) -> torch.Tensor:
    """An approximately orthogonal matrix close to ``matrix``'s polar factor, in bf16.

    The same operations, in the same order and dtype, as torch's Muon: normalize by the
    Frobenius norm, work on the wide orientation (rows <= columns) so the Gram matrix is the
    small one, and apply ``X <- a X + (b G + c G^2) X`` with ``G = X X^T``.
    """
    a, b, c = NS_COEFFICIENTS
    x = matrix.to(torch.bfloat16, copy=True)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T  # (rows, rows)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)  # b G + c G^2
        x = torch.addmm(x, poly, x, beta=a)  # a X + poly X
    return x.T if tall else x


def orthogonalize(matrix: torch.Tensor, steps: int, *, use_torch: bool = True) -> torch.Tensor:
    """Torch's Newton-Schulz where it exists (``use_torch``), else ``newton_schulz``."""
    if use_torch and _torch_newton_schulz is not None:
        return _torch_newton_schulz(matrix, NS_COEFFICIENTS, steps, NS_EPS)
    return newton_schulz(matrix, steps)


def adjusted_lr(lr: float, rule: str, shape: torch.Size) -> float:
    """The learning rate of a ``rows x cols`` matrix's orthogonal update.

    ``original`` (Jordan): ``lr * sqrt(max(1, rows / cols))``. ``match_rms_adamw`` (Liu et al.,
    2025, "Muon is Scalable for LLM Training"): ``lr * 0.2 * sqrt(max(rows, cols))``, which
    gives the update AdamW's typical RMS, so Muon can share AdamW's learning rate and weight
    decay; that is why it is the default here, where one ``train.lr`` drives every group.
    """
    rows, cols = shape[0], shape[1]
    if rule == "original":
        return lr * math.sqrt(max(1.0, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


class Muon(torch.optim.Optimizer):
    """Muon on groups with ``use_muon=True`` (2-D only), AdamW on the others.

    State (created when the optimizer is, so every checkpoint holds the same names):
    Muon params ``momentum_buffer``; AdamW params ``step`` (a CPU scalar), ``exp_avg``,
    ``exp_avg_sq``.
    """

    def __init__(
        self,
        params,
        *,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_steps: int = 5,
        adjust_lr: str = "match_rms_adamw",
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        use_torch_iteration: bool = True,
    ) -> None:
        if adjust_lr not in ("original", "match_rms_adamw"):
            raise ValueError(f"adjust_lr must be 'original' or 'match_rms_adamw', got {adjust_lr!r}")
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
            adjust_lr=adjust_lr, betas=betas, eps=eps, use_muon=True,
        )
        super().__init__(params, defaults)
        self._use_torch_iteration = use_torch_iteration
        for group in self.param_groups:
            for p in group["params"]:
                if group["use_muon"] and p.ndim != 2:
                    raise ValueError(f"Muon updates 2-D matrices only, got a parameter of shape {tuple(p.shape)}")
                self._init_state(p, group)

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if state:
            return state
        if group["use_muon"]:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        else:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            update = self._muon_update if group["use_muon"] else _adamw_update
            for p in group["params"]:
                if p.grad is not None:
                    update(p, p.grad, self._init_state(p, group), group)
        return loss

    def _muon_update(self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
        lr, mu = group["lr"], group["momentum"]
        buf = state["momentum_buffer"]
        buf.lerp_(grad, 1 - mu)
        direction = grad.lerp(buf, mu) if group["nesterov"] else buf
        full = direction.to(torch.bfloat16, copy=True)  # owned: the iteration works in place
        if isinstance(full, DTensor):
            full = full.full_tensor()  # the whole matrix, identical on every rank
        ortho = orthogonalize(full, group["ns_steps"], use_torch=self._use_torch_iteration)
        if isinstance(p, DTensor):
            # Replicate -> the parameter's placements is a local slice: no communication.
            replicated = [Replicate()] * p.device_mesh.ndim
            ortho = DTensor.from_local(ortho, p.device_mesh, replicated, run_check=False).redistribute(
                p.device_mesh, p.placements
            )
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(ortho, alpha=-adjusted_lr(lr, group["adjust_lr"], p.shape))


def _adamw_update(p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict) -> None:
    """Decoupled-weight-decay Adam (Loshchilov & Hutter) on one parameter."""
    lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
    state["step"] += 1
    t = float(state["step"])
    p.mul_(1 - lr * group["weight_decay"])
    state["exp_avg"].lerp_(grad, 1 - beta1)
    state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    denom = (state["exp_avg_sq"].sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
    p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**t))
