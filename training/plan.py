"""``ParallelPlan``: what the trainer needs to know about how the model is spread over ranks.

Its own module so that the builders (which make one) and ``training.xla`` (whose
``XlaSpmdPlan`` extends it) both import it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distributed import clip_grad_norm_, no_sync, param_hash
from distributed.overlap import matmul_carveout
from distributed.topology import Topology


@dataclass
class ParallelPlan:
    """What the trainer needs to know about how the model is spread over ranks.

    ``device`` is where the step runs: the rank's device for the torch strategies, the XLA
    device for ``xla_spmd`` (``training.xla.XlaSpmdPlan``, which also overrides
    ``place_batch`` and ``sync``).
    """

    topology: Topology
    strategy: str
    device: torch.device
    fsdp_applied: bool = False
    base_identity: dict[str, str] | None = None
    """LoRA runs: the frozen base's ``{"path", "sha256"}`` (models.lora.add_adapters), taken on
    the plain model before training; checkpoints record it and a resume verifies it."""
    backward_sm_carveout: int = 0
    """SMs the backward's matmuls leave to the gradient reduction beside them
    (``parallel.backward_sm_carveout`` where gradients are reduced across ranks, else 0)."""
    after_backward: Callable[[], None] | None = None
    """Runs once after the step's last backward, before clipping: completes gradients that the
    data-parallel wrapper did not reduce (``distributed.ddp.GatheredEmbeddingGrad``)."""

    @property
    def dp_size(self) -> int:
        return self.topology.dp_size

    @property
    def dp_rank(self) -> int:
        return self.topology.dp_rank

    @property
    def tp_size(self) -> int:
        return self.topology.tp_size

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(model, max_norm)

    def no_sync(self, model: nn.Module):
        return no_sync(model)  # skip gradient sync on accumulation micro-batches (DDP and FSDP)

    def wrap_part(self, module: nn.Module) -> nn.Module:
        """A part trained beside the policy (``training.parts``, e.g. a value head) on the step's
        device, replicated over the data-parallel ranks (DDP over the data-parallel group, its
        gradients all-reduced by the last micro-batch's backward), whatever the policy's
        strategy: such parts are small, so neither sharded nor split by tensor parallelism
        (tensor-parallel peers hold the same rows and compute the same gradients)."""
        module = module.to(self.device)
        if self.dp_size == 1:
            return module
        return DistributedDataParallel(
            module,
            device_ids=[self.device.index] if self.device.type == "cuda" else None,
            device_mesh=self.topology.dp_mesh,
        )

    def backward_context(self):
        """The context the backward runs in (distributed/overlap.py)."""
        return matmul_carveout(self.backward_sm_carveout)

    def finish_backward(self) -> None:
        """After the step's last backward: complete the gradients (``after_backward``)."""
        if self.after_backward is not None:
            self.after_backward()

    def param_hash(self, model: nn.Module) -> str:
        return param_hash(model)

    def place_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        """A batch tensor (host memory) on the step's device."""
        return tensor.to(self.device, non_blocking=True)

    @property
    def output_weight_is_local(self) -> bool:
        """The output weight is a whole, eager tensor inside the model's forward, so a loss may
        apply it itself (``Loss.head_loss``): not a tensor-parallel shard, not lazy XLA."""
        return self.tp_size == 1

    def sync(self) -> None:
        """Run the device work recorded so far. Eager torch devices run it as issued: nothing
        to do. (Lazy XLA tensors only record it; see ``training.xla``.)"""

    def after_load(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Restore the device layout that loading a checkpoint does not keep. The torch
        strategies load into their live (sharded) tensors: nothing to do."""
