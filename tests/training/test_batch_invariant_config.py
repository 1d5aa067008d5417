"""``determinism.batch_invariant``: a new key hashed only when set, carried into the run's ``Numerics``."""

from __future__ import annotations

import pytest
import torch

from core import config as config_lib
from core.exceptions import ConfigError
from training.determinism import numerics

CONFIG = "configs/tiny-grpo.yaml"


def test_the_key_is_hashed_only_when_set_and_reaches_the_numerics():
    plain = config_lib.load(CONFIG, [])
    off = config_lib.load(CONFIG, ["determinism.batch_invariant=false"])
    on = config_lib.load(CONFIG, ["determinism.batch_invariant=true"])
    assert config_lib.config_hash(off) == config_lib.config_hash(plain) != config_lib.config_hash(on)
    assert numerics(on).batch_invariant and not numerics(plain).batch_invariant
    cpu = torch.device("cpu")
    assert numerics(on).attention_kernel(cpu, 112) == "exact" == numerics(on).cached_attention(torch.float32)
    assert numerics(plain).attention_kernel(cpu, 112) == "sdpa"


def test_fast_mode_refuses_the_key():
    config = config_lib.load(CONFIG, ["determinism.batch_invariant=true", "determinism.mode=fast"])
    with pytest.raises(ConfigError, match="determinism.batch_invariant"):
        numerics(config)
