"""Rule-based rewards for checkable answers: 1.0 when a completion passes, else 0.0.

Each takes the generated completion text (special tokens already stripped) and the
expected answer. Normalization is deliberately small and stated per function, so a reward
of 1.0 means the same thing in every run:

- ``exact_answer``: both sides stripped of surrounding whitespace, inner whitespace runs
  collapsed to one space, and one trailing period dropped; then compared case-sensitively
  (an upper-casing task must not pass on a lower-case answer).
- ``numeric_tolerance``: the *last* number in the completion (``-3``, ``82``, ``1,234``,
  ``2.5``) against the answer, ``|x - answer| <= tol`` (absolute). A minus sign counts only
  when it does not follow a letter, digit or period (``10-3`` reads as 10 and 3).
- ``format_regex``: ``re.fullmatch(pattern, completion.strip(), re.DOTALL)``.

``REWARDS`` names them for records that say which reward checks them (``"reward"`` key).
"""

from __future__ import annotations

import math
import re
from typing import Callable

_WHITESPACE = re.compile(r"\s+")
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?![\d,])|\d+)(?:\.\d+)?")


def normalize_answer(text: str) -> str:
    """Whitespace trimmed and collapsed, one trailing period dropped."""
    text = _WHITESPACE.sub(" ", text.strip())
    return text[:-1].rstrip() if text.endswith(".") else text


def exact_answer(completion: str, answer: str) -> float:
    """1.0 when the normalized completion equals the normalized answer (case-sensitive)."""
    return 1.0 if normalize_answer(completion) == normalize_answer(answer) else 0.0


def last_number(text: str) -> float | None:
    """The last number written in ``text`` (thousands separators allowed), or None."""
    last = None
    for last in _NUMBER.finditer(text):
        pass
    if last is None:
        return None
    number = last.group().replace(",", "")
    start = last.start()
    if number.startswith("-") and start > 0 and (text[start - 1].isalnum() or text[start - 1] == "."):
        number = number[1:]  # a hyphen or subtraction sign, not a negative number
    return float(number)


def numeric_tolerance(completion: str, answer: str | float, tol: float = 0.0) -> float:
    """1.0 when the completion's last number is within ``tol`` (absolute) of the answer."""
    expected = float(answer)
    if not math.isfinite(expected):
        raise ValueError(f"numeric answer must be finite, got {answer!r}")
    value = last_number(completion)
    return 1.0 if value is not None and abs(value - expected) <= tol else 0.0


def format_regex(completion: str, pattern: str) -> float:
    """1.0 when the whole stripped completion matches ``pattern`` (``.`` spans lines)."""
    return 1.0 if re.fullmatch(pattern, completion.strip(), re.DOTALL) else 0.0


REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact_answer": exact_answer,
    "numeric_tolerance": numeric_tolerance,
}
"""Answer checkers by the name a record's ``"reward"`` field uses (format_regex needs a pattern)."""
