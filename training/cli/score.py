"""``python -m training score``: a reward model's scores of preference pairs, and its accuracy on them.

    python -m training score --from RUN_ID|RUN_DIR|HF_DIR --pairs FILE.jsonl [--step S] [--json]
                             [--rows N] [--device auto|cpu|cuda] [--root runs]

- ``--from``: a ``reward_model`` run (a run directory, or a run ID under ``--root``; its newest
  checkpoint or ``--step``) or its Hugging Face export (a ``...ForSequenceClassification``
  directory). A run gives its ``data.tokenizer`` and chat template (and ``data.template_thinking``), an
  export its own (and the ``template_thinking`` its marker recorded of its run).
- ``--pairs``: preference records, one JSON object a line, as ``record: preference`` reads them
  (``{"prompt", "chosen", "rejected"}``, strings or message lists; data/preference.py). Each side is
  rendered as training renders it, the whole conversation through the chat template, and scored at
  the read position every path shares: the conversation's last token (training/objectives/reward_model.py).
- Scores come from ``ModelReward.scores``, the code GRPO and PPO score rollouts with
  (training/objectives/model_reward.py): one sequence a row, ``--rows`` rows a forward (8), each row
  right-padded to the run's ``data.seq_len`` (or the longest side) rounded up to 128 tokens.
- Output: with ``--json``, one line per pair, ``{"index", "chosen_score", "rejected_score"}``
  (``index``: the pair's line number from 0), then ``{"accuracy", "margin", "pairs"}``: the fraction
  of pairs whose chosen side scores strictly higher (as the run's ``accuracy`` counts it) and the
  mean chosen - rejected score. Without it, a short table and the same summary.

Errors print one line and exit with their type's code: a bad ``--from`` or argument 2, a pairs file
that is missing, not JSON, or holds a bad record 3 (naming the file and line).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch

from core import config as config_lib
from core.config import Config
from core.exceptions import DataError, UsageError
from data.chat_template import ChatTemplate, RecordError
from data.preference import PreferenceEncoder
from data.tokenizers import build_tokenizer
from training.cli.export_target import exported_template_thinking
from training.objectives.model_reward import WIDTH_MULTIPLE, ModelReward, ScoreShape, build_model_reward

KEY = "--from"
MAX_LINE_BYTES = 64 << 20
"""A pairs file's line longer than this is refused (a DataError naming the line), not read whole."""


def add_arguments(p) -> None:
    p.add_argument("--from", dest="from_", required=True,
                   help="reward-model run ID (under --root), run directory, or its Hugging Face export")
    p.add_argument("--pairs", type=Path, required=True, help="JSONL preference pairs (prompt, chosen, rejected)")
    p.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the newest)")
    p.add_argument("--json", action="store_true", help="one JSON line per pair, then the summary")
    p.add_argument("--rows", type=int, default=8, help="sequences per forward (default: 8)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--root", default="runs", help="where run directories live (default: runs)")


def run_score(args) -> int:
    """The ``score`` subcommand (arguments: ``add_arguments``)."""
    if args.rows < 1:
        raise UsageError(f"--rows must be >= 1, got {args.rows}")
    if not args.pairs.is_file():
        raise DataError(f"--pairs {args.pairs}: no such file", file=str(args.pairs),
                        hint="give a JSONL file of preference records")
    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    config, source = reward_source(args.from_, root=args.root, step=args.step)
    tokenizer = build_tokenizer(config.data.tokenizer)
    template = ChatTemplate.for_tokenizer(config.data.tokenizer, config.data.chat_template,
                                          clock=config.data.template_clock, thinking=config.data.template_thinking)
    pairs = read_pairs(args.pairs, PreferenceEncoder(template, tokenizer))
    reward = build_model_reward(config, source, dist=_one_process(device), key=KEY)
    longest = max(len(side) for pair in pairs for side in pair)
    width = -(-max(config.data.seq_len, longest) // WIDTH_MULTIPLE) * WIDTH_MULTIPLE
    scores = score_pairs(reward, pairs, shape=ScoreShape(rows=args.rows, width=width), device=device,
                         pad_id=getattr(tokenizer, "pad_id", tokenizer.eos_id))
    _print(scores, as_json=args.json)
    return 0


def reward_source(spec: str, *, root: str, step: int | None) -> tuple[Config, str]:
    """(the config to build the reward model with, its source as a model reward names it): a run's own
    config, or for a Hugging Face directory the defaults with its model and tokenizer; one process, no
    sharding, no compile."""
    path = Path(spec)
    if (path / "config.json").is_file() and not (path / "config.yaml").is_file():
        if step is not None:
            raise UsageError("--step applies to runs, not to a Hugging Face directory", hint="drop --step")
        from models.hf_config import model_config_from_hf

        config = config_lib.load(None, [f"model.init_from={path}"])
        if not (path / "tokenizer.json").is_file():
            raise UsageError(f"--from {spec}: the directory has no tokenizer.json to render the pairs with",
                             hint="export the reward model with `python -m training export`, which writes one")
        config = dataclasses.replace(config, model=model_config_from_hf(path, base=config.model))
        thinking = exported_template_thinking(path)  # an export of a run that set data.template_thinking
        if thinking is not None:
            config = dataclasses.replace(config, data=dataclasses.replace(config.data, template_thinking=thinking))
        source = str(path)
    else:
        from core.run_context import load_recorded_config
        from training.checkpoint.load import resolve_run

        paths = resolve_run(spec, root)
        config = load_recorded_config(paths)
        source = f"run:{paths.root}" + (f"@{step}" if step is not None else "")
    parallel = dataclasses.replace(config.parallel, strategy="none", compile=False, tp=1)
    return dataclasses.replace(config, parallel=parallel), source


def read_pairs(file: Path, encoder: PreferenceEncoder) -> list[tuple[list[int], list[int]]]:
    """(chosen ids, rejected ids) of each line's record, each side its whole rendered conversation."""
    pairs = []
    with open(file, "rb") as f:
        for line_no, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(f"line {line_no} is longer than {MAX_LINE_BYTES} bytes", file=str(file),
                                record=line_no, hint="one preference record a line")
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
                ids, _, cut = encoder.encode(record)
            except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise DataError(f"line {line_no} is not a JSON object: {exc}", file=str(file), record=line_no,
                                hint="one preference record a line") from None
            except RecordError as exc:
                raise DataError(f"line {line_no}: {exc.message}", file=str(file), record=line_no,
                                hint="a preference record is {\"prompt\", \"chosen\", \"rejected\"}") from None
            pairs.append(([int(t) for t in ids[:cut]], [int(t) for t in ids[cut:]]))
    if not pairs:
        raise DataError(f"{file} holds no preference pair", file=str(file), hint="one preference record a line")
    return pairs


def score_pairs(reward: ModelReward, pairs: list[tuple[list[int], list[int]]], *, shape: ScoreShape,
                device: torch.device, pad_id: int) -> list[tuple[float, float]]:
    """(chosen score, rejected score) of each pair, through ``ModelReward.scores``."""
    sequences = [side for pair in pairs for side in pair]
    flat = reward.scores(sequences, shape=shape, device=device, pad_id=pad_id)
    return list(zip(flat[0::2], flat[1::2]))


def summary(scores: list[tuple[float, float]]) -> dict:
    """``accuracy`` (chosen strictly higher), ``margin`` (mean chosen - rejected) and ``pairs``."""
    n = len(scores)
    return {"accuracy": sum(c > r for c, r in scores) / n, "margin": math.fsum(c - r for c, r in scores) / n,
            "pairs": n}


def _print(scores: list[tuple[float, float]], *, as_json: bool) -> None:
    if as_json:
        for index, (chosen, rejected) in enumerate(scores):
            print(json.dumps({"index": index, "chosen_score": chosen, "rejected_score": rejected}))
        print(json.dumps(summary(scores)))
        return
    print(f"{'pair':>6}  {'chosen':>10}  {'rejected':>10}  {'margin':>10}")
    hidden = len(scores) - 20 if len(scores) > 20 else 0  # the first and last 10 pairs of a long file
    for index, (chosen, rejected) in enumerate(scores):
        if hidden and 10 <= index < len(scores) - 10:
            if index == 10:
                print(f"{'...':>6}  ({hidden} pairs not shown; --json prints every pair)")
            continue
        print(f"{index:>6}  {chosen:>10.4f}  {rejected:>10.4f}  {chosen - rejected:>10.4f}")
    s = summary(scores)
    print(f"accuracy {s['accuracy']:.4f}  margin {s['margin']:.4f}  pairs {s['pairs']}")


def _one_process(device: torch.device) -> SimpleNamespace:
    """The rank facts a frozen model is built with, for this one process."""
    return SimpleNamespace(rank=0, world_size=1, local_rank=0, is_distributed=False, device=device, backend="gloo")
