"""``dpo``: preference optimization (DPO, IPO, SimPO, ORPO) on pairs of responses.

Data: ``record: preference`` sources; each pair is two adjacent documents of one row (prompt +
chosen, prompt + rejected; data/preference.py), with ``pair_role``/``pair_index`` extras saying
which target tokens belong to which side of which pair. A pair's log-prob under a model is the
sum of its response tokens' log-probs, taken per token from hidden states and the output
weight without full logits (token_logps.py), then summed per sequence by a masked reduction
over the row (fixed order: deterministic on every device).

Reference (``sigmoid``, ``ipo``): a frozen model (frozen.py) run in ``prepare`` under no_grad.
Its per-pair sums travel as the ``ref_logps`` extra, (B, T) fp32: each sequence's sum sits at
the position of its first target token, zeros elsewhere, so the extra has the row's shape
whatever the number of pairs (the batch hash stays world-size independent) and records what
the reference gave. ``adapter_off`` (LoRA runs) is the policy itself with every adapter off
(models.lora.adapters_disabled): the frozen base, no second copy, identified by the base's
identity. With ``cache_reference`` the sums are stored once per pair
(reference_cache.py) and read back as the same fp32 bits, so cached and online runs have
identical ledgers. ``simpo`` and ``orpo`` are reference-free.

The loss is the mean over the global batch's pairs (``num_targets`` = pairs), each pair's loss
plus ``nll_coef`` times its chosen response's mean per-token NLL (RPO; 0 by default); metrics are
sums over pairs (chosen/rejected rewards, margins, accuracies, the chosen NLL, policy and
reference log-probs), and the ledger adds ``pairs``, ``rewards_margin``, ``accuracy``,
``chosen_logps`` and ``rejected_logps`` (the policy's mean summed log-probs per pair).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from core.config import Config
from core.exceptions import NonFiniteError
from data.batch import IGNORE_INDEX
from experiments.console import ConsoleField, ConsoleLine, ConsoleLines
from training.objectives import preference_loss
from training.objectives.base import LossOutput, ObjectiveContext, StatelessObjective, metric
from training.objectives.dpo_settings import KIND
from training.objectives.frozen import FrozenModel, adapter_off_reference, build_frozen, compute_autocast
from training.objectives.preference_loss import SequenceLogps
from training.objectives.reference_cache import ReferenceCache, fingerprint, pair_tokens
from training.objectives.token_logps import autocast_dtype, label_logps, pairwise_sum

KEY = "objective.dpo.reference"
REFERENCE_FREE = ("simpo", "orpo")
# Per pair, on the step and the eval lines: accuracy and margin of the implicit rewards, and the
# policy's summed log-probs of the chosen and rejected responses.
_PAIR_LINE = ConsoleLine(unit="pair", fields=(
    ConsoleField("accuracy", metric("accuracies")), ConsoleField("margin", metric("margins")),
    ConsoleField("logp chosen", metric("policy_chosen_logps"), ".2f"),
    ConsoleField("logp rejected", metric("policy_rejected_logps"), ".2f"),
))
METRICS = ("chosen_rewards", "rejected_rewards", "margins", "accuracies", "chosen_nll",
           "policy_chosen_logps", "policy_rejected_logps", "ref_chosen_logps", "ref_rejected_logps")


@dataclasses.dataclass
class PairLayout:
    """Where a (micro-)batch's pairs are, computed on the host from its extras and labels."""

    segments: torch.Tensor
    """(B, 2P, T) fp32 0/1: row b's sequence s = 2p + side (0 chosen, 1 rejected) at its target positions."""
    pairs: list[tuple[int, int]]
    """(row, pair number in row) of every pair, in row-major order."""
    first_target: list[tuple[int, int]]
    """Per pair: the (chosen, rejected) positions of the first target token in the row."""
    token_counts: torch.Tensor
    """(N, 2) float32 target tokens of (chosen, rejected) per pair."""


def pair_layout(batch) -> PairLayout:
    role = batch.extras["pair_role"].numpy().astype(np.int64)  # (B, T)
    index = batch.extras["pair_index"].numpy()  # (B, T)
    target = batch.labels.numpy() != IGNORE_INDEX  # (B, T)
    rows, width = role.shape
    per_row = index.max(axis=1) + 1 if width else np.zeros(rows, dtype=np.int64)
    slots = max(int(per_row.max()) if rows else 0, 1)
    seq = np.where((role > 0) & target, index * 2 + role - 1, -1)  # (B, T) sequence number or -1
    segments = np.zeros((rows, 2 * slots, width), dtype=np.float32)
    b, t = np.nonzero(seq >= 0)
    segments[b, seq[b, t], t] = 1.0
    pairs, first, counts = [], [], []
    for r in range(rows):
        for p in range(int(per_row[r])):
            positions = [np.flatnonzero(segments[r, 2 * p + side]) for side in (0, 1)]
            if any(len(pos) == 0 for pos in positions):
                raise ValueError(f"row {r} pair {p} has a side without target tokens")
            pairs.append((r, p))
            first.append((int(positions[0][0]), int(positions[1][0])))
            counts.append((len(positions[0]), len(positions[1])))
    return PairLayout(torch.from_numpy(segments), pairs, first,
                      torch.tensor(counts, dtype=torch.float32).reshape(-1, 2))


def sequence_sums(token_values: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """(B, T) per-token values, (B, S, T) 0/1 segments -> (B, S) sums.

    The sum is ``pairwise_sum``'s fixed tree: ``S`` is the most pairs of any row of the
    micro-batch, so it changes with the rows a micro-batch holds (with the GPU count, which
    spreads rows over ranks), and a library reduction picks its CUDA kernel, and so its order,
    by the number of sums it makes. A pair's sums then depend on its own tokens only."""
    return pairwise_sum(token_values.unsqueeze(1) * segments)


def count_pairs(batch) -> int:
    index = batch.extras["pair_index"]
    return int((index.max(dim=1).values + 1).sum()) if index.numel() else 0


class DPOObjective(StatelessObjective):
    name = KIND.name
    capabilities = KIND.capabilities
    updates_per_batch = 1
    settles_late = True
    console = ConsoleLines(step=_PAIR_LINE, eval=_PAIR_LINE)

    def __init__(self, config: Config) -> None:
        self.config = config
        self.settings = config.objective.dpo
        self.chunk_tokens = config.train.loss_chunk_tokens
        self.reference: FrozenModel | None = None
        self.cache: ReferenceCache | None = None
        self._context: ObjectiveContext | None = None
        self.fuse_head = False

    # ------------------------------------------------------------------ setup

    @staticmethod
    def frozen_sources(config: Config) -> dict[str, str]:
        """{config key: source} of the frozen models setup builds (``adapter_off`` is the policy itself)."""
        s = config.objective.dpo
        return {} if s.loss in REFERENCE_FREE or s.reference == "adapter_off" else {KEY: s.reference}

    def setup(self, model: nn.Module, context: ObjectiveContext) -> None:
        self._context = context
        self.fuse_head = context.fuse_head and self.chunk_tokens > 0
        if self.settings.loss in REFERENCE_FREE:
            return
        if self.settings.reference == "adapter_off":  # the policy itself, adapters off (LoRA)
            self.reference = adapter_off_reference(model, self.config, dist=context.dist,
                                                   base_identity=context.parallel.base_identity, key=KEY)
        else:
            self.reference = build_frozen(self.config, self.settings.reference, role="reference", dist=context.dist,
                                          key=KEY)
        if self.settings.cache_reference:
            self.cache = self._open_cache(context)

    def _open_cache(self, context: ObjectiveContext) -> ReferenceCache:
        from data.chat_template import ChatTemplate
        from data.sources.source import open_sources
        from data.tokenizers import build_tokenizer

        d = self.config.data
        sources = open_sources(d.sources, label="data.sources")
        if d.eval_source is not None:
            sources += open_sources((d.eval_source,), label="data.eval_source")
        parts = {
            "reference": self.reference.identity,
            "sources": [s.describe() for s in sources],
            "tokenizer": build_tokenizer(d.tokenizer).fingerprint,
            "template": ChatTemplate.for_tokenizer(d.tokenizer, d.chat_template).source,
            "seq_len": d.seq_len,
            "precision": self.config.parallel.precision,
            "device": context.dist.device.type,
            "compiled": self.config.parallel.compile,  # a compiled reference rounds differently
            "sums": "pairwise",  # sequence_sums' fixed tree (older caches hold sums of another order)
        }
        data = {s.name: s.content_digest() for s in sources}  # the records: checked, not part of the directory name
        directory = Path(self.settings.cache_dir) if self.settings.cache_dir else (
            Path(self.config.run.root) / "reference_cache" / fingerprint(parts)[:16])
        return ReferenceCache(directory, parts, data=data, rank=context.dist.rank,
                              world_size=context.dist.world_size)

    # ------------------------------------------------------------------ per batch

    def prepare(self, batch):
        if self.reference is None:
            return batch
        layout = pair_layout(batch)
        keys = [_pair_key(batch, r, first[0]) for (r, _), first in zip(layout.pairs, layout.first_target)]
        tokens = ([pair_tokens(batch, r, first) for (r, _), first in zip(layout.pairs, layout.first_target)]
                  if self.cache is not None else [])
        values = self.cache.lookup(keys, tokens) if self.cache is not None else None
        if self._must_run(values is None):
            computed = self._reference_sums(batch)
            first: dict[str, tuple[float, float]] = {}
            computed = [first.setdefault(k, v) for k, v in zip(keys, computed)]  # a repeated pair: as the cache
            if self.cache is not None:
                _check_finite(keys, computed, step=batch.step)  # never store what a later run would refuse
                self.cache.store([(k, t, c, r) for k, t, (c, r) in zip(keys, tokens, computed)])
            values = values if values is not None else computed
        ref = torch.zeros(batch.labels.shape, dtype=torch.float32)
        for ((row, _), (c_at, r_at)), (chosen, rejected) in zip(zip(layout.pairs, layout.first_target), values):
            ref[row, c_at], ref[row, r_at] = chosen, rejected
        return batch.with_extras(ref_logps=ref)

    def _must_run(self, missing: bool) -> bool:
        """Whether this rank runs the reference. A sharded (fsdp, or tensor-parallel adapter_off)
        reference's forward is collective: every rank runs it when any rank misses a cached pair."""
        dist = self._context.dist
        if not self.reference.collective:
            return missing
        flag = torch.tensor([1.0 if missing else 0.0], device=self._context.parallel.device
                            if dist.backend == "nccl" else torch.device("cpu"))
        return bool(dist.all_reduce(flag)[0] > 0)

    def _reference_sums(self, batch) -> list[tuple[float, float]]:
        """(chosen, rejected) fp32 sums per pair, micro-batch by micro-batch."""
        out: list[tuple[float, float]] = []
        module = self.reference.module
        for micro in batch.micro_batches(self.config.train.micro_batch_size):
            layout = pair_layout(micro)
            with torch.no_grad(), self._autocast(), self.reference.context():  # built: its own autocast too
                sums = self._pair_sums(module, micro, layout)  # (N, 2)
            out.extend((float(c), float(r)) for c, r in sums.float().cpu().tolist())
        return out

    def _autocast(self):
        return compute_autocast(self.config.parallel.precision, self._context.parallel.device)

    def _token_logps(self, model: nn.Module, placed) -> torch.Tensor:
        """(B, T) fp32 log-probs of the labels (0 where none)."""
        return label_logps(model, placed, fused=self.fuse_head, chunk_tokens=self.chunk_tokens,
                           compute_dtype=autocast_dtype(placed.input_ids.device),
                           compiled=self.config.parallel.compile)

    def _pair_sums(self, model: nn.Module, micro, layout: PairLayout) -> torch.Tensor:
        """(N, 2) summed response log-probs of the micro-batch's pairs (chosen, rejected)."""
        place = self._context.place
        placed = micro.placed(place)
        token_logps = self._token_logps(model, placed)  # (B, T)
        sums = sequence_sums(token_logps, place(layout.segments))  # (B, 2P)
        return _select_pairs(sums, layout)

    def num_targets(self, batch) -> int:
        return count_pairs(batch)

    def loss(self, model: nn.Module, micro) -> LossOutput:
        layout = pair_layout(micro)
        place = self._context.place
        placed = micro.placed(place)
        token_logps = self._token_logps(model, placed)  # (B, T)
        segments = place(layout.segments)
        if not layout.pairs:  # nothing to compare: a zero that keeps the graph
            return LossOutput((token_logps * 0).sum(), 0, {})
        policy_sums = _select_pairs(sequence_sums(token_logps, segments), layout)  # (N, 2)
        counts = place(layout.token_counts)
        policy = SequenceLogps(policy_sums[:, 0], policy_sums[:, 1], counts[:, 0], counts[:, 1])
        reference = None
        if self.settings.loss not in REFERENCE_FREE:
            ref_sums = _select_pairs(sequence_sums(placed.extras["ref_logps"], segments), layout)
            reference = SequenceLogps(ref_sums[:, 0], ref_sums[:, 1], counts[:, 0], counts[:, 1])
        losses, stats = self._losses(policy, reference)
        nll = preference_loss.chosen_nll(policy)  # (N,) mean per-token NLL of each chosen answer
        if self.settings.nll_coef > 0:  # RPO: anchors the chosen answer's likelihood
            losses = losses + self.settings.nll_coef * nll
        metrics = {
            "chosen_rewards": stats.chosen_rewards.sum(),
            "rejected_rewards": stats.rejected_rewards.sum(),
            "margins": stats.margins.sum(),
            "accuracies": stats.accuracies.sum(),
            "chosen_nll": nll.detach().sum(),
            "policy_chosen_logps": policy.chosen.detach().sum(),
            "policy_rejected_logps": policy.rejected.detach().sum(),
        }
        if reference is not None:
            metrics["ref_chosen_logps"] = reference.chosen.sum()
            metrics["ref_rejected_logps"] = reference.rejected.sum()
        return LossOutput(losses.sum(), len(layout.pairs), metrics)

    def _losses(self, policy: SequenceLogps, reference: SequenceLogps | None):
        s = self.settings
        if s.loss == "sigmoid":
            return preference_loss.sigmoid(policy, reference, beta=s.beta, label_smoothing=s.label_smoothing)
        if s.loss == "ipo":
            return preference_loss.ipo(policy, reference, beta=s.beta, length_normalized=s.ipo_length_normalized)
        if s.loss == "simpo":
            return preference_loss.simpo(policy, beta=s.beta, gamma=s.gamma)
        return preference_loss.orpo(policy, lam=s.lam)

    # ------------------------------------------------------------------ records and state

    def ledger_fields(self, batch, totals: dict[str, float], count: int) -> dict[str, Any]:
        pairs = max(count, 1)
        # The policy's summed log-probs of the chosen and rejected responses, means over the pairs:
        # a collapse (both falling, the margin still growing) shows here first.
        return {"pairs": count, "rewards_margin": totals.get("margins", 0.0) / pairs,
                "accuracy": totals.get("accuracies", 0.0) / pairs,
                "chosen_logps": totals.get("policy_chosen_logps", 0.0) / pairs,
                "rejected_logps": totals.get("policy_rejected_logps", 0.0) / pairs}

    def frozen_identity(self) -> dict[str, dict[str, str]]:
        return {"reference": self.reference.identity} if self.reference is not None else {}


def _select_pairs(sums: torch.Tensor, layout: PairLayout) -> torch.Tensor:
    """(B, 2P) per-sequence sums -> (N, 2) of the pairs that exist, in layout order."""
    slots = sums.shape[1] // 2
    flat = torch.tensor([r * slots + p for r, p in layout.pairs], dtype=torch.long)
    return sums.reshape(-1, 2).index_select(0, flat.to(sums.device))


def _check_finite(keys: list[str], values: list[tuple[float, float]], *, step: int) -> None:
    for key, pair in zip(keys, values):
        if not all(math.isfinite(v) for v in pair):
            raise NonFiniteError(f"the reference model's log-probs of pair {key} are not finite {pair}",
                                 record=key, step=step, hint="check the reference model's weights and this record")


def _pair_key(batch, row: int, position: int) -> str:
    """The provenance of the document at ``position`` of ``row``: source|shard|record."""
    for span in batch.provenance[row]:
        if span.start <= position < span.end:
            return f"{span.source}|{span.shard}|{span.record}"
    raise ValueError(f"no document at position {position} of row {row}")
