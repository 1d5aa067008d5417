"""parallel.ep, the expert-parallel degree: hashed only when set, >= 1, and a world size that
dp_replicate x tp x ep divides (core/batch_shape.py, distributed/config_checks.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core import config as config_lib
from core.exceptions import ConfigError

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.yaml"


def test_ep_is_hashed_only_when_set():
    plain = config_lib.load(TINY)
    assert config_lib.load(TINY, ["parallel.ep=1"]).hash == plain.hash
    assert config_lib.load(TINY, ["parallel.strategy=fsdp", "parallel.ep=2"]).hash != \
        config_lib.load(TINY, ["parallel.strategy=fsdp"]).hash


def test_ep_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"parallel.ep must be >= 1, got 0") as error:
        config_lib.load(TINY, ["parallel.ep=0"])
    assert error.value.context["key"] == "parallel.ep"


def test_the_world_size_must_hold_whole_expert_groups():
    config = config_lib.load(TINY, ["parallel.strategy=fsdp", "parallel.ep=4"])
    config_lib.validate_world(config, 4)
    with pytest.raises(ConfigError, match=r"world size 2 is not divisible by parallel.dp_replicate x parallel.tp x "
                                          r"parallel.ep = 1 x 1 x 4") as error:
        config_lib.validate_world(config, 2)
    assert error.value.context["key"] == "parallel.ep"
