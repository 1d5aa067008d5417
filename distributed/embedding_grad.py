"""The input embedding's gradient, gathered instead of all-reduced (``parallel.ddp_embedding_grad``).

The input embedding's gradient is complete only at the very end of the backward: the lookup
is the first thing the forward does, so its gradient is the last thing the backward makes.
DDP then all-reduces the whole (vocab x hidden) matrix with nothing left to overlap it, and
the optimizer waits: 544 MB in fp32 for Qwen2.5-0.5B, 1.2 GB for Qwen3-1.7B, where a tied
output head shares the matrix (docs/performance.md, 2026-11-27g).

Yet that gradient is a scatter of the rows each rank looked up: ``(tokens x hidden)`` values
at ``tokens`` row indices. ``gather`` sends those instead:

- the lookup runs on a detached weight; a small autograd function keeps the rows' gradient
  (and the token ids) when the backward reaches it, instead of adding it to the weight;
- with a tied head, the shared weight's gradient is then the head's alone, ready at the
  *start* of the backward, and DDP reduces it beside the backward like any other bucket (DDP
  orders its buckets by when gradients become ready, from the second step on); an untied
  embedding is left out of DDP altogether;
- after the backward of the last micro-batch, every rank all-gathers the kept ids and rows
  (in rank order) and adds the same scatter-sum, divided by the data-parallel size as DDP's
  mean is, to the weight's gradient. The scatter-sum is torch's embedding backward (sorted,
  no atomics), so every rank computes the same bits from the same gathered rows.

The bytes: an all-reduce moves about 2 x vocab x hidden values per rank; the gather receives
(ranks - 1) x tokens x hidden. Cheaper while ranks x tokens a step stays below about twice
the vocabulary (Qwen's 151,936 rows: 4 ranks x 16,384 tokens is 65,536). Micro-batches of an
accumulated step are kept and gathered together.

Changes the rounding of the gradient (a different summation order), deterministically: runs,
kill/resume and replay stay bitwise. The all-gather needs the same number of tokens on every
rank, checked on the first step and held to after: every Lockstep objective pads its rows to
``data.seq_len``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from core.exceptions import ConfigError

KEY = "parallel.ddp_embedding_grad"


class _KeptLookup(torch.autograd.Function):
    """``F.embedding(ids, weight)`` whose backward hands the rows' gradient to ``embedding``
    instead of the weight. ``anchor`` is a tensor that requires grad and belongs to no
    optimizer: it keeps the output in the autograd graph without making the weight wait."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, anchor: torch.Tensor, embedding: "GatheredEmbedding"):
        ctx.embedding = embedding
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        ctx.embedding.keep(ids, grad)
        return None, None, None, None


class GatheredEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose lookup gradient is gathered (``install`` turns one into this);
    ``finish`` after each micro-batch's backward."""

    gather_group: dist.ProcessGroup
    _anchor: torch.Tensor
    _kept: list[tuple[torch.Tensor, torch.Tensor]]
    _tokens: int | None  # per rank and step, agreed on the first step

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad):
            return F.embedding(ids, self.weight)
        return _KeptLookup.apply(ids, self.weight.detach(), self._anchor, self)

    def keep(self, ids: torch.Tensor, grad: torch.Tensor) -> None:
        # A copy: under compile_mode=reduce-overhead the gradient is the first block's CUDA
        # graph output, which the next micro-batch's replay may overwrite.
        self._kept.append((ids.reshape(-1), grad.reshape(-1, grad.shape[-1]).clone()))

    def discard(self) -> None:
        """Drop what a failed backward left kept, so the next step starts clean."""
        self._kept.clear()

    def finish(self, sync: bool) -> None:
        """After a micro-batch's backward: keep accumulating, or (``sync``: the last one)
        gather every rank's rows and add their mean scatter-sum to the weight's gradient."""
        if not sync or not self._kept:
            return
        ids, rows = self._kept[0] if len(self._kept) == 1 else map(torch.cat, zip(*self._kept))
        self.discard()
        size = self.gather_group.size()
        self._check_tokens(ids.numel())
        all_ids = ids.new_empty(size * ids.numel())
        all_rows = rows.new_empty(size * rows.shape[0], rows.shape[1])
        dist.all_gather_into_tensor(all_ids, ids, group=self.gather_group)
        dist.all_gather_into_tensor(all_rows, rows, group=self.gather_group)
        summed = torch.ops.aten.embedding_dense_backward(all_rows, all_ids, self.num_embeddings, -1, False)
        summed = summed.to(self.weight.dtype).div_(size)
        if self.weight.grad is None:
            self.weight.grad = summed
        else:
            self.weight.grad.add_(summed)

    def _check_tokens(self, tokens: int) -> None:
        if self._tokens is None:
            counts = torch.tensor([tokens], dtype=torch.int64, device=self.weight.device)
            every = counts.new_empty(self.gather_group.size())
            dist.all_gather_into_tensor(every, counts, group=self.gather_group)
            every = every.tolist()  # once per run: the host waits for the first step's backward
            if len(set(every)) != 1:
                raise ConfigError(
                    f"{KEY}=gather needs the same number of tokens on every rank; the first step had "
                    f"{every} (by rank)",
                    key=KEY,
                    hint=f"set {KEY}=allreduce",
                )
            self._tokens = tokens
        elif tokens != self._tokens:
            raise ConfigError(
                f"{KEY}=gather needs the same number of tokens on every rank and step; rank "
                f"{dist.get_rank()} had {tokens} this step against {self._tokens} on the first",
                key=KEY,
                hint=f"set {KEY}=allreduce",
            )


def install(model: nn.Module, group: dist.ProcessGroup) -> GatheredEmbedding | None:
    """Turn ``model.embed_tokens`` into a ``GatheredEmbedding`` reducing over ``group``;
    returns it, or None where the embedding is not trained (adapter training freezes it)."""
    embedding = model.embed_tokens
    if not embedding.weight.requires_grad:
        return None
    embedding.__class__ = GatheredEmbedding
    embedding.gather_group = group
    embedding._anchor = torch.zeros((), device=embedding.weight.device, requires_grad=True)
    embedding._kept = []
    embedding._tokens = None
    return embedding


def tied_to_output(model: nn.Module) -> bool:
    """True when the input embedding's weight is also the output head's."""
    head = getattr(model, "lm_head", None)
    return head is not None and head.weight is model.embed_tokens.weight


def gathered_embedding(model: nn.Module) -> GatheredEmbedding | None:
    """The ``GatheredEmbedding`` inside ``model`` (plain or wrapped), if any."""
    return next((module for module in model.modules() if isinstance(module, GatheredEmbedding)), None)
