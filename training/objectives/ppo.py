"""``ppo``: proximal policy optimization with a critic, on prompts with checkable answers.

The actor is the policy; the critic (critic.py) is a second trained part (``critic``: a value
head on its own trunk, its own learning rate ``critic_lr``); a frozen reference (frozen.py)
gives the KL penalty; the rewards are GRPO's (``objective.ppo.rewards``,
training/rollout/reward_settings.py): rule functions and trained reward models (``{name: model,
path}``, model_reward.py: scored without gradients, recorded by path and sha256 like the reference). Every formula is in ppo_loss.py. Per step (one loop step = one
rollout batch):

1. ``prepare`` (no gradients) rolls out this rank's prompt rows (training/rollout/group.py):
   ``group_size`` completions of each (1 by default: one episode per prompt, the critic is the
   baseline), keys ``(train.seed, "ppo", step, global prompt row, sample index)``, each scored by
   the reward environment plus the weighted scores of the reward models of its prompt + completion. On the experience laid out as a batch (one row per completion, global
   row ``prompt row * group_size + sample``) it computes once, with the weights that sampled:
   the policy's log-probs (``old_logps``) and the critic's values (``old_values``), under the
   autocast the updates' forwards run under (so the first update's ratio is exactly 1 in bf16 as
   in fp32), and, with a KL term, the reference's log-probs; then per-token rewards ``token_rewards(kl_estimate(old_logps,
   ref_logps, kl_estimator), score, mask, kl_coef)``, GAE (``gamma``, ``lam``) over the response
   tokens, advantages whitened over the whole rollout batch's response tokens
   (``whiten_advantages``; every rank's rows gathered in global row order, so the result does not
   depend on the world size) and returns = GAE advantages + values (before whitening). They
   travel as extras ``old_logps``, ``old_values``, ``advantages``, ``returns`` (B, T); the
   rollout statistics as ``Batch.prepared`` (a ``PPORollout``).
2. ``update_batch`` (a ``MinibatchObjective``): the loop makes ``ppo_epochs x minibatches``
   updates per step; update ``u`` is minibatch ``m = u % minibatches`` of epoch
   ``e = u // minibatches``: global rows ``order[m * n : (m + 1) * n]`` of
   ``order = minibatch_order(train.seed, step, e, rows)``, ``n = rows / minibatches``. The order
   depends on neither the world size nor a resume; each rank trains its share of those rows,
   padded with label-less rows to the largest share of any rank, so every rank runs the same
   number of forwards (the sharded strategies' collectives).
3. ``loss``: per response token the clipped policy loss (``clip_low``, ``clip_high``,
   ``dual_clip``) plus ``vf_coef`` times the clipped value loss (``value_clip``), summed; the loop
   divides by the minibatch's global count of response tokens.
4. ``ledger_fields``: the rollout statistics (``rollout_hash``, ``reward_mean``, ``reward_std``,
   ``completion_len_mean``, ``reward_errors``, training/rollout/experience.py), ``score_min``,
   ``score_max``, ``kl`` (mean over completions of the summed per-token KL estimate),
   ``kl_coef`` (the coefficient this step's rewards used), ``explained_variance`` of the old
   values against the returns (None where the returns do not vary), and the first update's
   per-token means: ``policy_loss``, ``value_loss``, ``clip_fraction``, ``value_clip_fraction``,
   ``approx_kl`` (and ``dual_clip_fraction`` with a dual clip). With ``kl_target > 0`` the
   adaptive coefficient (``AdaptiveKL``) is then moved by this step's ``kl``: its value is the
   objective's checkpointed state, so a resumed run continues with it.

**Batch-invariant numerics.** Under ``determinism.batch_invariant`` the sampler's log-probs are the
trainer's bit for bit, so they are the old log-probs: ``prepare`` runs no policy forward. The first
update checks it on its rows (training/objectives/logprob_parity.py): a sampled token whose trainer
log-prob differs is a determinism violation (exit 5), and the ledger's ``logprob_parity`` is 0.0 (the
first update's maximum; the later updates train moved weights and report 0). Outside that mode the
ledger's ``logprob_parity`` is the gap the stock kernels leave, max |sampler log-prob - old log-prob|
over the step's sampled tokens (both of the weights that sampled: no extra forward).

**Rollout correction.** With ``objective.ppo.rollout_correction`` (off by default) the sampler's
log-probs ride beside the old ones (the trainer's forward above) as ``rollout_logps``; the policy
loss of each token is weighed by TIS's truncated ratio and MIS's keep of its completion (the
value loss is not), and the ledger adds the mismatch statistics
(training/objectives/rollout_correction.py has the formulas).

**Episodes.** With ``objective.ppo.environment`` (GRPO's settings) each completion is an episode
of several turns, played as GRPO's are (training/rollout/agent.py builds the environment, the
runner and the step records for both; docs/post_training.md "Agentic rollouts"): turn ``t > 0``
keyed ``(train.seed, "ppo.turn<t>", step, prompt row, sample)``, the observation ids appended
between turns. A row's labels are its sampled ids only, so the old log-probs, the values, the KL
estimate, the score (at the last sampled token), the losses and their count all sit on sampled
tokens; GAE passes over the observations (ppo_loss.gae: a token off the mask is transparent), so
an episode's advantages are those of its sampled tokens laid end to end. The ledger adds GRPO's
``episodes_hash``, ``turns_mean``, ``tool_calls``, ``malformed_calls`` and ``env_errors``; rank 0
writes the step's episodes in ``ledger_fields``, a replay appends the recorded observations
without calling the environment, and evaluation plays the episodes greedily.

Nothing travels between these calls on the objective: what ``loss`` and ``ledger_fields`` need
is in the batch they are given; the one state is the KL coefficient. Checkpoints fall between
steps, never between the updates of one, so a SIGKILL in the middle of the epochs replays the
whole step on resume: the same prompts (data state), rollouts (keys), old values (weights) and
minibatch order (keys).

**Evaluation**: as GRPO's greedy evaluation (docs/post_training.md): each held-out prompt decoded
once at temperature 0, ``loss`` minus its configured reward, metrics ``reward_mean`` and
``accuracy`` (exact answer).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch
from torch import nn

from core.config import Config
from core.exceptions import ConfigError
from data.batch import IGNORE_INDEX, Batch
from data.chat_template import ChatTemplate
from data.tokenizers import build_tokenizer
from distributed.params import unwrap
from experiments.console import ConsoleField, ConsoleLine, ConsoleLines
from models.generation.sampler import SamplingParams
from models.routing_replay import replayed
from training.objectives.base import (OBJECTIVE_STATE_VERSION, LossOutput, ObjectiveContext, PartSpec, check_state,
                                      metric)
from training.objectives.critic import Critic, build_critic
from training.objectives.logprob_parity import CHECKED, PARITY, ParityCheck, checked_extras, first_update_only, logprob_parity
from training.objectives.ppo_loss import (AdaptiveKL, PolicyClip, explained_variance, gae, kl_estimate,
                                          masked_mean_var, minibatch_order, policy_loss, token_rewards, value_loss)
from training.objectives.model_reward import ReadPosition, build_model_rewards, reward_role, rollout_scores
from training.objectives.ppo_settings import KIND, model_rewards, resolve_rewards
from training.objectives.rollout_correction import (correction_extras, correction_fields, mismatch_sums,
                                                    policy_weights)
from training.objectives.token_logps import autocast_dtype, label_logps
from training.rollout.agent import AgentRollouts, episode_console_fields
from training.rollout.environment import batch_tasks
from training.rollout.episodes import EpisodeRunner
from training.rollout.experience import Experience, rollout_fields
from training.rollout.generator import Decoder, Generator
from training.rollout.group import GroupRollout, rollout_progress
from training.rollout.evaluation import answer_strips_thinking, evaluation_scores, evaluation_sums, held_out_indices

PURPOSE = "ppo"
SECTION = "objective.ppo"  # the settings' config section (errors name its keys)
EVAL_PURPOSE = "ppo-eval"
CRITIC = "critic"  # the trained part's name: checkpoint keys parts.critic.*, ledger grad_norm_critic
WHITEN_EPS = 1e-8
TOKEN_METRICS = ("policy_loss", "value_loss", "clip_fraction", "value_clip_fraction", "approx_kl")


@dataclass(frozen=True)
class PPORollout:
    """One step's rollouts as the ledger reads them (``Batch.prepared``)."""

    experience: Experience
    kl_coef: float
    """The KL coefficient this batch's rewards used."""
    rows: tuple[tuple[int, float, list[float], list[float]], ...]
    """This rank's completions: (global row, summed KL estimate, old values, returns on its response tokens)."""
    layout: tuple[tuple[int, ...], ...]
    """Every rank's global rows (the minibatch shares are padded to the largest)."""
    parity: float | None = None
    """Outside ``determinism.batch_invariant``: max |sampler log-prob - old log-prob| over this rank's
    sampled tokens (both of the weights that sampled; the ledger's ``logprob_parity``). None in that mode,
    where the first update checks the trainer's against the sampler's instead."""

    def summary(self) -> dict[str, Any]:
        return {"experience": self.experience.summary(), "rows": list(self.rows), "parity": self.parity}


class _PhaseClock:
    """Seconds between laps, by name (host time: each phase ends in a copy to the host)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, name: str | None = None) -> None:
        now = time.perf_counter()
        if name is not None:
            self.laps[name] = now - self._last
        self._last = now


class PPOObjective:
    name = KIND.name
    capabilities = KIND.capabilities
    settles_late = False  # a step's KL coefficient update must precede the next step's rollouts

    def __init__(self, config: Config) -> None:
        p = config.objective.ppo
        self.config, self.p = config, p
        self.updates_per_batch = p.ppo_epochs * p.minibatches
        self.correction = p.rollout_correction  # None: no importance weights between sampler and trainer
        # determinism.batch_invariant: the sampler's log-probs are the trainer's bit for bit, so they are the
        # old log-probs (no policy forward in prepare) and the first update checks them (logprob_parity.py).
        self.exact = config.determinism.batch_invariant
        self.parity = ParityCheck()  # the first update's exact comparison, read when the step settles
        self.rewards = self.check_config(config)
        self.tokenizer = build_tokenizer(config.data.tokenizer)
        self.template = template = ChatTemplate.for_tokenizer(config.data.tokenizer, config.data.chat_template,
                                                              clock=config.data.template_clock,
                                                              thinking=config.data.template_thinking)
        self.decoder = Decoder(self.tokenizer, template)
        self.agent = AgentRollouts(p.environment, rewards=self.rewards, on_reward_error=p.on_reward_error,
                                   section=SECTION, tokenizer=self.tokenizer, template=template)
        self.environment = self.agent.environment
        stop = self.decoder.stop_ids
        self.params = SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                                     max_new_tokens=p.max_new_tokens, stop_token_ids=stop)
        self.eval_params = SamplingParams(temperature=0.0, max_new_tokens=p.max_new_tokens, stop_token_ids=stop)
        self.clip = PolicyClip(low=p.clip_low, high=p.clip_high, dual=p.dual_clip)
        self.kl = AdaptiveKL(coef=p.kl_coef, target=p.kl_target, horizon=p.kl_horizon)
        self.console = self._console_lines(p)
        self.reference = None
        self.model_rewards: list = []  # (weight, ModelReward) of each model reward, built in setup
        self.generator: Generator | None = None
        self.episodes: EpisodeRunner | None = None
        self.rollout: GroupRollout | None = None
        self._context: ObjectiveContext | None = None
        self._model: nn.Module | None = None
        self._critic: Critic | None = None
        self.fuse_head = False

    @staticmethod
    def _console_lines(p) -> ConsoleLines:
        """Steps: the loss per response token, the rollouts' mean reward, the KL, the value loss,
        the explained variance and the clipped fraction and, with an environment, the tool calls and
        malformed calls of the step's episodes. Evaluations: per held-out prompt, the greedy reward
        and accuracy."""
        step = (ConsoleField("reward", "reward_mean"), ConsoleField("kl", "kl"),
                ConsoleField("value loss", "value_loss"), ConsoleField("clip", "clip_fraction"),
                ConsoleField("len", "completion_len_mean", ".1f"), *episode_console_fields(p.environment))
        held_out = (ConsoleField("reward", metric("reward_mean")), ConsoleField("accuracy", metric("accuracy")))
        return ConsoleLines(step=ConsoleLine(unit="token", fields=step),
                            eval=ConsoleLine(unit="prompt", loss=None, fields=held_out))

    @staticmethod
    def uses_reference(config: Config) -> bool:
        p = config.objective.ppo
        return p.kl_coef > 0 or p.kl_target > 0

    @staticmethod
    def frozen_sources(config: Config) -> dict[str, str]:
        """{config key: source} of the frozen models setup builds (the reference, with a KL term, and
        each model reward's reward model)."""
        p = config.objective.ppo
        sources = {"objective.ppo.reference": p.reference} if PPOObjective.uses_reference(config) else {}
        return {**sources, **{key: reward.path for key, reward in model_rewards(config).items()}}

    @staticmethod
    def part_sources(config: Config) -> dict[str, str]:
        """{config key: source} of the models it trains beside the policy (the critic's trunk), for the
        memory estimate (training/memory_estimate.py)."""
        return {"objective.ppo.critic": config.objective.ppo.critic}

    @staticmethod
    def check_config(config: Config) -> list:
        """The configured rule rewards, resolved, each model reward's vocabulary and tokenizer checked
        against the policy's (model_reward.check_vocabulary), and the critic's source checked (a path
        or run that does not exist, or another vocabulary, is a ConfigError: exit 2 before any run dir)."""
        from training.objectives.frozen import frozen_model_config
        from training.objectives.model_reward import check_vocabulary

        for key, reward in model_rewards(config).items():
            check_vocabulary(config, reward.path, key=key)
        rewards = resolve_rewards(config)
        AgentRollouts.check(config.objective.ppo.environment, rewards=rewards, section=SECTION)
        critic = frozen_model_config(config, config.objective.ppo.critic, key="objective.ppo.critic")
        if critic.vocab_size != config.model.vocab_size:
            raise ConfigError(f"objective.ppo.critic={config.objective.ppo.critic!r} has vocabulary size "
                              f"{critic.vocab_size}, the policy (model.vocab_size) {config.model.vocab_size}",
                              key="objective.ppo.critic", hint="start the critic from a model of the policy's tokenizer")
        return rewards

    # ------------------------------------------------------------------ seam

    def setup(self, model: nn.Module, context: ObjectiveContext) -> None:
        from training.objectives.frozen import build_frozen

        config, p = self.config, self.p
        self._context, self._model = context, model
        self.fuse_head = context.fuse_head and config.train.loss_chunk_tokens > 0
        # A constant of the config, not of the world size: rollouts do not depend on how rows are spread.
        self.generator = Generator(rows=p.group_size * config.train.global_batch_size // config.data.num_streams,
                                   max_len=config.data.seq_len, seed=config.train.seed)
        self.episodes = self.agent.runner(self.generator, self.decoder, context=config.data.seq_len)
        self.rollout = GroupRollout(generator=self.generator, decoder=self.decoder, environment=self.environment,
                                    params=self.params, group_size=p.group_size, overlong_buffer=0,
                                    resample_rounds=0, purpose=PURPOSE, any_rank=lambda flag: flag,
                                    episodes=self.episodes)
        if self.uses_reference(config):
            self.reference = build_frozen(config, p.reference, role="reference", dist=context.dist,
                                          key="objective.ppo.reference")
        self.model_rewards = build_model_rewards(config, model_rewards(config), dist=context.dist)
        # Where the reward models read a rollout (its closing ids), found from the template once.
        self.read_position = ReadPosition(self.tokenizer, self.template) if self.model_rewards else None

    def extra_parts(self, context: ObjectiveContext) -> dict[str, PartSpec]:
        """The critic, with its own learning rate (train.* otherwise)."""
        self._critic = build_critic(self.config)  # the loop places it in place and wraps it
        return {CRITIC: PartSpec(module=self._critic, train=dataclasses.replace(self.config.train,
                                                                                lr=self.p.critic_lr))}

    def prepare(self, batch: Batch) -> Batch:
        if batch.evaluation:
            return self._evaluation_batch(batch)
        p = self.p
        tasks = batch_tasks(batch, self.tokenizer)
        with rollout_progress(batch.step, len(tasks), p.group_size, episodes=self.episodes is not None,
                              enabled=self._context.dist.rank == 0) as progress:
            experience = self.rollout.collect(self._model, tasks, batch.step, progress=progress,
                                              **self.agent.recorded(self._context.run_dir, batch.step, p.group_size,
                                                                    replay=not self._context.records))
        clock = _PhaseClock()  # seconds per phase, as the experience's timings (benchmarks/ppo_step.py)
        if self.model_rewards:
            experience = experience.with_added_rewards(rollout_scores(
                self.model_rewards, self.read_position, experience.trajectories,
                config=self.config, group_size=p.group_size, device=self._context.parallel.device,
                pad_id=getattr(self.tokenizer, "pad_id", self.tokenizer.eos_id)))
            clock.lap("reward_model_s")
        # The rollout room's sequence advantages are GRPO's; PPO's are per token, below.
        experience = experience.with_advantages(np.zeros(len(experience.trajectories)))
        out = experience.batch(batch, seq_len=self.config.data.seq_len, mask_truncated=False,
                               pad_id=getattr(self.tokenizer, "pad_id", self.tokenizer.eos_id))
        mask = out.labels != IGNORE_INDEX
        sampled = out.extras["old_logps"]  # the sampler's log-probs (rollout correction's pi_rollout)
        clock.lap()
        with self._update_autocast():  # the first update's arithmetic: its ratio is exactly 1
            if self.exact:  # the trainer's forward would give these bits: the first update checks that it does
                old_logps = sampled
            else:
                old_logps = self._each_micro(out, lambda placed: self._token_logps(self._model, replayed(placed)))
                clock.lap("policy_logps_s")
            old_values = self._each_micro(out, self._values) * mask
            clock.lap("critic_values_s")
        if self.reference is not None:
            ref_logps = self._each_micro(out, self._reference_logps)
            clock.lap("reference_s")
            kl = kl_estimate(old_logps, ref_logps, p.kl_estimator) * mask
        else:
            kl = torch.zeros_like(old_logps)
        scores = torch.tensor(experience.shaped_rewards().reshape(-1), dtype=torch.float32)
        rewards = token_rewards(kl, scores, mask, self.kl.coef)
        advantages, returns = gae(rewards, old_values, mask, gamma=p.gamma, lam=p.lam)
        gathered = self._context.dist.all_gather_object(
            {row: advantages[r][mask[r]].tolist() for r, row in enumerate(out.sequence_index)})
        if p.whiten_advantages:
            advantages = self._whiten(gathered, advantages, mask)
        rows = tuple((row, float(kl[r].sum()), old_values[r][mask[r]].tolist(), returns[r][mask[r]].tolist())
                     for r, row in enumerate(out.sequence_index))
        clock.lap("advantages_s")
        parity = None if self.exact else float(logprob_parity(old_logps, sampled, mask)) if bool(mask.any()) else 0.0
        prepared = PPORollout(experience=experience.with_timings(**clock.laps), kl_coef=self.kl.coef, rows=rows,
                              layout=tuple(tuple(sorted(part)) for part in gathered), parity=parity)
        out = out.with_extras(old_logps=old_logps, old_values=old_values, advantages=advantages, returns=returns,
                              **checked_extras(sampled, exact=self.exact))
        if self.correction is not None:
            out = out.with_extras(**correction_extras(old_logps, sampled, mask, self.correction))
        return dataclasses.replace(out, prepared=prepared)

    def update_batch(self, batch: Batch, update: int) -> Batch:
        """This rank's share of minibatch ``update % minibatches`` of epoch ``update // minibatches``
        (module docstring, item 2)."""
        epoch, minibatch = divmod(update, self.p.minibatches)
        layout = batch.prepared.layout
        total = len({row for rows in layout for row in rows})
        size = total // self.p.minibatches
        order = minibatch_order(self.config.train.seed, batch.step, epoch, total)
        chosen = set(order[minibatch * size:(minibatch + 1) * size].tolist())
        mine = [r for r, row in enumerate(batch.sequence_index) if row in chosen]
        width = max(max(sum(row in chosen for row in rows) for rows in layout), 1)
        share = batch.select(mine + [0] * (width - len(mine)))
        share.labels[len(mine):] = IGNORE_INDEX  # padding: no loss, no count
        return first_update_only(share, update)

    def num_targets(self, batch: Batch) -> int:
        """Response tokens (the host labels)."""
        return batch.num_target_tokens()

    def loss(self, model: nn.Module, micro: Batch, parts: Mapping[str, nn.Module]) -> LossOutput:
        if micro.evaluation:
            return self._evaluation_loss(micro)
        count = self.num_targets(micro)  # host labels: no device sync
        placed = micro.placed(self._context.place)
        mask = placed.labels != IGNORE_INDEX
        extras = placed.extras
        logps = self._token_logps(model, replayed(placed)).float()  # the sampler's routing, where recorded
        self.parity.add(logps, placed, self._context.faults)  # batch_invariant, the first update: read at settle
        values = self._values(placed, critic=parts[CRITIC])
        policy, policy_terms = policy_loss(logps, extras["old_logps"], extras["advantages"], mask, self.clip)
        if self.correction is not None:
            policy = policy * policy_weights(extras, mask, self.correction)
        value, value_clipped = value_loss(values, extras["old_values"], extras["returns"], mask, self.p.value_clip)
        total = (policy + self.p.vf_coef * value).sum()
        with torch.no_grad():
            metrics = {"policy_loss": policy.detach().sum(),
                       "value_loss": value.detach().sum(), "clip_fraction": policy_terms["clipped"].sum(),
                       "value_clip_fraction": value_clipped.sum(), "approx_kl": policy_terms["approx_kl"].sum()}
            if "dual_clipped" in policy_terms:
                metrics["dual_clip_fraction"] = policy_terms["dual_clipped"].sum()
            maxima = {}
            if self.exact:  # the first update's parity (its rows carry the sampler's log-probs), 0 on later ones
                checked = extras.get(CHECKED)
                maxima[PARITY] = logprob_parity(logps, checked, mask) if checked is not None else logps.new_zeros(())
            if self.correction is not None:
                sums, most = mismatch_sums(extras, mask, self.correction)
                metrics.update(sums)
                maxima.update(most)
        return LossOutput(total, count, metrics, maxima)

    def ledger_fields(self, batch: Batch, totals: dict[str, float], count: int) -> dict[str, Any]:
        rollout: PPORollout = batch.prepared
        if self.exact:  # exit 5 on every rank, before this step's ledger line and checkpoint
            self.parity.settle(batch.step, self._context.dist)
        parts = self._context.dist.all_gather_object(rollout.summary())  # every rank, at the same point
        experiences = [part["experience"] for part in parts]
        context = self._context
        self.agent.write(context.run_dir, batch.step, experiences, records=context.records, dist=context.dist)
        fields = rollout_fields(experiences, group_size=self.p.group_size, shaping=False, masking=False,
                                resampling=False, episodes=self.agent.plays_episodes)
        fields.pop("reward_zero_var_groups")  # GRPO's: the critic, not the group, is PPO's baseline
        rows = sorted({row[0]: row for part in parts for row in part["rows"]}.values())
        scores = [r[5] for part in parts for r in part["experience"]["rows"]]
        kl = float(np.mean([row[1] for row in rows]))
        values = torch.tensor([v for row in rows for v in row[2]], dtype=torch.float64)
        returns = torch.tensor([v for row in rows for v in row[3]], dtype=torch.float64)
        variance = explained_variance(values, returns, torch.ones_like(values)) if len(values) > 1 else float("nan")
        tokens = max(count, 1)  # response tokens of every update's rows (ledger_over_updates)
        names = TOKEN_METRICS + (("dual_clip_fraction",) if self.p.dual_clip else ())
        fields.update(score_min=min(scores), score_max=max(scores), kl=kl, kl_coef=rollout.kl_coef,
                      explained_variance=None if np.isnan(variance) else variance,
                      **{name: totals[name] / tokens for name in names})
        if self.correction is not None:
            fields.update(correction_fields(totals, self.correction))
        # Exact: the first update's check (0.0); else the rollout's gap, the largest of any rank's.
        fields[PARITY] = totals[PARITY] if self.exact else max(part["parity"] for part in parts)
        if self.p.kl_target > 0:
            self.kl.update(kl, samples=len(rows))
        return fields

    def state_dict(self) -> dict[str, Any]:
        # The KL coefficient; the prompts come from the data state, the sampling keys and the
        # minibatch order from the step, and a step leaves no rollout buffer behind.
        return {"objective": self.name, "version": OBJECTIVE_STATE_VERSION, "kl": self.kl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(self.name, state)
        self.kl.load_state_dict(state["kl"])

    def frozen_identity(self) -> dict[str, dict[str, str]]:
        identities = {"reference": self.reference.identity} if self.reference is not None else {}
        return {**identities, **{reward_role(i): reward.identity for i, (_, reward) in enumerate(self.model_rewards)}}

    # ------------------------------------------------------------------ rollout batch

    def _whiten(self, gathered: list[dict[int, list[float]]], advantages: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """``(A - mean) / sqrt(var + eps)`` with the mean and unbiased variance of every rank's
        response-token advantages in global row order (ppo_loss.whiten over the whole batch)."""
        merged: dict[int, list[float]] = {}
        for part in gathered:
            merged.update(part)
        flat = torch.tensor([a for row in sorted(merged) for a in merged[row]], dtype=advantages.dtype)
        mean, var = masked_mean_var(flat, torch.ones_like(flat))
        return (advantages - mean) * torch.rsqrt(var + WHITEN_EPS) * mask.to(advantages.dtype)

    def _each_micro(self, batch: Batch, fn) -> torch.Tensor:
        """``fn(placed micro-batch)`` (B, T) over the batch's micro-batches, concatenated on the device and
        copied to the host once (a copy per micro-batch would make the host wait for the GPU after each)."""
        place = self._context.place
        return torch.cat([fn(micro.placed(place)).float()
                          for micro in batch.micro_batches(self.config.train.micro_batch_size)]).cpu()

    # ------------------------------------------------------------------ model calls

    def _update_autocast(self):
        """The autocast the loop runs the updates' forwards under (the policy's numerics: the precision's,
        none in fp32 or where FSDP2's policy casts the parameters), entered around prepare's forwards of
        the trained parts too, which the loop runs under no autocast: so the old log-probs are the bits the
        first update's forward gives (its ratio exactly 1, as in fp32) and the old values the critic's own
        arithmetic, in bf16 on one GPU as on several."""
        return unwrap(self._model).numerics.autocast(self._context.parallel.device)

    def _values(self, placed: Batch, critic: nn.Module | None = None) -> torch.Tensor:
        """(B, T) the critic's values, aligned with the labels (critic.py)."""
        critic = self._critic if critic is None else critic
        return critic(placed)

    def _token_logps(self, module: nn.Module, placed: Batch, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
        """(B, T) log-probs of the labels, 0 where there is none."""
        return label_logps(module, placed, fused=self.fuse_head, chunk_tokens=self.config.train.loss_chunk_tokens,
                           compute_dtype=compute_dtype)

    def _reference_logps(self, placed: Batch) -> torch.Tensor:
        """The frozen reference's, under its context (frozen.py: one arithmetic on any number of GPUs)."""
        with self.reference.context():
            return self._token_logps(self.reference.module, placed, autocast_dtype(placed.input_ids.device))

    # ------------------------------------------------------------------ evaluation

    def _evaluation_batch(self, batch: Batch) -> Batch:
        """The held-out prompt rows with the greedy completion's reward and exact-answer score
        (extras ``eval_reward``, ``eval_exact``, (B,) float32; training/rollout/evaluation.py); no
        training state is touched."""
        tasks = batch_tasks(batch, self.tokenizer)
        held_out = held_out_indices(batch, tasks, self.config.train.global_batch_size)
        reward, exact = evaluation_scores(self.generator, self._model, self.decoder, self.environment, batch, tasks,
                                          held_out, self.eval_params, purpose=EVAL_PURPOSE, samples=1,
                                          episodes=self.episodes,
                                          strip_thinking=answer_strips_thinking(self.p.rewards))
        return batch.with_extras(eval_reward=reward, eval_exact=exact)

    def _evaluation_loss(self, micro: Batch) -> LossOutput:
        """Per held-out prompt: minus its greedy reward, and the metric sums ``reward_mean`` and ``accuracy``."""
        return LossOutput(*evaluation_sums(micro.extras, sampled=False))
