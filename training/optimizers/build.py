"""The optimizer of a run (``train.optimizer``) and the rules that split parameters into groups.

Every trainable parameter gets one role, decided by the module that owns it, never by a
name list that a new architecture could miss (the output head is the module the model's
parallel plan names, ``model.parallel_plan.output``, core/model_plan.py):

=============  =====================================================  ============  =========
role           which parameters                                        weight decay  Muon runs
=============  =====================================================  ============  =========
``matrix``     2-D weights of the hidden layers (attention, MLP)       yes           Muon
``head``       the output projection (its plan's ``output``), untied   yes           AdamW
``embedding``  ``nn.Embedding`` weights (and a head tied to them)       no            AdamW
``vector``     norms, biases and any other tensor of fewer than 2 dims  no            AdamW
``tensor``     anything with more than 2 dims (none in the Qwen family) yes           AdamW
=============  =====================================================  ============  =========

Decaying a norm gain, a bias or an embedding row only pulls it towards zero against what
the normalization or the lookup needs; the head and hidden matrices are decayed. Muon's
orthogonalized update is meant for the hidden matrices only: the embedding is a lookup
table (its gradient is sparse row-wise) and the head maps to a vocabulary, so both stay
with AdamW (see docs/config.md, "Optimizers").

Groups list their parameters in sorted name order, so the same model always gives the same
groups, whatever wrapper (DDP, FSDP, compile, activation checkpointing) sits around it.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from core.config import TrainConfig
from distributed.model_structure import declared_plans
from training.optimizers.lion import Lion
from training.optimizers.local_shards import LocalShardAdamW
from training.optimizers.muon import Muon
from training.optimizers.schedule_free import ScheduleFreeAdamW

DECAYED_ROLES = frozenset({"matrix", "head", "tensor"})
MUON_ROLES = frozenset({"matrix"})


def parameter_roles(model: nn.Module) -> dict[str, tuple[str, nn.Parameter]]:
    """``{name: (role, parameter)}`` for every trainable parameter, in sorted name order.

    A parameter shared by several modules (a head tied to the embedding) is listed once,
    under its first name, with the role of an embedding if any owner is one.
    """
    roles: dict[int, str] = {}
    names: dict[int, str] = {}
    params: dict[int, nn.Parameter] = {}
    heads = {prefix + plan.output for prefix, plan in declared_plans(model)}
    for module_name, module in model.named_modules():
        for short, param in module.named_parameters(recurse=False):
            if not param.requires_grad:
                continue
            key = id(param)
            name = f"{module_name}.{short}" if module_name else short
            role = _role(module, param, head=module_name in heads)
            if key not in params or name < names[key]:
                names[key] = name
            params[key] = param
            if roles.get(key) != "embedding":
                roles[key] = role
    return {names[k]: (roles[k], params[k]) for k in sorted(params, key=lambda k: names[k])}


def _role(module: nn.Module, param: torch.Tensor, *, head: bool) -> str:
    if isinstance(module, nn.Embedding):
        return "embedding"
    if param.ndim < 2:
        return "vector"
    if head:
        return "head"
    return "matrix" if param.ndim == 2 else "tensor"


def param_groups(model: nn.Module, weight_decay: float, *, muon: bool = False) -> list[dict]:
    """Parameter groups by role: decayed / not decayed, and (``muon``) Muon / AdamW.

    Without ``muon``: ``[decay, no_decay]``. With ``muon``: ``[muon, adamw_decay,
    adamw_no_decay]``, each tagged with ``"use_muon"``. Empty groups are left out
    (torch.distributed.checkpoint's flattened optimizer state cannot hold one): a tied
    model under Muon has no ``adamw_decay`` group.
    """
    buckets: dict[tuple[bool, bool], list[nn.Parameter]] = {
        (True, True): [], (False, True): [], (False, False): []
    }
    for role, param in parameter_roles(model).values():
        use_muon = muon and role in MUON_ROLES
        buckets[(use_muon, use_muon or role in DECAYED_ROLES)].append(param)
    adamw = [
        {"params": buckets[(False, True)], "weight_decay": weight_decay},
        {"params": buckets[(False, False)], "weight_decay": 0.0},
    ]
    if muon:
        adamw = [
            {"params": buckets[(True, True)], "weight_decay": weight_decay, "use_muon": True},
            *({**group, "use_muon": False} for group in adamw),
        ]
    return [group for group in adamw if group["params"]]


def build_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer ``train.optimizer`` names, over ``param_groups(model)``."""
    betas = (config.beta1, config.beta2)
    if config.optimizer == "muon":
        return Muon(
            param_groups(model, config.weight_decay, muon=True),
            lr=config.lr,
            momentum=config.muon_momentum,
            nesterov=config.muon_nesterov,
            ns_steps=config.muon_ns_steps,
            adjust_lr=config.muon_adjust_lr,
            betas=betas,
            eps=config.eps,
        )
    groups = param_groups(model, config.weight_decay)
    if config.optimizer == "lion":
        return Lion(groups, lr=config.lr, betas=(config.lion_beta1, config.lion_beta2))
    if config.optimizer == "schedule_free_adamw":
        return ScheduleFreeAdamW(
            groups, lr=config.lr, betas=betas, eps=config.eps, weight_lr_power=config.sf_weight_lr_power
        )
    kwargs = dict(lr=config.lr, betas=betas, eps=config.eps)
    if device.type == "cuda":
        kwargs["fused"] = True  # one kernel for all parameters; deterministic
    else:
        kwargs["foreach"] = True
    return LocalShardAdamW(groups, **kwargs)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


@contextlib.contextmanager
def evaluation_weights(optimizer: torch.optim.Optimizer, model: nn.Module) -> Iterator[None]:
    """Evaluate with the weights the optimizer means for evaluation, then train on exactly
    the weights it trained on before.

    Only schedule-free AdamW has separate evaluation weights (its averaged point ``x``;
    training runs at the interpolation ``y``): they are swapped in for the block and the
    training weights are put back bit for bit, so an evaluation never changes the run's
    ledger or a kill/resume around it. For every other optimizer this does nothing.

    Under FSDP2 the swap happens in the sharded parameters, so every unit is resharded on
    the way in and out: a unit that keeps its gathered parameters after a forward (the
    root and the last unit, ``reshard_after_forward=False``) would otherwise run the next
    forward on stale gathered weights (``x`` after the evaluation).
    """
    if not isinstance(optimizer, ScheduleFreeAdamW):
        yield
        return
    _reshard(model)
    optimizer.eval()
    try:
        yield
    finally:
        _reshard(model)
        optimizer.train()


def _reshard(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
