"""The run IDs README.md quotes for the tiny chain (pretrain, SFT, the SFT model's evaluation,
GRPO) end with the hash of the config the quoted command runs: re-derived here from the
configs, so a change that moves a documented run's config (and so its numbers) fails until the
README's table is measured again. The numbers themselves (losses, accuracies) need the runs:
README.md names the commit, the run IDs and the ledgers' last-line hashes they were measured at."""

from __future__ import annotations

import re

import pytest

from core import config as config_lib
from tests import launch

README = (launch.ROOT / "README.md").read_text()
CONFIGS = launch.ROOT / "configs"
CPU = ["parallel.device=cpu"]
# (row label in README's table, config, the command's overrides)
DOCUMENTED = [
    ("1. pretrain", "tiny.yaml", CPU),
    ("2. SFT", "tiny-sft.yaml", [*CPU, "model.init_from=exports/tiny"]),
    ("the SFT model (step 1 at lr 0)", "tiny-grpo.yaml",
     [*CPU, "model.init_from=exports/tiny-sft", "train.lr=0", "train.max_steps=1", "train.eval_interval=1"]),
    ("3. GRPO", "tiny-grpo.yaml", [*CPU, "model.init_from=exports/tiny-sft"]),
]


@pytest.mark.parametrize("label, config, overrides", DOCUMENTED, ids=[row[0] for row in DOCUMENTED])
def test_a_documented_run_id_ends_with_its_commands_config_hash(label, config, overrides):
    row = next((line for line in README.splitlines() if line.startswith(f"| {label} |")), None)
    assert row is not None, f"README.md has no row {label!r}"
    quoted = re.search(r"`[a-z0-9.-]+-\d{8}-\d{6}-([0-9a-f]{8})`", row)
    assert quoted is not None, row
    assert config_lib.load(CONFIGS / config, overrides).hash[:8] == quoted.group(1), (label, row)


def test_the_tiny_moe_header_quotes_the_run_id_of_its_command():
    """configs/tiny-moe.yaml's header quotes its measured run (`python train.py --nproc 2 --config
    configs/tiny-moe.yaml`, no overrides): the run ID's hash is the config's."""
    header = (CONFIGS / "tiny-moe.yaml").read_text()
    quoted = re.search(r"run ID hash ([0-9a-f]{8})", header)
    assert quoted is not None and quoted.group(1) == config_lib.load(CONFIGS / "tiny-moe.yaml").hash[:8]
