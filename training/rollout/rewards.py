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

``strip_thinking`` (a setting of ``exact_answer`` and ``numeric_tolerance``): the answer is the
text after the completion's last ``</think>``, so a reasoning model's think block (Qwen3's) is not
compared; a completion that opens ``<think>`` and never closes it has no answer and scores 0; one
without ``<think>`` or ``</think>`` is compared whole (``answer_text``).

``REWARDS`` names them for records that say which reward checks them (``"reward"`` key).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from core import layout
from core.exceptions import ConfigError, DataError

_WHITESPACE = re.compile(r"\s+")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+(?![\d,])|\d+)(?:\.\d+)?")


def normalize_answer(text: str) -> str:
    """Whitespace trimmed and collapsed, one trailing period dropped."""
    text = _WHITESPACE.sub(" ", text.strip())
    return text[:-1].rstrip() if text.endswith(".") else text


def answer_text(completion: str) -> str | None:
    """The completion after its last ``</think>``; the whole completion where it has no think
    block; None where a ``<think>`` is never closed (the answer was never written)."""
    closed = completion.rfind(THINK_CLOSE)
    if closed >= 0:
        return completion[closed + len(THINK_CLOSE):]
    return None if THINK_OPEN in completion else completion


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


class AnswerError(ValueError):
    """The expected answer (from the data record) cannot be checked: the record is at fault."""


def numeric_tolerance(completion: str, answer: str | float, tol: float = 0.0) -> float:
    """1.0 when the completion's last number is within ``tol`` (absolute) of the answer."""
    try:
        expected = float(answer)
    except ValueError:
        raise AnswerError(f"the answer {answer!r} is not a number") from None
    if not math.isfinite(expected):
        raise AnswerError(f"the answer {answer!r} is not a finite number")
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


# ---------------------------------------------------------------------- configured rewards


class RewardError(DataError):
    """A reward function raised or returned a non-finite value (objective.grpo.on_reward_error=error): exit 3."""

    skippable = False


@dataclass(frozen=True)
class RewardFunction:
    """One configured reward: ``fn(completion, answer, prompt=...) -> float``, with its weight."""

    name: str
    weight: float
    fn: Callable[..., float]


def resolve_reward(name: str, *, weight: float, pattern: str = "", tol: float = 0.0, strip_thinking: bool = False,
                   key: str = "objective.grpo.rewards") -> RewardFunction:
    """A built-in reward by name, or a user function ``package.module:function`` (imported now).

    Every reward is called as ``fn(completion, answer, prompt=prompt)``; a user function must
    accept that and return a finite float (docs/post_training.md, GRPO). An unknown name or a
    path that does not import is a ConfigError naming the key, and so is ``strip_thinking`` on a
    reward that compares no answer (one not in ``STRIPS_THINKING``).
    """
    if strip_thinking and name not in STRIPS_THINKING:
        raise strip_thinking_error(name, key)
    if name == "exact_answer":
        if strip_thinking:
            return RewardFunction(name, weight, lambda completion, answer, prompt: _on_answer(
                exact_answer, completion, answer))
        return RewardFunction(name, weight, lambda completion, answer, prompt: exact_answer(completion, answer))
    if name == "numeric_tolerance":
        if strip_thinking:
            return RewardFunction(name, weight, lambda completion, answer, prompt: _on_answer(
                numeric_tolerance, completion, answer, tol))
        return RewardFunction(name, weight,
                              lambda completion, answer, prompt: numeric_tolerance(completion, answer, tol))
    if name == "format_regex":
        if not pattern:
            raise ConfigError("format_regex needs a pattern", key=f"{key}.pattern")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"format_regex pattern {pattern!r} does not compile: {exc}", key=f"{key}.pattern") from None
        return RewardFunction(name, weight, lambda completion, answer, prompt: format_regex(completion, pattern))
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"unknown reward {name!r}", key=f"{key}.name",
            hint="use exact_answer, numeric_tolerance, format_regex, or a function as 'package.module:function'",
        )
    if not all(part.isidentifier() for part in module_name.split(".")) or not attr.isidentifier():
        raise ConfigError(
            f"reward function {name!r} is not an absolute 'package.module:function' path"
            + (" (a relative module path has no package to be relative to)" if module_name.startswith(".") else ""),
            key=f"{key}.name", hint="name an installed module or one on PYTHONPATH, e.g. mypkg.rewards:score",
        )
    refuse_code_in_run_dir(module_name, what=f"reward function {name!r}", key=f"{key}.name")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"reward function {name!r}: module {module_name!r} does not import ({exc})",
                          key=f"{key}.name",
                          hint="install its package or put its directory on PYTHONPATH (never a run directory)") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(f"reward function {name!r}: module {module_name!r} has no function {attr!r}",
                          key=f"{key}.name", hint="name a callable fn(completion, answer, prompt=...) -> float")
    return RewardFunction(name, weight, lambda completion, answer, prompt: fn(completion, answer, prompt=prompt))


STRIPS_THINKING = ("exact_answer", "numeric_tolerance")
"""The built-in rewards that compare an answer, and so take ``strip_thinking``."""


def strip_thinking_error(name: str, key: str) -> ConfigError:
    """The error of ``strip_thinking`` set on the reward ``name`` (``key``: the reward's config key)."""
    return ConfigError(f"{key}: strip_thinking applies to the rewards that compare an answer "
                       f"({', '.join(STRIPS_THINKING)}), not to {name!r}", key=f"{key}.strip_thinking",
                       hint="drop strip_thinking from this reward (a function of your own can strip the think "
                            "block itself: training.rollout.rewards.answer_text)")


def exact_answer_of(completion: str, answer: str, *, strip_thinking: bool = False) -> float:
    """``exact_answer``, of the answer text alone under ``strip_thinking`` (held-out evaluation's score,
    training/rollout/evaluation.py: as the configured rewards read a completion)."""
    return _on_answer(exact_answer, completion, answer) if strip_thinking else exact_answer(completion, answer)


def _on_answer(check: Callable[..., float], completion: str, answer: str, *args) -> float:
    """``check`` of the completion's answer text (after its last ``</think>``); 0.0 where a think
    block is never closed. The record's answer is checked first either way, so a bad answer is
    the record's error (AnswerError) whatever the completion holds."""
    text = answer_text(completion)
    value = check(completion if text is None else text, answer, *args)
    return 0.0 if text is None else value


def refuse_code_in_run_dir(module_name: str, *, what: str, key: str) -> None:
    """Refuse (ConfigError) a module that would be imported from inside a run directory.

    Run dirs are outputs that anyone who can write a config can write into (``artifacts/``);
    code a config names comes only from installed packages and the import path the process
    started with. The module and each of its parent packages are located without importing
    (executing) any of them."""
    for location in _module_locations(module_name):
        run_dir = _enclosing_run_dir(location)
        if run_dir is not None:
            raise ConfigError(
                f"{what}: module {module_name!r} lies inside the run directory {run_dir} ({location}); "
                "code is never imported from a run directory",
                key=key, hint="install the module's package, or put its directory on PYTHONPATH outside every run dir",
            )


def _module_locations(module_name: str) -> list[Path]:
    """Every file and package directory that importing ``module_name`` could read: for each
    dotted part, its candidates on the import path (a parent package's directories below the
    top level), found by looking at the filesystem, so no package on the way is executed."""
    locations: list[Path] = []
    search = [Path(entry or ".") for entry in sys.path]
    parts = module_name.split(".")
    for depth in range(1, len(parts) + 1):
        loaded = sys.modules.get(".".join(parts[:depth]))
        if loaded is not None:  # imported already: where it was read from
            found = [Path(p) for p in getattr(loaded, "__path__", None) or []]
            found += [Path(loaded.__file__)] if getattr(loaded, "__file__", None) else []
        else:
            found = [path for directory in search for path in _candidates(directory, parts[depth - 1])]
            if depth == 1:  # a top-level name may also come from a finder of an installed package
                spec = importlib.util.find_spec(parts[0])
                if spec is not None:
                    found += [Path(spec.origin)] if spec.origin and spec.has_location else []
                    found += [Path(p) for p in spec.submodule_search_locations or []]
        found = list(dict.fromkeys(found))  # an entry twice on the path is one place
        locations += found
        search = [path for path in found if path.is_dir()]
    return locations


def _candidates(directory: Path, name: str) -> list[Path]:
    """``directory/name`` as a package directory and as a module file of any importable suffix."""
    package = directory / name
    modules = [directory / f"{name}{suffix}" for suffix in importlib.machinery.all_suffixes()]
    return ([package] if package.is_dir() else []) + [module for module in modules if module.is_file()]


def _enclosing_run_dir(path: Path) -> Path | None:
    """The run directory (it holds both config.yaml and meta.json) ``path`` lies in, if any."""
    resolved = Path(path).resolve()
    for directory in (resolved, *resolved.parents):
        if (directory / layout.CONFIG_FILE).is_file() and (directory / layout.META_FILE).is_file():
            return directory
    return None


def score(rewards: list[RewardFunction], completion: str, answer: str, prompt: str, *,
          where: str, on_error: str) -> tuple[float, int]:
    """The weighted sum of the rewards of one completion, and how many failed.

    A reward that raises or returns a non-finite value or a non-number is a RewardError naming
    the function and ``where`` (the sample), or, with ``on_error="zero"``, counts as 0 and is counted.
    An answer a numeric reward cannot read (``nan``, ``inf``, not a number) is the record's fault:
    a DataError naming ``where``, whatever ``on_error`` says.
    """
    total, failures = 0.0, 0
    for reward in rewards:
        try:
            value = reward.fn(completion, answer, prompt)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"returned {value!r}, not a finite number")
        except AnswerError as exc:  # the record's answer is bad, not the reward function
            raise DataError(f"{exc}, which {reward.name!r} needs: the prompt's data record is bad", sample=where,
                            hint="fix that record's 'answer' (`python -m data inspect --config X.yaml --step S` "
                                 "lists a step's records)") from None
        except Exception as exc:  # a user function may raise anything: named, then stopped or counted
            if on_error != "zero":
                raise RewardError(f"reward function {reward.name!r} failed on {where}: {exc}", reward=reward.name,
                                  sample=where, hint="fix the function, or set objective.grpo.on_reward_error=zero "
                                                     "to score such samples 0 and count them") from exc
            failures += 1
            continue
        total += reward.weight * float(value)
    return total, failures
