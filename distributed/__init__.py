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

import importlib

# Imported when first read (PEP 562), not with the package: the config loader imports
# distributed/config_checks.py without torch (``python train.py --nproc N`` checks a config first).
_EXPORTS = {
    "clip_grad_norm_": "distributed.grad",
    "no_sync": "distributed.grad",
    "canonical_name": "distributed.params",
    "param_hash": "distributed.params",
    "unwrap": "distributed.params",
    "parallelize": "distributed.parallelize",
    "Topology": "distributed.topology",
    "build_mesh": "distributed.topology",
    "mesh_shape": "distributed.topology",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'distributed' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


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
