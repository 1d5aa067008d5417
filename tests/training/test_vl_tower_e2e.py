"""A frozen vision tower through a run (``model.qwen2_5_vl.tower=frozen`` on the vl-sft row's config,
tests/configs/e2e-vl-sft.yaml: one process, two steps, a checkpoint at step 2), its export and generate.

The checkpoint holds no tensor and no optimizer state of the tower; the export carries the tower as the
run started it (its seeded init, bit for bit) and the trained language model; ``python -m training
generate --image`` from the run (its ``data.images``) and from the export (the ``preprocessor_config.json``
export wrote from them) give the same greedy answer, and transformers' PIL image processor loaded from the export
(``use_fast=False``, docs/data.md "What an export names") gives a photograph the training pixels.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

import models
from core import config as config_lib
from core import seeding
from core.layout import RunPaths
from data.vision.images import load_image, processing_of
from distributed.safe_dcp import SafeFileSystemReader
from models.hf_weights import load_pretrained
from tests import launch
from tests.methods import VL_SFT
from training.__main__ import main
from training.checkpoint.load import checkpoint_dir
from training.checkpoint.manifest import DCP_DIR

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def frozen_run(e2e_workdir):
    args = ["--config", str(VL_SFT.config_path), "run.name=vl-frozen-tower", "train.max_steps=2",
            "checkpoint.interval=2", "parallel.strategy=none", "model.qwen2_5_vl.tower=frozen"]
    result = launch.train(e2e_workdir, args, nproc=1, timeout=VL_SFT.timeout_s)
    assert result.returncode == 0, result.stderr
    return result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir


def test_the_checkpoint_leaves_the_tower_out_and_the_export_carries_it_as_initialized(frozen_run, e2e_workdir,
                                                                                        tmp_path, monkeypatch):
    monkeypatch.chdir(e2e_workdir)
    checkpoint = checkpoint_dir(RunPaths(frozen_run), None)
    saved = SafeFileSystemReader(str(checkpoint / DCP_DIR)).read_metadata().state_dict_metadata
    assert any(key.startswith("model.layers.") for key in saved)
    assert not [key for key in saved if "visual." in key]  # neither weights nor optimizer state
    out = tmp_path / "export"
    assert main(["export", "--run", str(frozen_run), "--to", str(out)]) == 0
    config = config_lib.load(frozen_run / "config.yaml")
    initial = models.build(config.model, generator=seeding.generator(config.train.seed, "model_init"))
    exported = load_pretrained(out)
    start, end = initial.state_dict(), exported.state_dict()
    assert all(torch.equal(start[name], end[name]) for name in start if name.startswith("visual."))
    assert not torch.equal(start["layers.0.mlp.up_proj.weight"], end["layers.0.mlp.up_proj.weight"])
    processor = json.loads((out / "preprocessor_config.json").read_text())
    assert (processor["min_pixels"], processor["max_pixels"]) == (config.data.images.min_pixels,
                                                                  config.data.images.max_pixels)

    photo = e2e_workdir / "datasets" / "images" / "photographs" / "chelsea.png"
    # transformers' PIL processor for the export (use_fast=False: where torchvision is installed the default
    # is its torchvision one, whose pixels differ; docs/data.md) gives the training pixels
    hf = transformers.AutoImageProcessor.from_pretrained(out, use_fast=False)(images=[Image.open(photo)],
                                                                              return_tensors="np")
    ours = load_image(photo, processing_of(config.data.images))
    assert hf["image_grid_thw"].tolist() == [list(ours.grid_thw)]
    assert float(np.abs(hf["pixel_values"] - ours.pixel_values).max()) <= 1e-6
    answers = []
    for source in (frozen_run, out):
        samples = tmp_path / f"samples-{len(answers)}.jsonl"
        assert main(["generate", "--from", str(source), "--device", "cpu", "--prompt", "What is this?",
                     "--image", str(photo), "--temperature", "0", "--max-new-tokens", "4", "--out", str(samples)]) == 0
        answers.append(json.loads(samples.read_text()))
    assert answers[0]["token_ids"] == answers[1]["token_ids"] and answers[0]["logprobs"] == answers[1]["logprobs"]
    assert answers[0]["prompt"].count("<|image_pad|>") == 1
