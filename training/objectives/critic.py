"""PPO's critic: a value head on its own Qwen trunk, trained beside the policy as the part ``critic``.

The trunk starts as a copy of the model ``objective.ppo.critic`` names (training/objectives/
frozen.py ``source_model``): ``init`` is the policy's own starting weights (``model.init_from``,
else the seeded initialization), or a Hugging Face directory, or ``run:RUN_ID[@STEP]``. The
value head ``Linear(hidden, 1)`` starts at zero, so the first values are 0 and the first
advantages are the rewards' GAE alone; except where the source is a reward model (a
``reward_model`` run, whose checkpoint holds a ``score`` part, or its Hugging Face
sequence-classification export): then the value head's weight is the reward model's score head and
its bias 0, so before any update the critic's value at a sequence's last token is the reward
model's score of that sequence (the trunk and the head are both the reward model's).

``values[b, t]`` is the value of the state that chooses token ``t + 1``, read from the trunk's
final normed hidden state at position ``t``: aligned with the labels (``labels[b, t]`` is that
token), as the policy's log-probs are. The trunk's output projection is never used: where it is
not tied to the embedding it is frozen, so neither the optimizer nor the data-parallel gradient
sync waits for a gradient it never gets.
"""

from __future__ import annotations

import torch
from torch import nn

from core.config import Config
from distributed.model_structure import plan_of
from models.forward import model_forward
from training.objectives.frozen import RUN_PREFIX, run_checkpoint, source_model
from training.objectives.reward_model_io import is_classifier, read_checkpoint_score, read_score_weight


class Critic(nn.Module):
    """(input_ids, position_ids, document_ids) (B, T) -> values (B, T), fp32."""

    def __init__(self, trunk: nn.Module, head_weight: torch.Tensor | None = None) -> None:
        super().__init__()
        self.trunk = trunk
        self.value_head = nn.Linear(trunk.config.hidden_size, 1)
        with torch.no_grad():
            if head_weight is None:
                self.value_head.weight.zero_()
            else:  # a reward model's score head (1, hidden)
                self.value_head.weight.copy_(head_weight)
            self.value_head.bias.zero_()
        plan = plan_of(trunk)
        output = trunk.get_submodule(plan.output)
        if output.weight is not trunk.get_submodule(plan.embedding).weight:
            output.weight.requires_grad_(False)

    def forward(self, batch) -> torch.Tensor:
        """(B, T) fp32 values of a placed batch (its ids, positions and documents)."""
        head = self.value_head
        # The trunk's one forward, its output projection replaced by the value head.
        values = model_forward(self.trunk, batch,
                               head=lambda hidden, _weight: head(hidden.to(head.weight.dtype))).head  # (B, T, 1)
        return values[..., 0].float()


def build_critic(config: Config) -> Critic:
    """The critic ``objective.ppo.critic`` names, on the host (the loop places and wraps it)."""
    source, key = config.objective.ppo.critic, "objective.ppo.critic"
    trunk = source_model(config, source, key=key)
    for param in trunk.parameters():
        param.requires_grad_(True)
    return Critic(trunk, reward_model_head(config, source, hidden_size=trunk.config.hidden_size, key=key))


def reward_model_head(config: Config, source: str, *, hidden_size: int, key: str) -> torch.Tensor | None:
    """The score head's weight (1, hidden_size) fp32 where ``source`` is a reward model, else None."""
    if source.startswith(RUN_PREFIX):
        weight = read_checkpoint_score(run_checkpoint(config, source, key=key))
        return None if weight is None else weight.float()
    if source != "init" and is_classifier(source):
        return read_score_weight(source, hidden_size)
    return None
