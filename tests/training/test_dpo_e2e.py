"""DPO end to end on CPU ranks (tests/configs/e2e-dpo.yaml). The four guarantees are two rows of
tests/training/test_guarantees.py: ``dpo`` (reference log-probs from a cache; the killed run
fills its own cache while it is killed; ``pairs``, ``rewards_margin`` and ``accuracy`` in the
ledger; the 2 -> 1 rank resume keeps the batch hashes and pair counts; accumulation keeps the
loss and margins) and ``dpo-lora-adapter-off`` (LoRA with ``reference: adapter_off``, the
policy with its adapters off, under FSDP2 with activation checkpointing and adapter dropout).
Here, what is particular to DPO:

- the first step's loss is log 2 (policy == reference), then margins move; the eval event
  reports the preference metrics (accuracy, margins) on held-out pairs;
- cached reference log-probs give the very same ledger as the online reference, the cache is
  what the second run reads, and a cache made for another configuration is refused (exit 4);
- with ``reference: adapter_off``, checkpoints record the LoRA base's identity as the reference's.
"""

from __future__ import annotations

import json

import pytest

from tests import launch
from tests.methods import DPO, DPO_LORA_ADAPTER_OFF

pytestmark = pytest.mark.slow

STEPS = DPO.steps
DPO_CONFIG = DPO.config_path


def dpo_args(*, max_steps: int = STEPS, name: str = "dpo", overrides=()) -> list[str]:
    return ["--config", str(DPO_CONFIG), f"run.name={name}", f"train.max_steps={max_steps}", *overrides]


def _run_dir(workdir, result):
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


@pytest.fixture
def reference(reference_runs):
    """The ``dpo`` row's uninterrupted run: 8 steps, an eval at step 8, a reference cache."""
    return reference_runs.run(DPO)


def test_dpo_ledger_records_pairs_margins_and_accuracy(reference):
    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert lines[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)  # policy == reference: log 2
    assert lines[0]["rewards_margin"] == 0.0 and lines[0]["accuracy"] == 0.0
    for line in lines:
        assert line["pairs"] == line["target_tokens"] > 0
        assert 0.0 <= line["accuracy"] <= 1.0
    assert any(line["rewards_margin"] != 0.0 for line in lines[1:])
    evals = [e for e in launch.events(reference) if e["event"] == "eval"]
    assert evals and {"accuracies", "margins", "chosen_rewards"} <= set(evals[-1]["metrics"])


def test_dpo_cached_reference_is_bitwise_the_online_one_and_a_stale_cache_is_refused(e2e_workdir, tmp_path):
    cache = tmp_path / "refcache"
    common = ["parallel.strategy=none"]
    online = launch.train(e2e_workdir, dpo_args(max_steps=3, name="dpo-online", overrides=common), nproc=1)
    cached_args = [*common, "objective.dpo.cache_reference=true", f"objective.dpo.cache_dir={cache}"]
    filling = launch.train(e2e_workdir, dpo_args(max_steps=3, name="dpo-fill", overrides=cached_args), nproc=1)
    assert online.returncode == 0 and filling.returncode == 0, online.stderr + filling.stderr
    files = sorted(cache.glob("entries-*.jsonl"))
    assert files
    stored = {p: p.read_bytes() for p in files}
    reading = launch.train(e2e_workdir, dpo_args(max_steps=3, name="dpo-read", overrides=cached_args), nproc=1)
    assert reading.returncode == 0, reading.stderr
    assert {p: p.read_bytes() for p in sorted(cache.glob("entries-*.jsonl"))} == stored  # nothing recomputed
    runs = [launch.ledger(_run_dir(e2e_workdir, r)) for r in (online, filling, reading)]
    assert runs[0] == runs[1] == runs[2]

    # The second run really reads the cache: a changed entry is found and refused (its checksum).
    path = files[0]
    lines = path.read_text().splitlines()
    key, tokens, chosen, rejected, check = json.loads(lines[1])
    lines[1] = json.dumps([key, tokens, (float.fromhex(chosen) - 1.0).hex(), rejected, check])
    path.write_text("\n".join(lines) + "\n")
    tampered = launch.train(e2e_workdir, dpo_args(max_steps=3, name="dpo-tampered", overrides=cached_args), nproc=1)
    assert tampered.returncode == 4, tampered.stderr
    assert "checksum" in tampered.stderr and key in tampered.stderr
    path.write_bytes(stored[path])

    stale = launch.train(e2e_workdir, dpo_args(max_steps=1, name="dpo-stale",
                                               overrides=[*cached_args, "data.seq_len=192"]), nproc=1)
    assert stale.returncode == 4, stale.stderr
    assert "reference cache" in stale.stderr and "fingerprint" in stale.stderr


def test_dpo_lora_adapter_off_reference_is_the_base(reference_runs):
    run_dir = reference_runs.run(DPO_LORA_ADAPTER_OFF)
    expected = launch.ledger(run_dir)
    assert expected[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)  # B = 0: the policy is its base
    assert any(line["rewards_margin"] != 0.0 for line in expected[1:])  # ... and then moves away from it
    frozen = json.loads((run_dir / "checkpoints" / "step_00000004" / "objective_state.json").read_text())["frozen"]
    assert frozen["reference"] == frozen["base"] and frozen["base"]["path"] == "init:seed"
