"""Lockstep entry point.

    python train.py --config configs/tiny.yaml [key.path=value ...]
    python train.py --nproc N --config X.yaml [...]       # N ranks here, train.py's exit codes
    python train.py [--nproc N] --resume RUN_ID [allowed overrides]
    python train.py [--nproc N] --replay RUN_ID --step S [--dump DIR]
    torchrun --nnodes=M --nproc_per_node=N ... train.py --config X.yaml [...]   # several nodes, Slurm
"""

from __future__ import annotations

import gc
import sys

from core.environment import require_dependencies
from runtime.launcher import launch_if_asked
from runtime.signals import exit_with_launcher

require_dependencies("train.py")  # the system Python without .venv: one line, not a traceback
# First, before the imports below load torch (seconds): under torchrun, a rank whose launcher
# is killed meanwhile exits too instead of waiting on a dead rendezvous (runtime/signals.py).
exit_with_launcher()
if __name__ == "__main__":  # --nproc N: the command line and config are checked for N ranks (no torch yet), then N ranks start
    from training.command_line import check_before_ranks

    launch_if_asked(__file__, sys.argv[1:], check=check_before_ranks)

try:  # torch loads here (seconds): Ctrl-C meanwhile ends the process with one line, not an import traceback
    from training import session  # noqa: E402

    from core.distributed_context import DistributedContext  # noqa: E402
    from runtime.fast_exit import exit_process  # noqa: E402
    from training.checkpoint.load import record_init_source  # noqa: E402
    from training.builders import build_data, build_guards, build_model, build_tracker, close_all  # noqa: E402
    from training.guards import Guards  # noqa: E402
    from training.loop import Trainer  # noqa: E402
except KeyboardInterrupt:
    sys.stderr.write("train.py: interrupted while starting (Ctrl-C); nothing was written\n")
    raise SystemExit(130) from None
# The imports' objects (torch's modules among them) live as long as the process: out of the
# collector's sight, the loop's full collections and the teardown's do not walk them again.
gc.freeze()


def main(argv: list[str] | None = None) -> int:
    run = events = dist = None
    parts: list = []  # what close_all closes: the data pipeline, the tracker, the guards
    try:
        args = session.parse_args(argv)
        config = session.resolve_config(args)  # exits 2 (or 4) before any process group exists
        session.prepare_process(config)
        dist = DistributedContext.from_env(config.parallel)
        run, events = session.open_run(args, config, dist)
        result = _fit(args, config, run, events, dist, parts)
        return session.finish(result, run, events, dist)
    except BaseException as error:  # one line on stderr, the traceback in logs and diagnostics
        guards = next((part for part in parts if isinstance(part, Guards)), None)
        return session.fail(error, run, events, dist, watchdog=guards.watchdog if guards else None)
    finally:
        close_all(parts, run, dist)


def _fit(args, config, run, events, dist: DistributedContext, parts: list):
    """Build the model, data, tracker and guards, and train. The model lives in this frame
    only: once it returns, nothing but ``dist`` holds the process group (DDP's reducer and
    FSDP's hooks do while the model lives), so ``close_all`` can end the group, and join
    its worker threads, while the interpreter is still whole."""
    model, parallel = build_model(config, dist)
    if dist.is_main and args.mode != "replay":
        record_init_source(config, run.paths)  # the init_from dir's config and tokenizer, for export
    data, eval_data = build_data(config, parallel)
    parts.append(data)
    tracker = build_tracker(config, run, dist, model, replaying=args.mode == "replay")
    parts.append(tracker)
    guards = build_guards(config, run, dist, events, data=data, replaying=args.mode == "replay")
    parts.append(guards)
    trainer = Trainer(
        config,
        run=run,
        dist=dist,
        model=model,
        parallel=parallel,
        data=data,
        eval_data_factory=eval_data,
        tracker=tracker,
        guards=guards,
        events=events,
        replay=session.replay_spec(args, run, dist),
    )
    return trainer.fit()


if __name__ == "__main__":
    exit_process(main())
