"""The calculator tool (data/calculator.py): exact answers, and typed refusals as text."""

from __future__ import annotations

import pytest

from data.calculator import MAX_CHARS, calculate


@pytest.mark.parametrize("expression,answer", [
    ("4821 * 37", "178377"),
    ("12+30", "42"),
    ("(7 - 10) * 3", "-9"),
    ("-5 // 2", "-3"),
    (" 100 // 7 ", "14"),
    ("+8", "8"),
])
def test_integer_arithmetic_is_exact(expression, answer):
    assert calculate(expression) == answer


@pytest.mark.parametrize("expression,why", [
    ("1 / 2", "only integers"),
    ("2 ** 3", "only integers"),
    ("1.5 + 1", "only integers"),
    ("__import__('os')", "only integers"),
    ("x + 1", "only integers"),
    ("7 // 0", "division by zero"),
    ("1 +", "not an arithmetic expression"),
    ("9" * 13 + "*" + "9" * 13, "more than 24 digits"),
    ("1+" * 40 + "1", f"longer than {MAX_CHARS}"),
    (17, "must be a string, got int"),
    ("True + 1", "only integers"),
])
def test_what_it_cannot_compute_is_an_error_line(expression, why):
    result = calculate(expression)
    assert result.startswith("error: ") and why in result
