"""The one way to run a model of any family: ``model_forward(model, batch, ...) -> ModelOutput``.

Every caller (the training step, each objective, frozen references and teachers, the
sampler's prefill and decode) runs the model through this function, and nowhere else
(tests/models/test_forward.py scans for other calls). It reads what a model needs from
``batch`` (anything with ``input_ids``, ``position_ids`` and ``document_ids``, and ``media``
where it has one: a data ``Batch`` or ``ModelInputs``), moves it with ``place``, calls the
model once and names what came out:

============  ==============================  =============================================
asked for     the model returns               ``ModelOutput`` field
============  ==============================  =============================================
(default)     logits (B, T, vocab)            ``logits``
hidden=True   final normed hidden (B, T, d)   ``hidden``
head=fn       ``fn(hidden, output weight)``   ``head`` (a fused loss or log-probs)
cache=c       last token's logits (B, vocab)  ``logits`` (generation: reads and extends c)
============  ==============================  =============================================

What a family's model implements (``FamilyModel``, the one protocol the generic code relies on:
the step, the objectives, training/builders.py and the generation engine): ``forward(input_ids, position_ids=None,
document_ids=None, head=None, cache=None, media=None)`` returning a ``ModelOutput``, the result in
``logits`` (or ``head`` where a head was given) and beside it the auxiliary losses and metrics it
wants trained and recorded, or the result alone where it has nothing besides (Qwen: its
logits or its head's result, as every direct caller in the tests reads them). ``media`` is opaque to everything but the family
(pixel patches and their grids, say); the family turns the batch's (B, T) ``position_ids``
(and its media) into the positions it needs with its ``model_positions`` (Qwen: the same
tensor; an M-RoPE family: (3, B, T)), inside its own forward, where every wrapper's hooks
have run. Beside its forward it carries the run's ``Numerics`` (``numerics``, handed over by
``use_numerics``) and, for the sampler, its ``generation_spec()``.

An auxiliary loss (``AuxLoss``) is a *sum* over this forward's units and the unit it averages
over in the global batch (``per``: every input token, every target token, every row), with a
weight. training/step.py is the one place that adds it to the objective's loss: it divides the
sum by the global count of its unit, as it divides the objective's sum by the global count of
targets, so its gradient does not depend on how the batch is split into micro-batches and
ranks. A loss that is no such sum but a product of two means over the global batch (a router's
load-balancing loss: tokens per expert times router probability per expert) is a
``PooledProductLoss``: the forward hands over its counts (no gradient) and its sums (with their
graph), and the step forms the loss from the counts reduced over the step's micro-batches and the
data-parallel ranks, so it is the global batch's value, and its gradient exactly so. A metric
(``ModelMetric``) is a sum and a count, both summed over micro-batches and ranks; the ledger gets
their ratio as ``model/<name>``.

A head runs inside the model's forward, where wrappers such as FSDP hold the output weight
unsharded. ``model`` may be wrapped (DDP, FSDP2, compiled blocks): it is called, so every
wrapper's hooks run (they find the tensors inside the returned dataclass). Nothing here
computes: the arithmetic is the model's own.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional, Protocol, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from models.generation.protocol import GenerationSpec
    from models.numerics import Numerics

Head = Callable[[torch.Tensor, torch.Tensor], Any]
"""(final normed hidden states (..., d), output weight (V, d)) -> anything (a loss sum, log-probs)."""

INPUT_TOKEN = "input_token"
"""An auxiliary loss averaged over every position of the global batch's input_ids (a router's balance loss)."""
TARGET_TOKEN = "target_token"
"""An auxiliary loss averaged over the global batch's target tokens (labels not ignored)."""
ROW = "row"
"""An auxiliary loss averaged over the global batch's rows."""
NORMALIZERS = (INPUT_TOKEN, TARGET_TOKEN, ROW)
"""What an auxiliary loss may be averaged over, in the global batch."""


class ModelBatch(Protocol):
    """What the model reads of a batch (``media`` too, where the batch has it)."""

    input_ids: torch.Tensor
    position_ids: Optional[torch.Tensor]
    document_ids: Optional[torch.Tensor]


@dataclass
class ModelInputs:
    """Model inputs that do not come from a data batch (the sampler's chunks)."""

    input_ids: torch.Tensor
    """(B, T) token ids."""
    position_ids: Optional[torch.Tensor] = None
    """(B, T) positions (default 0..T-1); with a cache, also each token's cache slot."""
    document_ids: Optional[torch.Tensor] = None
    """(B, T) packed-document ids: tokens attend within their document only (default: one)."""
    media: Any = None
    """What the family reads besides tokens (image patches and grids); None for text."""


@dataclass(frozen=True)
class AuxLoss:
    """A loss the model adds to the objective's: a sum over this forward's units of ``per``."""

    sum: torch.Tensor
    """Scalar: the loss summed over this forward's units (not averaged), with its graph."""
    per: str
    """The unit it is averaged over in the global batch: one of ``NORMALIZERS``."""
    weight: float = 1.0
    """Its coefficient in the loss that is backpropagated."""

    def __post_init__(self) -> None:
        if self.per not in NORMALIZERS:
            raise ValueError(f"an auxiliary loss is averaged over one of {NORMALIZERS}, not {self.per!r}")


@dataclass(frozen=True)
class PooledProductLoss:
    """A loss over the global batch of the form ``scale * sum_k f_k * p_k``, where ``f`` and ``p`` are
    ``counts`` and ``sums`` pooled over their R rows and divided by ``R * U`` (U: the global batch's
    count of ``per``); ``value`` is that formula. Only ``sums`` carries a gradient, so with the global
    counts known each forward's share, ``value(global counts, its sums, U)``, adds up to the global
    loss and its gradient exactly; training/step.py reduces the counts over the step before it forms
    any share (a load-balancing loss: rows are sparse layers, k experts)."""

    counts: torch.Tensor
    """(R, K) this forward's counts (tokens per expert per layer), without gradient."""
    sums: torch.Tensor
    """(R, K) fp32 this forward's sums over its units (router probabilities per expert per layer), with their graph."""
    units: int
    """This forward's count of ``per`` (its input tokens)."""
    per: str
    """The unit the means are over in the global batch: one of ``NORMALIZERS``."""
    scale: float = 1.0
    """The factor in front of the product (a load-balancing loss: the expert count)."""
    weight: float = 1.0
    """Its coefficient in the loss that is backpropagated."""

    def __post_init__(self) -> None:
        if self.per not in NORMALIZERS:
            raise ValueError(f"a pooled product loss is averaged over one of {NORMALIZERS}, not {self.per!r}")

    def value(self, counts: torch.Tensor, sums: torch.Tensor, units: int) -> torch.Tensor:
        """``scale * sum_k f_k * p_k`` with ``f = counts`` and ``p = sums`` pooled over rows, each over ``R * units``."""
        rows = counts.shape[0] * max(units, 1)
        f = counts.sum(dim=0).to(torch.float32) / rows  # (K,)
        p = sums.sum(dim=0) / rows  # (K,)
        return self.scale * (f * p).sum()

    @property
    def sum(self) -> torch.Tensor:
        """This forward's loss as if it were the whole batch, times its units (an ``AuxLoss``'s sum)."""
        return self.value(self.counts, self.sums, self.units) * self.units


@dataclass(frozen=True)
class ModelMetric:
    """A statistic the model reports (a layer's router load): a sum and what it is divided by."""

    sum: torch.Tensor
    """Scalar: the statistic summed over this forward."""
    count: torch.Tensor | float
    """What ``sum`` is divided by, once both are summed over micro-batches and ranks."""


@dataclass
class ModelOutput:
    """What one forward gave; a result field is None where it was not asked for."""

    logits: Optional[torch.Tensor] = None
    """(B, T, vocab) in the compute dtype; (B, vocab) of each row's last token with a cache."""
    hidden: Optional[torch.Tensor] = None
    """(B, T, d) final normalized hidden states."""
    head: Any = None
    """The result of the ``head`` function."""
    aux_losses: dict[str, AuxLoss | PooledProductLoss] = field(default_factory=dict)
    """Losses the model adds to the objective's, by name (a router's balance loss); Qwen: none."""
    metrics: dict[str, ModelMetric] = field(default_factory=dict)
    """Statistics the model reports, by name (per-layer router load); Qwen: none."""
    extra: dict[str, torch.Tensor] = field(default_factory=dict)
    """Outputs of further heads (e.g. a critic's values); none today."""

    @property
    def emitted(self) -> bool:
        """Whether the model added auxiliary losses or metrics."""
        return bool(self.aux_losses or self.metrics)


class FamilyModel(Protocol):
    """What the generic code asks of a model family's module: ``model_forward`` its positions and
    forward, training/builders.py its numerics, the generation engine its spec (module docstring)."""

    numerics: Numerics
    """The numerics every forward runs under (models/numerics.py): ``Numerics.for_model`` until
    ``use_numerics`` hands it the run's; the sampler's rule reads the same object."""

    def use_numerics(self, numerics: Numerics) -> None:
        """Run every forward under ``numerics`` from now on: the run's, built once
        (training.determinism.numerics), which a generation copy of the model carries too."""

    def generation_spec(self) -> GenerationSpec:
        """The vocabulary and its key/value cache's shape, device and dtype
        (models/generation/protocol.py, ``KVCache.for_spec``)."""

    def model_positions(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                        media: Any) -> torch.Tensor:
        """The positions its rotary embedding reads, from the batch's (B, T) ``position_ids``
        (None: 0..T-1) and its media."""

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None, head: Optional[Head] = None,
                cache: Any = None, media: Any = None) -> ModelOutput | torch.Tensor | Any:
        """One forward: a ``ModelOutput`` (the result, its auxiliary losses and metrics), or the
        result alone (logits, or the head's)."""


def model_forward(
    model: nn.Module,
    batch: ModelBatch,
    *,
    place: Callable[[torch.Tensor], torch.Tensor] | None = None,
    head: Head | None = None,
    hidden: bool = False,
    cache: Any = None,
) -> ModelOutput:
    """Run ``model`` on ``batch``'s ids, positions, documents and media, moved by ``place``
    (default: as they are); ``cache`` is a ``KVCache`` (models/generation/kv_cache.py); the
    module docstring says what each of ``head``, ``hidden`` and ``cache`` gives."""
    if sum((head is not None, hidden, cache is not None)) > 1:
        raise ValueError("model_forward takes at most one of head, hidden and cache")
    move = place if place is not None else _as_is
    input_ids = move(batch.input_ids)
    position_ids = None if batch.position_ids is None else move(batch.position_ids)
    document_ids = None if batch.document_ids is None else move(batch.document_ids)
    media = _placed(getattr(batch, "media", None) or None, move)  # a data Batch without media has {}
    # Exactly one call of the model in the whole code base: this one.
    asked = {"cache": cache} if cache is not None else {"head": _final_hidden if hidden else head}
    out = model(input_ids, position_ids=position_ids, document_ids=document_ids, media=media, **asked)
    if not isinstance(out, ModelOutput):  # the result alone: nothing besides it (Qwen)
        return ModelOutput(hidden=out) if hidden else ModelOutput(head=out) if head is not None else ModelOutput(logits=out)
    if hidden:
        out = replace(out, hidden=out.head, head=None)
    if out.emitted:
        _record(model, out)
    return out


# ---------------------------------------------------------------------- what the step collects

_RECORDING: contextvars.ContextVar[Optional["EmittedOutputs"]] = contextvars.ContextVar(
    "model_forward_recording", default=None)


class EmittedOutputs:
    """The auxiliary losses and metrics that the trained modules' forwards emitted inside one
    ``record_emitted`` block (one micro-batch's ``objective.loss``), in call order.

    The objectives call ``model_forward`` and keep only the result they need; the training step
    reads what the model added beside it here. Forwards of other modules (a frozen teacher) and
    forwards run without gradients are left out."""

    def __init__(self, trained: Sequence[nn.Module], *, without_grad: bool = False) -> None:
        self._trained = tuple(trained)
        self._without_grad = without_grad
        self._ids: set[int] | None = None  # every module of the trained ones, found on first use
        self.outputs: list[ModelOutput] = []
        """The emitting forwards' outputs."""

    def take(self, model: nn.Module, out: ModelOutput) -> None:
        """Keep ``out`` if ``model`` is (part of) a trained module and gradients are on (or the block
        records without them: the step's statistics pass)."""
        if not (torch.is_grad_enabled() or self._without_grad):
            return
        if self._ids is None:
            self._ids = {id(sub) for module in self._trained for sub in module.modules()}
        if id(model) in self._ids:
            self.outputs.append(out)

    def aux_losses(self) -> Iterator[tuple[str, AuxLoss | PooledProductLoss]]:
        for out in self.outputs:
            yield from out.aux_losses.items()

    def metrics(self) -> Iterator[tuple[str, ModelMetric]]:
        for out in self.outputs:
            yield from out.metrics.items()


@contextlib.contextmanager
def record_emitted(trained: Sequence[nn.Module], *, without_grad: bool = False) -> Iterator[EmittedOutputs]:
    """Collect, for the block's duration, what ``trained``'s forwards emit besides their result
    (``without_grad``: also from forwards run without gradients)."""
    emitted = EmittedOutputs(trained, without_grad=without_grad)
    token = _RECORDING.set(emitted)
    try:
        yield emitted
    finally:
        _RECORDING.reset(token)


def _record(model: nn.Module, out: ModelOutput) -> None:
    recording = _RECORDING.get()
    if recording is not None:
        recording.take(model, out)


def _placed(media: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``media`` with every tensor in it moved by ``move``: a tensor, or mappings, lists and tuples
    of them (``Batch.media``: per field, per row, the row's items)."""
    if media is None or move is _as_is:
        return media
    if isinstance(media, torch.Tensor):
        return move(media)
    if isinstance(media, Mapping):
        return {k: _placed(v, move) for k, v in media.items()}
    if isinstance(media, (list, tuple)):
        return type(media)(_placed(v, move) for v in media)
    return media


def _final_hidden(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return hidden


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
