"""``grpo``: group relative policy optimization on prompts with checkable answers.

Per step (one loop step = one optimizer step), rollout -> advantages -> loss:

1. ``prepare`` (no gradients) takes this rank's prompt rows of the global batch (data record kind
   ``prompt``: one prompt per row, its answer's tokens marked by ``target_mask``; data/chat_template.py)
   and rolls them out (training/rollout/group.py): ``group_size`` completions of each with the
   current weights, keys ``(train.seed, "grpo", step, global prompt row, sample index)`` (so a
   rollout depends on neither the world size nor the batch layout), each scored by the reward
   environment (the configured rewards, training/rollout/environment.py), DAPO's overlong penalty
   added (``overlong_buffer`` > 0) and groups whose shaped rewards are all equal re-sampled
   (DAPO's dynamic sampling, ``dynamic_sampling_rounds`` > 0). The advantages are normalized per
   group (``advantage_std``, training/rollout/advantages.py) and, when ``kl_coef > 0``, the frozen
   reference's log-probs computed. It returns the experience laid out as a *new* Batch
   (training/rollout/experience.py): one row per completion, global row
   ``prompt row * group_size + sample index``, extras ``advantages`` (B,), ``old_logps`` (B, T)
   (the sampler's log-probs, aligned with labels) and ``ref_logps`` (B, T), and the
   ``Experience`` itself as ``Batch.prepared``.
2. ``loss`` is the clipped surrogate with the k3 KL penalty (training/objectives/grpo_loss.py has
   every formula), summed per ``loss_norm``; the loop divides by the global count (completions,
   tokens, or completions x max_new_tokens). Under ``mask_truncated`` a truncated completion's row
   has no labels, so it adds neither loss nor count. It also reports, as the maximum
   ``logprob_parity`` (``LossOutput.maxima``), max |sampler log-prob - trainer log-prob| over the
   micro-batch's sampled tokens. Under ``determinism.batch_invariant`` the first update's must be 0:
   a difference is a determinism violation (exit 5, training/objectives/logprob_parity.py).
3. ``ledger_fields`` reads the step's experience from the prepared batch and gathers every rank's
   rollout digests and rewards (all ranks call it at the same point; the gather is keyed by global
   row, so the result is world-size independent; training/rollout/experience.py, ``rollout_fields``): ``rollout_hash`` (sha256 over the per-completion
   sha256 of the generated token ids, in global row order), ``reward_mean``, ``reward_std``
   (population), ``reward_zero_var_groups`` (fraction of groups whose rewards are all equal),
   ``completion_len_mean``, ``logprob_parity`` (the loop's maximum over the first update's
   micro-batches and all ranks) and ``reward_errors`` (rewards scored 0 under
   ``on_reward_error=zero``); with ``overlong_buffer > 0`` ``overlong_penalty_mean``, with
   ``mask_truncated`` ``truncated_masked`` (fraction of completions), with
   ``dynamic_sampling_rounds > 0`` ``resample_rounds`` and ``resampled_groups``.
   ``reward_mean``/``reward_std`` are the rewards' scores; ``reward_zero_var_groups`` counts the
   groups whose shaped rewards (the advantages' input) are all equal.

**Rollout correction.** With ``objective.grpo.rollout_correction`` (off by default) ``prepare``
also runs the policy over the rollout batch (the weights that sampled it) and the batch's
``old_logps`` become the trainer's, with the sampler's beside them as ``rollout_logps``; the loss
weighs each token's surrogate by TIS's truncated ratio and MIS's keep of its completion, and the
ledger adds the mismatch statistics (training/objectives/rollout_correction.py has the formulas).
``logprob_parity`` still compares the sampler's log-probs with the trainer's.

**Routing replay.** Where the model records its routing in the sampler (a mixture of experts under
``model.qwen3_moe.routing_replay``), the rollout batch carries it as the extra ``routing`` (in the
batch hash) and the policy's forwards (the loss, rollout correction's) replay it
(models/routing_replay.py); the reference's do not. The family reports the mismatch in the ledger.

**Episodes.** With ``objective.grpo.environment`` each sample is an episode of several turns
(training/rollout/episodes.py, docs/post_training.md "Agentic rollouts"; the environment, its
runner and the step records come from training/rollout/agent.py, as PPO's do): the tool environment
answers each turn, the observation's ids are appended, the next turn is sampled from the whole
sequence, keyed ``(train.seed, "grpo.turn<t>", step, prompt row, sample)`` after the first. A
row's labels are its sampled ids only, so the loss, KL, normalizer and length statistics count
them alone; ``dr_grpo`` counts ``max_episode_tokens`` slots per episode. The ledger adds
``episodes_hash``, ``turns_mean``, ``tool_calls``, ``malformed_calls`` and ``env_errors``, and rank 0
writes the step's episodes to the run dir (training/rollout/episode_store.py) in
``ledger_fields``; a replay reads them and appends the recorded observations without calling the
environment, a resumed step compares its new answers with them. Evaluation plays the episodes
greedily and reads the answer from the last turn.

Nothing travels between these calls on the objective: what ``loss`` and ``ledger_fields`` need
is in the batch they are given.

``inner_updates`` optimizer updates per rollout batch, all inside one loop step
(``updates_per_batch``): the ratio's denominator is the sampler's own log-probs, so on the
first update the ratio is 1 up to kernel differences, and on later ones it measures how far the
policy has moved since the rollouts, which the clipping bounds. Checkpoints fall between steps,
never between the updates of one, so resume needs no rollout buffer: the prompts come from the
data state and the randomness from the step, so a resumed step regenerates the same rollouts.

**Evaluation.** The loop evaluates (``Trainer.maybe_evaluate``: ``train.eval_batches`` global
batches of ``data.eval_source``, marked ``Batch.evaluation``) through the same ``prepare`` and
``loss``. For a held-out batch ``prepare`` decodes each prompt once, *greedily*
(temperature 0: no randomness, and the sampler's static shape makes a completion independent
of the world size), scores the completion with the configured rewards and with
``exact_answer``, and returns the prompt rows with extras ``eval_reward`` and ``eval_exact``;
``loss`` then returns, per prompt, minus the reward as the loss and the metric sums
``reward_mean`` and ``accuracy`` (1 where the completion gets the full exact_answer reward).
With ``eval_samples = k > 0`` it also samples k completions per prompt at ``eval_temperature``
(the rollouts' top-k/top-p), sample ``j`` of held-out prompt ``i`` (its index in the evaluation:
``(eval batch - 1) * global_batch_size + row``) keyed ``(train.seed, "grpo-eval", 0, i, j)``:
the same streams at every evaluation, so equal weights score equal numbers and evaluations
at different steps share their random numbers. Their per-prompt means (extras
``eval_sampled_reward``, ``eval_sampled_exact``) add the sums ``sampled_reward_mean`` and
``sampled_accuracy`` (pass@1 estimated from k samples).
The loop sums them over micro-batches and ranks and divides by the number of prompts.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from core.config import Config
from data.batch import IGNORE_INDEX, Batch
from data.chat_template import ChatTemplate
from data.tokenizers import build_tokenizer
from experiments.console import ConsoleField, ConsoleLine, ConsoleLines
from models.generation.sampler import SamplingParams
from models.routing_replay import replayed
from training.objectives.base import OBJECTIVE_STATE_VERSION, LossOutput, ObjectiveContext, check_state, metric
from training.objectives.grpo_loss import SurrogateSettings, loss_count, per_token_loss, reduce_loss, reduce_metric
from training.objectives.grpo_settings import KIND, model_rewards, resolve_rewards
from training.objectives.logprob_parity import PARITY, ParityCheck, checked_extras, first_update_only, logprob_parity
from training.objectives.model_reward import ReadPosition, build_model_rewards, reward_role, rollout_scores
from training.objectives.rollout_correction import (ROLLOUT_LOGPS, correction_extras, correction_fields,
                                                    mismatch_sums, policy_weights)
from training.objectives.token_logps import autocast_dtype, label_logps
from training.rollout.advantages import group_advantages
from training.rollout.agent import AgentRollouts, episode_console_fields
from training.rollout.environment import Task, batch_tasks
from training.rollout.episodes import EpisodeRunner
from training.rollout.experience import Experience, rollout_fields
from training.rollout.generator import Decoder, Generator
from training.rollout.group import GroupRollout, rollout_progress
from training.rollout.evaluation import answer_strips_thinking, evaluation_scores, evaluation_sums, held_out_indices

PURPOSE = "grpo"
SECTION = "objective.grpo"  # the settings' config section (errors name its keys)
EVAL_PURPOSE = "grpo-eval"
LOSS_UNIT = {"sequence": "completion", "token": "token", "dr_grpo": "token slot"}  # what the step loss averages over


class GRPOObjective:
    name = KIND.name
    capabilities = KIND.capabilities

    def __init__(self, config: Config) -> None:
        g = config.objective.grpo
        self.config, self.g = config, g
        self.updates_per_batch = g.inner_updates
        self.correction = g.rollout_correction  # None: the sampler's log-probs are the ratio's old policy
        self.exact = config.determinism.batch_invariant  # a nonzero logprob_parity is a determinism violation
        self.parity = ParityCheck()  # the first update's exact comparison, read when the step settles
        # Deferring a step's ledger fields would gain nothing: the next step's rollouts wait for
        # the GPU anyway (every decode step reads its tokens back).
        self.settles_late = False
        self.rewards = self.check_config(config)
        self.console = self._console_lines(g)
        self.tokenizer = build_tokenizer(config.data.tokenizer)
        self.template = ChatTemplate.for_tokenizer(config.data.tokenizer, config.data.chat_template,
                                                   clock=config.data.template_clock,
                                                   thinking=config.data.template_thinking)
        self.decoder = Decoder(self.tokenizer, self.template)
        self.agent = AgentRollouts(g.environment, rewards=self.rewards, on_reward_error=g.on_reward_error,
                                   section=SECTION, tokenizer=self.tokenizer, template=self.template)
        self.environment = self.agent.environment
        # The loss's dr_grpo slots per completion: an episode may sample up to its whole budget.
        self.slots = g.max_new_tokens if g.environment is None else g.environment.max_episode_tokens
        self.settings = SurrogateSettings(clip_low=g.clip_eps_low, clip_high=g.clip_eps_high, kl_coef=g.kl_coef,
                                          importance=g.importance, loss_norm=g.loss_norm)
        stop = self.decoder.stop_ids
        self.params = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                     max_new_tokens=g.max_new_tokens, stop_token_ids=stop)
        self.eval_params = SamplingParams(temperature=0.0, max_new_tokens=g.max_new_tokens, stop_token_ids=stop)
        self.eval_sampled_params = SamplingParams(temperature=g.eval_temperature, top_p=g.top_p, top_k=g.top_k,
                                                  max_new_tokens=g.max_new_tokens, stop_token_ids=stop)
        # Every forward of the sampler runs this many rows (its static shape): a constant of the
        # config, not of the world size, so rollouts do not depend on how rows are spread. By
        # default one row per completion of a step; rollout_slots: fewer, refilled as they finish.
        self.rollout_rows = g.rollout_slots or g.group_size * config.train.global_batch_size // config.data.num_streams
        self.episodes: EpisodeRunner | None = None
        self.reference = None
        self.model_rewards: list = []  # (weight, ModelReward) of each model reward, built in setup
        self.generator: Generator | None = None
        self.rollout: GroupRollout | None = None
        self._context: ObjectiveContext | None = None
        self._model: nn.Module | None = None
        self.fuse_head = False

    @staticmethod
    def _console_lines(g) -> ConsoleLines:
        """Steps: the surrogate loss per completion or token (``loss_norm``), the rollouts' mean
        reward, the KL to the reference (with ``kl_coef > 0``), the clipped fraction and, with an
        environment, the tool calls and malformed calls of the step's episodes. Evaluations:
        per held-out prompt, the greedy reward and accuracy (the loss is minus that reward: not
        shown), and with ``eval_samples`` the sampled reward and pass@1."""
        step = [ConsoleField("reward", "reward_mean"), ConsoleField("reward std", "reward_std")]
        if g.kl_coef > 0:
            step.append(ConsoleField("kl", metric("kl")))
        step += [ConsoleField("clip", metric("clip_fraction")), ConsoleField("len", "completion_len_mean", ".1f"),
                 *episode_console_fields(g.environment)]
        held_out = [ConsoleField("reward", metric("reward_mean")), ConsoleField("accuracy", metric("accuracy"))]
        if g.eval_samples > 0:
            held_out += [ConsoleField("sampled reward", metric("sampled_reward_mean")),
                         ConsoleField("pass@1", metric("sampled_accuracy"))]
        return ConsoleLines(step=ConsoleLine(unit=LOSS_UNIT[g.loss_norm], fields=tuple(step)),
                            eval=ConsoleLine(unit="prompt", loss=None, fields=tuple(held_out)))

    @staticmethod
    def frozen_sources(config: Config) -> dict[str, str]:
        """{config key: source} of the frozen models setup builds (the reference, with kl_coef > 0,
        and each model reward's reward model)."""
        g = config.objective.grpo
        sources = {"objective.grpo.reference": g.reference} if g.kl_coef > 0 else {}
        return {**sources, **{key: reward.path for key, reward in model_rewards(config).items()}}

    @staticmethod
    def check_config(config: Config) -> list:
        """The configured rule rewards, resolved (grpo_settings.resolve_rewards: a reward that does not
        import is a ConfigError), and each model reward's vocabulary and tokenizer checked against the
        policy's (model_reward.check_vocabulary); the config's own checks are grpo_settings.validate,
        run at load."""
        from training.objectives.model_reward import check_vocabulary

        for key, reward in model_rewards(config).items():
            check_vocabulary(config, reward.path, key=key)
        rewards = resolve_rewards(config)
        AgentRollouts.check(config.objective.grpo.environment, rewards=rewards, section=SECTION)
        return rewards

    # ------------------------------------------------------------------ seam

    def setup(self, model: nn.Module, context: ObjectiveContext) -> None:
        from training.objectives.frozen import build_frozen

        config, g = self.config, self.g
        self._context, self._model = context, model
        self.fuse_head = context.fuse_head and config.train.loss_chunk_tokens > 0
        # Every forward of the sampler runs this many rows (its static shape): a constant of the
        # config, not of the world size, so rollouts do not depend on how rows are spread.
        self.generator = Generator(rows=self.rollout_rows,
                                   max_len=config.data.seq_len, seed=config.train.seed)
        self.episodes = self.agent.runner(self.generator, self.decoder, context=config.data.seq_len)
        self.rollout = GroupRollout(generator=self.generator, decoder=self.decoder, environment=self.environment,
                                    params=self.params, group_size=g.group_size, overlong_buffer=g.overlong_buffer,
                                    resample_rounds=g.dynamic_sampling_rounds, purpose=PURPOSE,
                                    any_rank=lambda flag: any(context.dist.all_gather_object(flag)),
                                    episodes=self.episodes)
        if g.kl_coef > 0:
            self.reference = build_frozen(config, g.reference, role="reference", dist=context.dist,
                                          key="objective.grpo.reference")
        self.model_rewards = build_model_rewards(config, model_rewards(config), dist=context.dist)
        # Where the reward models read a rollout (its closing ids), found from the template once.
        self.read_position = ReadPosition(self.tokenizer, self.template) if self.model_rewards else None

    def prepare(self, batch: Batch) -> Batch:
        if batch.evaluation:
            return self._evaluation_batch(batch)
        tasks = batch_tasks(batch, self.tokenizer)
        with rollout_progress(batch.step, len(tasks), self.g.group_size, episodes=self.episodes is not None,
                              enabled=self._context.dist.rank == 0) as progress:
            experience = self.rollout.collect(self._model, tasks, batch.step, progress=progress,
                                              **self.agent.recorded(self._context.run_dir, batch.step,
                                                                    self.g.group_size, replay=not self._context.records))
        if self.model_rewards:
            experience = experience.with_added_rewards(self._model_scores(experience))
        experience = experience.with_advantages(
            group_advantages(experience.shaped_rewards(), eps=self.g.std_eps, std=self.g.advantage_std))
        out = experience.batch(batch, seq_len=self.config.data.seq_len, mask_truncated=self.g.mask_truncated,
                               pad_id=getattr(self.tokenizer, "pad_id", self.tokenizer.eos_id))
        out = out.with_extras(**checked_extras(out.extras["old_logps"], exact=self.exact))
        if self.correction is not None:
            started = time.perf_counter()
            out = out.with_extras(**correction_extras(self._policy_logps(out), out.extras["old_logps"],
                                                      out.labels != IGNORE_INDEX, self.correction))
            experience = experience.with_timings(policy_logps_s=time.perf_counter() - started)
        if self.reference is not None:
            started = time.perf_counter()
            out = out.with_extras(ref_logps=self._reference_logps(out))
            experience = experience.with_timings(reference_s=time.perf_counter() - started)
        return dataclasses.replace(out, prepared=experience)

    def update_batch(self, batch: Batch, update: int) -> Batch:
        """The whole rollout batch for every inner update; after the first, without the sampler's log-probs
        that ``loss`` checks the trainer's against (logprob_parity.first_update_only)."""
        return first_update_only(batch, update)

    def num_targets(self, batch: Batch) -> int:
        """The global normalizer's share of these rows (grpo_loss.loss_count), from the host labels."""
        return loss_count(batch.labels != IGNORE_INDEX, self.g.loss_norm, max_new_tokens=self.slots)

    def loss(self, model: nn.Module, micro: Batch) -> LossOutput:
        if micro.evaluation:
            return self._evaluation_loss(micro)
        count = self.num_targets(micro)  # host labels: no device sync
        placed = micro.placed(self._context.place)
        mask = placed.labels != IGNORE_INDEX
        logps = self._token_logps(model, replayed(placed), fuse=self.fuse_head).float()  # the sampler's routing
        old = placed.extras["old_logps"]
        weights = None if self.correction is None else policy_weights(placed.extras, mask, self.correction)
        per_token, terms = per_token_loss(logps, old, placed.extras.get("ref_logps"), placed.extras["advantages"],
                                          mask, self.settings, weights)
        total = reduce_loss(per_token, mask, self.g.loss_norm)
        self.parity.add(logps, placed, self._context.faults)  # batch_invariant, the first update: read at settle
        with torch.no_grad():
            sampled = old if self.correction is None else placed.extras[ROLLOUT_LOGPS]
            parity = logprob_parity(logps, sampled, mask)
            norm, slots = self.g.loss_norm, self.slots
            metrics = {"clip_fraction": reduce_metric(terms["clipped"], mask, norm, max_new_tokens=slots),
                       "entropy": reduce_metric(-logps.detach() * mask, mask, norm, max_new_tokens=slots)}
            if "kl" in terms:
                metrics["kl"] = reduce_metric(terms["kl"].detach(), mask, norm, max_new_tokens=slots)
            maxima = {PARITY: parity}
            if self.correction is not None:
                sums, most = mismatch_sums(placed.extras, mask, self.correction)
                metrics.update(sums)
                maxima.update(most)
        return LossOutput(total, count, metrics, maxima=maxima)

    def ledger_fields(self, batch: Batch, totals: dict[str, float], count: int) -> dict[str, Any]:
        experience: Experience = batch.prepared
        g = self.g
        if self.exact:  # exit 5 on every rank, before this step's ledger line and checkpoint
            self.parity.settle(batch.step, self._context.dist)
        parts = self._context.dist.all_gather_object(experience.summary())  # every rank, at the same point
        context = self._context
        self.agent.write(context.run_dir, batch.step, parts, records=context.records, dist=context.dist)
        fields = {**rollout_fields(parts, group_size=g.group_size, shaping=g.overlong_buffer > 0,
                                   masking=g.mask_truncated, resampling=g.dynamic_sampling_rounds > 0,
                                   episodes=self.episodes is not None),
                  PARITY: totals[PARITY]}
        if self.correction is not None:
            fields.update(correction_fields(totals, self.correction))
        return fields

    def state_dict(self) -> dict[str, Any]:
        # Nothing else to keep: the prompts come from the data state, the sampling keys from the
        # step, and one update per rollout batch leaves no rollout buffer between steps.
        return {"objective": self.name, "version": OBJECTIVE_STATE_VERSION}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(self.name, state)

    def frozen_identity(self) -> dict[str, dict[str, str]]:
        identities = {"reference": self.reference.identity} if self.reference is not None else {}
        return {**identities, **{reward_role(i): reward.identity for i, (_, reward) in enumerate(self.model_rewards)}}

    def _model_scores(self, experience: Experience) -> np.ndarray:
        """Per trajectory, the weighted sum of the reward models' scores of its prompt + completion."""
        return rollout_scores(self.model_rewards, self.read_position, experience.trajectories,
                              config=self.config, group_size=self.g.group_size, device=self._context.parallel.device,
                              pad_id=getattr(self.tokenizer, "pad_id", self.tokenizer.eos_id))

    # ------------------------------------------------------------------ evaluation

    def _evaluation_batch(self, batch: Batch) -> Batch:
        """The held-out prompt rows with the greedy completion's reward and exact-answer score
        (extras ``eval_reward``, ``eval_exact``, (B,) float32) and, with ``eval_samples > 0``, the
        means over the sampled completions (``eval_sampled_reward``, ``eval_sampled_exact``);
        no training state is touched (training/rollout/evaluation.py)."""
        tasks = batch_tasks(batch, self.tokenizer)
        held_out = held_out_indices(batch, tasks, self.config.train.global_batch_size)
        greedy = self._evaluation_scores(batch, tasks, held_out, self.eval_params, samples=1)
        extras = {"eval_reward": greedy[0], "eval_exact": greedy[1]}
        if self.g.eval_samples > 0:
            sampled = self._evaluation_scores(batch, tasks, held_out, self.eval_sampled_params,
                                              samples=self.g.eval_samples)
            extras.update(eval_sampled_reward=sampled[0], eval_sampled_exact=sampled[1])
        return batch.with_extras(**extras)

    def _evaluation_scores(self, batch: Batch, tasks: list[Task], held_out: list[int], params: SamplingParams, *,
                           samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        return evaluation_scores(self.generator, self._model, self.decoder, self.environment, batch, tasks, held_out,
                                 params, purpose=EVAL_PURPOSE, samples=samples,
                                 episodes=self.episodes, strip_thinking=answer_strips_thinking(self.g.rewards))

    def _evaluation_loss(self, micro: Batch) -> LossOutput:
        """Per held-out prompt: minus its greedy reward, and the metric sums of the scores ``prepare`` put in its extras."""
        return LossOutput(*evaluation_sums(micro.extras, sampled=self.g.eval_samples > 0))

    # ------------------------------------------------------------------ log-probs

    def _policy_logps(self, batch: Batch) -> torch.Tensor:
        """(B, T) the trainer's log-probs of the sampled tokens with the weights that sampled them
        (rollout correction's pi_train), micro-batch by micro-batch as the loss runs them."""
        place = self._context.place
        return torch.cat([self._token_logps(self._model, replayed(micro.placed(place)), fuse=self.fuse_head).float()
                          for micro in batch.micro_batches(self.config.train.micro_batch_size)]).cpu()  # one wait

    def _reference_logps(self, batch: Batch) -> torch.Tensor:
        place = self._context.place
        fuse = self.config.parallel.tp == 1 and self.config.train.loss_chunk_tokens > 0
        parts = []
        for micro in batch.micro_batches(self.config.train.micro_batch_size):
            placed = micro.placed(place)
            with self.reference.context():  # frozen.py: one arithmetic on any number of GPUs
                parts.append(self._token_logps(self.reference.module, placed, fuse=fuse,
                                               compute_dtype=autocast_dtype(placed.input_ids.device)).float())
        # One copy to the host for the batch: a copy per micro-batch made the host wait for the GPU
        # after each (64 a step in the Qwen3-0.6B recipe, benchmarks/host_syncs.py).
        return torch.cat(parts).cpu()

    def _token_logps(self, module: nn.Module, placed: Batch, *, fuse: bool,
                     compute_dtype: torch.dtype | None = None) -> torch.Tensor:
        """(B, T) log-probs of the labels, 0 where there is none."""
        return label_logps(module, placed, fused=fuse, chunk_tokens=self.config.train.loss_chunk_tokens,
                           compute_dtype=compute_dtype)

