"""``sft``: supervised fine-tuning on chat or prompt/completion data.

The same next-token loss as ``causal_lm``, over the tokens the data marks as targets
(``data.loss_on``: assistant turns with their end-of-turn token, the completion, or all;
data/chat_template.py), normalized by the trained tokens of the *global* batch, so 1x4
and 4x1 accumulation and every world size give the same loss. The ledger adds
``trained_tokens``.
"""

from __future__ import annotations

from typing import Any

from core.config import Config
from core.exceptions import ConfigError
from experiments.console import ConsoleField, ConsoleLine, ConsoleLines
from training.objectives.causal_lm import CausalLMObjective


class SFTObjective(CausalLMObjective):
    name = "sft"
    console = ConsoleLines(step=ConsoleLine(fields=(ConsoleField("trained tokens", "trained_tokens", ",.0f"),)))

    def __init__(self, config: Config) -> None:
        if not any(s.record != "text" for s in config.data.sources) and config.data.loss_on != "all":
            raise ConfigError(
                "objective.kind=sft needs chat or prompt_completion sources (data.sources[i].record)",
                key="data.sources",
                hint="declare the record kind of the fine-tuning source, e.g. record: chat",
            )
        super().__init__(config)

    def ledger_fields(self, batch, totals: dict[str, float], count: int) -> dict[str, Any]:
        return {"trained_tokens": count}
