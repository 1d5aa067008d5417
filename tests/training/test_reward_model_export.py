"""A reward model's checkpoint exports as a Hugging Face sequence classifier that transformers'
``AutoModelForSequenceClassification`` loads with Lockstep's scores (fp32, within 1e-5), padded
batches included (transformers reads the last non-pad token, Lockstep the sequence's last token);
the same directory imports back: ``model.init_from`` takes its trunk and the reward model its
score head, with the same scores."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from core import config as config_lib
from core.layout import RunPaths
from models.hf_weights import load_pretrained
from tests import launch
from training.export import checkpoint_dir, load_checkpoint_model
from training.objectives.base import ObjectiveContext
from training.objectives.reward_model import RewardModelObjective, sequence_scores
from training.objectives.reward_model_io import SCORE_PART, read_checkpoint_score, read_score_weight

pytestmark = pytest.mark.slow

RM_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-rm.yaml"
LENGTHS = (40, 23, 31)


def _ours(model, head, ids: torch.Tensor, lengths) -> torch.Tensor:
    """Each row's first ``lengths[r]`` tokens scored alone (one document per row)."""
    out = []
    with torch.no_grad():
        for row, n in zip(ids, lengths):
            out.append(sequence_scores(model, head, row[None, :n], torch.arange(n)[None],
                                       torch.zeros(1, n, dtype=torch.long), torch.tensor([0]), torch.tensor([n - 1])))
    return torch.cat(out)


def test_export_loads_in_transformers_with_equal_scores_and_imports_back(e2e_workdir, tmp_path):
    transformers = pytest.importorskip("transformers")
    result = launch.train(e2e_workdir, ["--config", str(RM_CONFIG), "run.name=rm-export", "train.max_steps=4"],
                          nproc=1)
    assert result.returncode == 0, result.stderr
    run_dir = result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir
    out = tmp_path / "rm-hf"
    exported = launch.run_module(e2e_workdir, ["training", "export", "--run", str(run_dir), "--to", str(out)])
    assert exported.returncode == 0, exported.stderr
    hf_config = json.loads((out / "config.json").read_text())
    assert hf_config["architectures"] == ["Qwen3ForSequenceClassification"] and hf_config["num_labels"] == 1
    pad = hf_config["pad_token_id"]

    paths = RunPaths(run_dir)
    config = config_lib.load(paths.config)
    checkpoint = checkpoint_dir(paths, None)
    trunk = load_checkpoint_model(config, checkpoint).eval()
    head = torch.nn.Linear(config.model.hidden_size, 1, bias=False)
    head.weight.data.copy_(read_checkpoint_score(checkpoint))
    ids = torch.randint(0, 256, (len(LENGTHS), max(LENGTHS)), generator=torch.Generator().manual_seed(1))
    ours = _ours(trunk, head, ids, LENGTHS)

    theirs_model = transformers.AutoModelForSequenceClassification.from_pretrained(str(out), dtype=torch.float32).eval()
    padded = ids.clone()
    for row, n in enumerate(LENGTHS):
        padded[row, n:] = pad  # right padding: transformers reads the last non-pad token
    mask = (padded != pad).long()
    with torch.no_grad():
        theirs = theirs_model(input_ids=padded, attention_mask=mask).logits[:, 0]
    assert (ours - theirs).abs().max().item() < 1e-5
    assert len(set(ours.tolist())) == len(LENGTHS)

    # Import: the trunk through model.init_from's loader, the head through the reward model's parts.
    imported = load_pretrained(out, base=config.model).eval()
    assert torch.equal(read_score_weight(out, config.model.hidden_size), head.weight)
    again = config_lib.load(str(RM_CONFIG), [f"model.init_from={out}"])
    context = ObjectiveContext(config=again, dist=SimpleNamespace(), parallel=SimpleNamespace(), place=lambda t: t)
    parts = RewardModelObjective(again).extra_parts(context)
    assert torch.equal(parts[SCORE_PART].module.weight, head.weight)
    assert (_ours(imported, parts[SCORE_PART].module, ids, LENGTHS) - ours).abs().max().item() < 1e-6
