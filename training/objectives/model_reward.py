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

``ModelReward.scores(sequences, shape=...)`` scores token-id sequences as the reward model was
trained to: each sequence its own document, the score read at its last token
(training/objectives/reward_model.py ``sequence_scores``). ``ReadPosition.sequence`` makes that
last token the read position every path shares: a rollout's prompt + completion is closed as the
chat template closes the conversation (a completion that stopped at its end-of-turn marker gets the
text the template writes after it, ChatML's ``\n``; one that stopped at EOS or ran out of tokens
gets the marker too), so the reward model reads the token it was trained at and a Hugging Face
classifier reads on ``apply_chat_template``'s ids. ``python -m training score`` scores preference
pairs through the same ``ModelReward.scores`` (training/cli/score.py). Every forward has one
shape, ``ScoreShape``: ``rows`` sequences (the last chunk filled up with dummy rows), each
right-padded to ``width`` tokens, both constants of the config (``score_shape``). A GEMM's result
for one row changes with the matrix's shape (docs/models.md, "Batch invariance"), never with the
other rows' values or the row's index; so at one shape a sequence's score depends on the weights
and the sequence only, not on which sequences share its forward: not on the world size, not on
how the rows are spread over the ranks. The score head runs over every position, so on the CPU a
score does not change with ``rows`` (micro_batch_size) either (``_chunk_scores``). Under ``fsdp`` the forward is collective: every rank has as
many sequences, so every rank calls it as many times, with the same number of rows.
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
from data.chat_template import ChatTemplate
from training.objectives.frozen import RUN_PREFIX, FrozenModel, build_frozen, frozen_tokenizer, run_checkpoint

ROLE = "reward"


class ReadPosition:
    """Token ids of a prompt + completion as the reward model reads them: the conversation as the chat
    template renders it, ending at the last token of the closed assistant turn (module docstring).

    ``end``: the end-of-turn marker's ids (none for a template without one); ``after``: the ids of
    what the template writes after an assistant turn's marker when the conversation ends there."""

    def __init__(self, tokenizer, template: ChatTemplate) -> None:
        self.tokenizer = tokenizer
        self.marker = template.end_of_turn
        self.end = [int(t) for t in tokenizer.encode_array(self.marker)] if self.marker else []
        self.after = [int(t) for t in tokenizer.encode_array(closing_text(template))] if self.marker else []
        self.eos = tokenizer.eos_id

    @property
    def closing(self) -> int:
        """The most tokens ``sequence`` adds to a prompt + completion."""
        return len(self.end) + len(self.after)

    def sequence(self, prompt_ids, tokens) -> list[int]:
        """``prompt_ids + tokens`` closed as the template closes the conversation."""
        tokens = [int(t) for t in tokens]
        if self.end and (tokens[-len(self.end):] == self.end or self._ends_at_marker(tokens)):
            closed = tokens  # stopped at its end-of-turn marker (a sampled one, or cut after it)
        else:  # stopped at EOS, or truncated: the template closes the turn with its marker
            closed = (tokens[:-1] if tokens and tokens[-1] == self.eos else tokens) + self.end
        return [int(t) for t in prompt_ids] + closed + self.after

    def _ends_at_marker(self, tokens: list[int]) -> bool:
        """A several-token marker the sampler's text cut stopped at (training/rollout/generator.py
        ``cut_at_marker``), whose ids may merge with the content's."""
        return len(self.end) > 1 and self.tokenizer.decode(tokens).endswith(self.marker)


def closing_text(template: ChatTemplate) -> str:
    """What ``template`` writes after the end-of-turn marker of an assistant turn that ends the
    conversation (ChatML's ``\n``), found by rendering one user and one assistant turn."""
    content = next(chr(c) for c in range(0xE000, 0xF900) if chr(c) not in template.source)  # private use
    text = template.render([{"role": "user", "content": "?"}, {"role": "assistant", "content": content}])
    at = text.rfind(content) + len(content)
    if at < len(content) or not text.startswith(template.end_of_turn, at):
        raise ConfigError(f"chat template ({template.origin}) does not end an assistant turn with "
                          f"{template.end_of_turn!r} right after its content: cannot tell where a reward model reads",
                          key="data.chat_template", file=template.origin)
    return text[at + len(template.end_of_turn):]


WIDTH_MULTIPLE = 128
"""A sequence is right-padded to ``data.seq_len`` rounded up to a multiple of this many tokens (the
flex kernel's block)."""


@dataclass(frozen=True)
class ScoreShape:
    """The shape of every reward-model forward: ``rows`` sequences of ``width`` tokens."""

    rows: int
    width: int


def score_shape(config: Config, *, group_size: int, closing: int = 0) -> ScoreShape:
    """A rank's chunk of ``micro_batch_size`` prompts' completions (``group_size`` each; a rank holds
    a multiple of micro_batch_size prompts, so its chunks are full), each padded to ``data.seq_len``
    plus ``closing`` (``ReadPosition.closing``) rounded up to WIDTH_MULTIPLE: a rollout's prompt +
    completion never exceeds ``data.seq_len``, and its closing adds at most ``closing`` tokens."""
    width = -(-(config.data.seq_len + closing) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    return ScoreShape(rows=config.train.micro_batch_size * group_size, width=width)


@dataclass
class ModelReward:
    """A frozen reward model: its trunk (a ``FrozenModel``) and its score head."""

    trunk: FrozenModel
    head: nn.Module
    identity: dict[str, str]
    """{"path": its source, "sha256": hash of the trunk's weights and the head's}."""

    def scores(self, sequences: list[list[int]], *, shape: ScoreShape, device: torch.device,
               pad_id: int) -> list[float]:
        """The fp32 score of each token-id sequence, in order (no gradients), in forwards of ``shape``."""
        longest = max((len(s) for s in sequences), default=0)
        if longest > shape.width:
            raise ValueError(f"a sequence of {longest} tokens does not fit the reward model's width of "
                             f"{shape.width} (data.seq_len rounded up to {WIDTH_MULTIPLE})")
        return [score for lo in range(0, len(sequences), shape.rows)
                for score in self._chunk_scores(sequences[lo:lo + shape.rows], shape, device, pad_id)]

    def _chunk_scores(self, sequences: list[list[int]], shape: ScoreShape, device: torch.device,
                      pad_id: int) -> list[float]:
        """The scores of up to ``shape.rows`` sequences, from one forward of ``shape``."""
        from training.objectives.reward_model import sequence_scores

        # Right-padded rows of one document each, no document mask: attention is causal, so no
        # token of a sequence sees the padding after it, and the score read at the sequence's last
        # token is the same as with the padding masked off, while the kernel stays plain causal
        # attention (a document mask makes SDPA build a (B, 1, T, T) mask and leave its fused kernels).
        # Rows past the sequences are dummies (one pad token each): the shape stays ``shape``.
        ids = torch.full((shape.rows, shape.width), pad_id, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        positions = torch.arange(shape.width).expand(shape.rows, shape.width)
        # The head scores every position, one (rows x width, hidden) GEMM, and each sequence's score
        # is read at its last token: the head over the last tokens alone, a GEMM of ``rows`` rows,
        # differs in the last bits between 1, 2, 3 or 5 rows and 8 on the CPU, the head over whole
        # rows of a multiple of 128 positions does not, so a score does not change with ``rows``
        # (train.micro_batch_size) either.
        every_row = torch.arange(shape.rows).repeat_interleave(shape.width)
        every_position = torch.arange(shape.width).repeat(shape.rows)
        with torch.no_grad(), self.trunk.context():
            out = sequence_scores(self.trunk.module, self.head, ids.to(device), positions.to(device),
                                  None, every_row.to(device), every_position.to(device))
        scores = out.float().cpu().view(shape.rows, shape.width)  # (rows * width,) -> (rows, width)
        return [scores[row, len(sequence) - 1].item() for row, sequence in enumerate(sequences)]


def build_model_rewards(config: Config, rewards: dict, *, dist: DistributedContext) -> list[tuple[float, ModelReward]]:
    """(weight, ModelReward) of each model reward, ``rewards`` being {config key of its path: settings}
    (training/rollout/reward_settings.py ``model_rewards``)."""
    return [(reward.weight, build_model_reward(config, reward.path, dist=dist, key=key))
            for key, reward in rewards.items()]


def reward_role(index: int) -> str:
    """The frozen role of the index-th model reward (``frozen_identity``): reward, reward1, ..."""
    return ROLE if index == 0 else f"{ROLE}{index}"


def weighted_scores(rewards: list[tuple[float, ModelReward]], sequences: list[list[int]], *, shape: ScoreShape,
                    device: torch.device, pad_id: int) -> np.ndarray:
    """Per sequence (a prompt + completion's ids), the weighted sum of the reward models' scores, in
    forwards of ``shape`` (every rank has as many sequences, so runs as many: a sharded reward
    model's forward is collective)."""
    total = np.zeros(len(sequences), dtype=np.float64)
    for weight, reward in rewards:
        total += weight * np.asarray(reward.scores(sequences, shape=shape, device=device, pad_id=pad_id),
                                     dtype=np.float64)
    return total


def rollout_scores(rewards: list[tuple[float, ModelReward]], read: ReadPosition, trajectories, *, config: Config,
                   group_size: int, device: torch.device, pad_id: int) -> np.ndarray:
    """Per trajectory (``prompt_ids``, ``tokens``: training/rollout/experience.py), the weighted sum of
    the reward models' scores of its prompt + completion closed at the read position (``read``), in
    forwards of ``score_shape``: what GRPO and PPO add to the environment's rewards."""
    return weighted_scores(rewards, [read.sequence(t.prompt_ids, t.tokens) for t in trajectories],
                           shape=score_shape(config, group_size=group_size, closing=read.closing),
                           device=device, pad_id=pad_id)


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
