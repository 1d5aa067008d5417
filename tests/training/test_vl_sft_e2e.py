"""Vision-language SFT through the whole stack (tests/configs/e2e-vl-sft.yaml: a tiny Qwen2.5-VL on the
embedded image chats, data/kinds/image_chat.py).

The four guarantees are its row of the guarantee table (tests/methods.py, ``VL_SFT``): SIGKILL + resume
gives the uninterrupted ledger bit for bit, replay before and after a checkpoint verifies, the 2-rank
checkpoint resumed on 1 rank and micro-batches 1 x 4 against 4 x 1 keep the batches and the trained
tokens. Here, on the row's run: the ledger trains answer tokens only and the loss falls; and with its
photographs mirrored (same sizes: only the pixels differ) the first batch's ``batch_hash`` is another
(its data state the same: the images are in the batch's digest) and a replay does not verify.
"""

from __future__ import annotations

import shutil
import pytest
from PIL import Image

from tests import launch
from tests.methods import VL_SFT

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_runs.run(VL_SFT)


def test_the_run_trains_answers_and_its_loss_falls(reference):
    lines = launch.ledger(reference)
    assert all(0 < line["trained_tokens"] < line["tokens"] for line in lines)
    assert lines[-1]["loss"] < lines[0]["loss"]


def _batch_hash(workdir, run, step: int) -> dict:
    """The batch hash and data state hash of global batch ``step`` of ``run``'s data, read in ``workdir``."""
    from core import config as config_lib
    from data.inspection import describe, global_batch
    from data.tokenizers import build_tokenizer

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workdir)
        config = config_lib.load(run / "config.yaml")
        report = describe(global_batch(config, step), build_tokenizer(config.data.tokenizer))
    return {key: report[key] for key in ("batch_hash", "data_state_hash")}


def test_a_replay_with_other_pixels_does_not_verify_and_their_batch_hash_differs(reference_runs, reference, tmp_path):
    first = launch.ledger(reference)[0]
    assert _batch_hash(reference_runs.workdir, reference, 1) == {k: first[k] for k in ("batch_hash", "data_state_hash")}
    shutil.copytree(reference_runs.workdir / "datasets" / "images", tmp_path / "datasets" / "images")
    shutil.copytree(reference, tmp_path / "runs" / reference.name)
    for path in (tmp_path / "datasets" / "images" / "photographs").iterdir():
        if path.suffix in (".png", ".jpg"):
            with Image.open(path) as image:
                image.transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(path)
    mirrored = _batch_hash(tmp_path, reference, 1)
    assert mirrored["data_state_hash"] == first["data_state_hash"] and mirrored["batch_hash"] != first["batch_hash"]
    result = launch.train(tmp_path, ["--replay", reference.name, "--step", "2"], nproc=2, timeout=VL_SFT.timeout_s)
    assert result.returncode != 0 and "determinism violation" in result.stderr and "step=1" in result.stderr
