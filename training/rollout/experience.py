"""The experience a rollout returns: an explicit value, built once per step and then only read.

``Experience`` holds one ``Trajectory`` per completion, prompt-major (the ``group_size``
completions of a prompt are consecutive), with what the policy loss and the ledger need: the
prompt and completion tokens, the sampler's log-probs, the environment's reward, the shaping
added to it, the advantages computed from the shaped rewards (training/rollout/advantages.py),
the rollout's own counts (dynamic-sampling rounds, groups replaced) and its timings.

``Experience.batch`` lays it out for the loop: one row per completion (prompt + completion,
padded to ``data.seq_len``; labels on the completion only), global row
``prompt row * group_size + sample index``, with per-row extras ``advantages`` (B,) float32 and
``old_logps`` (B, T) float32 (the sampler's log-probs, aligned with the labels) and, where the sampler
recorded each token's experts (routing replay), ``routing`` (B, T, layers, top_k) int16. The objective
attaches the experience itself to that batch (``Batch.prepared``), so the step's ledger fields
read it from the batch they are given (``summary`` is what each rank contributes to them, and
``rollout_fields`` turns every rank's summaries into the step's rollout statistics).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from data.batch import IGNORE_INDEX, Batch
from models.routing_replay import ROUTING

if TYPE_CHECKING:
    from training.rollout.episodes import EpisodeResult


@dataclass(frozen=True)
class Trajectory:
    """One completion of one prompt."""

    row: int
    """Global row of the completion: prompt row * group_size + sample index."""
    prompt_ids: list[int]
    tokens: list[int]
    """The completion's tokens (cut after a several-token end-of-turn marker)."""
    logprobs: list[float]
    """The sampler's log-probs of ``tokens``."""
    truncated: bool
    """It ran into max_new_tokens or data.seq_len with no stop."""
    reward: float
    """The environment's reward (the reward functions' weighted sum)."""
    penalty: float = 0.0
    """Shaping added to the reward before the advantages (DAPO's overlong penalty; 0 when off)."""
    reward_errors: int = 0
    mask: tuple[int, ...] = ()
    """Per token of ``tokens``: 1 sampled, 0 an observation (an episode's tool output); empty: all sampled."""
    episode: Optional[EpisodeResult] = None
    """The episode's turns, when an environment played several (training/rollout/episodes.py)."""
    routing: Optional[torch.Tensor] = None
    """(prompt + completion tokens or more, layers, top_k) int16: the sampler's recorded experts of each token
    (routing replay, models/routing_replay.py); None where the model records none."""

    @property
    def sampled(self) -> int:
        """Sampled tokens (what the length statistics and penalties count)."""
        return sum(self.mask) if self.mask else len(self.tokens)

    @property
    def digest(self) -> str:
        """sha256 of the completion's token ids (int64, little-endian)."""
        return hashlib.sha256(np.asarray(self.tokens, dtype="<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class Experience:
    trajectories: tuple[Trajectory, ...]
    group_size: int
    advantages: np.ndarray | None = None
    """(len(trajectories),) float64, once computed (``with_advantages``)."""
    resample_rounds: int = 0
    """Dynamic-sampling rounds run (the same on every rank)."""
    resampled_groups: int = 0
    """Groups of this rank replaced by a later round."""
    timings: dict[str, float] = field(default_factory=dict)
    """Seconds of the rollouts (``rollout_s``) and the reference pass (``reference_s``), and the
    tokens generated (``rollout_tokens``): benchmarks read them; not in the ledger (times vary)."""

    def rewards(self) -> np.ndarray:
        return np.array([t.reward for t in self.trajectories], dtype=np.float64)

    def penalties(self) -> np.ndarray:
        return np.array([t.penalty for t in self.trajectories], dtype=np.float64)

    def shaped_rewards(self) -> np.ndarray:
        """(prompts, group_size) float64: reward + shaping, what the advantages see."""
        return (self.rewards() + self.penalties()).reshape(-1, self.group_size)

    def with_added_rewards(self, added: np.ndarray) -> "Experience":
        """Each trajectory's reward plus ``added`` (one value per trajectory, in order): a reward
        scored after the rollout, for the whole batch at once (a reward model's)."""
        values = np.asarray(added, dtype=np.float64).reshape(-1)
        if values.shape[0] != len(self.trajectories):
            raise ValueError(f"{values.shape[0]} added rewards for {len(self.trajectories)} trajectories")
        return dataclasses.replace(self, trajectories=tuple(
            dataclasses.replace(t, reward=t.reward + float(v)) for t, v in zip(self.trajectories, values)))

    def with_advantages(self, advantages: np.ndarray) -> "Experience":
        return dataclasses.replace(self, advantages=np.asarray(advantages, dtype=np.float64).reshape(-1))

    def with_timings(self, **timings: float) -> "Experience":
        return dataclasses.replace(self, timings={**self.timings, **timings})

    def batch(self, prompts: Batch, *, seq_len: int, pad_id: int, mask_truncated: bool) -> Batch:
        """One row per completion (module docstring); a truncated completion has no labels under
        ``mask_truncated`` (it carries no loss and counts in no normalizer)."""
        if self.advantages is None:
            raise ValueError("Experience.batch needs the advantages: call with_advantages first")
        n, width = len(self.trajectories), seq_len
        input_ids = torch.full((n, width), pad_id, dtype=torch.int64)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.int64)
        document_ids = torch.ones((n, width), dtype=torch.int64)
        old_logps = torch.zeros((n, width), dtype=torch.float32)
        for i, t in enumerate(self.trajectories):
            p, c = len(t.prompt_ids), len(t.tokens)
            input_ids[i, :p + c] = torch.tensor(t.prompt_ids + t.tokens)
            document_ids[i, :p + c] = 0
            tokens, logprobs = torch.tensor(t.tokens), torch.tensor(t.logprobs, dtype=torch.float32)
            if t.mask:  # an episode: only sampled tokens carry labels (and old log-probs)
                sampled = torch.tensor(t.mask, dtype=torch.bool)
                tokens, logprobs = tokens.masked_fill(~sampled, IGNORE_INDEX), logprobs.masked_fill(~sampled, 0.0)
            if not (t.truncated and mask_truncated):
                labels[i, p - 1:p + c - 1] = tokens
            old_logps[i, p - 1:p + c - 1] = logprobs
        G = self.group_size
        extras = {"advantages": torch.tensor(self.advantages, dtype=torch.float32), "old_logps": old_logps}
        if any(t.routing is not None for t in self.trajectories):  # routing replay: (B, T, layers, top_k)
            extras[ROUTING] = recorded_routing(self.trajectories, width)
        return Batch(
            step=prompts.step, input_ids=input_ids, labels=labels,
            position_ids=torch.arange(width).expand(n, width).clone(), document_ids=document_ids,
            sequence_index=[t.row for t in self.trajectories],
            provenance=[prompts.provenance[i // G] for i in range(n)],
            media={name: [rows[i // G] for i in range(n)] for name, rows in prompts.media.items()},
            state=prompts.state,
            extras=extras,
        )

    def summary(self) -> dict[str, Any]:
        """This rank's share of the step's rollout statistics, small and picklable: per completion
        (global row, token digest, reward, length, penalty, shaped reward, truncated), and the counts."""
        shaped = self.rewards() + self.penalties()
        summary = {
            "rows": [(t.row, t.digest, t.reward, t.sampled, t.penalty, s, t.truncated)
                     for t, s in zip(self.trajectories, shaped.tolist())],
            "failures": sum(t.reward_errors for t in self.trajectories),
            "rounds": self.resample_rounds,
            "resampled": self.resampled_groups,
        }
        if any(t.episode is not None for t in self.trajectories):  # (global row, digest, record) per episode
            summary["episodes"] = [(t.row, t.episode.digest, t.episode.record()) for t in self.trajectories]
        return summary


def recorded_routing(trajectories: tuple[Trajectory, ...], width: int) -> torch.Tensor:
    """(B, width, layers, top_k) int16: each row's recorded experts over its prompt + completion, -1 beyond."""
    shape = next(t.routing.shape[1:] for t in trajectories if t.routing is not None)
    routing = torch.full((len(trajectories), width, *shape), -1, dtype=torch.int16)
    for i, t in enumerate(trajectories):
        if t.routing is not None:
            length = min(len(t.prompt_ids) + len(t.tokens), width)
            routing[i, :length] = t.routing[:length]
    return routing


def rollout_fields(parts: list[dict[str, Any]], *, group_size: int, shaping: bool, masking: bool,
                   resampling: bool, episodes: bool = False) -> dict[str, Any]:
    """The step's rollout statistics from every rank's ``Experience.summary()``, keyed by global row
    (tensor-parallel peers hold the same rows: they count once), so they do not depend on the
    world size: ``rollout_hash`` (sha256 over the per-completion sha256 of the generated token ids,
    in global row order), ``reward_mean``, ``reward_std`` (population; both of the environment's
    rewards), ``reward_zero_var_groups`` (fraction of groups whose shaped rewards are all equal),
    ``completion_len_mean``, ``reward_errors``; with ``shaping`` ``overlong_penalty_mean``, with
    ``masking`` ``truncated_masked`` (fraction of completions truncated), with ``resampling``
    ``resample_rounds`` and ``resampled_groups``; with ``episodes`` (an environment is configured)
    ``episodes_fields``'s. ``completion_len_mean`` counts sampled tokens only."""
    rows = sorted({row[0]: row for part in parts for row in part["rows"]}.values())
    copies = _copies(parts)
    digest = hashlib.sha256(b"".join(bytes.fromhex(row[1]) for row in rows)).hexdigest()
    rewards = np.array([row[2] for row in rows], dtype=np.float64)
    groups = np.array([row[5] for row in rows], dtype=np.float64).reshape(-1, group_size)
    fields = {
        "rollout_hash": digest,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()),
        "reward_zero_var_groups": float((groups.max(axis=1) == groups.min(axis=1)).mean()),
        "completion_len_mean": float(np.mean([row[3] for row in rows])),
        "reward_errors": int(sum(part["failures"] for part in parts)) // copies,
    }
    if shaping:
        fields["overlong_penalty_mean"] = float(np.mean([row[4] for row in rows]))
    if masking:
        fields["truncated_masked"] = float(np.mean([row[6] for row in rows]))
    if resampling:
        fields["resample_rounds"] = max(part["rounds"] for part in parts)
        fields["resampled_groups"] = sum(part["resampled"] for part in parts) // copies
    if episodes:
        fields.update(episodes_fields(episode_records(parts)))
    return fields


def episode_records(parts: list[dict[str, Any]]) -> dict[int, tuple[str, dict[str, Any]]]:
    """{global row: (episode digest, record)} from every rank's summary (peers' copies count once)."""
    unique = {row: (digest, record) for part in parts for row, digest, record in part.get("episodes", ())}
    return dict(sorted(unique.items()))


def episodes_fields(episodes: dict[int, tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The ledger's episode fields: ``episodes_hash`` (sha256 over the episodes' digests in global
    row order: every turn's sampled ids, observation ids and mask), ``turns_mean`` (sampled turns
    per episode), ``tool_calls`` (calls written, malformed ones included), ``malformed_calls`` and
    ``env_errors`` (episodes ended with reward 0 under on_env_error=zero)."""
    records = [record for _, record in episodes.values()]
    return {
        "episodes_hash": hashlib.sha256(b"".join(bytes.fromhex(d) for d, _ in episodes.values())).hexdigest(),
        "turns_mean": float(np.mean([len(r["turns"]) for r in records])),
        "tool_calls": sum(len(turn["calls"]) for r in records for turn in r["turns"]),
        "malformed_calls": sum(turn["malformed"] for r in records for turn in r["turns"]),
        "env_errors": sum(r["env_errors"] for r in records),
    }


def _copies(parts: list[dict[str, Any]]) -> int:
    """How many ranks hold each row (tensor-parallel peers repeat them)."""
    total = sum(len(part["rows"]) for part in parts)
    unique = len({row[0] for part in parts for row in part["rows"]})
    return max(1, total // max(1, unique))
