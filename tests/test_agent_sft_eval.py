"""scripts/agent_sft_eval.py: a first turn counts as a call only in the exact Qwen format, and
the summary's fractions and examples hold for any number of prompts (two included)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests import launch


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("agent_sft_eval", launch.ROOT / "scripts" / "agent_sft_eval.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _call(expression: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "\n</tool_call>"


def test_a_call_is_the_exact_format_only(script):
    assert script.parse_call(_call("725 * 95")) == {"name": "calculator", "arguments": {"expression": "725 * 95"}}
    assert script.parse_call("The answer is " + _call("725 * 95")) is None
    assert script.parse_call("<tool_call>\n{not json}\n</tool_call>") is None
    assert script.parse_call(_call("1 + 1").replace("calculator", "search")) is None


def test_the_summary_of_two_prompts(script):
    records = [{"prompt": "What is 725 * 95?", "answer": "68875"}, {"prompt": "What is 1 + 2 + 3?", "answer": "6"}]
    firsts = [_call("725 * 95"), "6"]
    calls = [script.parse_call(text) for text in firsts]
    found = script.summary(records, firsts, calls, seconds={0: " 68875 "}, plain=["68875", "6"])
    assert {key: value for key, value in found.items() if key != "examples"} == {
        "prompts": 2, "well_formed_calls": 0.5, "right_expression": 0.5, "solved_with_tool": 0.5,
        "solved_without_tool": 1.0}
    assert found["examples"] == [{"prompt": records[0]["prompt"], "first": firsts[0], "second": " 68875 "},
                                 {"prompt": records[1]["prompt"], "first": "6", "second": None}]
