"""``reward_model``: a scalar score head on the trunk, trained on preference pairs.

Data: the ``record: preference`` sources DPO reads (data/preference.py); each pair is two
adjacent documents of one row (prompt + chosen, then prompt + rejected), marked by the
``pair_role``/``pair_index`` extras.

The score of a sequence is ``score(h)``, a ``Linear(hidden_size, 1, bias=False)`` applied to the
trunk's final normed hidden state at the **read position**: the last token of the conversation as the
chat template renders it (ChatML's ``<|im_end|>\n``: the ``\n``), which is the token before the
end-of-text separator the packer adds after each side of a pair. Every path reads there: training and
held-out evaluation (here), a model reward in GRPO and PPO and ``python -m training score``
(training/objectives/model_reward.py ``ReadPosition``), and a Hugging Face sequence classifier
(the last non-pad token of ``apply_chat_template``'s ids), so an export scores the same
(training/cli/export.py). The row's other documents and padding come after it or attend only within
their own document, so they never change it. The head is a
trained part of its own, ``score`` (training/parts.py): it is checkpointed as ``parts.score.*``,
initialized from the run's seed (or from the ``score.weight`` of a Hugging Face sequence-classification
directory in ``model.init_from``), and trained with the run's ``train`` settings.

The loss is the mean over the global batch's pairs of the Bradley-Terry loss
``-log sigmoid(r_chosen - r_rejected - margin) + center_coef * (r_chosen + r_rejected)^2``
(ppo_loss.bradley_terry), ``margin`` the fixed ``margin`` or, under ``margin_from: record``, the
pair's own (its record's ``margin``, carried by the data as the extra ``pair_margin``, read at the
chosen sequence's last token). Metric sums over pairs: ``accuracies`` (chosen scored strictly higher),
``margins`` (r_chosen - r_rejected), ``chosen_scores``, ``rejected_scores``; the ledger holds their
means per pair, and the eval event the held-out pairs' (``metrics.accuracies``: held-out preference
accuracy).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from core import seeding
from core.config import Config
from experiments.console import ConsoleField, ConsoleLine, ConsoleLines
from models.hf_config import model_config_from_hf
from models.forward import ModelInputs, model_forward
from training.objectives.base import LossOutput, ObjectiveContext, PartSpec, StatelessObjective, metric
from training.objectives.ppo_loss import bradley_terry
from training.objectives.reward_model_io import SCORE_PART, is_classifier, read_score_weight
from training.objectives.reward_model_settings import KIND

SCORE_INIT_STD = 0.02
"""The score head's initial weights: normal(0, this), from the run's seed (Hugging Face's default initializer range)."""
# Per pair, on the step and the eval lines: how often the chosen response scores higher, and by how much.
_PAIR_LINE = ConsoleLine(unit="pair", fields=(
    ConsoleField("accuracy", metric("accuracies")), ConsoleField("margin", metric("margins")),
))


@dataclasses.dataclass(frozen=True)
class ScoreLayout:
    """Where a (micro-)batch's pairs are read, computed on the host from its extras: pair k's chosen
    sequence at ``(rows[k], chosen[k])``, its rejected one at ``(rows[k], rejected[k])``."""

    rows: torch.Tensor
    """(N,) int64 row of each pair, row-major order."""
    chosen: torch.Tensor
    """(N,) int64 read position of the chosen sequence: its rendered conversation's last token."""
    rejected: torch.Tensor
    """(N,) int64 read position of the rejected sequence."""

    @property
    def pairs(self) -> int:
        return int(self.rows.numel())


SEPARATORS = 1
"""Tokens the packer lays after each side of a pair (its end-of-text separator,
data/pipeline/packing.py ``_accept_pair``): the read position is this many tokens before a side's end."""


def score_layout(batch) -> ScoreLayout:
    """The read position of each side of each pair (``pair_role`` 1 chosen, 2 rejected; ``pair_index``
    the pair's number in its row, -1 outside pairs): the side's last token before its separator."""
    role = batch.extras["pair_role"].numpy()  # (B, T)
    index = batch.extras["pair_index"].numpy()  # (B, T)
    rows, ends = [], []
    for r in range(role.shape[0]):
        for p in range(int(index[r].max()) + 1 if role.shape[1] else 0):
            last = [np.flatnonzero((role[r] == side) & (index[r] == p)) for side in (1, 2)]
            if any(len(positions) == 0 for positions in last):
                raise ValueError(f"row {r} pair {p} has no {'chosen' if len(last[0]) == 0 else 'rejected'} sequence")
            if any(len(positions) <= SEPARATORS for positions in last):
                raise ValueError(f"row {r} pair {p} has a side of no token before its separator")
            rows.append(r)
            ends.append((int(last[0][-1 - SEPARATORS]), int(last[1][-1 - SEPARATORS])))
    ends_t = torch.tensor(ends, dtype=torch.long).reshape(-1, 2)
    return ScoreLayout(torch.tensor(rows, dtype=torch.long), ends_t[:, 0], ends_t[:, 1])


def count_pairs(batch) -> int:
    index = batch.extras["pair_index"]
    return int((index.max(dim=1).values + 1).sum()) if index.numel() else 0


def score_head(hidden_size: int, *, generator: torch.Generator) -> nn.Linear:
    """The score head, ``Linear(hidden_size, 1, bias=False)``, its weight normal(0, SCORE_INIT_STD)."""
    head = nn.Linear(hidden_size, 1, bias=False)
    with torch.no_grad():
        head.weight.normal_(0.0, SCORE_INIT_STD, generator=generator)
    return head


def sequence_scores(model: nn.Module, head: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    document_ids: torch.Tensor | None, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(N,) fp32 scores of the sequences ending at ``(rows[k], positions[k])``: the model's final
    hidden states there, through ``head``. The one place a reward model runs its trunk."""

    def last_hidden(hidden: torch.Tensor, _output_weight: torch.Tensor) -> torch.Tensor:
        return hidden[rows, positions]  # (B, T, H) -> (N, H)

    hidden = model_forward(model, ModelInputs(input_ids, position_ids, document_ids), head=last_hidden).head
    return head(hidden)[:, 0].float()  # (N,)


class RewardModelObjective(StatelessObjective):
    name = KIND.name
    capabilities = KIND.capabilities
    updates_per_batch = 1
    settles_late = True
    console = ConsoleLines(step=_PAIR_LINE, eval=_PAIR_LINE)

    def __init__(self, config: Config) -> None:
        self.config = config
        self.settings = config.objective.reward_model
        self._context: ObjectiveContext | None = None

    def setup(self, model: nn.Module, context: ObjectiveContext) -> None:
        self._context = context

    def extra_parts(self, context: ObjectiveContext) -> dict[str, PartSpec]:
        source = self.config.model.init_from
        # The trunk's width: with init_from its config.json's, whatever the YAML's shape says.
        hidden_size = (model_config_from_hf(source, base=self.config.model) if source is not None
                       else self.config.model).hidden_size
        head = score_head(hidden_size, generator=seeding.generator(self.config.train.seed, "score_init"))
        if source is not None and is_classifier(source):  # a reward model's export: its head too
            with torch.no_grad():
                head.weight.copy_(read_score_weight(source, hidden_size))
        return {SCORE_PART: PartSpec(module=head, train=self.config.train)}

    def prepare(self, batch):
        return batch

    def num_targets(self, batch) -> int:
        return count_pairs(batch)

    def loss(self, model: nn.Module, micro, parts: Mapping[str, nn.Module]) -> LossOutput:
        layout = score_layout(micro)
        place = self._context.place
        placed = micro.placed(place)
        rows = place(layout.rows).repeat(2)  # chosen sequences, then rejected ones
        ends = place(torch.cat([layout.chosen, layout.rejected]))
        scores = sequence_scores(model, parts[SCORE_PART], placed.input_ids, placed.position_ids,
                                 placed.document_ids, rows, ends)  # (2N,)
        chosen, rejected = scores[:layout.pairs], scores[layout.pairs:]
        losses, stats = bradley_terry(chosen, rejected, margin=self._margins(placed, rows[:layout.pairs],
                                                                             ends[:layout.pairs]),
                                      center=self.settings.center_coef)
        metrics = {
            "accuracies": stats["accuracy"].sum(),
            "margins": stats["margin"].sum(),
            "chosen_scores": chosen.detach().sum(),
            "rejected_scores": rejected.detach().sum(),
        }
        return LossOutput(losses.sum(), layout.pairs, metrics)

    def _margins(self, placed, rows: torch.Tensor, chosen_ends: torch.Tensor) -> torch.Tensor | float:
        """(N,) each pair's own margin under margin_from: record, else the fixed margin."""
        if self.settings.margin_from == "record":
            return placed.extras["pair_margin"][rows, chosen_ends]
        return self.settings.margin

    def ledger_fields(self, batch, totals: dict[str, float], count: int) -> dict[str, Any]:
        pairs = max(count, 1)
        return {"pairs": count, "accuracy": totals.get("accuracies", 0.0) / pairs,
                "margin": totals.get("margins", 0.0) / pairs,
                "chosen_score": totals.get("chosen_scores", 0.0) / pairs,
                "rejected_score": totals.get("rejected_scores", 0.0) / pairs}

