"""Replay one step of a recorded run, bit for bit, and optionally dump what it saw.

``--replay RUN_ID --step S`` restores the newest intact checkpoint at or before S-1, runs to
S without writing anything into the run, and compares every ledger field of every replayed
step with the recorded line (``DeterminismError``, exit 5, on the first difference).
``--dump DIR`` writes step S's batch (token ids and document provenance) and per-layer
activation and gradient statistics.

The frozen models (reference, teacher, reward models, a LoRA run's base) must be those the run
used: the restored checkpoint's recorded identities are checked as on a resume; a replay from step
1, with no checkpoint before it, checks them against the newest of the run's checkpoints that
records them (``recorded_frozen``; a run's frozen models never change, a resume refuses that), so a
model changed on disk is a CheckpointError naming it and both hashes (exit 4), never a step that
differs (exit 5). A run without any checkpoint has no record of them.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from core.exceptions import ResumeError
from core.layout import RunPaths, list_steps, state_file_name, step_dir_name
from distributed.model_structure import declared_plans
from training.record import ledger as ledger_lib


TEMPORARY_PREFIX = "lockstep-replay-"


def temporary_output_dir(run_id: str, step: int) -> Path:
    """A fresh directory for a replay without ``--dump``: its logs, and its diagnostics if it fails."""
    return Path(tempfile.mkdtemp(prefix=f"{TEMPORARY_PREFIX}{run_id}-step{step}-"))


def discard_temporary_output(directory: Path) -> bool:
    """Remove a replay's temporary directory once every step matched (nothing in it to look
    at); a ``--dump DIR`` is never one. Returns whether it was removed."""
    directory = Path(directory)
    if directory.parent != Path(tempfile.gettempdir()) or not directory.name.startswith(TEMPORARY_PREFIX):
        return False
    shutil.rmtree(directory, ignore_errors=True)
    return not directory.exists()


def recorded_ledger(paths: RunPaths, step: int) -> dict[int, dict[str, Any]]:
    lines = ledger_lib.read(paths.ledger)
    ledger_lib.check_sequence(lines, paths.ledger)  # a gap is reported as such, not as a mismatch
    records = {r["step"]: r for r in lines}
    if step not in records:
        last = max(records) if records else 0
        raise ResumeError(
            f"step {step} is not in the ledger of {paths.root.name} (it has steps 1..{last})",
            step=step,
            hint=f"pick a step between 1 and {last}",
        )
    return records


def recorded_frozen(paths: RunPaths) -> dict[str, dict[str, str]] | None:
    """The frozen models' identities ({role: {"path", "sha256"}}) in the run's newest checkpoint
    whose objective state records them, or None where no checkpoint does (module docstring)."""
    for step in reversed(list_steps(paths.checkpoints)):
        file = paths.checkpoints / step_dir_name(step) / state_file_name(OBJECTIVE_PART)
        try:
            frozen = json.loads(file.read_text()).get("frozen")
        except (OSError, ValueError, AttributeError):
            continue  # a damaged or partial checkpoint: an older one records the same models
        if isinstance(frozen, dict):
            return frozen
    return None


OBJECTIVE_PART = "objective"
"""The checkpoint part whose state records the frozen models (training/loop.py writes it)."""


class StepDump:
    """Collects per-layer statistics during one step and writes the dump directory."""

    def __init__(self, out_dir: Path, *, rank: int) -> None:
        self.out_dir = out_dir
        self.rank = rank
        self.activations: dict[str, dict[str, float]] = {}
        self.output_grads: dict[str, dict[str, float]] = {}
        self.param_grads: dict[str, dict[str, float]] = {}

    @contextlib.contextmanager
    def attach(self, model: nn.Module) -> Iterator[None]:
        handles = []
        for name, module in _layers(model):
            handles.append(module.register_forward_hook(self._forward_hook(name)))
            handles.append(module.register_full_backward_hook(self._backward_hook(name)))
        for name, param in model.named_parameters():
            if param.requires_grad:
                handles.append(param.register_hook(self._param_hook(name)))
        try:
            yield
            # FSDP2 computes gradients on unsharded copies and writes the reduced shard to each
            # parameter's .grad, so the hooks above never fire there: after the backward, read
            # what they missed from .grad (this rank's shard, a DTensor's local part).
            for name, param in model.named_parameters():
                if param.requires_grad and param.grad is not None and name not in self.param_grads:
                    _accumulate(self.param_grads, name, param.grad)
        finally:
            for handle in handles:
                handle.remove()

    def _forward_hook(self, name: str):
        def hook(_module, _inputs, output):
            tensor = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(tensor, torch.Tensor):
                _accumulate(self.activations, name, tensor)

        return hook

    def _backward_hook(self, name: str):
        def hook(_module, _grad_in, grad_out):
            if grad_out and isinstance(grad_out[0], torch.Tensor):
                _accumulate(self.output_grads, name, grad_out[0])

        return hook

    def _param_hook(self, name: str):
        def hook(grad):
            _accumulate(self.param_grads, name, grad)
            return grad

        return hook

    def write(self, batch, record: dict[str, Any]) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        prefix = self.out_dir / f"rank{self.rank}"
        torch.save(
            {
                "input_ids": batch.input_ids,
                "labels": batch.labels,
                "position_ids": batch.position_ids,
                "document_ids": batch.document_ids,
                "sequence_index": list(batch.sequence_index),
            },
            f"{prefix}_batch.pt",
        )
        provenance = [
            {"sequence_index": idx, "documents": [_plain(span) for span in spans]}
            for idx, spans in zip(batch.sequence_index, batch.provenance)
        ]
        summary = {
            "step": batch.step,
            "rank": self.rank,
            "ledger": record,
            "provenance": provenance,
            "activations": self.activations,
            "output_grads": self.output_grads,
            "param_grads": self.param_grads,
        }
        Path(f"{prefix}_step.json").write_text(json.dumps(summary, indent=1, sort_keys=True, default=str))


def _layers(model: nn.Module):
    """Named sub-modules worth a line each, as the model's parallel plan names them: the
    embedding, every block of every stack, the root modules (final norm) and the output head."""
    for prefix, plan in declared_plans(model):
        paths = [plan.embedding, *(f"{stack.path}.{index}" for stack in plan.stacks
                                   for index in range(len(model.get_submodule(prefix + stack.path)))),
                 *plan.root_modules, plan.output]
        for path in paths:
            yield prefix + path, model.get_submodule(prefix + path)


def _accumulate(table: dict[str, dict[str, float]], name: str, tensor: torch.Tensor) -> None:
    t = tensor.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    t = t.float()
    stats = table.setdefault(name, {"count": 0, "sum_sq": 0.0, "absmax": 0.0, "mean_sum": 0.0, "numel": 0})
    stats["count"] += 1
    stats["numel"] += t.numel()
    stats["sum_sq"] += float(t.pow(2).sum())
    stats["mean_sum"] += float(t.sum())
    stats["absmax"] = max(stats["absmax"], float(t.abs().max())) if t.numel() else stats["absmax"]
    stats["rms"] = (stats["sum_sq"] / max(stats["numel"], 1)) ** 0.5
    stats["mean"] = stats["mean_sum"] / max(stats["numel"], 1)
    stats["nonfinite"] = stats.get("nonfinite", 0) + int((~torch.isfinite(t)).sum())


def _plain(span: Any) -> Any:
    return asdict(span) if is_dataclass(span) else span
