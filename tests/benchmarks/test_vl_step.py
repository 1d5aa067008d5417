"""benchmarks/vl_step.py --smoke, in this process: the Qwen2.5-VL-3B preset's code path at a tiny shape
on CPU, Lockstep through train.main twice (equal ledgers) on the image-chat corpus the benchmark writes,
and transformers' Qwen2_5_VLForConditionalGeneration on the same batch shape, into one JSON with both
sides' timings, MFU over both towers and Lockstep's data wait; the transformers batch has the processor's
layout."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import vl_step
from models.qwen_vl.flops import vision_flops


@pytest.mark.usefixtures("restore_process_state")
def test_the_smoke_trains_both_sides_on_images_and_repeats_bitwise(tmp_path, capfd):
    out = tmp_path / "vl_step.json"
    assert vl_step.main(["--smoke", "--run-root", str(tmp_path / "runs"), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    lockstep, repeat, hf = report["lockstep"], report["lockstep_repeat"], report["transformers"]
    assert lockstep["status"] == repeat["status"] == hf["status"] == "ok", (lockstep, repeat, hf)
    assert lockstep["in_process"] and "determinism.mode=bitwise" in lockstep["command"]
    assert "record: image_chat" in lockstep["command"]
    # Both ran the preset's architecture at the smoke's shape, the same parameters on both sides.
    assert hf["hf_class"] == "Qwen2_5_VLForConditionalGeneration" and hf["hf_params"] == report["shape"]["params_total"]
    # Every row is one conversation of seq tokens showing 4 images of 56 px: grid (1, 4, 4), 4 merged tokens each.
    settings = vl_step.SMOKE_SETTINGS
    assert report["shape"]["image_grid_thw"] == [1, 4, 4] and hf["image_tokens_per_row"] == settings["images"] * 4
    assert report["corpus"]["tokens_per_record"] == settings["seq"]
    records = [json.loads(line) for line in (tmp_path / "runs" / "corpus" / "chat" / "part-00000.jsonl").open()]
    assert {len(r["images"]) for r in records} == {settings["images"]}
    # A train.py run of warmup + steps + 1 steps; the ledgers of the two runs are equal, hashes and all.
    steps = settings["warmup"] + settings["steps"] + 1
    assert report["bitwise_repeat"]["equal"] and report["bitwise_repeat"]["lines"] == [steps, steps]
    assert report["bitwise_repeat"]["last_param_hash"][0] is not None
    for part in (lockstep, hf):
        assert part["tokens_per_s"] > 0 and part["step_time_s"] > 0
    assert 0 <= lockstep["data_wait_fraction"] < 1
    # FLOPs over both towers: the text's per token plus the vision tower's over a row's 4 images.
    flops = report["shape"]["flops_per_token"]
    from core.config import load

    config = load(vl_step.ROOT / vl_step.PRESET, vl_step.model_overrides(vl_step.parse_args(["--smoke"]),
                                                                          report["shape"]["token_ids"])).model
    assert flops["vision_per_row"] == vision_flops(config, [(1, 4, 4)] * settings["images"])
    assert flops["all_matmuls"] == flops["text"]["all_matmuls"] + flops["vision_per_row"] / settings["seq"]
    assert lockstep["flops_per_token"] == hf["flops_per_token"] == flops
    printed = capfd.readouterr().out  # capfd: train.main hands faulthandler the real stderr
    assert "| lockstep (bitwise) | ok |" in printed and "equal ledgers" in printed


def test_the_transformers_batch_has_the_processor_layout(tmp_path):
    args = vl_step.parse_args(["--seq", "1200", "--micro-batch", "2", "--out", str(tmp_path / "x.json")])
    corpus = tmp_path / "corpus"
    token_ids = vl_step.write_tokenizer(corpus / "tokenizer")
    config = vl_step.load_config(args, tmp_path, corpus, token_ids)
    grid = vl_step.image_grid(args, config)
    assert grid == (1, 32, 32)  # 448 px in patches of 14
    batch = vl_step.hf_batch(args, config, grid, token_ids, torch.device("cpu"), torch.Generator().manual_seed(0))
    ids = batch["input_ids"]
    assert ids.shape == (2, 1200) and batch["pixel_values"].shape == (2 * 4 * 32 * 32, 3 * 2 * 14 * 14)
    assert batch["image_grid_thw"].tolist() == [[1, 32, 32]] * 8
    for row in ids:
        count = {key: int((row == token).sum()) for key, token in token_ids.items()}
        assert count == {"vision_start_token_id": 4, "vision_end_token_id": 4, "image_token_id": 4 * 256,
                         "video_token_id": 0}
        starts = (row == token_ids["vision_start_token_id"]).nonzero().flatten()
        for start in starts:  # start, 256 pads, end
            assert row[start + 1:start + 257].eq(token_ids["image_token_id"]).all()
            assert row[start + 257] == token_ids["vision_end_token_id"]
    vision = torch.isin(ids, torch.tensor(list(token_ids.values())))
    assert batch["labels"][vision].eq(-100).all() and batch["labels"][~vision].equal(ids[~vision])
    assert batch["mm_token_type_ids"].sum() == 2 * 4 * 256


def test_an_image_size_the_processor_would_resize_is_refused(tmp_path):
    args = vl_step.parse_args(["--image-size", "440", "--out", str(tmp_path / "x.json")])
    corpus = tmp_path / "corpus"
    token_ids = vl_step.write_tokenizer(corpus / "tokenizer")
    config = vl_step.load_config(args, tmp_path, corpus, token_ids)
    with pytest.raises(ValueError, match="--image-size 440 must be a multiple of 28"):
        vl_step.image_grid(args, config)
