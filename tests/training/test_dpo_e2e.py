"""DPO keeps every guarantee of the loop, end to end on CPU ranks (tests/configs/e2e-dpo.yaml):

- SIGKILL of the 2-rank job at random moments, then resume, ends with a ledger identical to an
  uninterrupted run's (``pairs``, ``rewards_margin`` and ``accuracy`` included);
- replay of a step before and after a checkpoint verifies;
- 2 ranks -> resume on 1 rank keeps the batch hashes (pair roles and reference log-probs are in them);
- accumulation 8x1 vs 2x4 on one rank: the same loss (the mean over the global batch's pairs);
- cached reference log-probs give the very same ledger as the online reference, the cache is
  what the second run reads, and a cache made for another configuration is refused (exit 4);
- the eval event reports the preference metrics (accuracy, margins) on held-out pairs;
- LoRA with ``reference: adapter_off`` (the policy with its adapters off, under FSDP2 with
  activation checkpointing and adapter dropout): SIGKILL/resume gives the same ledger, replay
  verifies, and checkpoints record the LoRA base's identity as the reference's.
"""

from __future__ import annotations

import json

import pytest

from tests import launch

pytestmark = pytest.mark.slow

STEPS = 8
DPO_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-dpo.yaml"


def dpo_args(*, max_steps: int = STEPS, name: str = "dpo", overrides=()) -> list[str]:
    return ["--config", str(DPO_CONFIG), f"run.name={name}", f"train.max_steps={max_steps}", *overrides]


def _run_dir(workdir, result):
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


@pytest.fixture(scope="module")
def reference(e2e_workdir):
    result = launch.train(e2e_workdir, dpo_args(overrides=["train.eval_interval=8", "train.eval_batches=2"]),
                          nproc=2)
    assert result.returncode == 0, result.stderr
    return _run_dir(e2e_workdir, result)


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


def test_dpo_sigkill_at_random_moments_then_resume_is_identical(e2e_workdir, reference):
    args = dpo_args(name="dpo-killed", overrides=["train.eval_interval=8", "train.eval_batches=2"])
    run_dir = launch.kill_and_resume(e2e_workdir, args, name="dpo-killed", seed=7)
    assert launch.ledger(run_dir) == launch.ledger(reference)


def test_dpo_replay_verifies_before_and_after_a_checkpoint(e2e_workdir, reference):
    launch.replay_verifies(e2e_workdir, reference)  # steps 3 and 6: checkpoints every 4 steps


def test_dpo_resume_on_one_rank_keeps_the_batch_hashes(e2e_workdir, reference):
    launch.one_rank_resume_keeps_the_batches(e2e_workdir, reference, same=("pairs",))


def test_dpo_accumulation_does_not_change_the_loss(e2e_workdir):
    runs = [launch.train(e2e_workdir, dpo_args(max_steps=2, name=f"dpo-acc{m}",
                                               overrides=[f"train.micro_batch_size={m}", "parallel.strategy=none"]),
                         nproc=1) for m in (1, 4)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr + runs[1].stderr
    a, b = (launch.ledger(_run_dir(e2e_workdir, r)) for r in runs)
    assert [r["batch_hash"] for r in a] == [r["batch_hash"] for r in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["rewards_margin"] == pytest.approx(y["rewards_margin"], rel=1e-4, abs=1e-7)


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


def test_dpo_lora_adapter_off_reference_resumes_identically_and_replays(e2e_workdir):
    overrides = ["model.lora.rank=4", "model.lora.alpha=8.0", "model.lora.dropout=0.1", "train.lr=1.0e-2",
                 "objective.dpo.reference=adapter_off", "parallel.strategy=fsdp",
                 "parallel.activation_checkpointing=full"]
    whole = launch.train(e2e_workdir, dpo_args(max_steps=6, name="dpo-lora", overrides=overrides), nproc=2)
    assert whole.returncode == 0, whole.stderr
    expected = launch.ledger(_run_dir(e2e_workdir, whole))
    assert expected[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)  # B = 0: the policy is its base
    assert any(line["rewards_margin"] != 0.0 for line in expected[1:])  # ... and then moves away from it
    args = dpo_args(max_steps=6, name="dpo-lora-killed", overrides=overrides)
    run_dir = launch.kill_and_resume(e2e_workdir, args, name="dpo-lora-killed", seed=11, kills=1)
    assert launch.ledger(run_dir) == expected
    launch.replay_verifies(e2e_workdir, run_dir, steps=(6,))  # from the checkpoint of step 4
    frozen = json.loads((run_dir / "checkpoints" / "step_00000004" / "objective_state.json").read_text())["frozen"]
    assert frozen["reference"] == frozen["base"] and frozen["base"]["path"] == "init:seed"
