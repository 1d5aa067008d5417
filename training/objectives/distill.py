"""``distill``: knowledge distillation from a frozen teacher, mixed with the hard-label loss.

The teacher (``objective.distill.teacher``: a Hugging Face directory or ``run:RUN_ID[@STEP]``)
is built by frozen.py, spread like the student (sharded under fsdp), and may be larger; it must
share the student's tokenizer: a different vocabulary size is a ConfigError naming both.

Per micro-batch, the teacher runs under no_grad and returns its final hidden states (through
the model's ``head`` hook, no logits); the student's forward hands its hidden states and output
weight to ``distill_loss_sum`` (distill_loss.py), which projects both chunk by chunk over the
tokens and never holds full-vocabulary logits of the micro-batch. The loss covers the
batch's target tokens (labels that are not IGNORE_INDEX: every token for text, the trained
turns for chat data), as ``(1 - alpha) T² D + alpha CE`` summed, divided by the global
batch's target tokens. Evaluation reports the student's hard-label cross entropy as the
loss (comparable with the same student trained without a teacher), and the divergence and
CE per token as metrics. The teacher's outputs are not batch extras: they are (B, T, d)
activations, recomputed by the deterministic teacher on replay, and the teacher's identity
(path + weights hash) is in every checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from core.config import Config
from data.batch import IGNORE_INDEX
from experiments.console import ConsoleField, ConsoleLine, ConsoleLines
from models.forward import model_forward
from training.objectives.base import LossOutput, ObjectiveContext, StatelessObjective, metric
from training.objectives.distill_settings import KEY, KIND, check_teacher, check_vocab, student_vocab
from training.objectives.distill_loss import distill_loss_from_logits, distill_loss_sum
from training.objectives.frozen import FrozenModel, build_frozen, output_weight
from training.objectives.token_logps import autocast_dtype


class DistillObjective(StatelessObjective):
    name = KIND.name
    capabilities = KIND.capabilities
    updates_per_batch = 1
    settles_late = True

    def __init__(self, config: Config) -> None:
        self.config = config
        self.settings = config.objective.distill
        # Per target token: the divergence (named by objective.distill.loss) and the hard-label
        # CE; the eval loss is that CE (see the module docstring).
        divergence = ConsoleField(self.settings.loss, metric("divergence"))
        self.console = ConsoleLines(
            step=ConsoleLine(fields=(divergence, ConsoleField("ce", metric("ce")))),
            eval=ConsoleLine(loss="ce", fields=(divergence,)),
        )
        self.teacher: FrozenModel | None = None
        self._teacher_weight: torch.Tensor | None = None
        self._context: ObjectiveContext | None = None
        self.fuse_head = False

    @staticmethod
    def frozen_sources(config: Config) -> dict[str, str]:
        """{config key: source} of the frozen models setup builds: the teacher."""
        return {KEY: config.objective.distill.teacher}

    # The teacher must share the student's vocabulary and tokenizer: distill_settings.check_teacher.
    check_config = staticmethod(check_teacher)

    def setup(self, model: nn.Module, context: ObjectiveContext) -> None:
        self._context = context
        self.check_config(self.config)
        self.teacher = build_frozen(self.config, self.settings.teacher, role="teacher", dist=context.dist, key=KEY)
        check_vocab(student_vocab(self.config), self.teacher.vocab_size, self.settings.teacher)
        self.fuse_head = context.fuse_head
        if self.fuse_head:  # gathered once: the teacher never changes
            weight = output_weight(self.teacher.module)
            self._teacher_weight = weight.to(self._compute_dtype() or weight.dtype)

    def _compute_dtype(self) -> torch.dtype | None:
        precision = self.config.parallel.precision
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)

    def prepare(self, batch):
        return batch

    def num_targets(self, batch) -> int:
        return batch.num_target_tokens()

    def loss(self, model: nn.Module, micro) -> LossOutput:
        count = self.num_targets(micro)
        placed = micro.placed(self._context.place)
        mask = placed.labels != IGNORE_INDEX
        s = self.settings
        options = dict(kind=s.loss, temperature=s.temperature, alpha=s.alpha, beta=s.beta)
        labels = placed.labels  # also with alpha = 0: the CE is reported (and is the eval loss)
        if not self.fuse_head:
            with torch.no_grad(), self.teacher.context():
                teacher_logits = model_forward(self.teacher.module, placed).logits
            total, _, stats = distill_loss_from_logits(model_forward(model, placed).logits, teacher_logits,
                                                       labels, mask, **options)
        else:
            with torch.no_grad(), self.teacher.context():
                teacher_hidden = model_forward(self.teacher.module, placed, hidden=True).hidden
            teacher_hidden = teacher_hidden.to(self._teacher_weight.dtype)

            def head(hidden, weight):
                return distill_loss_sum(hidden, weight, teacher_hidden, self._teacher_weight, labels, mask,
                                        chunk_tokens=s.chunk_tokens, compute_dtype=autocast_dtype(hidden.device),
                                        compiled=self.config.parallel.compile, **options)

            total, _, stats = model_forward(model, placed, head=head).head
        metrics = {"divergence": stats.divergence_sum.float(), "ce": stats.ce_sum.float()}
        if micro.evaluation:  # a held-out batch: the hard-label CE, comparable with a run without teacher
            return LossOutput(stats.ce_sum.detach(), count, metrics)
        return LossOutput(total, count, metrics)

    def ledger_fields(self, batch, totals: dict[str, float], count: int) -> dict[str, Any]:
        return {"trained_tokens": count}

    def frozen_identity(self) -> dict[str, dict[str, str]]:
        return {"teacher": self.teacher.identity} if self.teacher is not None else {}

