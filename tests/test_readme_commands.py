"""The README's training commands resolve as written: every `train.py --config` command of its
code blocks (and scripts/slurm_train.sbatch) loads its config with its overrides and fits the
world size it launches (ranks per node x nodes), so a GPU command that cannot work fails here,
on the CPU, before anyone rents the GPUs. ``model.init_from`` is left out (it names weights
downloaded beforehand); commands with placeholders (``<RUN_ID>``, ``X.yaml``) are skipped."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from core import config as config_lib

ROOT = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S)
    lines = "\n".join(blocks).replace("\\\n", " ").splitlines()
    return [line.split("  #")[0].strip() for line in lines]


def _train_commands() -> list[str]:
    commands = [c for c in _commands((ROOT / "README.md").read_text()) if "train.py" in c and "--config" in c]
    return [c for c in commands if not re.search(r"<|X\.yaml|\[|\bN\b|\.\.\.", c)]


def _world(words: list[str]) -> int:
    def flag(name: str, default: int) -> int:
        for i, word in enumerate(words):
            if word == name:
                return int(words[i + 1])
            if word.startswith(name + "="):
                return int(word.split("=", 1)[1])
        return default

    return flag("--nproc", 1) * flag("--nproc_per_node", 1) * flag("--nnodes", 1)


def _resolve(config: str, overrides: list[str], world: int) -> None:
    kept = [o for o in overrides if not o.startswith("model.init_from=")]
    config_lib.validate_world(config_lib.load(ROOT / config, kept), world)


def test_the_readme_has_training_commands_to_check():
    assert len(_train_commands()) >= 5, _train_commands()


@pytest.mark.parametrize("command", _train_commands())
def test_a_readme_training_command_resolves_for_its_world_size(command):
    words = shlex.split(command)
    after = words[words.index("train.py") + 1:]
    config = after[after.index("--config") + 1]
    overrides = [w for w in after if "=" in w and not w.startswith("-")]
    _resolve(config, overrides, _world(words))


def test_the_slurm_example_resolves_for_its_32_ranks():
    script = (ROOT / "scripts" / "slurm_train.sbatch").read_text()
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", script).group(1))
    per_node = int(re.search(r"--nproc_per_node=(\d+)", script).group(1))
    config = re.search(r'config=\$\{1:-([^}]+)\}', script).group(1)
    call = script[script.index("train.py --config"):]
    overrides = re.findall(r"(?<=\s)([a-z_]+(?:\.[a-z_0-9]+)+=\S+)", call)
    assert overrides and nodes * per_node == 32
    _resolve(config, overrides, nodes * per_node)


def test_the_make_targets_the_readme_names_exist():
    makefile = (ROOT / "Makefile").read_text()
    named = {c.split()[1] for c in _commands((ROOT / "README.md").read_text()) if c.startswith("make ")}
    assert {"train", "test", "setup", "data"} <= named
    assert [t for t in named if not re.search(rf"^{re.escape(t)}:", makefile, re.M)] == []
