"""Run browser: ``python -m experiments runs [list | show RUN_ID | diff A B | plot RUN_ID [RUN_ID ...] |
episodes RUN_ID --step S]``.

Every subcommand takes ``--root DIR`` (default ``runs``); RUN_ID may be a unique prefix.
Exit codes follow docs/contracts.md: 0 success, 2 usage error (unknown run, bad arguments, a run
or step without episodes), 3 data error (a run file that does not parse).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from core.environment import REQUIRED_MODULES, require_dependencies

# The system Python without .venv: one line, not a traceback from a subcommand's imports
# (runs show reads configs, which registers the objective kinds: core/registration.py; runs plot
# draws with matplotlib).
require_dependencies("-m experiments", modules=(*REQUIRED_MODULES, "matplotlib"))

from core.exceptions import LockstepError  # noqa: E402
from core import layout  # noqa: E402
from core.registration import provider  # noqa: E402
from experiments.episodes import StepEpisodes, format_episodes  # noqa: E402
from experiments.plots import MAX_PANELS, Plot, comparison_path, plot_comparison, plot_run  # noqa: E402
from experiments.runs import config_diff, describe_run, newest_first, resolve_run, summarize  # noqa: E402


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.handler(args)
    except LockstepError as err:
        print(str(err), file=sys.stderr)
        return err.exit_code


def _parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(add_help=False)
    top.add_argument("--root", type=Path, default=Path("runs"), help="directory of run dirs")
    # Subcommands accept --root too; SUPPRESS keeps `runs --root X list` from being reset.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", type=Path, default=argparse.SUPPRESS, help="directory of run dirs")
    parser = argparse.ArgumentParser(prog="python -m experiments")
    groups = parser.add_subparsers(dest="group", required=True)
    runs = groups.add_parser("runs", help="list and inspect runs", parents=[top])
    runs.set_defaults(handler=_list, json=False)
    sub = runs.add_subparsers(dest="command")
    p = sub.add_parser("list", help="runs with state, step, loss, tokens/s", parents=[common])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=_list)
    p = sub.add_parser("show", help="one run's summary", parents=[common])
    p.add_argument("run_id")
    p.add_argument("--events", type=int, default=30, help="how many of the last events to show")
    p.add_argument("--json", action="store_true")
    p.set_defaults(handler=_show)
    p = sub.add_parser("diff", help="config differences of two runs", parents=[common])
    p.add_argument("a")
    p.add_argument("b")
    p.set_defaults(handler=_diff)
    p = sub.add_parser("plot", help="every ledger, metric and eval series to PNG, grouped; several runs: "
                       "each run's PNG and a comparison", parents=[common])
    p.add_argument("run_ids", nargs="+", metavar="RUN_ID")
    p.add_argument("--series", action="append", default=[], metavar="PATTERN",
                   help="draw only the series this shell-style pattern matches (e.g. 'loss', 'objective/*'); "
                        "repeatable")
    p.add_argument("--max-panels", type=int, default=MAX_PANELS, metavar="N",
                   help=f"draw at most N panels, the first in display order (default {MAX_PANELS}; 0: all); "
                        "what is left out is named on stderr")
    p.add_argument("--out", type=Path, default=None,
                   help=f"one run: its PNG (default RUN/{layout.ARTIFACTS_DIR}/{layout.PLOTS_FILE}); several: "
                        "the comparison's (default ROOT/compare-<8 hex of the run IDs>.png)")
    p.set_defaults(handler=_plot)
    p = sub.add_parser("episodes", help="an agent run's episodes of one step as text", parents=[common])
    p.add_argument("run_id")
    p.add_argument("--step", type=int, required=True, help="the training step whose episodes to print")
    p.add_argument("--ids", action="store_true", help="print token ids instead of decoding them")
    p.set_defaults(handler=_episodes)
    return parser


def _list(args: argparse.Namespace) -> int:
    summaries = [summarize(p) for p in newest_first(args.root)]  # the latest run on top
    if args.json:
        print(json.dumps([s.to_dict() for s in summaries], indent=2))
        return 0
    if not summaries:
        print(f"no runs under {args.root}")
        return 0
    rows = [("RUN_ID", "STATE", "STEP", "LOSS", "TOK/S")]
    for s in summaries:
        rows.append((s.run_id, s.state, _fmt(s.step), _fmt(s.loss, ".4f"), _fmt(s.tokens_per_s, ",.0f")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def _show(args: argparse.Namespace) -> int:
    # A run whose meta.json lacks its config hash has it computed from config.yaml, which the
    # loader reads after the registering functions ran (core/registration.py).
    info = describe_run(resolve_run(args.root, args.run_id), max_events=args.events)
    if args.json:
        print(json.dumps(info, indent=2, default=repr))
        return 0
    print(f"run:         {info['run_id']}")
    print(f"path:        {info['path']}")
    print(f"state:       {info['state']}" + (f"  ({info['state_detail']})" if info["state_detail"] else ""))
    print(f"config hash: {info['config_hash'] or 'unknown'}")
    meta = info["meta"] or {}
    for key in sorted(meta):
        if isinstance(meta[key], (str, int, float, bool)) or meta[key] is None:
            print(f"meta.{key}: {meta[key]}")
    print(f"last ledger: {json.dumps(info['last_ledger']) if info['last_ledger'] else '-'}")
    ckpts = info["checkpoints"]
    names = ", ".join(c["name"] + ("" if c["has_manifest"] else " (no manifest)") for c in ckpts["checkpoints"])
    print(f"checkpoints: {names or '-'}  LATEST={ckpts['latest'] or '-'}")
    if info["diagnostics"]:
        print(f"diagnostics: {', '.join(info['diagnostics'])}")
    print(f"events ({len(info['events'])} of {info['events_total']}):")
    for event in info["events"]:
        print("  " + _fmt_event(event))
    return 0


def _diff(args: argparse.Namespace) -> int:
    a, b = resolve_run(args.root, args.a), resolve_run(args.root, args.b)
    changes = config_diff(a, b)
    if not changes:
        print(f"configs of {a.name} and {b.name} are equal")
        return 0
    print(f"--- {a.name}\n+++ {b.name}")
    for key, va, vb in changes:
        print(f"{key}: {va!r} -> {vb!r}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    """Prints the path of every PNG written (each has a JSON of the lines drawn beside it); on
    stderr, the panels each left out and the lines of the run's files that could not be read."""
    run_dirs = list(dict.fromkeys(resolve_run(args.root, run_id) for run_id in args.run_ids))
    limits = {"patterns": args.series, "max_panels": args.max_panels}
    if len(run_dirs) == 1:
        _report(plot_run(run_dirs[0], args.out or run_dirs[0] / layout.ARTIFACTS_DIR / layout.PLOTS_FILE, **limits))
        return 0
    for run_dir in run_dirs:
        _report(plot_run(run_dir, run_dir / layout.ARTIFACTS_DIR / layout.PLOTS_FILE, **limits))
    _report(plot_comparison(run_dirs, args.out or comparison_path(args.root, run_dirs), **limits), skipped=False)
    return 0


def _episodes(args: argparse.Namespace) -> int:
    episodes = StepEpisodes.read(resolve_run(args.root, args.run_id), args.step)
    print(format_episodes(episodes, _ids if args.ids else _decoder(episodes.tokenizer)))
    return 0


def _decoder(spec: str):
    """The run's tokenizer's decode; token ids (and a note on stderr) where it cannot be built here.
    The data layer's tokenizer builder is registered from above by name (core/registration.py)."""
    try:
        return provider("tokenizer")(spec).decode
    except LockstepError as err:
        print(f"note: printing token ids: the run's tokenizer does not load here ({err})", file=sys.stderr)
        return _ids


def _ids(ids: list[int]) -> str:
    return " ".join(map(str, ids))


def _report(plot: Plot, *, skipped: bool = True) -> None:
    print(plot.path)
    if plot.left_out:
        shown = ", ".join(plot.left_out[:5]) + (f" and {len(plot.left_out) - 5} more" if len(plot.left_out) > 5 else "")
        print(f"note: {plot.path} draws {plot.drawn} of {plot.drawn + len(plot.left_out)} panels; left out: {shown} "
              f"(all listed in {plot.path.with_suffix('.json').name}) -> choose series with --series PATTERN, or "
              "draw more with --max-panels N (0: all)", file=sys.stderr)
    if skipped and plot.skipped_lines:  # the comparison re-reads the runs' files: said once, above
        shown = "; ".join(plot.skipped_lines[:3]) + (f"; and {len(plot.skipped_lines) - 3} more"
                                                    if len(plot.skipped_lines) > 3 else "")
        print(f"warning: skipped {len(plot.skipped_lines)} unreadable line(s), as runs show does: {shown}",
              file=sys.stderr)


def _fmt(value: Any, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def _fmt_event(event: dict[str, Any]) -> str:
    when = datetime.datetime.fromtimestamp(event["time"]).strftime("%Y-%m-%d %H:%M:%S")
    rest = {k: v for k, v in event.items() if k not in ("event", "time", "rank", "schema_version")}
    fields = " ".join(f"{k}={json.dumps(v, default=repr)}" for k, v in rest.items())
    return f"{when} rank{event['rank']} {event['event']} {fields}".rstrip()


if __name__ == "__main__":
    sys.exit(main())
