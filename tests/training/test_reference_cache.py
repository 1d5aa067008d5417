"""The reference log-prob cache (training/objectives/reference_cache.py): exact round trip,
another fingerprint refused, a torn last line ignored, a pair stored once; and the cache proves
what it holds: other data under it, other tokens for a pair, an edited entry and a non-finite
value are refused (exit 4) naming what differs."""

from __future__ import annotations

import json

import numpy as np
import pytest

from core.exceptions import CheckpointError, ExitCode
from tests import launch
from training.objectives.reference_cache import ReferenceCache

PARTS = {"seq_len": 256}
DATA = {"pairs": {"train.jsonl": "aa" * 32}}


def _cache(path, parts=PARTS, data=DATA, rank=0, world_size=1):
    return ReferenceCache(path, parts, data=data, rank=rank, world_size=world_size)


def test_values_come_back_bit_for_bit_across_writers(tmp_path):
    values = np.float32([-12.345678, -0.1, -1234.5]).tolist()
    _cache(tmp_path, rank=0, world_size=2).store([("a", "ta", values[0], values[1])])
    _cache(tmp_path, rank=1, world_size=2).store([("b", "tb", values[2], values[0])])
    cache = _cache(tmp_path)  # a resume on another world size
    assert cache.lookup(["a", "b"], ["ta", "tb"]) == [(values[0], values[1]), (values[2], values[0])]
    assert cache.lookup(["a", "c"], ["ta", "tc"]) is None and cache.misses == 1


def test_another_fingerprint_is_refused_naming_what_differs(tmp_path):
    _cache(tmp_path, parts={"seq_len": 256, "tokenizer": "byte"}).store([("a", "t", -1.0, -2.0)])
    with pytest.raises(CheckpointError, match="fingerprint") as info:
        _cache(tmp_path, parts={"seq_len": 128, "tokenizer": "byte"})
    assert "another seq_len" in info.value.message and info.value.exit_code == ExitCode.CHECKPOINT


def test_a_torn_line_is_ignored_and_a_repeated_pair_is_stored_once(tmp_path):
    cache = _cache(tmp_path)
    cache.store([("a", "t", -1.0, -2.0), ("a", "t", -1.0, -2.0), ("b", "t", -3.0, -4.0)])
    path = next(tmp_path.glob("entries-*.jsonl"))
    assert len(path.read_text().splitlines()) == 3  # header + a + b
    path.write_text(path.read_text() + '["c", "t", "-0x1.0p+0"')  # killed mid-write
    reopened = _cache(tmp_path)
    assert reopened.get("c") is None and reopened.get("b") == (-3.0, -4.0)
    reopened.store([("c", "t", -5.0, -6.0)])
    assert _cache(tmp_path).get("c") == (-5.0, -6.0)


def test_changed_data_under_a_cache_is_refused_naming_the_shard(tmp_path):
    _cache(tmp_path).store([("a", "t", -1.0, -2.0)])
    with pytest.raises(CheckpointError) as info:
        _cache(tmp_path, data={"pairs": {"train.jsonl": "bb" * 32}})
    assert "other data" in info.value.message and "'train.jsonl' of source 'pairs' changed" in info.value.message


def test_a_pair_whose_tokens_changed_is_refused_naming_the_record(tmp_path):
    _cache(tmp_path).store([("pairs|train.jsonl|7", "tokens-then", -1.0, -2.0)])
    cache = _cache(tmp_path)
    with pytest.raises(CheckpointError) as info:
        cache.lookup(["pairs|train.jsonl|7"], ["tokens-now"])
    assert "other tokens" in info.value.message and info.value.context["record"] == "pairs|train.jsonl|7"


def _edit_first_entry(tmp_path, chosen_hex):
    path = next(tmp_path.glob("entries-*.jsonl"))
    lines = path.read_text().splitlines()
    entry = json.loads(lines[1])
    entry[2] = chosen_hex
    path.write_text("\n".join([lines[0], json.dumps(entry), *lines[2:]]) + "\n")
    return path


def test_an_edited_cached_value_is_refused(tmp_path):
    _cache(tmp_path).store([("pairs|train.jsonl|3", "t", -12.5, -14.0)])
    path = _edit_first_entry(tmp_path, (-1.0).hex())  # the probe: a value changed to -1.0
    with pytest.raises(CheckpointError) as info:
        _cache(tmp_path)
    assert "checksum" in info.value.message
    assert info.value.context["record"] == "pairs|train.jsonl|3" and info.value.context["line"] == 2
    assert info.value.context["file"] == str(path)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_cached_value_is_refused_naming_the_record(tmp_path, value):
    _cache(tmp_path).store([("pairs|train.jsonl|3", "t", -12.5, -14.0)])
    _edit_first_entry(tmp_path, value)
    with pytest.raises(CheckpointError) as info:
        _cache(tmp_path)
    assert "not finite" in info.value.message and "inspect the batch" not in str(info.value)
    assert info.value.context["record"] == "pairs|train.jsonl|3"


@pytest.mark.slow  # starts train.py
def test_dpo_run_refuses_chosen_and_rejected_swapped_under_its_cache(tmp_path):
    """The probe end to end: a cached run, then the data's chosen and rejected swapped: exit 4."""
    import subprocess
    import sys

    data = tmp_path / "pairs.jsonl"
    pairs = [{"prompt": f"Say {i}.", "chosen": f"{i} it is", "rejected": f"no {i * 7}"} for i in range(16)]
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    args = [sys.executable, str(launch.ROOT / "train.py"), "--config", str(launch.ROOT / "configs" / "tiny-dpo.yaml"),
            f"run.root={tmp_path / 'runs'}", "parallel.device=cpu", "train.max_steps=1", "train.eval_interval=0",
            "objective.dpo.cache_reference=true", "checkpoint.interval=0", "data.num_streams=1",
            f"data.sources=[{{path: {data}, record: preference}}]", "data.eval_source=null",
            "train.global_batch_size=4", "train.micro_batch_size=4", "train.eval_generate.source=null"]
    first = subprocess.run(args, cwd=tmp_path, env=launch.env(tmp_path), capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr
    swapped = [{**p, "chosen": p["rejected"], "rejected": p["chosen"]} for p in pairs]
    data.write_text("".join(json.dumps(p) + "\n" for p in swapped))
    second = subprocess.run(args, cwd=tmp_path, env=launch.env(tmp_path), capture_output=True, text=True, timeout=300)
    assert second.returncode == ExitCode.CHECKPOINT, second.stderr
    assert "other data" in second.stderr and "pairs.jsonl" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
