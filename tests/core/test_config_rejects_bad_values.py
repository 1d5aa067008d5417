"""Values that used to be accepted or fail late are config errors (exit 2) naming the key."""

from __future__ import annotations

import pytest

from core import config as config_lib
from core.exceptions import ConfigError, ExitCode


@pytest.mark.parametrize(
    "override, key",
    [
        ("run.name=../../x", "run.name"),
        ("run.name=/tmp/abs", "run.name"),
        ("run.name=a/b", "run.name"),
        ("run.name=", "run.name"),
        ("run.name=-x", "run.name"),
        ("run.name=.hidden", "run.name"),
        (f"run.name={'a' * 65}", "run.name"),
        ("train.lr=-1", "train.lr"),
        ("train.lr=.nan", "train.lr"),
        ("train.lr=.inf", "train.lr"),
        ("train.warmup_steps=-5", "train.warmup_steps"),
        ("model.vocab_size=0", "model.vocab_size"),
        ("data.sources=[{path: x, weight: .inf}]", "data.sources[0].weight"),
        ("data.sources=[{path: x, weight: .nan}]", "data.sources[0].weight"),
    ],
)
def test_bad_value_is_a_config_error_naming_the_key(override, key):
    with pytest.raises(ConfigError) as info:
        config_lib.load(None, [override])
    assert info.value.context.get("key") == key
    assert info.value.exit_code == ExitCode.CONFIG


@pytest.mark.parametrize("name", ["run", "e2e", "Qwen2.5-0.5b_sft", "9lives", "a" * 64])
def test_good_run_names_are_accepted(name):
    assert config_lib.load(None, [f"run.name={name}"]).run.name == name
