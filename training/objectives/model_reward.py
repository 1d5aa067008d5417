"""A trained reward model as a reward: the score of a prompt + completion, without gradients.

``build_model_reward(config, source, ...)`` reads a reward model from ``run:RUN_ID[@STEP]`` (a
reward-model run's checkpoint: its policy trunk and its ``score`` part) or from a Hugging Face
sequence-classification directory (its export, training/objectives/reward_model_io.py). It is a
frozen model like a reference (training/objectives/frozen.py): built once, spread like the policy
(fully sharded under ``fsdp``, a replica otherwise; the score head, one row, a replica everywhere),
never saved, and recorded by identity, ``{"path": source, "sha256": ...}`` over the trunk's
weights and the head's, so a resume refuses a reward model changed on disk (``check_frozen``:
exit 4 naming both hashes).

Refused before any run dir (ConfigError, exit 2): a source that holds no score head, and a reward
model whose vocabulary or tokenizer differs from the policy's (both named), since it would read
the policy's token ids as other words.

``ModelReward.scores(sequences)`` scores token-id sequences (each a rendered prompt + completion)
as the reward model was trained to: each sequence its own document, the score read at its last
token (training/objectives/reward_model.py ``sequence_scores``). Under ``fsdp`` its forward is
collective: every rank calls it at the same points, with the same number of rows.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import nn

from core.config import Config
from core.distributed_context import DistributedContext
from core.exceptions import ConfigError
from training.objectives.frozen import RUN_PREFIX, FrozenModel, build_frozen, frozen_tokenizer, run_checkpoint

ROLE = "reward"


WIDTH_MULTIPLE = 128
"""A chunk of sequences is right-padded to a multiple of this many tokens (the flex kernel's block)."""


@dataclass
class ModelReward:
    """A frozen reward model: its trunk (a ``FrozenModel``) and its score head."""

    trunk: FrozenModel
    head: nn.Module
    identity: dict[str, str]
    """{"path": its source, "sha256": hash of the trunk's weights and the head's}."""

    def scores(self, sequences: list[list[int]], *, device: torch.device, pad_id: int) -> list[float]:
        """The fp32 score of each token-id sequence, in order (no gradients)."""
        from training.objectives.reward_model import sequence_scores

        if not sequences:
            return []
        # Right-padded rows of one document each, no document mask: attention is causal, so no
        # token of a sequence sees the padding after it, and the score read at the sequence's last
        # token is the same as with the padding masked off, while the kernel stays plain causal
        # attention (a document mask makes SDPA build a (B, 1, T, T) mask and leave its fused kernels).
        # The width is rounded up to a multiple of WIDTH_MULTIPLE: a compiled attention kernel (flex)
        # sees a few shapes, not one per chunk's longest sequence.
        width = -(-max(len(s) for s in sequences) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
        ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        positions = torch.arange(width).expand(len(sequences), width)
        last = torch.tensor([len(s) - 1 for s in sequences], dtype=torch.long)
        with torch.no_grad(), self.trunk.context():
            out = sequence_scores(self.trunk.module, self.head, ids.to(device), positions.to(device),
                                  None, torch.arange(len(sequences), device=device), last.to(device))
        return out.float().cpu().tolist()


def build_model_rewards(config: Config, rewards: dict, *, dist: DistributedContext) -> list[tuple[float, ModelReward]]:
    """(weight, ModelReward) of each model reward, ``rewards`` being {config key of its path: settings}
    (training/rollout/reward_settings.py ``model_rewards``)."""
    return [(reward.weight, build_model_reward(config, reward.path, dist=dist, key=key))
            for key, reward in rewards.items()]


def reward_role(index: int) -> str:
    """The frozen role of the index-th model reward (``frozen_identity``): reward, reward1, ..."""
    return ROLE if index == 0 else f"{ROLE}{index}"


def weighted_scores(rewards: list[tuple[float, ModelReward]], sequences: list[list[int]], *, rows: int,
                    device: torch.device, pad_id: int) -> np.ndarray:
    """Per sequence (a prompt + completion's ids), the weighted sum of the reward models' scores, in
    chunks of ``rows`` sequences (every rank runs as many chunks: a sharded reward model's forward
    is collective)."""
    total = np.zeros(len(sequences), dtype=np.float64)
    for weight, reward in rewards:
        scores = [s for lo in range(0, len(sequences), rows)
                  for s in reward.scores(sequences[lo:lo + rows], device=device, pad_id=pad_id)]
        total += weight * np.asarray(scores, dtype=np.float64)
    return total


def build_model_reward(config: Config, source: str, *, dist: DistributedContext, key: str) -> ModelReward:
    """The reward model ``source`` names (module docstring); ``key`` is the config key, for errors."""
    head_weight = _score_weight(config, source, key=key)
    check_vocabulary(config, source, key=key)
    trunk = build_frozen(config, source, role=ROLE, dist=dist, key=key)
    head = nn.Linear(head_weight.shape[1], 1, bias=False)
    with torch.no_grad():
        head.weight.copy_(head_weight)
    head.requires_grad_(False)
    head = head.to(dist.device).eval()
    digest = hashlib.sha256(trunk.identity["sha256"].encode())
    digest.update(head_weight.float().numpy().tobytes())
    return ModelReward(trunk, head, {"path": source, "sha256": digest.hexdigest()})


def check_vocabulary(config: Config, source: str, *, key: str) -> None:
    """A reward model must read the policy's token ids: the same vocabulary size and tokenizer."""
    from training.objectives.frozen import frozen_model_config

    theirs = frozen_model_config(config, source, key=key).vocab_size
    if theirs != config.model.vocab_size:
        raise ConfigError(f"{key}={source!r}: the reward model's vocabulary has {theirs} tokens, the policy's "
                          f"model.vocab_size {config.model.vocab_size}", key=key,
                          hint="train the reward model on the policy's tokenizer (the same data.tokenizer)")
    tokenizer = frozen_tokenizer(config, source, key=key)
    if tokenizer is not None:  # a run: the data.tokenizer it trained with
        same, described = tokenizer == config.data.tokenizer, tokenizer
    else:  # a Hugging Face directory: its own tokenizer.json, token by token
        file = Path(source) / "tokenizer.json"
        if not file.is_file():
            return  # nothing to compare beyond the vocabulary size
        same, described = _vocabulary(Tokenizer.from_file(str(file))) == _policy_vocabulary(config), str(file)
    if not same:
        raise ConfigError(f"{key}={source!r}: the reward model's tokenizer ({described}) differs from the policy's "
                          f"data.tokenizer ({config.data.tokenizer})", key=key,
                          hint="train the reward model with the policy's data.tokenizer")


def _policy_vocabulary(config: Config) -> dict[str, int]:
    from data.tokenizers import ByteTokenizer, build_tokenizer

    ours = build_tokenizer(config.data.tokenizer)
    if isinstance(ours, ByteTokenizer):
        return _vocabulary(Tokenizer.from_str(ours.hf_tokenizer_json()))
    return _vocabulary(Tokenizer.from_file(str(ours.path)))


def _vocabulary(tokenizer: Tokenizer) -> dict[str, int]:
    return tokenizer.get_vocab(with_added_tokens=True)


def _score_weight(config: Config, source: str, *, key: str) -> torch.Tensor:
    from training.objectives.reward_model_io import is_classifier, read_checkpoint_score, read_score_weight

    if source.startswith(RUN_PREFIX):
        weight = read_checkpoint_score(run_checkpoint(config, source, key=key))
        if weight is None:
            raise ConfigError(f"{key}={source!r}: that run's checkpoint holds no score head (it is not a reward model)",
                              key=key, hint="name a run of objective.kind=reward_model")
        return weight.float()
    if not (Path(source) / "config.json").is_file() or not is_classifier(source):
        raise ConfigError(f"{key}={source!r} is neither 'run:RUN_ID[@STEP]' nor a Hugging Face sequence-classification "
                          "directory", key=key, hint="export the reward model with `python -m training export`")
    from models.hf_config import model_config_from_hf

    return read_score_weight(source, model_config_from_hf(source, base=config.model).hidden_size)
