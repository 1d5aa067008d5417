"""Routing replay's one seam between the rollouts, the objectives and a mixture-of-experts family.

A family whose ``generation_spec()`` declares ``routing`` (its sparse layers, top_k) has the sampler
record every token's experts per sparse layer (models/generation/routing_record.py); each sample
carries them (``Sample.routing``), the rollout batch as the extra ``ROUTING`` (B, T, layers, top_k)
int16 (-1 where a token has none: padding, a completion's last token), in the batch hash. The
objectives hand it to the policy's training forwards with ``replayed(batch)``, which puts it where
the forward contract carries what a family reads besides tokens (``media``); the family routes the
recorded tokens to the recorded experts and reports the mismatch as a model metric. Nothing here
names a family.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ROUTING = "routing"
"""The rollout batch's extra and the forward's media key of the recorded routing."""


def replayed(batch: Any) -> Any:
    """``batch`` (a placed data ``Batch``) for a forward that replays its recorded routing: its extra
    ``ROUTING`` as the forward's media; ``batch`` itself where it carries none."""
    routing = batch.extras.get(ROUTING)
    if routing is None:
        return batch
    return dataclasses.replace(batch, media={**batch.media, ROUTING: routing})
