"""The trainer: restore -> steps -> ledger and metrics -> checkpoints -> clean shutdown.

``Trainer.fit()`` owns the lifecycle of a run. Each step:

1. take the next batch (the data state *after* it travels with it),
2. forward/backward over micro-batches, loss normalized by the global target tokens,
3. all-reduce the loss, clip gradients, agree across ranks that everything is finite,
4. update (or skip, under ``runtime.on_nonfinite: skip``),
5. gather the batch and data-state hashes, write the ledger line (rank 0),
6. checkpoint when due (the ledger line is already on disk, so a checkpoint never exists
   without its line), log metrics, evaluate when due, stop if any rank was signalled.

The same class replays a recorded run (``ReplaySpec``): nothing is written to the run, each
computed line is compared with the recorded one, and the first difference raises
``DeterminismError``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from core.config import Config
from core.distributed_context import DistributedContext
from core.exceptions import DataError, DeterminismError, NonFiniteError
from core.logging import EventLog, get_logger
from core.run_context import RunContext
from data.hashing import batch_hash, sequence_digest, state_hash
from data.state import merge_states
from training import ledger as ledger_lib
from training.checkpointing import CheckpointManager, restore_rng_state
from training.guards import Guards
from training.losses import CausalLMLoss, Loss
from training.optim import build_optimizer, set_lr
from training.precision import Precision
from training.schedule import lr_at
from training.step import apply_update, forward_backward, model_logits

TRAINER_STATE_VERSION = 1


@dataclass
class ReplaySpec:
    """Replay steps up to ``step`` and compare them with ``recorded`` ledger lines."""

    step: int
    recorded: dict[int, dict[str, Any]]
    dump: Any = None  # training.replay.StepDump: instruments and writes step ``step``


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
        loss_fn: Loss | None = None,
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
        self.loss_fn = loss_fn or CausalLMLoss(
            chunk_tokens=config.train.loss_chunk_tokens, compiled=config.parallel.compile
        )
        self.fuse_head = getattr(self.loss_fn, "fuses_head", False) and parallel.output_weight_is_local
        self.replay = replay
        self.log = get_logger()
        self.device = parallel.device  # where the step runs; dist.device unless xla_spmd (XLA)
        self.precision = Precision(config.parallel, device=self.device, wrapper_casts=parallel.fsdp_applied)
        self.optimizer = build_optimizer(model, config.train, self.device)
        self.ledger = ledger_lib.Ledger(run.paths.ledger, writer=dist.is_main and replay is None)
        self.checkpoints = CheckpointManager(
            config.checkpoint,
            checkpoint_dir=run.paths.checkpoints,
            dist=dist,
            on_corrupt=self._on_corrupt_checkpoint,
            read_only=replay is not None,
        )
        self.step = 0
        self.tokens_seen = 0
        self._global_data_state: dict[str, Any] | None = None

    # ------------------------------------------------------------------ lifecycle

    def fit(self) -> FitResult:
        first_step = self.restore() + 1
        self._data_iter = iter(self.data)
        last_step = self.replay.step if self.replay else self.config.train.max_steps
        result = FitResult(status="finished", first_step=first_step, last_step=first_step - 1)
        started = time.perf_counter()
        self.guards.start()
        try:
            for step in range(first_step, last_step + 1):
                record = self.train_one_step(step)
                result.last_step = step
                result.tokens += record["tokens"]
                if result.first_loss is None:
                    result.first_loss = record["loss"]
                result.last_loss = record["loss"]
                if self.replay is not None:
                    continue
                self.maybe_evaluate(step)
                if step < last_step and self.guards.should_stop(self.dist):
                    self.save_checkpoint(step, reason="signal")
                    self.events.emit("stopped", step=step, signal=self.guards.stop_reason())
                    result.status = "stopped"
                    break
            else:
                if self.replay is None and self.config.checkpoint.at_end and last_step >= first_step:
                    if self.checkpoints.latest_step != last_step:
                        self.save_checkpoint(last_step, reason="end")
            self.checkpoints.wait()
        finally:
            self.guards.close()
        result.seconds = time.perf_counter() - started
        if self.replay is not None:
            result.status = "replayed"
        return result

    def restore(self) -> int:
        """Load the newest intact checkpoint (<= replay step - 1 when replaying); returns its step."""
        max_step = self.replay.step - 1 if self.replay else None
        found = self.checkpoints.latest_intact(max_step=max_step)
        if found is None:
            if self.run.resumed and self.replay is None:
                self.log.info("no intact checkpoint: the resumed run starts from step 1")
            self.ledger.truncate_after(0)
            return 0
        step, path = found
        loaded = self.checkpoints.load(path, model=self.model, optimizer=self.optimizer)
        self.parallel.after_load(self.model, self.optimizer)
        state = loaded.trainer_state
        if state.get("version") != TRAINER_STATE_VERSION:
            raise DataError(f"trainer state version {state.get('version')} is not supported", file=str(path))
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        self.precision.load_state_dict(state["precision"])
        self.guards.load_state_dict(state["guards"])
        self.data.load_state_dict(loaded.data_state)
        self._global_data_state = loaded.data_state
        if loaded.rng_state is not None:
            restore_rng_state(loaded.rng_state, self.device)
        self.ledger.truncate_after(step)
        self.events.emit("resumed" if self.replay is None else "replay_restored", step=step, path=str(path))
        self.log.info("restored checkpoint step %d from %s", step, path)
        return step

    # ------------------------------------------------------------------ one step

    def train_one_step(self, step: int) -> dict[str, Any]:
        guards, timer = self.guards, self.guards.timer
        guards.begin_step(step)
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
        guards.faults.before_step(step)

        lr = lr_at(step, self.config.train)
        set_lr(self.optimizer, lr)
        local_targets = self.loss_fn.num_targets(batch)
        global_targets = int(self._all_reduce_sum(float(local_targets)))
        micro = batch.micro_batches(self.config.train.micro_batch_size)
        instrument = (
            self.replay.dump.attach(self.model)
            if self.replay is not None and self.replay.dump is not None and step == self.replay.step
            else contextlib.nullcontext()
        )
        with instrument:
            local_loss = forward_backward(
                self.model,
                micro,
                loss_fn=self.loss_fn,
                precision=self.precision,
                global_targets=max(global_targets, 1),
                dp_size=self.parallel.dp_size,
                device=self.device,
                no_sync=self.parallel.no_sync,
                timer=timer,
                poison=lambda loss: guards.faults.poison_loss(step, loss),
                place=self.parallel.place_batch,
                fuse_head=self.fuse_head,
            )
        with timer.phase("communication"):
            loss = self._all_reduce_sum(local_loss) / max(global_targets, 1)
        with timer.phase("optimizer"):
            self.precision.unscale_(self.optimizer)
            grad_norm = self.parallel.clip_grad_norm(self.model, self.config.train.grad_clip)
            # Lazy devices (xla_spmd) run the recorded forward, backward and clipping here,
            # before loss and norm are read, and the update at the second sync; both are no-ops
            # for the torch strategies (training/xla.py explains the two cuts).
            self.parallel.sync()
            finite, loss, grad_norm = apply_update(self.optimizer, self.precision, guards.nonfinite, loss, grad_norm)
            self.optimizer.zero_grad(set_to_none=True)
            self.parallel.sync()
            if not finite:
                self._handle_nonfinite(step, batch, loss, grad_norm)
        self.step = step
        tokens = batch.input_ids.numel() * self.parallel.dp_size
        self.tokens_seen += tokens

        record = self._ledger_record(step, batch, loss, grad_norm, lr, tokens, global_targets)
        if not finite:
            record["skipped"] = True
        due = self._checkpoint_due(step)
        if self._param_hash_due(step, due):
            with timer.phase("checkpoint"):
                record["param_hash"] = self.parallel.param_hash(self.model)
        if self.replay is not None:
            self._compare(step, record)
            if step == self.replay.step and self.replay.dump is not None:
                self.replay.dump.write(batch, record)
        else:
            self.ledger.append(record)
            if due:
                with timer.phase("checkpoint"):
                    self.save_checkpoint(step, reason="interval")
        times = guards.end_step(step)
        self.tracker.log(step, self._metrics(record, times, batch))
        return record

    def _ledger_record(self, step, batch, loss, grad_norm, lr, tokens, targets) -> dict[str, Any]:
        rows = [(i, sequence_digest(row)) for i, row in zip(batch.sequence_index, batch.input_ids)]
        gathered = self.dist.all_gather_object((rows, self.data.state_dict()))
        # Tensor-parallel peers hold the same rows: key by global row index.
        all_rows = sorted({i: d for rank_rows, _ in gathered for i, d in rank_rows}.items())
        self._global_data_state = merge_states([state for _, state in gathered])
        return {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": tokens,
            "target_tokens": targets,
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

    def _compare(self, step: int, record: dict[str, Any]) -> None:
        expected = self.replay.recorded.get(step)
        if expected is None:
            raise DeterminismError(f"the run's ledger has no line for step {step}", step=step)
        field_name = ledger_lib.first_mismatch(expected, record)
        if field_name is not None:
            raise DeterminismError(
                f"{field_name} differs: recorded {expected.get(field_name)!r}, replayed {record.get(field_name)!r}",
                step=step,
                field=field_name,
                rank="all" if self.dist.world_size > 1 else 0,
                hint="compare meta.json environments; see docs/determinism.md",
            )
        self.log.info("replay step %d matches the ledger", step)

    # ------------------------------------------------------------------ checkpoints

    def _param_hash_due(self, step: int, checkpoint_due: bool) -> bool:
        """Checkpoint steps and the last step; a replay hashes where the recorded line did."""
        if self.replay is not None:
            return "param_hash" in self.replay.recorded.get(step, {})
        return checkpoint_due or step == self.config.train.max_steps

    def _checkpoint_due(self, step: int) -> bool:
        interval = self.config.checkpoint.interval
        return self.replay is None and interval > 0 and step % interval == 0

    def save_checkpoint(self, step: int, *, reason: str) -> None:
        with self.guards.paused():
            path = self.checkpoints.save(
                step,
                model=self.model,
                optimizer=self.optimizer,
                trainer_state=self.trainer_state(),
                data_state=self._global_data_state,
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

    def _on_corrupt_checkpoint(self, step: int, path: Path, reason: str) -> None:
        self.events.emit("checkpoint_corrupt", step=step, path=str(path), reason=reason)
        self.log.warning("checkpoint step %d at %s is damaged (%s): using an older one", step, path, reason)

    # ------------------------------------------------------------------ evaluation

    def maybe_evaluate(self, step: int) -> None:
        every = self.config.train.eval_interval
        if every <= 0 or step % every or self.eval_data_factory is None:
            return
        self.guards.heartbeat(step, "eval")
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64, device=self._reduce_device)
        with torch.no_grad(), self.eval_data_factory() as eval_data:
            for _ in range(self.config.train.eval_batches):
                try:
                    batch = next(eval_data)
                except StopIteration:
                    break
                for micro in batch.micro_batches(self.config.train.micro_batch_size):
                    with self.precision.autocast():
                        logits = model_logits(self.model, micro, self.parallel.place_batch)
                    total[0] += self.loss_fn(logits, micro).double().to(total.device)
                    total[1] += self.loss_fn.num_targets(micro)
        self.model.train()
        self.dist.all_reduce(total)
        eval_loss = float(total[0] / total[1]) if total[1] > 0 else float("nan")
        if self.dist.is_main:
            self.events.emit("eval", step=step, loss=eval_loss, tokens=int(total[1]))
        self.log.info("eval step %d: loss %.4f over %d tokens", step, eval_loss, int(total[1]))

    # ------------------------------------------------------------------ helpers

    @property
    def _reduce_device(self) -> torch.device:
        return self.device if self.dist.backend == "nccl" else torch.device("cpu")

    def _all_reduce_sum(self, value):
        if isinstance(value, torch.Tensor) and not self.dist.is_distributed:
            # Nothing to reduce. The value stays where it is: reading a lazy XLA loss here
            # would run the forward as a graph of its own before the step's graph.
            return value.detach().float()
        if isinstance(value, torch.Tensor):
            t = value.detach().to(self._reduce_device, torch.float32).clone()
            return self.dist.all_reduce(t)
        t = torch.tensor([value], dtype=torch.float64, device=self._reduce_device)
        return float(self.dist.all_reduce(t)[0])

    def _metrics(self, record: dict[str, Any], times: dict[str, float], batch) -> dict[str, float]:
        step_time = max(sum(times.values()), 1e-9)
        local_tokens = batch.input_ids.numel()
        metrics = {
            "loss": record["loss"],
            "grad_norm": record["grad_norm"],
            "lr": record["lr"],
            "step_time": step_time,
            "tokens_per_s": local_tokens / step_time,
            "tokens": float(local_tokens),
        }
        metrics.update({f"time_{k}": v for k, v in times.items()})
        metrics.update(self.guards.memory())
        return metrics
