"""User reward functions for the GRPO tests, named as 'tests.training.grpo_rewards:<name>'."""

from __future__ import annotations


def fails_on_third_sample(completion: str, answer: str, *, prompt: str) -> float:
    """Raises once a prompt has been scored twice (every group has four samples)."""
    fails_on_third_sample.calls = getattr(fails_on_third_sample, "calls", 0) + 1
    if fails_on_third_sample.calls == 3:
        raise ZeroDivisionError("the test's reward fails here")
    return 0.0
