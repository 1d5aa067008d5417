"""configs/tiny-qlora.yaml: its NF4 base fits its layout, and it trains on CPU."""

from __future__ import annotations

import math

import pytest

from core import config as config_lib
from models.nf4 import check_nf4_layout
from tests import launch

CONFIG = launch.ROOT / "configs" / "tiny-qlora.yaml"


def test_every_base_linear_splits_into_whole_nf4_blocks_on_its_two_ddp_ranks():
    config = config_lib.load(CONFIG, ["parallel.device=cpu"])
    config_lib.validate_world(config, 2)
    assert config.model.quantize_base == "nf4" and config.model.lora.rank > 0
    assert config.parallel.strategy == "ddp"
    check_nf4_layout(config.model, shards=1)  # DDP keeps whole weights on every rank
    tiny = config_lib.load(launch.ROOT / "configs" / "tiny-lora.yaml", ["model.quantize_base=nf4"])
    with pytest.raises(config_lib.ConfigError, match="k_proj"):  # why the shape differs from tiny.yaml
        check_nf4_layout(tiny.model, shards=1)


@pytest.mark.slow
def test_it_trains_two_steps_on_cpu(e2e_workdir):
    result = launch.train(e2e_workdir, ["--config", str(CONFIG), "parallel.device=cpu", "train.max_steps=2"], nproc=1,
                          timeout=300)
    assert result.exit_code == 0, result.stdout + result.stderr
    ledger = launch.ledger(e2e_workdir / result.run_dir)
    assert [line["step"] for line in ledger] == [1, 2] and all(math.isfinite(line["loss"]) for line in ledger)
    assert ledger[0]["trained_tokens"] > 0
