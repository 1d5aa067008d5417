"""``objective.kind=causal_lm`` (pretraining): no settings of its own, its capabilities.

Registered first by training/registry.py, so it is objective.kind's default.
"""

from __future__ import annotations

from core.objective_kinds import ObjectiveCapabilities, ObjectiveKind

CAPABILITIES = ObjectiveCapabilities(
    fused_head=True,  # next-token cross entropy, fused with the output projection chunk by chunk
    bounded_tokens=True,  # one row of data.seq_len tokens per sequence
    resumes_stateless_checkpoints=True,  # checkpoints from before objectives existed were pretraining
)

KIND = ObjectiveKind(name="causal_lm", summary="pretraining", objective="training.objectives.causal_lm:CausalLMObjective",
                     capabilities=CAPABILITIES)
