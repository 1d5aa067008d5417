"""The trainer: restore -> steps -> ledger and metrics -> checkpoints -> clean shutdown.

``Trainer.fit()`` owns the lifecycle of a run. Each step:

1. take the next batch (the data state *after* it travels with it),
2. forward/backward over micro-batches, loss normalized by the global target tokens,
3. all-reduce the loss, clip gradients, agree across ranks that everything is finite,
4. enqueue the update (a non-finite step's update is skipped on the device),
5. gather the batch and data-state hashes,
6. settle: read loss, norm and flags back, write the ledger line (rank 0), checkpoint when
   due (the ledger line is already on disk, so a checkpoint never exists without its line),
   log metrics; then evaluate when due, stop if any rank was signalled.

Step 6 of a step normally runs inside the next step, between its backward and its update
(``runtime.deferred_settle``): the GPU has finished the step by then, so the host never waits
for it between steps, and a non-finite step still stops the run before another update.
Checkpoint, parameter-hash, evaluation and last steps, and a step before a stop, settle at
once. The ledger is the same either way.

What differs between training methods lives in the run's objective (training/objectives:
the frozen models it needs, a no-grad preparation of each batch, the loss over a micro-batch,
its ledger fields and its state). What happens to each ledger line lives in the recorder
(training/record/recorder.py): a recording run appends it, a replay compares it with the recorded
one. The run trains a set of named parts (training/parts.py): the ``policy``, and any part
the objective declares beside it (a value head), each with its own optimizer, schedule and
clipping, stepped together. A checkpoint is a dict of named parts: each trained part's model
and optimizer (tensors), and the JSON states ``trainer``, ``data`` and ``objective`` (with the
identity of the objective's frozen models, verified on resume).
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from core.config import Config
from core.distributed_context import DistributedContext
from core.exceptions import CheckpointError, DataError, NonFiniteError
from core.logging import EventLog, get_logger
from core.run_context import RunContext
from data.hashing import batch_hash, state_hash
from data.state import merge_states
from distributed import unwrap
from experiments.console import Heartbeat, Progress, eval_line
from models.lora import set_dropout_key
from runtime.collection import CollectionSchedule
from training.checkpoint.manager import CheckpointManager, restore_rng_state
from training.generation_eval import GenerationEvaluation
from training.guards import Guards
from training.objectives import Objective, ObjectiveContext, build_objective
from training.checkpoint.state import check_frozen
from training.objectives.base import declared_parts, metric, update_batch
from training.optimizers.build import evaluation_weights
from training.parts import POLICY, TrainablePart, build_parts, grad_norm_field, param_hash_field
from training.precision import Precision
from training.record.recorder import LedgerWriter, ReplayComparator, ReplaySpec, StepRecorder
from training.step import UpdateValues, enqueue_update, forward_backward, is_model_sum, local_units, model_fields

TRAINER_STATE_VERSION = 1
TRAINER_PART, DATA_PART, OBJECTIVE_PART = "trainer", "data", "objective"


@dataclass
class FitResult:
    status: str  # finished | stopped | replayed
    first_step: int
    last_step: int
    first_loss: float | None = None
    last_loss: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class _Step:
    """A step whose work is issued: what its ledger line, checkpoint and metrics need."""

    step: int
    batch: Any
    lr: float
    tokens: int
    targets: int
    first_targets: int  # the global count of the first update's rows (of every update's, ledger_over_updates): the metric sums' divisor
    updates: list[UpdateValues]  # the step's updates' values, read when it settles
    metric_names: list[str]  # the objective's metric sums among the first update's values
    maximum_names: list[str]  # then its maxima (LossOutput.maxima)
    hashes: dict[str, str]  # batch_hash and data_state_hash
    checkpoint_due: bool = False
    hash_due: bool = False
    times: dict[str, float] = field(default_factory=dict)  # seconds per phase
    record: dict[str, Any] = field(default_factory=dict)  # the ledger line, once settled
    totals: dict[str, float] = field(default_factory=dict)  # the objective's metric sums
    fields: dict[str, Any] = field(default_factory=dict)  # the objective's ledger fields


class Trainer:
    """One run's training lifecycle.

    ``parallel`` is the parallelism layer's toolbox for the wrapped model: ``dp_size``,
    ``dp_rank``, ``clip_grad_norm(model, max_norm)``, ``no_sync(model)`` and
    ``param_hash(model)``, plus ``device``, ``place_batch(tensor)``, ``sync()`` and
    ``after_load(model, optimizer)`` (which matter for xla_spmd's lazy XLA tensors, see
    ``training.xla``); the trainer never branches on the strategy itself.
    """

    def __init__(
        self,
        config: Config,
        *,
        run: RunContext,
        dist: DistributedContext,
        model: nn.Module,
        parallel,
        data,
        eval_data_factory: Callable[[], Any] | None,
        tracker,
        guards: Guards,
        events: EventLog,
        objective: Objective | None = None,
        replay: ReplaySpec | None = None,
    ) -> None:
        self.config = config
        self.run = run
        self.dist = dist
        self.model = model
        self.parallel = parallel
        self.data = data
        self.eval_data_factory = eval_data_factory
        self.tracker = tracker
        self.guards = guards
        self.events = events
        self.recorder: StepRecorder = (
            ReplayComparator(replay, dist) if replay is not None else LedgerWriter(run.paths.ledger, dist)
        )
        self.log = get_logger()
        self.device = parallel.device  # where the step runs; dist.device unless xla_spmd (XLA)
        self.objective = objective or build_objective(config)
        signals = getattr(guards, "signals", None)
        context = ObjectiveContext(config=config, dist=dist, parallel=parallel, place=parallel.place_batch,
                                   fuse_head=parallel.output_weight_is_local, run_dir=run.paths.root,
                                   records=self.recorder.records, faults=getattr(guards, "faults", None))
        with signals.at_once() if signals is not None else contextlib.nullcontext():  # frozen models: minutes
            self.objective.setup(model, context)
        tracker.show(self.objective.console.step)  # the method's unit and fields on the step line
        self.generation_eval = (  # train.eval_generate: held-out answers, at every evaluation step
            GenerationEvaluation(config, rank=parallel.dp_rank, world_size=parallel.dp_size, device=self.device)
            if config.train.eval_generate.source is not None else None)
        numerics = unwrap(model).numerics  # its wrapper_casts: FSDP2's policy casts the parameters (builders.py)
        self.precision = Precision(numerics, device=self.device, wrapper_casts=numerics.wrapper_casts)
        # The policy, and the parts the objective trains beside it (training/parts.py).
        self.parts: dict[str, TrainablePart] = build_parts(
            model, config.train, declared_parts(self.objective, context), device=self.device,
            wrap=parallel.wrap_part)
        self.optimizer = self.parts[POLICY].optimizer
        self._others = {name: part for name, part in self.parts.items() if name != POLICY}
        self.checkpoints = CheckpointManager(
            config.checkpoint,
            checkpoint_dir=run.paths.checkpoints,
            dist=dist,
            on_corrupt=self._on_corrupt_checkpoint,
            read_only=not self.recorder.records,
        )
        self.step = 0
        self.tokens_seen = 0
        # A line at least every 30 s on rank 0 (experiments/console.py): the step in progress and
        # its phase. Through the logger to a log or a pipe; on a terminal through print, which a
        # progress bar shows above itself.
        self.heartbeat = Heartbeat(config.train.max_steps, enabled=dist.is_main,
                                   print_fn=None if sys.stdout.isatty() else self.log.info)
        self._global_data_state: dict[str, Any] | None = None
        self._on_settled: Callable[[_Step], None] = lambda step: None

    # ------------------------------------------------------------------ lifecycle

    def fit(self) -> FitResult:
        first_step = self.restore() + 1
        self._data_iter = iter(self.data)
        last_step = self.recorder.last_step(self.config.train.max_steps)
        result = FitResult(status="finished", first_step=first_step, last_step=first_step - 1)
        started = time.perf_counter()
        self.guards.start()
        collection = CollectionSchedule(self.config.runtime.gc_interval)
        collection.start()
        pending: _Step | None = None  # issued, its values not read yet (runtime.deferred_settle)

        def settled(step: _Step) -> None:
            record = step.record
            result.tokens += record["tokens"]
            if result.first_loss is None:
                result.first_loss = record["loss"]
            result.last_loss = record["loss"]

        self._on_settled = settled
        self.heartbeat.start(listen=self.log)
        try:
            for step in range(first_step, last_step + 1):
                pending = self._run_step(step, previous=pending, last_step=last_step)
                collection.after_step(step)
                result.last_step = step
                if not self.recorder.records:
                    continue
                self.maybe_evaluate(step)
                if step < last_step and self.guards.should_stop(self.dist):
                    pending = self._settle_late(pending)
                    self.save_checkpoint(step, reason="signal")
                    self.events.emit("stopped", step=step, signal=self.guards.stop_reason())
                    result.status = "stopped"
                    break
            else:
                if self.recorder.records and self.config.checkpoint.at_end and last_step >= first_step:
                    if self.checkpoints.latest_step != last_step:
                        self.save_checkpoint(last_step, reason="end")
            self.checkpoints.wait()
        finally:
            self.heartbeat.stop()
            collection.stop()
            self.guards.close()
        result.seconds = time.perf_counter() - started
        # Distinct over ranks: streams on several ranks may read (and skip) the same record.
        per_rank = self.dist.all_gather_object(sorted(self.data.skipped_records()))
        result.extra["bad_records_skipped"] = len(set().union(*(map(tuple, keys) for keys in per_rank)))
        if not self.recorder.records:
            result.status = "replayed"
        return result

    def restore(self) -> int:
        """Load the newest intact checkpoint (<= replay step - 1 when replaying); returns its step."""
        found = self.checkpoints.latest_intact(max_step=self.recorder.restore_limit())
        if found is None:
            damaged = self.checkpoints.list_steps() if self.recorder.restore_limit() is None else []
            if self.run.resumed and damaged:  # never restart silently over damaged checkpoints
                raise CheckpointError(
                    f"no intact checkpoint: all {len(damaged)} are damaged (steps {', '.join(map(str, damaged))}; "
                    "reasons in events.jsonl, checkpoint_corrupt)",
                    path=str(self.checkpoints.checkpoint_dir),
                    hint="restore them from a copy, or move checkpoints/ and ledger.jsonl aside to run again from step 1",
                )
            if self.run.resumed and self.recorder.records:
                self.log.info("no intact checkpoint: the resumed run starts from step 1")
            recorded = self.recorder.recorded_frozen()
            if recorded is not None:  # a replay from step 1: the frozen models the run's checkpoints record
                check_frozen(self.frozen_identity(), recorded)
            self.recorder.restored(0)
            return 0
        step, path = found
        loaded = self.checkpoints.load(path, model=self.model, optimizer=self.optimizer,
                                       parts=self._trained_states())
        self.parallel.after_load(self.model, self.optimizer)
        state = loaded.states[TRAINER_PART]
        if state.get("version") != TRAINER_STATE_VERSION:
            raise DataError(f"trainer state version {state.get('version')} is not supported", file=str(path))
        self._load_objective_state(loaded.states.get(OBJECTIVE_PART), path)
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.precision.load_state_dict(state["precision"])
        self.guards.load_state_dict(state["guards"])
        self.data.load_state_dict(loaded.states[DATA_PART])
        self._global_data_state = loaded.states[DATA_PART]
        if loaded.rng_state is not None:
            restore_rng_state(loaded.rng_state, self.device)
        self.recorder.restored(step)
        self.events.emit(self.recorder.restored_event, step=step, path=str(path))
        self.log.info("restored checkpoint step %d from %s", step, path)
        return step

    # ------------------------------------------------------------------ one step

    def _run_step(self, step: int, *, previous: _Step | None, last_step: int) -> _Step | None:
        """Run step ``step``: its batch, forward, backward and update, and its ledger line,
        checkpoint and metrics, or leave those to the next step (returned; see ``_settle``).

        ``previous``, a step whose values are not read yet, is settled after this step's
        backward is issued and before its update: by then the GPU has long finished it, so the
        host never waits for the GPU between steps, and a non-finite step stops the run before
        the next update. A step settles at once where something needs its parameters or all of
        its lines: checkpoint and parameter-hash steps, evaluation steps, the last step, and
        every step under ``runtime.deferred_settle: false`` or of an objective whose ledger
        fields cannot wait (``Objective.settles_late``: GRPO's).
        """
        guards, timer = self.guards, self.guards.timer
        guards.begin_step(step)
        self.heartbeat.at(step, "running (data)")
        with timer.phase("data_wait"):
            delay = guards.faults.slow_data_delay(step)
            if delay:
                time.sleep(delay)
            batch = next(self._data_iter)
        if batch.step != step:
            raise DataError(
                f"data pipeline produced batch {batch.step} for step {step}",
                step=step,
                rank=self.dist.rank,
                hint="the data state in the checkpoint does not match the trainer state",
            )
        if previous is not None and step in guards.fault_steps:
            # An injected fault at a step's start finds every earlier step in the ledger, as
            # the relaunch after it expects (runtime/relaunch.py).
            previous = self._settle_late(previous)
        guards.faults.before_step(step)
        self.heartbeat.at(step, "running (prepare)")  # frozen models' outputs, rollouts
        with timer.phase("prepare"), torch.no_grad():
            batch = self.objective.prepare(batch)  # frozen models' outputs, rollouts: as batch extras

        self.heartbeat.at(step, "running (update)")
        lr = self.parts[POLICY].set_lr(step)
        for part in self._others.values():
            part.set_lr(step)
        global_targets, units = self._global_counts(batch)
        # Most objectives make one update per batch; GRPO with inner_updates > 1 makes several
        # on the same rollouts, PPO one per minibatch of each epoch (a MinibatchObjective picks
        # each update's rows). The step's loss and grad_norm are the first update's (taken on the
        # rollout policy), its metrics too unless the objective declares ledger_over_updates (PPO:
        # means over every update); later updates' losses and norms go into the ledger.
        shares = [self._update_rows(batch, u, global_targets, units) for u in range(self.objective.updates_per_batch)]
        updates = [self._update(step, rows, targets, units=rows_units, first=u == 0,
                                previous=previous if u == 0 else None)
                   for u, (rows, targets, rows_units) in enumerate(shares)]
        self.step = step
        tokens = batch.input_ids.numel() * self.parallel.dp_size
        self.tokens_seen += tokens
        current = _Step(step=step, batch=batch, lr=lr, tokens=tokens, targets=global_targets,
                        first_targets=(sum(t for _, t, _ in shares) if self.objective.capabilities.ledger_over_updates
                                       else shares[0][1]),
                        updates=[values for values, _, _ in updates], metric_names=updates[0][1],
                        maximum_names=updates[0][2], hashes=self._ledger_hashes(batch))
        current.checkpoint_due = self._checkpoint_due(step)
        current.hash_due = self.recorder.param_hash_due(step, current.checkpoint_due, self.config.train.max_steps)
        settle_now = (not (self.config.runtime.deferred_settle and self.objective.settles_late)
                      or current.checkpoint_due or current.hash_due or step == last_step
                      or self._evaluation_due(step))
        if settle_now:
            self._settle(current)
        current.times = guards.end_step(step)
        if not settle_now:
            return current
        self._log(current)
        return None

    def _update_rows(self, batch, update: int, global_targets: int,
                     units: dict[str, int]) -> tuple[Any, int, dict[str, int]]:
        """The rows update ``update`` trains on (``objectives.base.update_batch``) and their global
        counts of targets and units: the whole batch's, counted already, unless the objective chose a share."""
        rows = update_batch(self.objective, batch, update)
        if rows is batch:
            return batch, global_targets, units
        return (rows, *self._global_counts(rows))

    def _global_counts(self, batch) -> tuple[int, dict[str, int]]:
        """The global batch's count of the objective's targets, and of each unit a model's auxiliary
        losses may average over (``training.step.local_units``), summed over ranks in one host
        all-reduce."""
        units = local_units(batch)
        summed = self._all_reduce_host([float(self.objective.num_targets(batch)), *map(float, units.values())])
        return int(summed[0]), {name: int(value) for name, value in zip(units, summed[1:])}

    def _settle(self, done: _Step) -> None:
        """Read a step's values and write its ledger line (and its checkpoint when due); a
        non-finite step stops the run here under ``runtime.on_nonfinite: abort``."""
        timer = self.guards.timer
        reads = [u.read() for u in done.updates]
        for finite, loss, grad_norm, _ in reads:
            if not finite:
                self._handle_nonfinite(done.step, done.batch, loss, grad_norm)
        _, loss, grad_norm, values = reads[0]
        n_metrics, n_maxima = len(done.metric_names), len(done.maximum_names)
        # The metric sums, then the maxima, then the other parts' gradient norms (enqueue_update).
        totals = dict(zip(done.metric_names, values[:n_metrics]))
        maxima = dict(zip(done.maximum_names, values[n_metrics:n_metrics + n_maxima]))
        if self.objective.capabilities.ledger_over_updates:  # every update's sums (first_targets counts them all)
            for *_, later in reads[1:]:
                for i, name in enumerate(done.metric_names):
                    totals[name] += later[i]
                for i, name in enumerate(done.maximum_names):
                    maxima[name] = max(maxima[name], later[n_metrics + i])
        model = model_fields(totals)  # the model's metrics and auxiliary losses (none for Qwen)
        totals = {name: value for name, value in totals.items() if not is_model_sum(name)}
        record = {
            "step": done.step,
            "loss": loss,
            "grad_norm": grad_norm,
            **{grad_norm_field(name): norm for name, norm in zip(self._others, values[n_metrics + n_maxima:])},
            "lr": done.lr,
            "tokens": done.tokens,
            "target_tokens": done.targets,
            **done.hashes,
        }
        if len(reads) > 1:
            record["inner_losses"] = [r[1] for r in reads]
            record["inner_grad_norms"] = [r[2] for r in reads]
        done.fields = {**self.objective.ledger_fields(done.batch, {**totals, **maxima}, done.first_targets), **model}
        record.update(done.fields)
        if not all(r[0] for r in reads):
            record["skipped"] = True
        if done.hash_due:
            with timer.phase("checkpoint"):
                record["param_hash"] = self.parallel.param_hash(self.model)
                for name, part in self._others.items():
                    record[param_hash_field(name)] = self.parallel.param_hash(part.module)
        self.recorder.record(done.step, record, done.batch)
        done.record, done.totals = record, totals
        if done.checkpoint_due:
            with timer.phase("checkpoint"):
                self.save_checkpoint(done.step, reason="interval")
        self._on_settled(done)

    def _settle_late(self, pending: _Step | None) -> None:
        """Settle and log a step left for the next one ahead of its usual place: before a stop's
        checkpoint, or before an injected step-start fault."""
        if pending is not None:
            self._settle(pending)
            self._log(pending)
        return None

    def _log(self, done: _Step) -> None:
        if self.tracker.log(done.step, self._metrics(done)) is not None:
            self.heartbeat.touch()  # rank 0 printed the interval's step line

    def _update(self, step: int, batch, global_targets: int, *, units: dict[str, int], first: bool,
                previous: _Step | None) -> tuple[UpdateValues, list[str], list[str]]:
        """Forward, backward and one optimizer update on the prepared batch, with ``previous``
        settled between the backward and the update. Returns the update's values (not read
        yet) and the names of the metric sums (the objective's and the model's) and maxima among them."""
        guards, timer = self.guards, self.guards.timer
        micro = batch.micro_batches(self.config.train.micro_batch_size)
        with self.recorder.instrument(self.model, step) if first else contextlib.nullcontext():
            local_loss, local_metrics, local_maxima = forward_backward(
                self.model,
                micro,
                objective=self.objective,
                precision=self.precision,
                global_targets=max(global_targets, 1),
                dp_size=self.parallel.dp_size,
                device=self.device,
                no_sync=self.parallel.no_sync,
                timer=timer,
                before_forward=self._before_forward(step),
                backward_context=self.parallel.backward_context,
                poison=lambda loss: guards.faults.poison_loss(step, loss),
                parts=self._other_modules(),
                units=units,
                sum_over_replicas=self._sum_over_replicas,
            )
        with timer.phase("communication"):
            self.parallel.finish_backward()
            loss = self._all_reduce_sum(local_loss) / max(global_targets, 1)
            names, summed = self._all_reduce_metrics(local_metrics)
            maximum_names, maxed = self._all_reduce_maxima(local_maxima)
        if previous is not None:
            with timer.phase("settle"):
                self._settle(previous)
                self._log(previous)
        with timer.phase("optimizer"):
            for part in self.parts.values():
                self.precision.unscale_(part.optimizer)
            policy = self.parts[POLICY]
            grad_norm = self.parallel.clip_grad_norm(policy.module, policy.grad_clip)
            others = [(part.optimizer, self.parallel.clip_grad_norm(part.module, part.grad_clip))
                      for part in self._others.values()]
            # Lazy devices (xla_spmd) run the recorded forward, backward and clipping here,
            # before loss and norm are read, and the update at the second sync; both are no-ops
            # for the torch strategies (training/xla.py explains the two cuts).
            self.parallel.sync()
            parts = [t for t in (summed, maxed) if t is not None]  # read back with the loss, in one copy
            extra = torch.cat(parts) if parts else None
            values = enqueue_update(self.optimizer, self.precision, guards.nonfinite, loss, grad_norm, extra=extra,
                                    parts=others)
            for part in self.parts.values():
                part.optimizer.zero_grad(set_to_none=True)
            after_update = getattr(unwrap(self.model), "after_update", None)
            if after_update is not None:  # state a model moves after each update (a router's balancing bias)
                after_update(self._sum_over_replicas)
            self.parallel.sync()
        return values, names, maximum_names

    def _before_forward(self, step: int) -> Callable[[int], None] | None:
        """What runs before each micro-batch's forward: LoRA dropout keys, and with CUDA-graphed
        blocks the mark of a new iteration (the graphs' outputs of the last micro-batch, whose
        backward has run, may then be overwritten)."""
        keys = self._dropout_keys(step)
        if self.config.parallel.compile_mode != "reduce-overhead":
            return keys

        def before(micro: int) -> None:
            torch.compiler.cudagraph_mark_step_begin()
            if keys is not None:
                keys(micro)

        return before

    def _dropout_keys(self, step: int) -> Callable[[int], None] | None:
        """LoRA dropout: key each micro-batch's masks by (seed, step, data-parallel rank, micro-batch)."""
        if self.config.model.lora.rank == 0 or self.config.model.lora.dropout == 0.0:
            return None
        seed, rank = self.config.train.seed, self.parallel.dp_rank
        return lambda micro: set_dropout_key(self.model, seed=seed, step=step, rank=rank, micro_batch=micro)

    def _ledger_hashes(self, batch) -> dict[str, str]:
        """The ledger's batch and data-state hashes, over every rank's rows and the merged data
        state after this batch (taken before the next batch is drawn)."""
        rows = batch.row_digests()
        gathered = self.dist.all_gather_object((rows, self.data.state_dict()))
        # Tensor-parallel peers hold the same rows: key by global row index.
        all_rows = sorted({i: d for rank_rows, _ in gathered for i, d in rank_rows}.items())
        self._global_data_state = merge_states([state for _, state in gathered])
        return {
            "batch_hash": batch_hash([d for _, d in all_rows]),
            "data_state_hash": state_hash(self._global_data_state),
        }

    def _handle_nonfinite(self, step: int, batch, loss: float, grad_norm: float) -> None:
        if self.config.runtime.on_nonfinite == "skip":
            self.events.emit("nonfinite_skip", step=step, loss=loss, grad_norm=grad_norm)
            self.log.warning("step %d: non-finite loss=%s grad_norm=%s: update skipped", step, loss, grad_norm)
            return
        path = self.guards.dump_provenance(step, batch)
        self.events.emit("nonfinite_abort", step=step, loss=loss, grad_norm=grad_norm, provenance=str(path))
        raise NonFiniteError(
            f"loss={loss} grad_norm={grad_norm} is not finite",
            step=step,
            rank=self.dist.rank,
            provenance=str(path),
            hint="inspect the batch with `python -m data inspect`, or set runtime.on_nonfinite=skip",
        )

    # ------------------------------------------------------------------ checkpoints

    def _checkpoint_due(self, step: int) -> bool:
        interval = self.config.checkpoint.interval
        return self.recorder.records and interval > 0 and step % interval == 0

    def save_checkpoint(self, step: int, *, reason: str) -> None:
        with self.guards.paused():
            path = self.checkpoints.save(
                step,
                model=self.model,
                optimizer=self.optimizer,
                parts=self._trained_states(),
                states={
                    TRAINER_PART: self.trainer_state(),
                    DATA_PART: self._global_data_state,
                    OBJECTIVE_PART: {**self.objective.state_dict(), "frozen": self.frozen_identity()},
                },
                after_shards=lambda: self.guards.faults.maybe_crash_in_checkpoint(step),
            )
        if self.dist.is_main:
            self.events.emit("checkpoint_saved", step=step, path=str(path), reason=reason)

    def trainer_state(self) -> dict[str, Any]:
        return {
            "version": TRAINER_STATE_VERSION,
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "precision": self.precision.state_dict(),
            "world_size": self.dist.world_size,
            "strategy": self.config.parallel.strategy,
            "guards": self.guards.state_dict(),
        }

    def frozen_identity(self) -> dict[str, dict[str, str]]:
        """Path and sha256 of every frozen model: the objective's, and a LoRA run's base."""
        base = self.parallel.base_identity
        return {**self.objective.frozen_identity(), **({"base": base} if base is not None else {})}

    def _load_objective_state(self, state: dict[str, Any] | None, path: Path) -> None:
        """The objective's state and the identity of its frozen models, as the checkpoint has them.
        A checkpoint from before objectives existed has none: it was pretraining."""
        if state is None:
            if not self.objective.capabilities.resumes_stateless_checkpoints:
                raise CheckpointError(
                    f"the checkpoint has no objective state, this run trains {self.objective.name!r}",
                    path=str(path), hint="resume with the run's objective.kind",
                )
            return
        state = dict(state)
        check_frozen(self.frozen_identity(), state.pop("frozen", {}))
        self.objective.load_state_dict(state)

    def _on_corrupt_checkpoint(self, step: int, path: Path, reason: str) -> None:
        self.events.emit("checkpoint_corrupt", step=step, path=str(path), reason=reason)
        self.log.warning("checkpoint step %d at %s is damaged (%s): using an older one", step, path, reason)

    # ------------------------------------------------------------------ evaluation

    def _evaluation_due(self, step: int) -> bool:
        every = self.config.train.eval_interval
        return every > 0 and step % every == 0 and (self.eval_data_factory is not None
                                                    or self.generation_eval is not None)

    def maybe_evaluate(self, step: int) -> None:
        if not self._evaluation_due(step):
            return
        self.guards.heartbeat(step, "eval")
        self.heartbeat.at(step, "evaluating")
        self._set_training(False)
        total = torch.zeros(2, dtype=torch.float64, device=self._reduce_device)
        sums: dict[str, torch.Tensor] = {}  # the objective's metric sums (e.g. DPO accuracy)
        # Long evaluations (GRPO decodes every held-out prompt) count their batches on the console.
        progress = Progress(f"eval step {step}", self.config.train.eval_batches, unit="batches",
                            enabled=self.dist.is_main, print_fn=self.log.info)
        # Schedule-free optimizers evaluate their averaged weights (training/optimizers/build.py).
        held_out = self.eval_data_factory() if self.eval_data_factory is not None else contextlib.nullcontext(iter(()))
        generated: dict[str, float] = {}  # train.eval_generate's sums, over its own prompts
        with torch.no_grad(), evaluation_weights(self.optimizer, self.model), held_out as eval_data, progress:
            for _ in range(self.config.train.eval_batches):
                try:
                    batch = self.objective.prepare(next(eval_data).for_evaluation())
                except StopIteration:
                    break
                for micro in batch.micro_batches(self.config.train.micro_batch_size):
                    with self.precision.autocast():
                        out = self._loss(micro)
                    total[0] += out.sum.double().to(total.device)
                    total[1] += out.count
                    for name, value in out.metrics.items():
                        sums[name] = sums.get(name, 0) + value.detach().double().to(total.device)
                progress.advance()
                self.guards.heartbeat(step, "eval")  # the watchdog bounds one eval batch, not the whole eval
            if self.generation_eval is not None:
                generated = self.generation_eval.evaluate(
                    self.model, on_batch=lambda: self.guards.heartbeat(step, "eval"))
        self._set_training(True)
        self.dist.all_reduce(total)
        total /= self.parallel.tp_size  # tensor-parallel peers evaluated the same rows
        eval_loss = float(total[0] / total[1]) if total[1] > 0 else float("nan")
        names = sorted(sums)  # every rank's objective reports the same metric names
        metric_sums = self.dist.all_reduce(torch.stack([sums[n] for n in names])) / self.parallel.tp_size \
            if names else None
        means = {n: float(v) / max(float(total[1]), 1.0) for n, v in zip(names, metric_sums)} if names else {}
        means.update(self._generation_means(generated))
        line = self.objective.console.eval  # the unit the eval loss averages over, and the method's fields
        if self.dist.is_main:  # ``tokens``: the count of units (named so before units were recorded)
            self.events.emit("eval", step=step, loss=eval_loss if total[1] > 0 else None, tokens=int(total[1]),
                             unit=line.unit,
                             **({"metrics": means} if means else {}))
        values = {"loss": eval_loss, **{metric(name): value for name, value in means.items()}}
        if self.eval_data_factory is not None:  # else train.eval_generate alone: its line below
            self.log.info("%s", eval_line(step, int(total[1]), values, line))
        if generated:
            self.log.info("eval step %d, generation: %s", step, ", ".join(
                f"{n} {v:.0f}" if n == GenerationEvaluation.COUNT else f"{n} {v:.4f}"
                for n, v in means.items() if n.startswith(GenerationEvaluation.PREFIX)))

    def _generation_means(self, local: dict[str, float]) -> dict[str, float]:
        """train.eval_generate's metric sums over the ranks, divided by its prompts (``generate/prompts``
        is kept as the count)."""
        if not local:
            return {}
        names = sorted(local)
        sums = torch.tensor([local[n] for n in names], dtype=torch.float64, device=self._reduce_device)
        sums = self.dist.all_reduce(sums) / self.parallel.tp_size  # tensor-parallel peers decoded the same rows
        totals = dict(zip(names, sums.tolist()))
        prompts = totals[GenerationEvaluation.COUNT]
        return {n: (v if n == GenerationEvaluation.COUNT else v / max(prompts, 1.0)) for n, v in totals.items()}

    # ------------------------------------------------------------------ parts

    def _other_modules(self) -> dict[str, nn.Module]:
        """The modules trained beside the policy, by name, as the objective's ``loss`` gets them."""
        return {name: part.module for name, part in self._others.items()}

    def _trained_states(self) -> dict[str, tuple[nn.Module, torch.optim.Optimizer]]:
        """The parts besides the policy as the checkpoint stores them (each its own part)."""
        return {name: (part.module, part.optimizer) for name, part in self._others.items()}

    def _loss(self, micro):
        """An evaluation micro-batch's loss (the step's goes through ``forward_backward``)."""
        others = self._other_modules()
        return self.objective.loss(self.model, micro, others) if others else self.objective.loss(self.model, micro)

    def _set_training(self, mode: bool) -> None:
        for part in self.parts.values():
            part.module.train(mode)

    # ------------------------------------------------------------------ helpers

    @property
    def _reduce_device(self) -> torch.device:
        return self.device if self.dist.backend == "nccl" else torch.device("cpu")

    def _all_reduce_sum(self, value):
        """The sum of a per-replica value over the data-parallel replicas. Tensor-parallel peers
        hold the same rows and compute the same value, so the sum over all ranks counts each
        replica tp times."""
        if isinstance(value, torch.Tensor) and not self.dist.is_distributed:
            # Nothing to reduce. The value stays where it is: reading a lazy XLA loss here
            # would run the forward as a graph of its own before the step's graph.
            return value.detach().float()
        tp = self.parallel.tp_size
        if isinstance(value, torch.Tensor):
            t = value.detach().to(self._reduce_device, torch.float32).clone()
            return self.dist.all_reduce(t) / tp if tp > 1 else self.dist.all_reduce(t)
        # A host number is reduced on the host (gloo): a device collective would make the
        # host wait for the GPU's queue before it could go on.
        t = torch.tensor([value], dtype=torch.float64)
        return float(self.dist.host_all_reduce(t)[0]) / tp

    def _sum_over_replicas(self, tensor: torch.Tensor) -> torch.Tensor:
        """An integer tensor summed exactly over the data-parallel replicas (``after_update``'s reducer):
        int64 over all ranks, divided by the tensor-parallel peers that counted the same rows."""
        if not self.dist.is_distributed:
            return tensor
        t = self.dist.all_reduce(tensor.detach().to(self._reduce_device, torch.int64).clone())
        return t // self.parallel.tp_size

    def _all_reduce_host(self, values: list[float]) -> list[float]:
        """Per-replica host numbers summed over the data-parallel replicas on the host (gloo), as
        ``_all_reduce_sum`` sums one."""
        t = torch.tensor(values, dtype=torch.float64)
        return (self.dist.host_all_reduce(t) / self.parallel.tp_size).tolist()

    def _all_reduce_metrics(self, local: dict[str, torch.Tensor]) -> tuple[list[str], torch.Tensor | None]:
        """The objective's metric sums over micro-batches and ranks (one all-reduce), as names
        and a device vector that ``enqueue_update`` reads back with the loss."""
        if not local:
            return [], None
        names = sorted(local)
        stacked = torch.stack([local[n].reshape(()).to(torch.float32) for n in names])
        return names, self._all_reduce_sum(stacked) if self.dist.is_distributed else stacked

    def _all_reduce_maxima(self, local: dict[str, torch.Tensor]) -> tuple[list[str], torch.Tensor | None]:
        """The objective's maxima over micro-batches and ranks (one all-reduce by max; tensor-parallel
        peers' equal values change nothing), as names and a vector read back with the loss."""
        if not local:
            return [], None
        names = sorted(local)
        stacked = torch.stack([local[n].reshape(()).to(torch.float32) for n in names])
        if self.dist.is_distributed:
            stacked = self.dist.all_reduce(stacked.to(self._reduce_device), op="max")
        return names, stacked

    def _metrics(self, done: _Step) -> dict[str, float]:
        record, times = done.record, done.times
        step_time = max(sum(times.values()), 1e-9)
        local_tokens = done.batch.input_ids.numel()
        metrics = {metric(name): value / max(done.first_targets, 1) for name, value in done.totals.items()}
        metrics.update({
            "loss": record["loss"],
            "grad_norm": record["grad_norm"],
            **{grad_norm_field(name): record[grad_norm_field(name)] for name in self._others},
            "lr": record["lr"],
            "step_time": step_time,
            "tokens_per_s": local_tokens / step_time,
            "tokens": float(local_tokens),
        })
        # The objective's numeric ledger fields (every rank computes the same ones).
        metrics.update({k: float(v) for k, v in done.fields.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
        metrics["data/bad_records_skipped"] = float(self.data.stats().get("bad_records_skipped", 0))
        metrics.update({f"time_{k}": v for k, v in times.items()})
        metrics.update(self.guards.memory())
        return metrics
