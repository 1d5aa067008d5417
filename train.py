"""Lockstep entry point.

    python train.py --config configs/tiny.yaml [key.path=value ...]
    torchrun --standalone --nproc_per_node=N train.py --config X.yaml [...]
    torchrun ... train.py --resume RUN_ID [allowed overrides]
    torchrun ... train.py --replay RUN_ID --step S [--dump DIR]
"""

from __future__ import annotations

import sys

from core.distributed_context import DistributedContext
from training import session
from training.builders import build_data, build_guards, build_model, build_tracker, close_all
from training.loop import Trainer


def main(argv: list[str] | None = None) -> int:
    run = events = dist = guards = None
    parts: list = []
    try:
        args = session.parse_args(argv)
        config = session.resolve_config(args)  # exits 2 (or 4) before any process group exists
        session.prepare_process(config)
        dist = DistributedContext.from_env(config.parallel)
        run, events = session.open_run(args, config, dist)
        model, parallel = build_model(config, dist)
        data, eval_data = build_data(config, parallel)
        tracker = build_tracker(config, run, dist, model, replaying=args.mode == "replay")
        guards = build_guards(config, run, dist, events, data=data)
        parts = [data, tracker, guards]
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
        result = trainer.fit()
        return session.finish(result, run, events, dist)
    except BaseException as error:  # one line on stderr, the traceback in logs and diagnostics
        return session.fail(error, run, events, dist, watchdog=guards.watchdog if guards else None)
    finally:
        close_all(parts, run, dist)


if __name__ == "__main__":
    sys.exit(main())
