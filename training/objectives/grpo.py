"""``grpo``: group relative policy optimization on prompts with checkable answers.

Per step (one loop step = one optimizer step):

1. ``prepare`` (no gradients) takes this rank's prompt rows of the global batch (data record kind
   ``prompt``: one prompt per row, its answer's tokens marked by ``target_mask``; data/chat_template.py),
   samples ``group_size`` completions of each with the current weights
   (models/qwen/sampler.py, keys ``(train.seed, "grpo", step, global prompt row, sample index)``,
   so a rollout depends on neither the world size nor the batch layout), scores them with the
   configured rewards (training/objectives/rewards.py), adds DAPO's overlong penalty
   (``overlong_buffer`` > 0), re-samples groups whose rewards are all equal (DAPO's dynamic
   sampling, ``dynamic_sampling_rounds`` > 0: ``_resample_uniform_groups``), normalizes
   advantages per group (``advantage_std``) and,
   when ``kl_coef > 0``, computes the frozen reference's log-probs. It returns a *new* Batch:
   one row per completion (prompt + completion, padded to ``data.seq_len``; labels on the
   completion tokens only), global row ``prompt row * group_size + sample index``, with extras
   ``advantages`` (B,), ``old_logps`` (B, T) (the sampler's log-probs, aligned with labels) and
   ``ref_logps`` (B, T).
2. ``loss`` is the clipped surrogate with the k3 KL penalty (training/objectives/grpo_loss.py has
   every formula), summed per ``loss_norm``; the loop divides by the global count (completions,
   tokens, or completions x max_new_tokens). Under ``mask_truncated`` a truncated completion's row
   has no labels, so it adds neither loss nor count.
3. ``ledger_fields`` gathers every rank's rollout digests and rewards (all ranks call it at the
   same point; the gather is keyed by global row, so the result is world-size independent):
   ``rollout_hash`` (sha256 over the per-completion sha256 of the generated token ids, in
   global row order), ``reward_mean``, ``reward_std`` (population), ``reward_zero_var_groups``
   (fraction of groups whose rewards are all equal), ``completion_len_mean``,
   ``logprob_parity`` (max |sampler log-prob - trainer log-prob| over the sampled tokens) and
   ``reward_errors`` (rewards scored 0 under ``on_reward_error=zero``); with ``overlong_buffer > 0``
   ``overlong_penalty_mean``, with ``mask_truncated`` ``truncated_masked`` (fraction of completions),
   with ``dynamic_sampling_rounds > 0`` ``resample_rounds`` and ``resampled_groups``.
   ``reward_mean``/``reward_std`` are the rewards' scores; ``reward_zero_var_groups`` counts the
   groups whose shaped rewards (the advantages' input) are all equal.

``inner_updates`` optimizer updates per rollout batch, all inside one loop step
(``updates_per_batch``): the ratio's denominator is the sampler's own log-probs, so on the
first update the ratio is 1 up to kernel differences, and on later ones it measures how far the
policy has moved since the rollouts, which the clipping bounds. Checkpoints fall between steps,
never between the updates of one, so resume needs no rollout buffer: the prompts come from the
data state and the randomness from the step, so a resumed step regenerates the same rollouts.

**Evaluation.** The loop evaluates (``Trainer.maybe_evaluate``: ``train.eval_batches`` global
batches of ``data.eval_source``) with the model in eval mode, through the same ``prepare`` and
``loss``. In eval mode ``prepare`` decodes each held-out prompt once, *greedily*
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

import hashlib
import time
from typing import Any

import numpy as np
import torch
from torch import nn

from core.config import Config
from core.exceptions import DataError
from data.batch import IGNORE_INDEX, Batch, prompt_and_answer
from data.chat_template import ChatTemplate
from data.tokenizers import build_tokenizer
from experiments.console import ConsoleField, ConsoleLine, ConsoleLines
from models.qwen.sampler import Sample, Sampler, SamplingParams, generation_model
from models.generation import sample_prompts
from training.generate import cut_at_marker, stop_tokens
from training.objectives.base import OBJECTIVE_STATE_VERSION, LossOutput, ObjectiveContext, check_state, metric
from training.objectives.grpo_loss import (
    SurrogateSettings,
    group_advantages,
    loss_count,
    overlong_penalty,
    per_token_loss,
    reduce_loss,
    reduce_metric,
)
from training.objectives.grpo_settings import KIND, resolve_rewards
from training.objectives.rewards import exact_answer, score
from training.objectives.token_logps import linear_token_logps, token_logps_from_logits

PURPOSE = "grpo"
EVAL_PURPOSE = "grpo-eval"
LOSS_UNIT = {"sequence": "completion", "token": "token", "dr_grpo": "token slot"}  # what the step loss averages over


class GRPOObjective:
    name = KIND.name
    capabilities = KIND.capabilities

    def __init__(self, config: Config) -> None:
        g = config.objective.grpo
        self.config, self.g = config, g
        self.updates_per_batch = g.inner_updates
        # ledger_fields reads the rollouts of the last prepare (and generation waits for the
        # GPU anyway): every step settles before the next one's rollouts.
        self.settles_late = False
        self.rewards = self.check_config(config)
        self.console = self._console_lines(g)
        self.tokenizer = build_tokenizer(config.data.tokenizer)
        template = ChatTemplate.for_tokenizer(config.data.tokenizer, config.data.chat_template)
        # EOS and a one-token end-of-turn marker stop a sample; a marker of several tokens is cut on the host.
        self.stop_ids, self.end_marker = stop_tokens(self.tokenizer, template)
        self.settings = SurrogateSettings(clip_low=g.clip_eps_low, clip_high=g.clip_eps_high, kl_coef=g.kl_coef,
                                          importance=g.importance, loss_norm=g.loss_norm)
        self.params = SamplingParams(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                                     max_new_tokens=g.max_new_tokens, stop_token_ids=self.stop_ids)
        self.eval_params = SamplingParams(temperature=0.0, max_new_tokens=g.max_new_tokens,
                                          stop_token_ids=self.stop_ids)
        self.eval_sampled_params = SamplingParams(temperature=g.eval_temperature, top_p=g.top_p, top_k=g.top_k,
                                                  max_new_tokens=g.max_new_tokens, stop_token_ids=self.stop_ids)
        # Every forward of the sampler runs this many rows (its static shape): a constant of the
        # config, not of the world size, so rollouts do not depend on how rows are spread. By
        # default one row per completion of a step; rollout_slots: fewer, refilled as they finish.
        self.rollout_rows = g.rollout_slots or g.group_size * config.train.global_batch_size // config.data.num_streams
        self.reference = None
        self._context: ObjectiveContext | None = None
        self._model: nn.Module | None = None
        self._sampler: Sampler | None = None
        self._local: dict[str, Any] = {}
        self._parity: list[torch.Tensor] = []
        self._timings: dict[str, float] = {}
        self.fuse_head = False

    @staticmethod
    def _console_lines(g) -> ConsoleLines:
        """Steps: the surrogate loss per completion or token (``loss_norm``), the rollouts' mean
        reward, the KL to the reference (with ``kl_coef > 0``) and the clipped fraction. Evaluations:
        per held-out prompt, the greedy reward and accuracy (the loss is minus that reward: not
        shown), and with ``eval_samples`` the sampled reward and pass@1."""
        step = [ConsoleField("reward", "reward_mean"), ConsoleField("reward std", "reward_std")]
        if g.kl_coef > 0:
            step.append(ConsoleField("kl", metric("kl")))
        step += [ConsoleField("clip", metric("clip_fraction")), ConsoleField("len", "completion_len_mean", ".1f")]
        held_out = [ConsoleField("reward", metric("reward_mean")), ConsoleField("accuracy", metric("accuracy"))]
        if g.eval_samples > 0:
            held_out += [ConsoleField("sampled reward", metric("sampled_reward_mean")),
                         ConsoleField("pass@1", metric("sampled_accuracy"))]
        return ConsoleLines(step=ConsoleLine(unit=LOSS_UNIT[g.loss_norm], fields=tuple(step)),
                            eval=ConsoleLine(unit="prompt", loss=None, fields=tuple(held_out)))

    def last_timings(self) -> dict[str, float]:
        """Seconds of the last prepare's rollouts and reference pass, and the tokens generated
        (benchmarks/grpo_step.py; not in the ledger: times are not deterministic)."""
        return dict(self._timings)

    @staticmethod
    def frozen_sources(config: Config) -> dict[str, str]:
        """{config key: source} of the frozen models setup builds (the reference, with kl_coef > 0)."""
        g = config.objective.grpo
        return {"objective.grpo.reference": g.reference} if g.kl_coef > 0 else {}

    @staticmethod
    def check_config(config: Config) -> list:
        """The configured rewards, resolved (grpo_settings.resolve_rewards: a reward that does not
        import is a ConfigError); the config's own checks are grpo_settings.validate, run at load."""
        return resolve_rewards(config)

    # ------------------------------------------------------------------ seam

    def setup(self, model: nn.Module, context: ObjectiveContext) -> None:
        from training.objectives.frozen import build_frozen

        self._context, self._model = context, model
        self.fuse_head = context.fuse_head and self.config.train.loss_chunk_tokens > 0
        if self.g.kl_coef > 0:
            self.reference = build_frozen(self.config, self.g.reference, role="reference", dist=context.dist,
                                          key="objective.grpo.reference")

    def prepare(self, batch: Batch) -> Batch:
        if not self._model.training:  # the loop evaluates in eval mode (module docstring)
            return self._evaluation_batch(batch)
        prompts = [self._prompt_of(batch, r) for r in range(len(batch.sequence_index))]
        self._timings = {"rollout_s": 0.0, "rollout_tokens": 0}
        samples = self._rollouts([p[1] for p in prompts], [p[0] for p in prompts], batch.step)
        groups = [self._scored_group(batch, r, prompt, group) for r, (prompt, group) in enumerate(zip(prompts, samples))]
        rounds, resampled = self._resample_uniform_groups(batch, prompts, groups)
        rows = [row for group in groups for row in group["rows"]]
        scores = np.concatenate([group["scores"] for group in groups])
        penalties = np.concatenate([group["penalties"] for group in groups])
        shaped = scores + penalties  # what the advantages see (the scores alone when overlong shaping is off)
        advantages = group_advantages(shaped.reshape(len(prompts), self.g.group_size), eps=self.g.std_eps,
                                      std=self.g.advantage_std).reshape(-1)
        out = self._rollout_batch(batch, rows, advantages)
        if self.reference is not None:
            out = out.with_extras(ref_logps=self._reference_logps(out))
        self._local = {
            "rows": [(index, hashlib.sha256(np.asarray(tokens, dtype="<i8").tobytes()).hexdigest(), reward,
                      len(tokens), penalty, shaped_reward, truncated)
                     for (index, _, tokens, _, truncated), reward, penalty, shaped_reward
                     in zip(rows, scores.tolist(), penalties.tolist(), shaped.tolist())],
            "failures": sum(group["failures"] for group in groups),
            "rounds": rounds,
            "resampled": resampled,
        }
        self._parity = []
        return out

    def _scored_group(self, batch: Batch, r: int, prompt: tuple, group: list[Sample], *,
                      resample_round: int = 0) -> dict[str, Any]:
        """Prompt row ``r``'s completions as rollout rows, with their scores, overlong penalties and
        the number of reward functions scored 0 after an error."""
        index, prompt_ids, answer, prompt_text = prompt
        source = batch.provenance[r][0]  # the prompt's record: a bad answer is blamed on it
        where_round = f", resample round {resample_round}" if resample_round else ""
        rows, scores, failures = [], [], 0
        for s, sample in enumerate(group):
            tokens, text, truncated = self._completion(sample)
            value, failed = score(self.rewards, text, answer, prompt_text, on_error=self.g.on_reward_error,
                                  where=f"step {batch.step}, prompt row {index}, sample {s}{where_round} "
                                        f"(file {source.shard}, record {source.record})")
            failures += failed
            scores.append(value)
            rows.append((index * self.g.group_size + s, prompt_ids, tokens, sample.logprobs[: len(tokens)], truncated))
        penalties = overlong_penalty([len(row[2]) for row in rows], max_new_tokens=self.g.max_new_tokens,
                                     buffer=self.g.overlong_buffer)
        return {"rows": rows, "scores": np.array(scores, dtype=np.float64), "penalties": penalties,
                "failures": failures}

    def _resample_uniform_groups(self, batch: Batch, prompts: list, groups: list[dict]) -> tuple[int, int]:
        """DAPO's dynamic sampling (``dynamic_sampling_rounds`` = R > 0): a group whose shaped rewards
        are all equal (advantage 0: it teaches nothing) is replaced, in place, by a fresh group of
        the same prompt, sample ``j`` of round ``k`` keyed ``(seed, "grpo.resample<k>", step, prompt
        row, j)``, for at most R rounds; what is still uniform then stays (advantage 0). Every rank
        runs the same rounds (generation may be a collective) while any rank has a uniform group;
        a prompt's group depends only on its own rounds, so not on the world size. Returns (rounds
        run, groups replaced on this rank)."""
        rounds, resampled = 0, 0
        for k in range(1, self.g.dynamic_sampling_rounds + 1):
            uniform = [p for p, group in enumerate(groups) if np.ptp(group["scores"] + group["penalties"]) == 0]
            if not any(self._context.dist.all_gather_object(bool(uniform))):
                break
            fresh = self._rollouts([prompts[p][1] for p in uniform], [prompts[p][0] for p in uniform], batch.step,
                                   purpose=f"{PURPOSE}.resample{k}")
            for p, group in zip(uniform, fresh):
                groups[p] = self._scored_group(batch, p, prompts[p], group, resample_round=k)
            rounds, resampled = k, resampled + len(uniform)
        return rounds, resampled

    def num_targets(self, batch: Batch) -> int:
        """The global normalizer's share of these rows (grpo_loss.loss_count), from the host labels."""
        return loss_count(batch.labels != IGNORE_INDEX, self.g.loss_norm, max_new_tokens=self.g.max_new_tokens)

    def loss(self, model: nn.Module, micro: Batch) -> LossOutput:
        if "eval_reward" in micro.extras:  # an evaluation batch: scored in prepare, one unit per prompt
            reward, exact = micro.extras["eval_reward"], micro.extras["eval_exact"]
            metrics = {"reward_mean": reward.sum(), "accuracy": exact.sum()}
            if "eval_sampled_reward" in micro.extras:  # per-prompt means over the eval_samples completions
                metrics["sampled_reward_mean"] = micro.extras["eval_sampled_reward"].sum()
                metrics["sampled_accuracy"] = micro.extras["eval_sampled_exact"].sum()
            return LossOutput(-reward.sum(), int(reward.shape[0]), metrics)
        count = self.num_targets(micro)  # host labels: no device sync
        placed = micro.placed(self._context.place)
        mask = placed.labels != IGNORE_INDEX
        logps = self._token_logps(model, placed, fuse=self.fuse_head).float()
        old = placed.extras["old_logps"]
        per_token, terms = per_token_loss(logps, old, placed.extras.get("ref_logps"), placed.extras["advantages"],
                                          mask, self.settings)
        total = reduce_loss(per_token, mask, self.g.loss_norm)
        with torch.no_grad():
            self._parity.append(((logps.detach() - old).abs() * mask).max())
            norm, slots = self.g.loss_norm, self.g.max_new_tokens
            metrics = {"clip_fraction": reduce_metric(terms["clipped"], mask, norm, max_new_tokens=slots),
                       "entropy": reduce_metric(-logps.detach() * mask, mask, norm, max_new_tokens=slots)}
            if "kl" in terms:
                metrics["kl"] = reduce_metric(terms["kl"].detach(), mask, norm, max_new_tokens=slots)
        return LossOutput(total, count, metrics)

    def ledger_fields(self, totals: dict[str, float], count: int) -> dict[str, Any]:
        # The first update's micro-batches (each update runs the same ones, in order): later
        # updates measure how far the policy moved, not sampler/trainer parity.
        first = self._parity[: len(self._parity) // self.updates_per_batch]
        parity = max((float(p) for p in first), default=0.0)
        gathered = self._context.dist.all_gather_object({**self._local, "parity": parity})
        # Tensor-parallel peers hold the same rows: key by global row.
        rows = sorted({row[0]: row for part in gathered for row in part["rows"]}.values())
        digest = hashlib.sha256(b"".join(bytes.fromhex(row[1]) for row in rows)).hexdigest()
        rewards = np.array([row[2] for row in rows], dtype=np.float64)
        groups = np.array([row[5] for row in rows], dtype=np.float64).reshape(-1, self.g.group_size)
        return {
            "rollout_hash": digest,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "reward_zero_var_groups": float((groups.max(axis=1) == groups.min(axis=1)).mean()),
            "completion_len_mean": float(np.mean([row[3] for row in rows])),
            "logprob_parity": max(part["parity"] for part in gathered),
            "reward_errors": int(sum(part["failures"] for part in gathered)) // max(1, self._tp_copies(gathered)),
            **self._dapo_fields(rows),
            **self._resampling_fields(gathered),
        }

    def _dapo_fields(self, rows: list[tuple]) -> dict[str, float]:
        """With overlong shaping, the mean penalty added to the rewards; with truncation masking,
        the fraction of completions masked. Absent when off, so earlier ledgers keep their fields."""
        fields = {}
        if self.g.overlong_buffer > 0:
            fields["overlong_penalty_mean"] = float(np.mean([row[4] for row in rows]))
        if self.g.mask_truncated:
            fields["truncated_masked"] = float(np.mean([row[6] for row in rows]))
        return fields

    def _resampling_fields(self, gathered: list[dict]) -> dict[str, int]:
        """With dynamic sampling: the extra rollout rounds run (the same on every rank) and the
        groups replaced over all ranks. Absent when off."""
        if self.g.dynamic_sampling_rounds == 0:
            return {}
        return {"resample_rounds": max(part["rounds"] for part in gathered),
                "resampled_groups": sum(part["resampled"] for part in gathered) // max(1, self._tp_copies(gathered))}

    def state_dict(self) -> dict[str, Any]:
        # Nothing else to keep: the prompts come from the data state, the sampling keys from the
        # step, and one update per rollout batch leaves no rollout buffer between steps.
        return {"objective": self.name, "version": OBJECTIVE_STATE_VERSION}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state(self.name, state)

    def frozen_identity(self) -> dict[str, dict[str, str]]:
        return {"reference": self.reference.identity} if self.reference is not None else {}

    # ------------------------------------------------------------------ rollouts

    def _prompt_of(self, batch: Batch, r: int) -> tuple[int, list[int], str, str]:
        """(global row, prompt ids, answer text, prompt text) of prompt row ``r``."""
        span = batch.provenance[r][0]
        prompt, answer = prompt_and_answer(batch, r)
        if not prompt:
            raise DataError("prompt record renders to no prompt token", file=span.shard, record=span.record + 1,
                            step=batch.step)
        return (batch.sequence_index[r], prompt, self.tokenizer.decode(answer), self.tokenizer.decode(prompt))

    def _rollouts(self, prompt_ids: list[list[int]], indices: list[int], step: int, *,
                  purpose: str = PURPOSE) -> list[list[Sample]]:
        """``group_size`` completions of each prompt, one list per prompt (``prepare`` adds up the timings)."""
        started = time.perf_counter()
        G = self.g.group_size
        flat = self._generate(prompt_ids, indices, self.params, purpose=purpose, step=step, samples=G)
        self._timings["rollout_s"] += time.perf_counter() - started
        self._timings["rollout_tokens"] += sum(len(sample.tokens) for sample in flat)
        return [flat[p * G:(p + 1) * G] for p in range(len(prompt_ids))]

    def _generate(self, prompt_ids: list[list[int]], indices: list[int], params: SamplingParams, *,
                  purpose: str, step: int, samples: int) -> list[Sample]:
        """``samples`` completions of each prompt with the current weights, prompt-major."""
        model = self._model
        was_training = model.training
        model.eval()
        try:
            dtype = torch.bfloat16 if (self.config.parallel.precision == "bf16"
                                       and self._context.parallel.device.type == "cuda") else None
            plain = generation_model(model, dtype=dtype)  # a collective for sharded models: every rank
            if self._sampler is None:
                self._sampler = Sampler(plain, max_batch=self.rollout_rows, max_len=self.config.data.seq_len)
            elif self._sampler.model is not plain:  # a fresh copy: into the sampler's model, whose
                with torch.no_grad():               # compiled decode step (and CUDA graph) stays valid
                    for kept, fresh in zip(self._sampler.model.parameters(), plain.parameters()):
                        kept.copy_(fresh)
                del plain
            flat = sample_prompts(self._sampler, prompt_ids, indices, params, seed=self.config.train.seed,
                                  purpose=purpose, step=step, samples_per_prompt=samples)
        finally:
            model.train(was_training)
        return [sample for _, _, sample in flat]

    def _evaluation_batch(self, batch: Batch) -> Batch:
        """The held-out prompt rows with the greedy completion's reward and exact-answer score
        (extras ``eval_reward``, ``eval_exact``, (B,) float32) and, with ``eval_samples > 0``, the
        means over the sampled completions (``eval_sampled_reward``, ``eval_sampled_exact``);
        no training state is touched."""
        prompts = [self._prompt_of(batch, r) for r in range(len(batch.sequence_index))]
        # A prompt's index in the evaluation (eval batches count from 1, rows within the global
        # batch): the same for every world size and at every evaluation.
        held_out = [(batch.step - 1) * self.config.train.global_batch_size + p[0] for p in prompts]
        greedy = self._evaluation_scores(batch, prompts, held_out, self.eval_params, samples=1)
        extras = {"eval_reward": greedy[0], "eval_exact": greedy[1]}
        if self.g.eval_samples > 0:
            sampled = self._evaluation_scores(batch, prompts, held_out, self.eval_sampled_params,
                                              samples=self.g.eval_samples)
            extras.update(eval_sampled_reward=sampled[0], eval_sampled_exact=sampled[1])
        return batch.with_extras(**extras)

    def _evaluation_scores(self, batch: Batch, prompts: list, held_out: list[int], params: SamplingParams, *,
                           samples: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per prompt, the mean configured reward and the mean exact-answer score of ``samples``
        completions; sample ``j`` of held-out prompt ``i`` is keyed ``(seed, EVAL_PURPOSE, 0, i, j)``
        (greedy decoding draws nothing from its key)."""
        flat = self._generate([p[1] for p in prompts], held_out, params, purpose=EVAL_PURPOSE, step=0,
                              samples=samples)
        rewards = np.zeros((len(prompts), samples), dtype=np.float64)
        exact = np.zeros((len(prompts), samples), dtype=np.float64)
        for p, (index, _, answer, prompt_text) in enumerate(prompts):
            for s in range(samples):
                _, text, _ = self._completion(flat[p * samples + s])
                rewards[p, s], _ = score(self.rewards, text, answer, prompt_text, on_error=self.g.on_reward_error,
                                         where=f"evaluation batch {batch.step}, prompt row {index}, sample {s}")
                exact[p, s] = exact_answer(text, answer)
        return (torch.tensor(rewards.mean(axis=1), dtype=torch.float32),
                torch.tensor(exact.mean(axis=1), dtype=torch.float32))

    def _completion(self, sample: Sample) -> tuple[list[int], str, bool]:
        """The tokens trained on (cut after a several-token end-of-turn marker), the completion
        text the rewards see (without stop tokens and the marker): as ``python -m training generate``,
        and whether it was truncated (it ran into max_new_tokens or data.seq_len with no stop)."""
        sample, text = cut_at_marker(sample, self.tokenizer, self.end_marker, self.stop_ids)
        return list(sample.tokens), text, sample.finish_reason == "length"

    def _rollout_batch(self, batch: Batch, rows: list, advantages: np.ndarray) -> Batch:
        """One row per completion: prompt + completion, padded; labels on the completion only (none
        on a truncated one under mask_truncated: it carries no loss and counts in no normalizer)."""
        width, pad = self.config.data.seq_len, getattr(self.tokenizer, "pad_id", self.tokenizer.eos_id)
        n = len(rows)
        input_ids = torch.full((n, width), pad, dtype=torch.int64)
        labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.int64)
        document_ids = torch.ones((n, width), dtype=torch.int64)
        old_logps = torch.zeros((n, width), dtype=torch.float32)
        for i, (_, prompt, tokens, logprobs, truncated) in enumerate(rows):
            p, c = len(prompt), len(tokens)
            input_ids[i, :p + c] = torch.tensor(prompt + tokens)
            document_ids[i, :p + c] = 0
            if not (truncated and self.g.mask_truncated):
                labels[i, p - 1:p + c - 1] = torch.tensor(tokens)
            old_logps[i, p - 1:p + c - 1] = torch.tensor(logprobs, dtype=torch.float32)
        G = self.g.group_size
        return Batch(
            step=batch.step, input_ids=input_ids, labels=labels,
            position_ids=torch.arange(width).expand(n, width).clone(), document_ids=document_ids,
            sequence_index=[index for index, *_ in rows],
            provenance=[batch.provenance[i // G] for i in range(n)],
            state=batch.state,
            extras={"advantages": torch.tensor(advantages, dtype=torch.float32), "old_logps": old_logps},
        )

    def _reference_logps(self, batch: Batch) -> torch.Tensor:
        started = time.perf_counter()
        place = self._context.place
        fuse = self.config.parallel.tp == 1 and self.config.train.loss_chunk_tokens > 0
        parts = [self._token_logps(self.reference.module, micro.placed(place), fuse=fuse).float().cpu()
                 for micro in batch.micro_batches(self.config.train.micro_batch_size)]
        self._timings["reference_s"] = time.perf_counter() - started
        return torch.cat(parts)

    def _token_logps(self, module: nn.Module, placed: Batch, *, fuse: bool) -> torch.Tensor:
        """(B, T) log-probs of the labels, 0 where there is none."""
        kwargs = {"position_ids": placed.position_ids, "document_ids": placed.document_ids}
        if fuse:
            chunk = self.config.train.loss_chunk_tokens
            return module(placed.input_ids, **kwargs,
                          head=lambda hidden, weight: linear_token_logps(hidden, weight, placed.labels,
                                                                         chunk_tokens=chunk))
        return token_logps_from_logits(module(placed.input_ids, **kwargs), placed.labels)

    @staticmethod
    def _tp_copies(gathered: list[dict]) -> int:
        """How many ranks hold each row (tensor-parallel peers repeat them)."""
        total = sum(len(part["rows"]) for part in gathered)
        unique = len({row[0] for part in gathered for row in part["rows"]})
        return max(1, total // max(1, unique))
