"""Training scenarios run both in one process and on several ranks, then compared."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from core.config import ModelConfig, ParallelConfig
from core.distributed_context import DistributedContext
from distributed import build_mesh, clip_grad_norm_, no_sync, param_hash, parallelize, unwrap
from distributed.params import canonical_named_parameters
from models import build

# The toy model: GQA (4 query, 2 key/value heads), tied embeddings, Qwen3 q/k norms.
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 64, 96, 2, 4, 2  # head_dim 16 (flex needs >= 16)

GLOBAL_BATCH = 4
SEQ_LEN = 16
STEPS = 3
MAX_NORM = 0.5  # below the gradient norms of these runs, so clipping really scales


def build_model(arch: str = "qwen3", attention: str = "sdpa") -> torch.nn.Module:
    """The real model at toy size; the same weights on every call and in every process."""
    config = ModelConfig(
        arch=arch,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_layers=LAYERS,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        init_std=0.1,
        attention=attention,
    )
    return build(config, generator=torch.Generator().manual_seed(0))


def make_batch(step: int, batch_size: int = GLOBAL_BATCH) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: two packed documents per row; identical in every process."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ_LEN + 1), generator=g)
    split = SEQ_LEN // 2 + step  # where the second document starts
    positions = torch.cat([torch.arange(split), torch.arange(SEQ_LEN - split)]).expand(batch_size, SEQ_LEN)
    documents = (torch.arange(SEQ_LEN) >= split).long().expand(batch_size, SEQ_LEN)
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": positions.contiguous(),
        "document_ids": documents.contiguous(),
    }


def cpu_parallel(**overrides: Any) -> ParallelConfig:
    return dataclasses.replace(ParallelConfig(device="cpu", backend="gloo"), **overrides)


def cuda_parallel(**overrides: Any) -> ParallelConfig:
    return dataclasses.replace(ParallelConfig(device="cuda", backend="nccl"), **overrides)


def train(
    parallel: ParallelConfig, *, optimizer: str = "adamw", micro_batches: int = 1, arch: str = "qwen3",
    attention: str = "sdpa",
) -> dict[str, Any]:
    """Train a toy model for STEPS steps on the same global batches under ``parallel``."""
    with DistributedContext.from_env(parallel) as dist:
        topology = build_mesh(parallel, dist)
        model = parallelize(build_model(arch, attention), parallel, dist, topology)
        hash_before = param_hash(model)
        opt = (
            torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
            if optimizer == "adamw"
            else torch.optim.SGD(model.parameters(), lr=0.1)
        )
        losses, norms, other_norms = [], [], []
        for step in range(STEPS):
            per_rank = GLOBAL_BATCH // topology.dp_size
            rows = slice(topology.dp_rank * per_rank, (topology.dp_rank + 1) * per_rank)
            local = {key: value[rows].to(dist.device) for key, value in make_batch(step).items()}
            loss = _accumulate(model, local, micro_batches)
            other_norms.append([float(clip_grad_norm_(model, 0.0, p)) for p in (1.0, float("inf"))])
            norms.append(float(clip_grad_norm_(model, MAX_NORM)))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(dist.all_reduce(loss, op="avg")))  # TP peers hold equal losses
        return {
            "losses": losses,
            "grad_norms": norms,
            "l1_inf_norms": other_norms,
            "hash_before": hash_before,
            "hash_after": param_hash(model),
            "dp": (topology.dp_rank, topology.dp_size),
            "names": sorted(name for name, _ in canonical_named_parameters(model)),
            "state_dict_keys": sorted(get_model_state_dict(model)),
            "tied": _tied(model),
            "fsdp_units": _fsdp_units(model),
        }


def _accumulate(model, batch: dict[str, torch.Tensor], micro_batches: int) -> torch.Tensor:
    """Mean token loss of this rank's rows, gradients accumulated over micro-batches."""
    total = torch.zeros((), device=batch["input_ids"].device)
    chunks = [dict(zip(batch, parts)) for parts in zip(*(v.chunk(micro_batches) for v in batch.values()))]
    for i, micro in enumerate(chunks):
        context = no_sync(model) if i < len(chunks) - 1 else contextlib.nullcontext()
        with context:
            logits = model(
                micro["input_ids"], position_ids=micro["position_ids"], document_ids=micro["document_ids"]
            )
            loss = F.cross_entropy(logits.float().flatten(0, 1), micro["labels"].flatten())
            (loss / len(chunks)).backward()
        total += loss.detach() / len(chunks)
    return total


def _fsdp_units(model) -> int:
    """How many FSDP units (one all-gather each) the model was sharded into; 0 without FSDP."""
    from torch.distributed.fsdp import FSDPModule

    return len({id(m._get_fsdp_state()) for m in model.modules() if isinstance(m, FSDPModule)})


def _tied(model) -> bool:
    plain = unwrap(model)
    return plain.lm_head.weight is plain.embed_tokens.weight


def many(runs: list[tuple[str, dict[str, Any], dict[str, Any]]], device: str = "cpu") -> dict[str, Any]:
    """Several (name, ParallelConfig overrides, train kwargs) runs in one set of processes.

    One process group serves them all (the contexts inside ``train`` find it and leave it
    alone): re-creating the group on the same port between runs races the old store.
    """
    config = cpu_parallel if device == "cpu" else cuda_parallel
    with DistributedContext.from_env(config(strategy="ddp")):
        return {name: train(config(**over), **kwargs) for name, over, kwargs in runs}
