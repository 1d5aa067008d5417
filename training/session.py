"""The steps ``train.py`` tells as a story: command line, config, run, model, data, exit.

Each function does one wiring step and raises a typed error when it cannot; ``fail()``
turns any error into the one line on stderr, the traceback in the rank's log and
``diagnostics/``, a ``failed`` event, and the exit code of docs/contracts.md.
"""

from __future__ import annotations

import errno
import faulthandler
import logging
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from core import layout
from core.config import Config
from core.distributed_context import DistributedContext, ProcessInfo, select_device
from core.exceptions import ConfigError, ExitCode, LockstepError, WatchdogAbort, exit_code_for
from core.logging import EventLog, console, get_logger, setup_logging
from core.run_context import RunContext, load_recorded_config
from experiments.artifacts import ArtifactStore
from models import model_config_from_hf
from models.flops import num_params
from runtime.signals import StartupSignals, exit_if_launcher_lost, exit_with_launcher, record_launcher_loss
from runtime.watchdog import configure_nccl_diagnostics
from runtime import launcher, relaunch
from training import failed_start
from training.record import replay as replay_lib
from training.checkpoint import resume as resume_lib
from training.optimizers.schedule import reshape_warning
from training.objectives import check_objective_config
from training.command_line import Args, check_before_ranks, load_config, parse_args  # noqa: F401


# --------------------------------------------------------------------------- command line
# training/command_line.py: read without torch, so that `python train.py --nproc N` answers a bad
# command line or config before torch is imported and before any rank starts.


def resolve_config(args: Args) -> Config:
    """The run's config, validated against the launcher's world size (no process group yet)."""
    config = load_config(args, ProcessInfo.from_env().world_size)
    # The model layer owns the shape rules (including an init_from directory's config.json);
    # asking it here makes a bad shape exit 2 before any process group or run dir exists.
    model = config.model
    model = model if model.init_from is None else model_config_from_hf(model.init_from, base=model)
    num_params(model)  # the family resolves its shape to count it: a shape it cannot build is a ConfigError
    check_vocab_covers_tokenizer(model.vocab_size, config.data.tokenizer)
    check_chat_data(config.data)  # a template that renders no assistant span: exit 2, naming its file
    if config.model.quantize_base == "nf4":  # every base linear must split into whole NF4 blocks
        from models.nf4 import check_nf4_layout

        world = ProcessInfo.from_env().world_size
        shards = world // (config.parallel.tp * config.parallel.dp_replicate)  # FSDP shards a weight over these
        check_nf4_layout(model, shards=shards if config.parallel.strategy == "fsdp" else 1)
    if config.model.lora.init_from is not None:  # a directory that is no matching adapter: exit 2, no run dir
        from models.lora import check_peft_adapter

        lora = config.model.lora
        check_peft_adapter(lora.init_from, rank=lora.rank, alpha=lora.alpha)
    if config.parallel.strategy == "xla_spmd":
        from training.xla import check_config  # imports without torch_xla; says if it is missing

        check_config(config)
    check_objective_config(config)  # e.g. GRPO's reward functions import: exit 2, no run dir yet
    return config


def prepare_process(config: Config) -> None:
    """Process-wide settings read when the process group is created (NCCL flight recorder),
    a rank that outlives its launcher exits (``runtime.signals.exit_with_launcher``), and a
    fatal signal prints the Python stacks (``faulthandler``).

    The device is checked first: ranks that would share a GPU are a ConfigError (exit 2)
    before anything is written under ``run.root``."""
    exit_with_launcher()
    StartupSignals()  # a stop signal before the step loop is recorded, not a silent death
    # A rank killed by its own native code (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) prints
    # every thread's Python stack to stderr first; the launcher alone would report the signal.
    faulthandler.enable(all_threads=True)
    info = ProcessInfo.from_env()
    device = select_device(config.parallel, info.local_rank, info.local_world_size)
    check_model_fits(config, device, info)
    if device.type == "cuda":
        configure_nccl_diagnostics(Path(config.run.root) / "_nccl_traces", config.runtime.watchdog_timeout_s)


def check_chat_data(data) -> None:
    """Chat sources: the template must render an assistant span the tokenizer can mark."""
    from data.pipeline.plan import check_chat_config

    check_chat_config(data)


def check_vocab_covers_tokenizer(vocab_size: int, tokenizer: str) -> None:
    """A tokenizer id >= model.vocab_size would only fail inside the embedding (IndexError)."""
    from data.tokenizers import build_tokenizer

    needed = build_tokenizer(tokenizer).vocab_size
    if vocab_size < needed:
        raise ConfigError(
            f"model.vocab_size={vocab_size} is smaller than the tokenizer's vocabulary ({needed} ids, data.tokenizer={tokenizer})",
            key="model.vocab_size",
            file=None if tokenizer == "byte" else str(tokenizer),
            hint=f"set model.vocab_size >= {needed}",
        )


def check_model_fits(config: Config, device, info: ProcessInfo) -> None:
    """Refuse (exit 2) a run whose models (the trained one with its gradients and optimizer
    state, and every frozen reference or teacher) cannot fit, before anything is allocated (a
    huge model would otherwise be OOM-killed mid-build): training/memory_estimate.py."""
    from training.memory_estimate import check_run_fits

    check_run_fits(config, device, info)


def open_run(args: Args, config: Config, dist: DistributedContext) -> tuple[RunContext, EventLog]:
    if args.mode == "train":
        run = RunContext.create(config, dist)
        if dist.is_main:
            relaunch.record_launch(config.run.root, run.run_id)  # a restart of this job continues it
    else:
        run = RunContext.open_existing(
            config.run.root, args.resume or args.replay, dist, lock=args.mode == "resume"
        )
        run.config = config
        if args.mode == "replay":
            run.use_output_dir(replay_output_dir(args, run, dist))
    events = None
    try:  # from here the run dir exists: a failure (or a stop signal) is recorded in it
        setup_logging(dist.rank, run.logs_dir, console=dist.is_main)
        events = EventLog(run.paths.events if args.mode != "replay" else None, rank=dist.rank)
        record_launcher_loss(events.path)  # a killed launcher's run then reads as failed (runtime/signals.py)
        if dist.is_main:
            console(f"run_id: {run.run_id}")
            console(f"run_dir: {run.run_dir}")
            if args.mode == "replay":
                console(f"replay_dir: {run.output_dir}")
        if args.mode == "train" and dist.is_main:
            ArtifactStore(run.run_dir).collect(config, repo_root=Path.cwd())
        if args.mode != "train":
            resume_lib.check_environment(run.paths, config, dist.device, strict=config.runtime.strict_env)
        if args.mode == "resume":
            warn_schedule_reshape(run.paths, config)
        if dist.is_main and args.mode != "replay":
            events.emit(
                "run_started" if args.mode == "train" else "resume_started",
                world_size=dist.world_size,
                config_hash=config.hash,
                strategy=config.parallel.strategy,
            )
        get_logger().info("%s on %s, world size %d", args.mode, dist.device, dist.world_size)
    except BaseException as error:
        # The caller never receives ``run``: record here and free the lock; the caller's
        # fail() prints the one line.
        record_failure(error, run, events, dist.rank)
        run.release()
        raise
    return run, events


def warn_schedule_reshape(paths: layout.RunPaths, config: Config) -> None:
    """A resume whose ``train.max_steps`` reshapes the LR schedule says so, with the learning
    rate at the step it continues at (its newest checkpoint's, plus one) before and after."""
    checkpoints = layout.list_steps(paths.checkpoints)
    step = (checkpoints[-1] if checkpoints else 0) + 1
    message = reshape_warning(step, load_recorded_config(paths).train, config.train)
    if message is not None:
        get_logger().warning(message)


def replay_output_dir(args: Args, run: RunContext, dist: DistributedContext) -> Path:
    """A replay's own directory: ``--dump DIR``, else a fresh temporary one (printed), so
    the replayed run is only read, never written."""
    if args.dump:
        return Path(args.dump)
    made = None
    if dist.is_main:
        made = str(replay_lib.temporary_output_dir(run.run_id, args.step))
    return Path(dist.broadcast_object(made))


def replay_spec(args: Args, run: RunContext, dist: DistributedContext):
    from training.record.recorder import ReplaySpec

    if args.mode != "replay":
        return None
    recorded = replay_lib.recorded_ledger(run.paths, args.step)
    dump = replay_lib.StepDump(Path(args.dump), rank=dist.rank) if args.dump else None
    return ReplaySpec(step=args.step, recorded=recorded, dump=dump, frozen=replay_lib.recorded_frozen(run.paths))


# --------------------------------------------------------------------------- endings


def finish(result, run: RunContext, events: EventLog, dist: DistributedContext) -> int:
    if dist.is_main:
        if result.status == "replayed":
            removed = replay_lib.discard_temporary_output(run.output_dir)  # a --dump DIR stays
            console(f"replay: steps {result.first_step}..{result.last_step} match the ledger of {run.run_id}"
                    + (f"; {run.output_dir} removed (keep the logs with --dump DIR)" if removed else ""))
        else:
            # data.on_bad_record=skip: how many records were skipped (the trainer's total over ranks).
            skipped = int(result.extra.get("bad_records_skipped", 0))
            if result.status != "stopped":  # the loop records "stopped" with its signal
                events.emit(result.status, step=result.last_step, tokens=result.tokens, bad_records_skipped=skipped)
            if result.last_step < result.first_step:  # resumed at or past train.max_steps: nothing ran
                max_steps = run.config.train.max_steps
                console(f"{result.status}: run {run.run_id} already has {result.last_step} steps (train.max_steps="
                        f"{max_steps}), nothing to train -> raise train.max_steps to continue it, e.g. "
                        f"--resume {run.run_id} train.max_steps={max(2 * result.last_step, 1)}")
                return ExitCode.OK
            console(
                f"{result.status}: steps {result.first_step}..{result.last_step}, "
                f"{result.tokens} tokens, loss {_fmt(result.first_loss)} -> {_fmt(result.last_loss)}, "
                f"{result.tokens_per_s:,.0f} tokens/s"
                + (f", {skipped} bad records skipped" if skipped else "")
                + f", run dir {run.run_dir}"
            )
    return ExitCode.OK


def fail(
    error: BaseException,
    run: RunContext | None,
    events: EventLog | None,
    dist: DistributedContext | None,
    *,
    watchdog=None,
) -> int:
    if isinstance(error, SystemExit) and not error.code:  # --help: argparse printed it, a clean exit
        return ExitCode.OK
    exit_if_launcher_lost()  # an error that follows the launcher's death is recorded as that death
    if watchdog is not None and watchdog.fired:
        # A peer's watchdog exit broke our blocked collective after our own watchdog fired:
        # the cause is the hang, so exit as the watchdog would once its bundle is written.
        watchdog.wait_for_dump(timeout=60)
        error = WatchdogAbort(f"watchdog fired, then: {error}", rank=dist.rank if dist else None)
    _quiet_stop_signals()
    rank = dist.rank if dist is not None else ProcessInfo.from_env().rank
    line = f"[rank {rank}] {_one_line(error)}"
    if not launcher.report_failure(line):  # under train.py --nproc the launcher prints it, once
        print(line, file=sys.stderr, flush=True)
    return record_failure(error, run, events, rank)


def _quiet_stop_signals() -> None:
    """A failing rank is on its way out: the SIGTERM its launcher sends every rank once one
    failed must not raise a second error (and a traceback) in the middle of this one's exit;
    a Ctrl-C ends it at once, its line already printed."""
    try:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    except ValueError:  # not the main thread: nothing was installed here either
        pass


def _exit_code(error: BaseException) -> int:
    return 130 if isinstance(error, KeyboardInterrupt) else exit_code_for(error)


def _one_line(error: BaseException) -> str:
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:  # wherever it hit: one line, what to do
        where = f" writing {error.filename}" if error.filename else ""
        return (f"error: disk full: no space left on device{where} -> free disk space under run.root (or point "
                "run.root at a larger disk), then resume the run (--resume RUN_ID) or start it again")
    return str(error) if isinstance(error, LockstepError) else f"error: {type(error).__name__}: {error}"


def record_failure(error: BaseException, run: RunContext | None, events: EventLog | None, rank: int) -> int:
    """The traceback into the rank's log and ``diagnostics/``, a ``failed`` event; the exit code."""
    code, line = _exit_code(error), _one_line(error)
    text = "".join(traceback.format_exception(error))
    _log_to_files_only(f"{line}\n{text}")  # the console (stdout) gets nothing more than stderr's line
    if run is not None:
        discarded = failed_start.applies(run, code)  # nothing trained yet: the run dir goes, its logs stay
        try:
            diagnostics = failed_start.output_dir(run) / layout.DIAGNOSTICS_DIR
            diagnostics.mkdir(parents=True, exist_ok=True)
            (diagnostics / f"rank{rank}_failure.txt").write_text(f"{line}\n\n{text}")
            if events is not None and events.path is not None and events.path.parent.exists() and not discarded:
                record: dict[str, Any] = (
                    error.to_record() if isinstance(error, LockstepError) else {"type": type(error).__name__, "message": str(error)}
                )
                record["exit_code"] = code
                events.emit("failed", **record)
        except OSError:
            pass
        if discarded and rank == 0:
            failed_start.set_aside(run)
    return code


def _log_to_files_only(message: str) -> None:
    """The traceback goes to ``logs/rank<R>.log``, not to the logger's console handler;
    before the run dir exists there is no log file and the stderr line is all there is."""
    logger = get_logger()
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "%s", (message,), None)
    for handler in logger.handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"
