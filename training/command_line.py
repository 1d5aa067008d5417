"""train.py's command line and the checks that need no torch: ``parse_args`` (``Args``),
``load_config`` (a new run's config, or a resumed or replayed run's recorded one with its
overrides, validated for a number of ranks) and ``check_before_ranks``, what ``python train.py
--nproc N`` runs in its own process before it starts a rank (runtime/launcher.py).

For a new run nothing here imports torch, so a typo in a config is answered in about a second;
a resume or replay reads its run dir through the checkpoint layer, which does."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, replace

from core import config as config_lib
from core.config import Config
from core.exceptions import UsageError
from runtime import relaunch
from runtime.faults import parse_faults

@dataclass(frozen=True)
class Args:
    config: str | None
    resume: str | None
    replay: str | None
    step: int | None
    dump: str | None
    overrides: tuple[str, ...]

    @property
    def mode(self) -> str:
        return "resume" if self.resume else "replay" if self.replay else "train"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse exits 2 by itself; keep one typed path
        raise UsageError(message, hint="see `python train.py --help`")


def parse_args(argv: list[str] | None = None) -> Args:
    parser = _Parser(prog="train.py", description="Lockstep: deterministic LLM training.")
    parser.add_argument("--config", help="YAML config file (may `extends:` another)")
    parser.add_argument("--resume", metavar="RUN_ID", help="continue a run from its newest intact checkpoint")
    parser.add_argument("--replay", metavar="RUN_ID", help="re-execute a step of a run and verify it")
    parser.add_argument("--step", type=int, help="the step to replay")
    parser.add_argument("--dump", metavar="DIR", help="with --replay: write the step's batch and layer statistics")
    parser.add_argument("--nproc", metavar="N", help="start N ranks on this machine (instead of torchrun)")
    parser.add_argument("--root", metavar="DIR", help="where run directories live, as for the other tools: "
                        "the config key run.root (default runs)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides with YAML values, e.g. train.lr=3e-4")
    ns = parser.parse_intermixed_args(argv)  # overrides before and after a flag: `a=1 --root R b=2`
    if ns.nproc is not None:  # train.py's launcher takes it out before a rank parses the rest
        raise UsageError("--nproc is read by `python train.py` itself", hint="run `python train.py --nproc N ...`")
    chosen = [flag for flag in ("config", "resume", "replay") if getattr(ns, flag)]
    if len(chosen) != 1:
        raise UsageError(
            "pass exactly one of --config, --resume RUN_ID, --replay RUN_ID",
            hint="e.g. python train.py --config configs/tiny.yaml",
        )
    if ns.replay and (ns.step is None or ns.step < 1):
        raise UsageError("--replay needs --step S with S >= 1", hint="e.g. --replay RUN_ID --step 7")
    if (ns.step is not None or ns.dump) and not ns.replay:
        raise UsageError("--step and --dump are only valid with --replay")
    overrides = (*ns.overrides, *root_override(ns.root, ns.overrides))
    return continue_after_restart(full_run_id(Args(ns.config, ns.resume, ns.replay, ns.step, ns.dump, overrides)))


def root_override(root: str | None, overrides: list[str]) -> tuple[str, ...]:
    """``--root DIR`` as the override ``run.root=DIR`` it stands for (the tools' spelling of the
    key); both given with different directories is a UsageError."""
    if root is None:
        return ()
    for item in overrides:
        key, value = config_lib.parse_override(item)
        if key == "run.root" and value != root:
            raise UsageError(f"--root {root} and {item} name different run roots", hint="pass one of them")
    return (f"run.root={json.dumps(root)}",)  # quoted: a directory named 1 or null stays a string


def full_run_id(args: Args) -> Args:
    """``--resume``/``--replay`` given a unique prefix of a run ID (as ``runs show`` takes it)
    name the whole ID from here on; a prefix of several runs is a ResumeError naming them."""
    if args.mode == "train":
        return args
    from training.checkpoint import resume as resume_lib

    root = resume_lib.parse_override_root(list(args.overrides))
    run_id = resume_lib.find_run(root, args.resume or args.replay).root.name
    return replace(args, **{args.mode: run_id})


def continue_after_restart(args: Args) -> Args:
    """A launcher's restart of a ``--config`` job continues the run its first attempt created
    (``runtime.relaunch``): the same command becomes ``--resume RUN_ID`` with the same
    overrides, minus the injected faults the earlier attempt already reached."""
    if args.mode != "train" or not relaunch.is_restart():  # a first attempt: its config is read once, later
        return args
    from core.run_context import run_paths
    from training.checkpoint import resume as resume_lib
    from training.record import ledger as ledger_lib

    config = config_lib.load(args.config, args.overrides)
    run_id = relaunch.launched_run(config.run.root)
    if run_id is None or not run_paths(config.run.root, run_id).config.is_file():  # or a failed start, set aside
        return args
    recorded = ledger_lib.read(resume_lib.find_run(config.run.root, run_id).ledger)
    faults = relaunch.faults_not_yet_reached(config.runtime.faults, recorded[-1]["step"] if recorded else 0)
    overrides = (*args.overrides, f"runtime.faults={json.dumps(faults)}")
    return Args(config=None, resume=run_id, replay=None, step=None, dump=None, overrides=overrides)


def check_before_ranks(argv: list[str], world_size: int) -> None:
    """What ``python train.py --nproc N`` checks in its own process before it starts a rank (a
    typed error: one line, its exit code): the command line, and the config with every violated
    constraint between the batch, the streams and N ranks at once. A resume or replay checks the
    recorded config with its overrides (read from the run dir, as a rank would). The ranks check
    all of it again, with the rest of ``resolve_config``: they may run under torchrun or Slurm."""
    load_config(parse_args(argv), world_size)


def load_config(args: Args, world_size: int) -> Config:
    """The config of a new run, or the recorded one of a resumed or replayed run with its
    overrides, validated for ``world_size`` ranks (no run dir is written)."""
    if args.mode == "train":
        config = config_lib.load(args.config, args.overrides, world_size=world_size)
    else:
        run_id = args.resume or args.replay
        from training.checkpoint import resume as resume_lib

        root = resume_lib.parse_override_root(list(args.overrides))
        config = resume_lib.resume_config(root, run_id, list(args.overrides))
        config_lib.validate_world(config, world_size)
    parse_faults(config.runtime.faults)  # a bad fault entry is a config error (exit 2)
    return config
