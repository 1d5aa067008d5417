"""Rule-based rewards: the documented normalization, and nothing more lenient."""

from __future__ import annotations

import pytest

from core.config import config_hash, load
from core.exceptions import ConfigError
from training.rollout.reward_settings import resolve_rule_rewards
from training.rollout.rewards import (
    REWARDS, AnswerError, exact_answer, format_regex, last_number, numeric_tolerance, resolve_reward,
)


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


# ---------------------------------------------------------------------- strip_thinking

THOUGHT_THEN_ANSWER = "<think>\nSix sevens: 7, 14, 21, 28, 35, 43? no, 42.\n</think>\n\n42"


def _strip(name: str, completion: str, answer: str, **settings) -> float:
    reward = resolve_reward(name, weight=1.0, strip_thinking=True, key="objective.grpo.rewards[0]", **settings)
    return reward.fn(completion, answer, "What is 6 times 7?")


@pytest.mark.parametrize("name", ["exact_answer", "numeric_tolerance"])
@pytest.mark.parametrize("completion, stripped, whole", [
    # whole: (exact_answer, numeric_tolerance) without the setting, the whole completion compared
    (THOUGHT_THEN_ANSWER, 1.0, (0.0, 1.0)),  # the think block is not the answer
    ("<think>first</think>43<think>again 42</think> 41.", 0.0, (0.0, 0.0)),  # after the last </think> only
    ("<think>first</think>43<think>again</think> 42.", 1.0, (0.0, 1.0)),
    ("<think>\n6 x 7 = 42, so the answer is 42", 0.0, (0.0, 1.0)),  # never closed: no answer written
    ("<think>42</think>\n\n", 0.0, (0.0, 1.0)),  # closed, then nothing
    ("42", 1.0, (1.0, 1.0)),  # no think block: compared whole, as without the setting
    ("</think>42", 1.0, (0.0, 1.0)),  # the closing tag alone (the template opened the block)
])
def test_strip_thinking_scores_only_the_text_after_the_last_think_block(name, completion, stripped, whole):
    assert _strip(name, completion, "42") == stripped
    default = resolve_reward(name, weight=1.0).fn(completion, "42", "?")  # the default: unchanged
    assert default == whole[name == "numeric_tolerance"] == REWARDS[name](completion, "42")


def test_strip_thinking_keeps_each_rewards_own_rule():
    assert _strip("numeric_tolerance", "<think>about 40</think>It is 41.5", "42", tol=0.5) == 1.0
    assert _strip("numeric_tolerance", "<think>42</think>It is 40", "42", tol=0.5) == 0.0
    assert _strip("exact_answer", "<think>x</think>  forty   two.\n", "forty two") == 1.0
    assert _strip("exact_answer", "<think>x</think>FORTY TWO", "forty two") == 0.0
    with pytest.raises(AnswerError):  # a bad record answer is the record's error, even when no answer was written
        _strip("numeric_tolerance", "<think>unclosed", "n/a")


@pytest.mark.parametrize("name, settings", [("format_regex", {"pattern": r"\d+"}),
                                            (f"{__name__}:_user_reward", {})])
def test_strip_thinking_on_a_reward_that_compares_no_answer_is_refused(name, settings):
    with pytest.raises(ConfigError) as info:
        _strip(name, "42", "42", **settings)
    assert info.value.context["key"] == "objective.grpo.rewards[0].strip_thinking"
    assert "exact_answer, numeric_tolerance" in str(info.value) and repr(name) in str(info.value)


def _user_reward(completion, answer, prompt):
    return 1.0


GRPO = "configs/tiny-grpo.yaml"


def test_the_setting_is_a_reward_key_checked_with_the_objective_and_hashed_only_when_set():
    plain = load(GRPO, [])
    off = load(GRPO, ["objective.grpo.rewards=[{name: exact_answer, strip_thinking: false}]"])
    on = load(GRPO, ["objective.grpo.rewards=[{name: exact_answer, strip_thinking: true}]"])
    assert plain.objective.grpo.rewards[0].name == "exact_answer" and not plain.objective.grpo.rewards[0].strip_thinking
    assert config_hash(off) == config_hash(plain) != config_hash(on)
    [reward] = resolve_rule_rewards(on.objective.grpo, "objective.grpo")
    assert reward.fn(THOUGHT_THEN_ANSWER, "42", "?") == 1.0
    for kind in ("grpo", "ppo"):
        with pytest.raises(ConfigError) as info:
            load(f"configs/tiny-{kind}.yaml", [f"objective.{kind}.rewards=[{{name: exact_answer}}, "
                                               "{name: format_regex, pattern: 'x', strip_thinking: true}]"])
        assert f"objective.{kind}.rewards[1].strip_thinking" in str(info.value)
    with pytest.raises(ConfigError, match="strip_thinking"):  # unknown keys stay refused
        load(GRPO, ["objective.grpo.rewards=[{name: exact_answer, strip_thinkin: true}]"])


def test_held_out_accuracy_reads_the_answer_as_the_configured_rewards_do():
    """training/rollout/evaluation.py: where a reward strips the think block, the evaluation's
    exact-answer score does too (Qwen3's greedy accuracy would otherwise be 0 for its reasoning)."""
    from training.rollout.evaluation import answer_strips_thinking
    from training.rollout.reward_settings import RewardSettings
    from training.rollout.rewards import exact_answer_of

    stripped = (RewardSettings(name="format_regex", pattern=".*"), RewardSettings(name="exact_answer", strip_thinking=True))
    assert answer_strips_thinking(stripped) and not answer_strips_thinking((RewardSettings(name="exact_answer"),))
    completion = "<think>\n2 + 2\n</think>\n\n4"
    assert exact_answer_of(completion, "4", strip_thinking=True) == 1.0
    assert exact_answer_of(completion, "4") == 0.0  # the default: the whole completion
    assert exact_answer_of("<think>\n2 + 2 is", "4", strip_thinking=True) == 0.0  # never closed: no answer
    assert exact_answer_of("4", "4", strip_thinking=True) == exact_answer_of("4", "4") == 1.0
