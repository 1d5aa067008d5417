"""``python -m training {export, generate, score}``: the training layer's command line.

    python -m training export --run RUN_ID [--step S] --to DIR [--overwrite] [--dtype fp32|bf16|fp16]
                              [--root runs] [--adapter | --merge]  (LoRA runs: PEFT adapter dir, or merged model)
                              (where it may write and how: training/cli/export_target.py)

    python -m training generate --from RUN_ID|RUN_DIR|HF_DIR [--step S] (--prompt TEXT [--image PATH ...] | --prompts FILE.jsonl)
                                [--max-new-tokens N] [--temperature T] [--top-p P] [--seed S] [--num-beams N]
                                [--out FILE.jsonl [--overwrite]]  (never inside a run directory)
                                (training/cli/generate.py)

    python -m training score --from RUN_ID|RUN_DIR|HF_DIR --pairs FILE.jsonl [--step S] [--json]
                             (a reward model's scores of preference pairs: training/cli/score.py)

``--run`` takes a run ID (under ``--root``) or a run directory. Errors print one line and exit
with the code of their type (2 usage/config, 3 data, 4 checkpoint); see core/exceptions.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from core.environment import require_dependencies

require_dependencies("-m training")  # the system Python without .venv: one line, not a traceback

import torch  # noqa: E402

from core.exceptions import LockstepError, UsageError, exit_code_for  # noqa: E402
from core.layout import RunPaths  # noqa: E402
from runtime.fast_exit import exit_process  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "export":
            return _export(args)
        if args.command == "score":
            from training.cli.score import run_score

            return run_score(args)
        if args.command == "generate":
            from training.cli.generate import check_sampling, run_generate

            check_sampling(args)
            return run_generate(args)
        raise UsageError(f"unknown command {args.command!r}")
    except LockstepError as exc:
        print(str(exc), file=sys.stderr)
        return exit_code_for(exc)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m training", description="Lockstep training tools")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("export", help="write a Hugging Face directory from a checkpoint")
    p.add_argument("--run", required=True, help="run ID (under --root) or run directory")
    p.add_argument("--root", default="runs", help="where run directories live (default: runs)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--to", required=True, type=Path, help="output directory (new or empty; see --overwrite)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier export at --to (atomically; only a directory an export wrote, "
                        "holding nothing else, never one a run uses)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="weights' dtype (default: as trained, fp32 master weights)")
    form = p.add_mutually_exclusive_group()
    form.add_argument("--adapter", action="store_true",
                      help="LoRA runs: write the PEFT adapter directory (adapter_model.safetensors, adapter_config.json)")
    form.add_argument("--merge", action="store_true",
                      help="LoRA runs: write the full model with the adapters merged (the default for LoRA runs)")
    g = sub.add_parser("generate", help="sample from a checkpoint or a Hugging Face directory")
    from training.cli.generate import add_arguments

    add_arguments(g)
    from training.cli import score

    score.add_arguments(sub.add_parser("score", help="a reward model's scores and accuracy on preference pairs"))
    return parser


def _export(args) -> int:
    from training.cli.export import export
    from training.checkpoint.load import resolve_run

    paths = resolve_run(args.run, args.root)
    if args.merge and not _trains_adapters(paths):
        raise UsageError(f"run {paths.root.name} trained no adapters (model.lora.rank is 0): nothing to merge",
                         hint="export it without --merge")
    checkpoint = export(paths, args.to, step=args.step, dtype=DTYPES.get(args.dtype), adapter=args.adapter,
                        overwrite=args.overwrite, run_roots=(Path(args.root),))
    print(f"exported {checkpoint} -> {args.to}")
    return 0


def _trains_adapters(paths: RunPaths) -> bool:
    from core.run_context import load_recorded_config

    return load_recorded_config(paths).model.lora.rank > 0


if __name__ == "__main__":
    exit_process(main())
