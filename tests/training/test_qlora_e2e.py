"""QLoRA (adapters over an NF4 base, torchao) keeps the core guarantees end to end on 2 CPU
ranks, as LoRA does (tests/training/test_lora_e2e.py):

- the base is quantized deterministically and never trains: the checkpoint holds only adapter
  tensors, and the whole-model hash the run wrote equals a fresh quantization of the untouched
  base plus the checkpoint's adapters;
- SIGKILL at random moments, then resume, ends with a ledger identical line for line;
- replay of a step before and after a checkpoint verifies;
- resuming the 2-rank run on 1 rank keeps the batch hashes (and the losses within fp32 noise);
- the same under FSDP2, whose shards split the NF4 base (tests/configs/e2e-qlora-fsdp.yaml): a
  run SIGKILLed mid-step resumes to the uninterrupted ledger, a step after the resume replays,
  and the 2-rank checkpoint resumes on 1 rank with the same batches.
"""

from __future__ import annotations

import pytest

from tests import launch

pytestmark = pytest.mark.slow

pytest.importorskip("torchao")

STEPS = 8
QLORA_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-qlora.yaml"
QLORA_FSDP_CONFIG = launch.ROOT / "tests" / "configs" / "e2e-qlora-fsdp.yaml"


def qlora_args(base, *, max_steps: int = STEPS, name: str = "qlora", overrides=(), config=QLORA_CONFIG) -> list[str]:
    return ["--config", str(config), f"run.name={name}", f"train.max_steps={max_steps}",
            f"model.init_from={base}", *overrides]


def _save_base(config, path):
    """A plain (unquantized, adapter-free) model of ``config``'s shape, saved as a Hugging Face
    directory; the run quantizes it on load."""
    import torch

    import models
    from core import config as config_lib

    model = models.build(config_lib.load(config).model, generator=torch.Generator().manual_seed(11))
    assert not any(name.endswith(".lora_A.weight") for name, _ in model.named_parameters())
    models.save_pretrained(model, path)
    return path


@pytest.fixture(scope="module")
def base_dir(e2e_workdir):
    return _save_base(QLORA_CONFIG, e2e_workdir / "qlora-base")


@pytest.fixture(scope="module")
def reference(e2e_workdir, base_dir):
    result = launch.train(e2e_workdir, qlora_args(base_dir), nproc=2)
    assert result.returncode == 0, result.stderr
    return result.run_dir if result.run_dir.is_absolute() else e2e_workdir / result.run_dir


def test_qlora_trains_only_adapters_over_a_deterministic_nf4_base(reference):
    from torch.distributed.checkpoint import FileSystemReader

    from core import config as config_lib
    from core.layout import RunPaths
    from distributed import param_hash
    from models.lora import is_adapter_name
    from models.nf4 import is_nf4
    from training.export import checkpoint_dir, load_checkpoint_model

    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert lines[-1]["loss"] < lines[0]["loss"]
    paths = RunPaths(reference)
    path = checkpoint_dir(paths, STEPS)
    model = load_checkpoint_model(config_lib.load(paths.config), path)
    assert any(is_nf4(p) for p in model.parameters())  # the base really is NF4 here
    assert param_hash(model) == lines[-1]["param_hash"]  # same NF4 bytes, same adapters
    saved = FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    tensors = [k for k, v in saved.items() if hasattr(v, "size") and not k.startswith("optim.param_groups")]
    assert tensors and all(is_adapter_name(k) for k in tensors), [k for k in tensors if not is_adapter_name(k)]


def test_qlora_sigkill_at_random_moments_then_resume_is_identical(e2e_workdir, reference, base_dir):
    run_dir = launch.kill_and_resume(e2e_workdir, qlora_args(base_dir, name="qlora-killed"), name="qlora-killed",
                                     seed=11)
    assert launch.ledger(run_dir) == launch.ledger(reference)


def test_qlora_replay_verifies_before_and_after_a_checkpoint(e2e_workdir, reference):
    launch.replay_verifies(e2e_workdir, reference)  # steps 3 and 6: checkpoints every 4 steps


def test_qlora_resume_on_one_rank_keeps_the_batch_hashes(e2e_workdir, reference):
    launch.one_rank_resume_keeps_the_batches(e2e_workdir, reference, same=("trained_tokens",))


def test_qlora_under_fsdp_resumes_replays_and_moves_to_one_rank(e2e_workdir):
    base = _save_base(QLORA_FSDP_CONFIG, e2e_workdir / "qlora-fsdp-base")
    reference = launch.train(e2e_workdir, qlora_args(base, max_steps=6, name="qlora-fsdp", config=QLORA_FSDP_CONFIG))
    assert reference.returncode == 0, reference.stderr
    assert "strategy fsdp" in reference.stdout
    reference_dir = e2e_workdir / reference.run_dir
    expected = launch.ledger(reference_dir)
    assert len(expected) == 6 and expected[-1]["loss"] < expected[0]["loss"]

    # Killed while step 5 waits for its data, after the step-4 line (the step-4 checkpoint
    # complete or torn), resumed by run ID: the uninterrupted ledger, param_hash included.
    name = "qlora-fsdp-killed"
    run_dir = launch.stall_kill_and_resume(
        e2e_workdir, qlora_args(base, max_steps=6, name=name, config=QLORA_FSDP_CONFIG), name=name)
    assert launch.ledger(run_dir) == expected
    assert [r["param_hash"] for r in expected if "param_hash" in r]  # the NF4-sharded hash was checked
    launch.replay_verifies(e2e_workdir, run_dir, steps=(5,))
    launch.one_rank_resume_keeps_the_batches(e2e_workdir, reference_dir, step=4, same=("trained_tokens",))
