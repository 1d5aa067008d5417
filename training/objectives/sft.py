"""``sft``: supervised fine-tuning on chat or prompt/completion data.

The same next-token loss as ``causal_lm``, over the tokens the data marks as targets
(``data.loss_on``: assistant turns with their end-of-turn token, the completion, or all;
data/chat_template.py), normalized by the trained tokens of the *global* batch, so 1x4
and 4x1 accumulation and every world size give the same loss. The ledger adds
``trained_tokens``.
"""

from __future__ import annotations

from typing import Any

from experiments.console import ConsoleField, ConsoleLine, ConsoleLines
from training.objectives.causal_lm import CausalLMObjective
from training.objectives.sft_settings import KIND


class SFTObjective(CausalLMObjective):
    """Its check of the data sources is sft_settings.validate, run when the config is loaded."""

    name = KIND.name
    capabilities = KIND.capabilities
    console = ConsoleLines(step=ConsoleLine(fields=(ConsoleField("trained tokens", "trained_tokens", ",.0f"),)))

    def ledger_fields(self, batch, totals: dict[str, float], count: int) -> dict[str, Any]:
        return {"trained_tokens": count}
