"""Parallelism: device mesh, DDP, FSDP2, tensor parallelism, XLA SPMD, and the helpers
the training loop needs to stay strategy-agnostic (gradient clipping, no_sync, hashing).

Typical use (see docs/parallelism.md)::

    topology = build_mesh(config.parallel, dist)
    model = parallelize(models.build(config.model), config.parallel, dist, topology)
    ...
    grad_norm = clip_grad_norm_(model, config.train.grad_clip)
    digest = param_hash(model)

``distributed.xla_spmd`` is imported on its own: it needs torch_xla.
"""

from distributed.grad import clip_grad_norm_, no_sync
from distributed.params import canonical_name, param_hash, unwrap
from distributed.parallelize import parallelize
from distributed.topology import Topology, build_mesh, mesh_shape

__all__ = [
    "Topology",
    "build_mesh",
    "canonical_name",
    "clip_grad_norm_",
    "mesh_shape",
    "no_sync",
    "param_hash",
    "parallelize",
    "unwrap",
]
