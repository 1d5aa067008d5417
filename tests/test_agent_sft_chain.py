"""The agent SFT chain ships as three stage configs (configs/tiny-agent-sft-{1,2,3}.yaml): each is
configs/tiny-agent-sft.yaml with the overrides of the measured three-command recipe (docs/post_training.md,
"SFT on tool transcripts"), and each stage after the first starts from the directory the docs export
the stage before it to. Loaded only, nothing trained."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from core.config import diff, load

ROOT = Path(__file__).resolve().parents[1]
BASE = "configs/tiny-agent-sft.yaml"

# The recipe as it was measured (2026-11-29d): the command-line overrides of each stage on BASE.
RECIPE = {
    1: ["train.max_steps=400"],
    2: ["train.max_steps=800", "train.schedule=constant", "model.init_from=exports/agent-sft-1"],
    3: ["train.max_steps=600", "model.init_from=exports/agent-sft-2"],
}


@pytest.mark.parametrize("stage", sorted(RECIPE))
def test_a_stage_config_is_the_recipe_applied_to_the_old_config(stage, monkeypatch):
    monkeypatch.chdir(ROOT)
    name = f"tiny-agent-sft-{stage}"
    shipped = load(f"configs/{name}.yaml")
    recipe = load(BASE, [*RECIPE[stage], f"run.name={name}"])  # only the run's name is the stage's own
    assert diff(shipped, recipe) == []
    assert diff(shipped, load(BASE)) != []  # a stage that changed nothing would be the run that does not learn


def test_each_stage_starts_from_where_the_docs_export_the_stage_before(monkeypatch):
    monkeypatch.chdir(ROOT)
    stages = [load(f"configs/tiny-agent-sft-{stage}.yaml") for stage in sorted(RECIPE)]
    assert stages[0].model.init_from is None  # the seeded init
    guide = (ROOT / "docs" / "post_training.md").read_text()
    for number, (before, after) in enumerate(zip(stages, stages[1:]), start=1):
        exported = re.findall(rf"export --run <STAGE {number} RUN_ID> --to (\S+)", guide)
        assert exported and set(exported) == {after.model.init_from}
        assert f"configs/{before.run.name}.yaml" in guide and f"configs/{after.run.name}.yaml" in guide
    assert sum(stage.train.max_steps for stage in stages) == load(BASE).train.max_steps


def test_the_old_config_points_at_the_stage_configs():
    header = (ROOT / BASE).read_text().split("\nextends:")[0]
    for stage in sorted(RECIPE):
        assert f"tiny-agent-sft-{stage}.yaml" in header
