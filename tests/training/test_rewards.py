"""Rule-based rewards: the documented normalization, and nothing more lenient."""

from __future__ import annotations

import pytest

from training.rollout.rewards import REWARDS, exact_answer, format_regex, last_number, numeric_tolerance


@pytest.mark.parametrize("completion", ["tac", "  tac\n", "tac.", " tac . "])
def test_exact_answer_trims_whitespace_and_one_trailing_period(completion):
    assert exact_answer(completion, "tac") == 1.0


@pytest.mark.parametrize("completion", ["TAC", "tac!", "tac..", "t a c", "tac tac", "", "'tac'"])
def test_exact_answer_rejects_anything_else(completion):
    assert exact_answer(completion, "tac") == 0.0


def test_exact_answer_collapses_inner_whitespace():
    assert exact_answer("New   York\n", "New York") == 1.0


@pytest.mark.parametrize(
    "text, number",
    [
        ("82", 82.0),
        ("37 + 45 = 82", 82.0),
        ("The answer is -3.", -3.0),
        ("10-3", 3.0),  # a subtraction sign, not a negative number
        ("1,234 apples", 1234.0),
        ("x = 2.5.", 2.5),
        ("no digits", None),
    ],
)
def test_last_number(text, number):
    assert last_number(text) == number


def test_numeric_tolerance_is_absolute_and_inclusive():
    assert numeric_tolerance("The result is 82", "82") == 1.0
    assert numeric_tolerance("83", "82") == 0.0
    assert numeric_tolerance("83", "82", tol=1.0) == 1.0
    assert numeric_tolerance("83.5", "82", tol=1.0) == 0.0
    assert numeric_tolerance("-7", -7) == 1.0
    assert numeric_tolerance("seven", "7") == 0.0
    assert numeric_tolerance("82 then 81", "82") == 0.0  # only the last number counts
    with pytest.raises(ValueError):
        numeric_tolerance("1", "nan")


def test_format_regex_matches_the_whole_stripped_completion():
    assert format_regex("  <answer>42</answer>\n", r"<answer>\d+</answer>") == 1.0
    assert format_regex("so <answer>42</answer>", r"<answer>\d+</answer>") == 0.0
    assert format_regex("<think>a\nb</think> 4", r"<think>.*</think> \d") == 1.0  # '.' spans lines


def test_rewards_by_name():
    assert set(REWARDS) == {"exact_answer", "numeric_tolerance"}
    assert REWARDS["numeric_tolerance"]("= 12", "12") == 1.0 and REWARDS["exact_answer"]("ab", "ba") == 0.0
