"""The trainer's side of ``parallel.strategy: xla_spmd`` (torch_xla SPMD in one process).

``training.builders.build_model`` imports this module only for that strategy, because it
needs torch_xla, which only the XLA interpreter has (``bash scripts/setup_xla_venv.sh``)::

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python train.py --config configs/tiny.yaml \\
        parallel.strategy=xla_spmd

One process drives every XLA device of the host (``distributed.xla_spmd``): parameters are
sharded on dim 0 over a 1-D mesh of all devices, batches on the batch dimension, and the XLA
compiler inserts the collectives. For torch.distributed the run is one process of world
size 1 (``DistributedContext.device`` stays ``cpu``, the backend gloo), so host-side code
(collectives, RNG capture, guards, memory readings) keeps running on the host; only the
step runs on ``XlaSpmdPlan.device``. What the trainer does differently, all through the
plan (the trainer never names the strategy):

- ``place_batch`` copies a batch tensor to the XLA device and marks it split over the mesh.
- XLA tensors are lazy: operations are recorded and run when the graph is cut. The loop
  calls ``sync()`` twice per optimizer step. After gradient clipping, so forward, backward
  and clipping run as one graph and the loss and gradient norm are read from it (reading
  them earlier would run a partial graph first); the non-finite check must see those values
  *before* the update (``runtime.on_nonfinite``), which is why there is a cut there. After
  the update, so the optimizer runs as its own graph. Every step records the same two
  graphs, so each is compiled once (plus once for the first update, which creates the
  optimizer state).
- Parameter hashes and checkpoints read XLA tensors with ``.cpu()``, which returns a sharded
  tensor's full value, so the checkpoint manager works unchanged and writes the full-tensor
  DCP format of the torch strategies (an xla_spmd checkpoint loads into a plain CPU model
  with the same parameter hash). Every tensor is gathered to the host, one at a time: fine
  on one host, not the no-gather path of ``xla_spmd.save_checkpoint``. Loading writes into
  the live parameters in place (their sharding stays); ``after_load`` re-shards the
  optimizer state, which loading replaces with replicated tensors.
- The torch CPU RNG state is checkpointed as for any run; the XLA device RNG is not (the
  model draws no random numbers on the device: no dropout).

Refused combinations (``check_config``, ``ConfigError``, exit 2): torch_xla missing;
``parallel.precision`` other than fp32 (bf16 autocast breaks attention under torch_xla 2.9,
fp16 needs a gradient scaler for XLA); ``parallel.compile`` and
``parallel.activation_checkpointing`` (not wired for XLA). World size, ``parallel.tp`` and
``parallel.dp_replicate`` are checked by ``distributed.topology``.

Determinism: ``torch.use_deterministic_algorithms`` governs torch's own kernels, not the
code XLA compiles. XLA on CPU runs a compiled graph the same way every time, so a run and
its resumption give identical ledgers (tested by ``tests/xla/test_train_xla.py``); other XLA
backends are not tested here.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from core.config import Config
from core.exceptions import ConfigError
from core.logging import get_logger
from distributed.topology import Topology
from training.plan import ParallelPlan

# torch_xla defaults this to 1 (warnings), which prints a GSPMD deprecation notice for every
# compiled graph; errors still show. Read when torch_xla loads, so set before the import;
# an exported value wins.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

try:
    import torch_xla.distributed.spmd as xs

    from distributed import xla_spmd
except ModuleNotFoundError as error:  # the main interpreter: check_config() says so
    if not (error.name or "").startswith("torch_xla"):
        raise
    _torch_xla_missing: ModuleNotFoundError | None = error
else:
    _torch_xla_missing = None


@dataclass
class XlaSpmdPlan(ParallelPlan):
    """``ParallelPlan`` for a model set up by ``distributed.xla_spmd.setup_xla_spmd``.

    Gradient clipping, ``no_sync`` (nothing to skip: there is no wrapper) and the parameter
    hash are the base class's: they work on lazy XLA tensors as on plain ones.
    """

    mesh: Any = field(default=None, kw_only=True)  # torch_xla.distributed.spmd.Mesh

    @property
    def output_weight_is_local(self) -> bool:
        return False  # the fused loss's chunk loop would be traced into the lazy graph

    def place_batch(self, tensor: torch.Tensor) -> torch.Tensor:
        return xla_spmd.shard_batch(tensor.to(self.device), self.mesh)

    def sync(self) -> None:
        xla_spmd.sync()

    def after_load(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Shard the loaded optimizer state like its parameter, as training leaves it.

        The checkpoint manager loads parameters in place (their sharding stays), but the
        optimizer's moments arrive as new, replicated XLA tensors: a full copy on every
        device, and a different first graph than the uninterrupted run's.
        """
        count = self.mesh.size()
        for param, state in optimizer.state.items():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.device.type == "xla" and value.shape == param.shape:
                    xs.mark_sharding(value, self.mesh, xla_spmd.parameter_spec(tuple(param.shape), count))
        xla_spmd.sync()


def setup(model: nn.Module, config: Config, topology: Topology) -> tuple[nn.Module, XlaSpmdPlan]:
    """Move ``model`` (plain, on the host) onto the XLA SPMD mesh; returns it and its plan."""
    check_config(config)
    model, mesh, device = xla_spmd.setup_xla_spmd(model, config.parallel)
    log = get_logger()
    log.info("xla_spmd: %d XLA devices in mesh axis %r, step device %s", mesh.size(), xla_spmd.MESH_AXIS, device)
    if config.train.micro_batch_size % mesh.size():
        log.warning(
            "train.micro_batch_size=%d does not divide by the %d XLA devices: XLA pads the batch "
            "and replicates some activations to split it (correct, but slower)",
            config.train.micro_batch_size,
            mesh.size(),
        )
    plan = XlaSpmdPlan(topology=topology, strategy=config.parallel.strategy, device=device, mesh=mesh)
    return model, plan


def check_config(config: Config) -> None:
    """ConfigError (exit 2) for what xla_spmd cannot run, torch_xla missing included.

    Needs no XLA device, so it can run before the run directory exists.
    """
    if _torch_xla_missing is not None:
        raise ConfigError(
            "parallel.strategy=xla_spmd needs torch_xla, which this interpreter does not have",
            key="parallel.strategy",
            hint="build the XLA interpreter with `bash scripts/setup_xla_venv.sh` and run "
            "`PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 .venv-xla/bin/python train.py ...`",
        ) from _torch_xla_missing
    parallel = config.parallel
    if parallel.precision != "fp32":
        # bf16: torch_xla 2.9's autocast does not cast scaled_dot_product_attention's inputs,
        # so the fp32 q/k (after their RMSNorm) meet a bf16 v and SDPA refuses the mix.
        # fp16 would need a gradient scaler for XLA.
        raise ConfigError(
            f"parallel.precision={parallel.precision} is not supported with parallel.strategy=xla_spmd",
            key="parallel.precision",
            hint="use parallel.precision=fp32",
        )
    if parallel.compile:
        raise ConfigError(
            "parallel.compile is not supported with parallel.strategy=xla_spmd (XLA compiles the step itself)",
            key="parallel.compile",
            hint="set parallel.compile=false",
        )
    if parallel.activation_checkpointing != "none":
        raise ConfigError(
            f"parallel.activation_checkpointing={parallel.activation_checkpointing} is not supported "
            "with parallel.strategy=xla_spmd",
            key="parallel.activation_checkpointing",
            hint="set parallel.activation_checkpointing=none",
        )
