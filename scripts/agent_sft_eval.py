"""Held-out tool use of a model fine-tuned on the agent transcripts (configs/tiny-agent-sft.yaml).

    .venv/bin/python scripts/agent_sft_eval.py --from RUN_ID|HF_DIR [--root runs] [--step S] [--prompts N]

For each prompt of ``datasets/tasks/agent/rl/eval`` (the first N), greedy, two turns, the way an
agent episode runs them: the prompt is rendered with the calculator listed as a tool and the
generation prompt; the model's first turn is parsed as one Qwen-format call
(``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``); a well-formed call is answered
with the calculator's result (data/calculator.py), appended as the template's observation text,
and the model's second turn is its answer. Prints the fractions of first turns that are
well-formed calculator calls, of calls whose expression is the question's, and of answers equal
to the record's answer, and the same answer accuracy without the tool (the prompt rendered
without tools, one turn).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from core.environment import require_dependencies  # noqa: E402

require_dependencies("scripts/agent_sft_eval.py")  # the system Python without .venv: one line

import torch  # noqa: E402
from data import calculator  # noqa: E402
from data.chat_template import ChatTemplate  # noqa: E402
from data.tokenizers import build_tokenizer  # noqa: E402
from models.generation.sampler import SamplingParams  # noqa: E402
from training.cli.generate import load_source  # noqa: E402
from training.rollout.generator import Decoder, Generator  # noqa: E402

EVAL = ROOT / "datasets/tasks/agent/rl/eval"


def parse_call(text: str) -> dict | None:
    """The one call of a turn that is exactly ``<tool_call>\\n{json}\\n</tool_call>``, or None."""
    body = text.strip()
    if not (body.startswith("<tool_call>") and body.endswith("</tool_call>")):
        return None
    try:
        call = json.loads(body[len("<tool_call>"):-len("</tool_call>")])
    except ValueError:
        return None
    ok = isinstance(call, dict) and call.get("name") == calculator.NAME and isinstance(call.get("arguments"), dict) \
        and isinstance(call["arguments"].get("expression"), str)
    return call if ok else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="from_", required=True)
    parser.add_argument("--root", default="runs")
    parser.add_argument("--step", type=int, default=None, help="a run's checkpoint step (default: the newest)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    if args.prompts < 1 or args.batch < 1:
        parser.error("--prompts and --batch take a count of at least 1")
    torch.set_num_threads(2)
    source = load_source(args.from_, root=args.root, step=args.step, device=torch.device("cpu"))
    model = source.model.eval()
    tokenizer = build_tokenizer(source.tokenizer_spec)
    template = ChatTemplate.for_tokenizer(source.tokenizer_spec, source.chat_template, clock=source.template_clock,
                                          thinking=source.template_thinking)
    decoder = Decoder(tokenizer, template)
    params = SamplingParams(temperature=0.0, max_new_tokens=128, stop_token_ids=decoder.stop_ids)
    records = [json.loads(line) for part in sorted(EVAL.glob("*.jsonl")) for line in part.read_text().splitlines()]
    records = records[:args.prompts]
    tools = [calculator.SPEC]
    generator = Generator.over(model, rows=args.batch, seed=0, max_len=1152)

    def turn(texts: list[str]) -> list[str]:
        ids = [list(tokenizer.encode_array(t)) for t in texts]
        samples = generator.generate(ids, list(range(len(ids))), params, purpose="agent-eval")
        return [decoder.completion(sample).text for _, _, sample in samples]

    questions = [[{"role": "user", "content": r["prompt"]}] for r in records]
    prompts = [template.render(q, add_generation_prompt=True, tools=tools) for q in questions]
    firsts = turn(prompts)
    calls = [parse_call(text) for text in firsts]
    results = [calculator.calculate(c["arguments"]["expression"]) if c else None for c in calls]
    follow = [i for i, c in enumerate(calls) if c]
    seconds = dict(zip(follow, turn([
        prompts[i] + firsts[i] + template.end_of_turn
        + template.observation_text([{"role": "tool", "content": results[i]}], tools=tools) for i in follow])))
    plain = turn([template.render(q, add_generation_prompt=True) for q in questions])
    print(json.dumps(summary(records, firsts, calls, seconds, plain), indent=1))


def summary(records: list[dict], firsts: list[str], calls: list[dict | None], seconds: dict[int, str],
            plain: list[str]) -> dict:
    """The fractions of the prompts whose first turn is a well-formed call, whose call's expression
    is the question's, solved with the tool (the second turn, after the result) and without it
    (``plain``), and up to three examples."""
    n = len(records)
    follow = [i for i, c in enumerate(calls) if c]
    expressions = [r["prompt"].removeprefix("What is ").removesuffix("?") for r in records]
    return {
        "prompts": n,
        "well_formed_calls": len(follow) / n,
        "right_expression": sum(calls[i]["arguments"]["expression"] == expressions[i] for i in follow) / n,
        "solved_with_tool": sum(seconds[i].strip() == records[i]["answer"] for i in follow) / n,
        "solved_without_tool": sum(text.strip() == r["answer"] for text, r in zip(plain, records)) / n,
        "examples": [{"prompt": records[i]["prompt"], "first": firsts[i], "second": seconds.get(i)}
                     for i in range(min(3, n))],
    }


if __name__ == "__main__":
    main()
