"""Checkpoints that restore a run bit for bit: save, find the newest intact one, load.

The on-disk format (layout, manifest, verification) lives in ``training.checkpoint.manifest``.
Model and optimizer go through ``get_state_dict``/``set_state_dict`` with canonical FQNs
(no ``module.``/``_orig_mod.`` prefixes) and a flattened optimizer state, so one code path
serves a plain module, DDP and FSDP2, and a checkpoint saved under one strategy or world
size loads under another. Each trained part (training/parts.py) is saved that way under its
own DCP keys (``part_keys``): the policy under ``model``/``optim``, the layout of every
single-model checkpoint, any other part under ``parts.<name>.``.

Save protocol (all ranks take part; rank 0 does the directory work):
1. stage: every rank takes its state dict (a copy when saving asynchronously, see below),
   captures its RNG state and encodes the JSON states, so a bad state fails before any
   file is written;
2. rank 0 removes leftovers of crashed saves (``.tmp-*``) and creates
   ``.tmp-step_<N>-<nonce>`` next to the final place (same filesystem), and broadcasts it;
3. every rank writes its DCP shards (fsynced by DCP) and its own files (fsynced);
4. the files are hashed, split across ranks; rank 0 writes the manifest, re-reads and
   checks it against the directory, fsyncs every directory, renames the temporary
   directory into place, fsyncs the parent, then replaces ``LATEST`` atomically (write
   ``LATEST.tmp``, fsync, ``os.replace``, fsync) and applies retention.
A crash at any point leaves ``LATEST`` naming the previous complete checkpoint.

Asynchronous save (``checkpoint.async_save``). ``save()`` blocks for steps 1-2 only (staging,
plus one small broadcast); steps 3-4 run in a background thread. Staging copies the tensors
so that later optimizer steps cannot change what is written (``checkpoint.staging``):
``host`` copies them into reused host buffers on the loop's thread; ``device`` clones them
on their device and leaves the device-to-host copy (through two small pinned chunks into
pageable buffers, ``SnapshotBuffers``) to the background thread (``DeviceSnapshot``);
``auto`` is ``device`` where
the snapshot fits in free device memory. Each rank decides for itself: the choice changes
no collective. Steps 3-4 need collectives (DCP plans its shards across ranks; hashing and
the final outcome are shared), and collectives issued from a second thread on the training
loop's process group could interleave with the loop's own all-reduces and deadlock or
corrupt both. The manager therefore creates, once in its constructor, a dedicated gloo
process group used for *every* checkpoint collective, on both the main and the background
thread. Gloo groups
are independent communicators, so they run safely beside the training group (this is
the arrangement torch's own ``async_save`` asks for); gloo is right here because DCP only
exchanges small pickled plans, never tensors. Only one save is in flight: ``save()`` and
every other collective method first ``wait()``, which joins the thread and re-raises a
background failure as ``CheckpointError`` on every rank (rank 0's outcome is broadcast).

Optimizer state at load. ``get_state_dict`` on a never-stepped optimizer initializes it by
taking an optimizer step with zero gradients and a zero learning rate. That touches the
parameters and the step counters, so it is avoided on both paths:
- save: an optimizer without state saves no optimizer entries (``has_optimizer_state``
  is false in the manifest), and a load of such a checkpoint clears the optimizer state;
- load: every parameter without state gets zero placeholders shaped like the parameter
  (DTensor-aware, via ``zeros_like``) or like a scalar, for each state name the checkpoint
  holds (dtype from the checkpoint metadata). The placeholders are the targets DCP loads
  into; nothing steps. Parameters that had no state at save time have it removed again.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from core.config import CheckpointConfig
from core.distributed_context import DistributedContext
from core.exceptions import CheckpointError
from core.logging import get_logger
from distributed.params import canonical_named_parameters
from training.checkpoint.state import (
    OPTIM_KEY,
    DeviceSnapshot,
    HostBuffers,
    SnapshotBuffers,
    add_optimizer_placeholders,
    capture_rng_state,
    check_nothing_left_behind,
    cuda_bytes,
    drop_state_absent_from_checkpoint,
    encode_rng_state,
    has_optimizer_state,
    restore_rng_state,
    tensor_bytes,
)
from distributed.safe_dcp import SafeFileSystemReader
from training.checkpoint.manifest import (
    DATA_PART,
    DCP_DIR,
    EXTRA_DIR,
    LATEST_TMP_NAME,
    MANIFEST_NAME,
    TMP_PREFIX,
    TRAINER_PART,
    CheckpointCorruptError,
    CheckpointFormatError,
    CheckpointManifest,
    check_hashes,
    check_header,
    check_listing,
    encode_json_state,
    extra_file_name,
    fsync_dir,
    fsync_dirs_below,
    hash_file,
    list_files,
    list_steps,
    parse_step_dir_name,
    part_of_state_file,
    read_latest,
    read_manifest,
    rng_file_name,
    state_file_name,
    step_dir_name,
    verify_checkpoint,
    write_file_durably,
    write_latest,
)

# A one-process run saves with no process group on purpose (no_dist); DCP warns about that at
# every save, in the middle of the console's step lines.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointFormatError",
    "CheckpointManager",
    "LoadedCheckpoint",
    "capture_rng_state",
    "restore_rng_state",
    "verify_checkpoint",
]

log = get_logger()

MODEL_KEY = "model"
PARTS_KEY = "parts"
POLICY_PART = "policy"
_GIB = 1 << 30

# ``staging: auto`` snapshots on the device only with this much headroom beyond the snapshot
# (fraction of it, plus bytes): the allocator needs slack for fragmentation.
_SNAPSHOT_MARGIN = 0.1
_SNAPSHOT_RESERVE_BYTES = 2 * _GIB
# Threads (and so DCP files) per rank for writing and hashing a checkpoint. With one, a
# Qwen3-1.7B save (22 GB on one rank) became visible 65 s after it started on an H200 host.
_IO_THREADS = max(1, min(4, (os.cpu_count() or 1) // 2))

# A checkpoint's files hold its tensors' bytes plus metadata, manifests and RNG states.
_FREE_SPACE_MARGIN = 1.05
# A save that waits this long for the previous one to finish is reported: the saves come
# faster than they are written, and the wait is on the training loop.
_SLOW_WAIT_WARN_S = 1.0


_STATE_DICT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True)
# Frozen parameters (a LoRA run's base) are not saved: the run identifies them instead
# (path + sha256, verified on resume). Loading then leaves them out of the request, so the
# model's own load_state_dict must not ask for them (strict=False); DCP still refuses a
# requested tensor the checkpoint lacks, and check_nothing_left_behind one it has in excess.
_LOAD_OPTIONS_WITH_FROZEN = StateDictOptions(flatten_optimizer_state_dict=True, ignore_frozen_params=True,
                                             strict=False)


def _load_options(model: nn.Module) -> StateDictOptions:
    frozen = any(not p.requires_grad for p in model.parameters())
    return _LOAD_OPTIONS_WITH_FROZEN if frozen else _STATE_DICT_OPTIONS


def _without_frozen(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """The model state without frozen parameters under *any* of their names: ignore_frozen_params
    drops each parameter under one name only, and would keep a tied alias (the output head
    tied to a frozen embedding: the whole vocabulary matrix in every LoRA checkpoint)."""
    frozen = {name for name, param in canonical_named_parameters(model) if not param.requires_grad}
    return {key: value for key, value in state.items() if key not in frozen} if frozen else state
_FAILURES = (Exception, dcp.CheckpointException)  # DCP's own error derives from BaseException

TrainedState = tuple[nn.Module, "torch.optim.Optimizer | None"]
"""A trained part as the checkpoint sees it: its module and its optimizer (None: model only)."""


def part_keys(name: str) -> tuple[str, str]:
    """The DCP keys of a trained part's model and optimizer state.

    The policy keeps the top-level ``model`` and ``optim`` of a single-model checkpoint, so a
    policy-only run writes and reads exactly the layout it always had; every other part has its
    own ``parts.<name>.model`` and ``parts.<name>.optim``.
    """
    if name == POLICY_PART:
        return MODEL_KEY, OPTIM_KEY
    return f"{PARTS_KEY}.{name}.{MODEL_KEY}", f"{PARTS_KEY}.{name}.{OPTIM_KEY}"


def saved_part_names(saved_keys) -> set[str]:
    """The parts besides the policy whose tensors a checkpoint holds (from its DCP keys)."""
    prefix = f"{PARTS_KEY}."
    return {key[len(prefix):].split(".", 1)[0] for key in saved_keys if key.startswith(prefix)}


def _all_parts(model: nn.Module, optimizer, parts: Mapping[str, TrainedState]) -> dict[str, TrainedState]:
    if POLICY_PART in parts:
        raise CheckpointError(f"the part name {POLICY_PART!r} is the model's own; name the other parts differently")
    return {POLICY_PART: (model, optimizer), **parts}

T = TypeVar("T")


# --------------------------------------------------------------------------- collectives


class _CheckpointGroup:
    """Object collectives on a gloo group reserved for checkpoint I/O (see module docstring).

    ``on_main`` and ``everywhere`` keep ranks in lockstep on errors: a failure on any rank
    becomes the same exception on every rank at the same point, never a hang.
    """

    def __init__(self, ctx: DistributedContext) -> None:
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.group: Any = None
        if ctx.world_size > 1:
            self.group = dist.new_group(backend="gloo", timeout=ctx.timeout)

    def broadcast(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def on_main(self, fn: Callable[[], T], what: str) -> T:
        """Run ``fn`` on rank 0 only and hand its result (or its error) to every rank."""
        result: tuple[Any, BaseException | None] = (None, None)
        if self.rank == 0:
            result = _capture(fn, what)
        value, error = self.broadcast(result)
        if error is not None:
            raise error
        return value

    def everywhere(self, fn: Callable[[], T], what: str) -> list[T]:
        """Run ``fn`` on every rank; all results to every rank, or the first rank's error."""
        results = self.gather(_capture(fn, what))
        for rank, (_, error) in enumerate(results):
            if error is not None:
                error.context.setdefault("rank", rank)
                raise error
        return [value for value, _ in results]


def _capture(fn: Callable[[], T], what: str) -> tuple[T | None, CheckpointError | None]:
    try:
        return fn(), None
    except CheckpointError as exc:
        return None, exc
    except _FAILURES as exc:  # an OSError, a DCP error: becomes a typed, picklable error
        return None, CheckpointError(f"{what} failed: {type(exc).__name__}: {exc}")


# --------------------------------------------------------------------------- manager


@dataclass
class LoadedCheckpoint:
    """What ``CheckpointManager.load`` restored, besides the model and optimizer (in place)."""

    step: int
    path: Path
    states: dict[str, dict]  # the named JSON parts (trainer, data, objective, ...), by name
    rng_state: dict | None  # this rank's; None when the saving run had no such rank
    extra_files: dict[str, bytes] = field(default_factory=dict)
    saved_world_size: int = 1

    @property
    def trainer_state(self) -> dict:
        return self.states[TRAINER_PART]

    @property
    def data_state(self) -> dict:
        return self.states[DATA_PART]


@dataclass
class _StagedSave:
    """What the write phase needs; when saving asynchronously nothing here aliases live state."""

    step: int
    state: dict[str, Any] | DeviceSnapshot  # a snapshot until the save thread moves it to host
    has_optimizer_state: bool
    rank_files: dict[str, bytes]


class CheckpointManager:
    """Saves, finds and loads the checkpoints of one run (see the module docstring).

    Every method except ``list_steps`` is collective: all ranks call it in the same order.
    The constructor is collective too when distributed (it creates the checkpoint group).
    ``checkpoint_dir`` must be one directory shared by all ranks. ``on_corrupt(step, path,
    reason)`` is called on every rank, with the same arguments, for each damaged checkpoint
    skipped while looking for an intact one. ``read_only`` (replay) refuses ``save()`` and
    leaves the directory untouched, leftovers included.
    """

    def __init__(
        self,
        config: CheckpointConfig,
        *,
        checkpoint_dir: Path,
        dist: DistributedContext,
        on_corrupt: Callable[[int, Path, str], None] | None = None,
        read_only: bool = False,
    ) -> None:
        self.config = config
        self.checkpoint_dir = Path(checkpoint_dir)
        self.dist = dist
        self.on_corrupt = on_corrupt
        self.read_only = read_only
        self._group = _CheckpointGroup(dist)
        self._thread: threading.Thread | None = None
        self._background_error: BaseException | None = None
        self._verified: set[Path] = set()
        self._latest_step: int | None = None
        self._host_buffers = HostBuffers()  # staging=host: pinned, filled on the loop thread
        self._snapshot_buffers = SnapshotBuffers()  # staging=device: filled on the save thread
        self._auto_staging: tuple[str, int] | None = None  # (choice, snapshot bytes it was made for)
        if dist.is_main and not read_only:
            self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
            self._remove_leftovers()

    @property
    def latest_step(self) -> int | None:
        """Step of the last checkpoint this manager saved (or is saving) or loaded; else None."""
        return self._latest_step

    # ------------------------------------------------------------------ save

    def save(
        self,
        step: int,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        states: Mapping[str, dict],
        parts: Mapping[str, TrainedState] | None = None,
        extra_files: dict[str, bytes] | None = None,
        after_shards: Callable[[], None] | None = None,
    ) -> Path:
        """Write checkpoint ``step``; returns its final path (durable after ``wait()`` if async).

        The checkpoint is a dict of named parts: the trained parts' tensors through DCP (the
        policy's ``model`` and ``optimizer``, and each of ``parts``, ``{name: (module,
        optimizer)}``, under its own keys: ``part_keys``) and the JSON ``states`` by name
        (``trainer`` and ``data`` always; ``objective`` and others as the run has them), each in
        ``<name>_state.json``. ``after_shards`` runs on every rank once its shards are written,
        before anything is published (the ``crash_checkpoint`` fault, runtime/faults.py)."""
        if self.read_only:
            raise CheckpointError("this checkpoint manager is read-only (replay) and does not save", step=step)
        self._wait_for_previous(step)
        trained = _all_parts(model, optimizer, parts or {})
        staged = self._stage(step, trained, states, extra_files or {})
        tmp_name = self._group.on_main(lambda: self._make_tmp_dir(step), "creating the checkpoint's temporary dir")
        tmp = self.checkpoint_dir / tmp_name
        final = self.checkpoint_dir / step_dir_name(step)
        self._verified.discard(final)
        if self.config.async_save:
            self._thread = threading.Thread(
                target=self._run_in_background, args=(staged, tmp, final, after_shards),
                name=f"checkpoint-step-{step}",
            )
            self._thread.start()
        else:
            self._write_and_publish(staged, tmp, final, after_shards)
        self._latest_step = step
        return final

    def wait(self) -> None:
        """Block until the asynchronous save in flight (if any) is durable; raise its error."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        error, self._background_error = self._background_error, None
        if isinstance(error, CheckpointError):
            raise error
        if error is not None:
            raise CheckpointError(f"asynchronous checkpoint save failed: {error!r}") from error

    def _wait_for_previous(self, step: int) -> None:
        """``wait()``, warning when the previous asynchronous save kept the loop waiting."""
        previous, started = self._latest_step, time.monotonic()
        in_flight = self.in_flight
        self.wait()
        waited = time.monotonic() - started
        if in_flight and waited >= _SLOW_WAIT_WARN_S:
            log.warning(
                "checkpoint step %d waited %.1f s for the asynchronous save of step %s to finish: "
                "saves take longer to write than checkpoint.interval steps take to train; raise "
                "checkpoint.interval (or write to a faster disk) to keep them off the loop",
                step, waited, previous,
            )

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        self.wait()

    def _stage(self, step, trained: dict[str, TrainedState], states, extra_files) -> _StagedSave:
        rank_files = {rng_file_name(self.dist.rank): encode_rng_state(capture_rng_state(self.dist.device))}
        missing = [name for name in (TRAINER_PART, DATA_PART) if name not in states]
        if missing:
            raise CheckpointError(f"checkpoint step {step} lacks the {', '.join(missing)} state", step=step)
        encoded = {state_file_name(name): encode_json_state(state, f"{name}_state") for name, state in states.items()}
        extra = {extra_file_name(name): bytes(data) for name, data in extra_files.items()}
        if self.dist.is_main:
            rank_files.update({**encoded, **extra})
        state: dict[str, Any] = {}
        has_optim = False
        for name, (module, optimizer) in trained.items():
            model_key, optim_key = part_keys(name)
            if has_optimizer_state(optimizer):
                msd, osd = get_state_dict(module, optimizer, options=_STATE_DICT_OPTIONS)
                state[model_key], state[optim_key] = _without_frozen(module, msd), osd
                has_optim = True
            else:  # get_state_dict would initialize the optimizer by stepping it
                state[model_key] = _without_frozen(module, get_model_state_dict(module, options=_STATE_DICT_OPTIONS))
        self._check_free_space(step, tensor_bytes(state) + sum(len(b) for b in rank_files.values()))
        staged = self._copy_for_background(state) if self.config.async_save else state
        return _StagedSave(step=step, state=staged, has_optimizer_state=has_optim, rank_files=rank_files)

    def _check_free_space(self, step: int, my_bytes: int) -> None:
        """Refuse a save the disk cannot hold, before anything is written (collective).

        DCP reports a full disk as ``unexpected pos`` from its zip writer, half-way through
        the write; this names the directory and the sizes instead. Older checkpoints are
        only rotated out after the new one is published, so their space does not count.
        """
        total = sum(self._group.gather(my_bytes))
        need = int(total * _FREE_SPACE_MARGIN)

        def check() -> None:
            free = shutil.disk_usage(self.checkpoint_dir).free
            if free < need:
                raise CheckpointError(
                    f"not enough free disk space for checkpoint step {step}: it needs about "
                    f"{need / _GIB:.2f} GiB, {self.checkpoint_dir} has {free / _GIB:.2f} GiB free",
                    step=step,
                    path=str(self.checkpoint_dir),
                    hint="free disk space, lower checkpoint.keep, or put run.root on a larger disk; "
                    "the run can be resumed from its last checkpoint",
                )

        self._group.on_main(check, "checking free disk space")

    def _copy_for_background(self, state: dict[str, Any]) -> dict[str, Any] | DeviceSnapshot:
        """A copy of the tensors that later training steps cannot change (``checkpoint.staging``)."""
        if self._staging(state) == "device":
            return DeviceSnapshot(state, self.dist.device)  # the save thread moves it to host
        host = self._host_buffers.copy(state)
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking pinned copies have landed
        return host

    def _staging(self, state: dict[str, Any]) -> str:
        """``checkpoint.staging`` for this save, ``auto`` resolved on this rank (and logged).

        ``auto`` snapshots on the device when the driver reports room for the snapshot plus a
        margin. Memory the caching allocator holds but is not using does not count: after
        the first step it covers the step's peak (activations), which the next steps need
        while the snapshot still exists. A freed snapshot stays in that cache, where the next
        snapshot (same shapes) reuses it but the driver no longer reports it free, so the
        decision is kept until the state grows (e.g. optimizer state appears after a save at
        step 0).
        """
        if self.config.staging != "auto":
            return self.config.staging
        nbytes = cuda_bytes(state)
        if self._auto_staging is not None and nbytes <= self._auto_staging[1]:
            return self._auto_staging[0]
        if nbytes == 0:
            choice = "host"
            log.info("checkpoint staging: host (the state is not on a CUDA device)")
        else:
            free, _ = torch.cuda.mem_get_info(self.dist.device)
            needed = int(nbytes * (1 + _SNAPSHOT_MARGIN)) + _SNAPSHOT_RESERVE_BYTES
            choice = "device" if free >= needed else "host"
            log.info(
                "checkpoint staging: %s (snapshot %.1f GiB; %s has %.1f GiB free, %.1f GiB needed)",
                choice, nbytes / _GIB, self.dist.device, free / _GIB, needed / _GIB,
            )
        self._auto_staging = (choice, nbytes)
        return choice

    def _make_tmp_dir(self, step: int) -> str:
        self._remove_leftovers()
        name = f"{TMP_PREFIX}{step_dir_name(step)}-{secrets.token_hex(4)}"
        (self.checkpoint_dir / name).mkdir()
        return name

    def _run_in_background(self, staged: _StagedSave, tmp: Path, final: Path,
                           after_shards: Callable[[], None] | None) -> None:
        try:
            # Every rank joins, whatever it staged, so the checkpoint group's collectives stay
            # paired; a failed copy fails the save on every rank before DCP's collectives.
            self._group.everywhere(lambda: self._move_to_host(staged), "copying the checkpoint to host memory")
            self._write_and_publish(staged, tmp, final, after_shards)
        except BaseException as exc:  # surfaces at the next wait()/save()
            self._background_error = exc

    def _move_to_host(self, staged: _StagedSave) -> None:
        """Replace a device snapshot by its host copy (which frees the snapshot's memory)."""
        if isinstance(staged.state, DeviceSnapshot):
            staged.state = staged.state.to_host(self._snapshot_buffers)

    def _write_and_publish(self, staged: _StagedSave, tmp: Path, final: Path,
                           after_shards: Callable[[], None] | None = None) -> None:
        group = self._group
        try:
            dcp.save(
                staged.state,
                storage_writer=dcp.FileSystemWriter(str(tmp / DCP_DIR), sync_files=True, thread_count=_IO_THREADS),
                process_group=group.group,
                no_dist=group.group is None,
            )
        except _FAILURES as exc:  # DCP reports a failure on every rank
            raise CheckpointError(
                f"writing model/optimizer shards failed: {exc}", step=staged.step, path=str(tmp)
            ) from exc
        if after_shards is not None:
            after_shards()
        group.everywhere(lambda: self._write_rank_files(tmp, staged.rank_files), "writing checkpoint files")
        names = group.on_main(lambda: list_files(tmp), "listing checkpoint files")
        mine = names[group.rank :: group.world_size]
        hashed = group.everywhere(lambda: _hash_files(tmp, mine), "hashing checkpoint files")
        entries = {name: entry for part in hashed for name, entry in part.items()}
        manifest = CheckpointManifest(
            step=staged.step,
            world_size=group.world_size,
            has_optimizer_state=staged.has_optimizer_state,
            torch_version=torch.__version__,
            files=entries,
        )
        group.on_main(lambda: self._publish(manifest, tmp, final), "publishing the checkpoint")

    @staticmethod
    def _write_rank_files(tmp: Path, files: dict[str, bytes]) -> None:
        for rel, data in files.items():
            target = tmp / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            write_file_durably(target, data)

    def _publish(self, manifest: CheckpointManifest, tmp: Path, final: Path) -> None:
        write_file_durably(tmp / MANIFEST_NAME, manifest.to_bytes())
        reason = check_listing(tmp, read_manifest(tmp))
        if reason is not None:
            raise CheckpointCorruptError(f"checkpoint failed its check before publishing: {reason}", path=str(tmp))
        fsync_dirs_below(tmp)
        if final.exists():  # a newer-than-LATEST leftover of a crash, being re-saved
            self._remove_dir(final)
        os.rename(tmp, final)
        fsync_dir(self.checkpoint_dir)
        write_latest(self.checkpoint_dir, manifest.step)
        self._apply_retention()

    def _apply_retention(self) -> None:
        """Keep the newest ``keep`` checkpoints up to LATEST (LATEST among them).

        Directories newer than LATEST (left by a crash, or damaged ones a resume fell back
        from) are never loaded and do not count; saving their step again replaces them.
        """
        if self.config.keep == 0:
            return
        latest = read_latest(self.checkpoint_dir)
        steps = [s for s in self.list_steps() if latest is None or s <= latest]
        for step in steps[: -self.config.keep]:
            self._remove_dir(self.checkpoint_dir / step_dir_name(step))

    def _remove_dir(self, path: Path) -> None:
        """Rename first (atomic), then delete: a crash never leaves a half-deleted step dir."""
        doomed = self.checkpoint_dir / f"{TMP_PREFIX}deleting-{path.name}-{secrets.token_hex(4)}"
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def _remove_leftovers(self) -> None:
        for entry in self.checkpoint_dir.iterdir():
            if entry.name.startswith(TMP_PREFIX):
                log.info("removing leftover of an interrupted save: %s", entry)
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
        (self.checkpoint_dir / LATEST_TMP_NAME).unlink(missing_ok=True)

    # ------------------------------------------------------------------ find

    def list_steps(self) -> list[int]:
        """Steps of the published checkpoint directories, ascending (intact or not). Local."""
        return list_steps(self.checkpoint_dir)

    def _candidates(self, max_step: int | None) -> list[int]:
        """LATEST's step first, then older checkpoints, newest first; newer orphans are skipped."""
        steps = set(self.list_steps())
        latest = read_latest(self.checkpoint_dir)
        if latest is not None:
            steps = {s for s in steps if s <= latest} | {latest}
        if max_step is not None:
            steps = {s for s in steps if s <= max_step}
        return sorted(steps, reverse=True)

    def latest_intact(self, max_step: int | None = None) -> tuple[int, Path] | None:
        """The newest verified checkpoint with step <= ``max_step``; damaged ones are reported."""
        self.wait()
        for step in self._group.on_main(lambda: self._candidates(max_step), "listing checkpoints"):
            path = self.checkpoint_dir / step_dir_name(step)
            reason = self._verify(path, step)
            if reason is None:
                self._verified.add(path)
                return step, path
            if self.on_corrupt is not None:
                self.on_corrupt(step, path, reason)  # the caller reports it (the trainer: event + log)
            else:
                log.warning("checkpoint %s is damaged (%s); trying an older one", path, reason)
        return None

    def _verify(self, path: Path, step: int | None) -> str | None:
        """Collective full check: rank 0 reads the manifest, every rank hashes a share."""
        manifest, reason = self._group.on_main(lambda: check_header(path, step), f"reading {path}/manifest.json")
        if reason is not None:
            return reason
        mine = sorted(manifest.files)[self._group.rank :: self._group.world_size]
        reasons = self._group.everywhere(lambda: check_hashes(path, manifest, mine), "verifying checkpoint files")
        return next((r for r in reasons if r is not None), None)

    # ------------------------------------------------------------------ load

    def load(
        self, path: Path, *, model: nn.Module, optimizer: torch.optim.Optimizer | None,
        parts: Mapping[str, TrainedState] | None = None,
    ) -> LoadedCheckpoint:
        """Restore model (and optimizer), and each of ``parts`` (``{name: (module, optimizer)}``,
        the parts trained besides the policy), in place from ``path``; RNG is returned, not
        restored. The checkpoint must hold exactly these parts."""
        self.wait()
        path = Path(path)
        step = parse_step_dir_name(path.name)
        if path not in self._verified:
            reason = self._verify(path, step)
            if reason is not None:
                raise CheckpointCorruptError(f"checkpoint is damaged: {reason}", path=str(path))
        manifest = read_manifest(path)
        try:
            self._load_parts(path, manifest, _all_parts(model, optimizer, parts or {}))
        except CheckpointError:
            raise
        except _FAILURES as exc:
            raise CheckpointError(
                f"restoring model/optimizer failed: {type(exc).__name__}: {exc}",
                path=str(path),
                hint="a checkpoint loads only into the same architecture and optimizer type",
            ) from exc
        self._latest_step = manifest.step
        rng_path = path / rng_file_name(self.dist.rank)
        extra_prefix = f"{EXTRA_DIR}/"
        return LoadedCheckpoint(
            step=manifest.step,
            path=path,
            states={
                part_of_state_file(name): json.loads((path / name).read_bytes())
                for name in sorted(manifest.files)
                if part_of_state_file(name) is not None
            },
            rng_state=torch.load(rng_path, weights_only=True) if rng_path.exists() else None,
            extra_files={
                name[len(extra_prefix) :]: (path / name).read_bytes()
                for name in sorted(manifest.files)
                if name.startswith(extra_prefix)
            },
            saved_world_size=manifest.world_size,
        )

    def _load_parts(self, path: Path, manifest: CheckpointManifest, trained: dict[str, TrainedState]) -> None:
        """DCP load into the live (possibly sharded) tensors of every part, then set_state_dict;
        never steps. A part's optimizer state is loaded where the checkpoint holds it."""
        reader = SafeFileSystemReader(str(path / DCP_DIR))  # no code execution from .metadata
        saved = reader.read_metadata().state_dict_metadata
        _check_part_names(saved, trained, path)
        group = self._group.group
        request: dict[str, Any] = {}
        with_optimizer: dict[str, bool] = {}
        for name, (module, optimizer) in trained.items():
            model_key, optim_key = part_keys(name)
            with_optimizer[name] = (optimizer is not None and manifest.has_optimizer_state
                                    and any(key.startswith(f"{optim_key}.") for key in saved))
            if with_optimizer[name]:
                add_optimizer_placeholders(optimizer, saved, optim_key)
                msd, osd = get_state_dict(module, optimizer, options=_STATE_DICT_OPTIONS)
                drop_state_absent_from_checkpoint(optimizer, osd, set(saved), optim_key)
                request[model_key], request[optim_key] = _without_frozen(module, msd), osd
            else:
                request[model_key] = _without_frozen(module, get_model_state_dict(module, options=_STATE_DICT_OPTIONS))
        check_nothing_left_behind({k for k in saved if any(k.startswith(f"{top}.") for top in request)}, request)
        for name in trained:
            _check_model_shapes(saved, part_keys(name)[0], request[part_keys(name)[0]], path)
        dcp.load(request, storage_reader=reader, process_group=group, no_dist=group is None)
        for name, (module, optimizer) in trained.items():
            model_key, optim_key = part_keys(name)
            if with_optimizer[name]:
                set_state_dict(module, optimizer, model_state_dict=request[model_key],
                               optim_state_dict=request[optim_key], options=_load_options(module))
            else:
                set_model_state_dict(module, request[model_key], options=_load_options(module))
                if optimizer is not None:  # saved before its first step: fresh state
                    optimizer.state.clear()


def _check_model_shapes(saved, model_key: str, state: Mapping[str, Any], path: Path) -> None:
    """Each model tensor's shape in the checkpoint is the live model's (global, for a DTensor): a
    checkpoint of another shape (another expert count, width or vocabulary) names both shapes."""
    for name, value in state.items():
        size = getattr(saved.get(f"{model_key}.{name}"), "size", None)
        if size is not None and isinstance(value, torch.Tensor) and tuple(size) != tuple(value.shape):
            raise CheckpointError(
                f"{model_key}.{name} has shape {list(size)} in the checkpoint, but {list(value.shape)} in this run's "
                f"model", path=str(path),
                hint="a checkpoint loads only into the model shape it was saved from (model.* as the run recorded)")


def _check_part_names(saved_keys, trained: Mapping[str, TrainedState], path: Path) -> None:
    """A checkpoint restores only the parts it was saved with: one this run does not train would
    be dropped silently, one it lacks would start from its initialization."""
    saved, wanted = saved_part_names(saved_keys), set(trained) - {POLICY_PART}
    if saved != wanted:
        def names(found: set[str]) -> str:
            return ", ".join(sorted({POLICY_PART} | found))

        raise CheckpointError(
            f"the checkpoint holds the trained parts {names(saved)}, this run trains {names(wanted)}",
            path=str(path),
            hint="resume with the objective (and its settings) the run was saved with",
        )


def _hash_files(root: Path, names: list[str]) -> dict[str, Any]:
    """sha256 of each file, in ``_IO_THREADS`` threads (hashlib releases the GIL)."""
    with ThreadPoolExecutor(max_workers=_IO_THREADS, thread_name_prefix="lockstep-hash") as pool:
        return dict(zip(names, pool.map(lambda name: hash_file(root / name), names)))
