"""QLoRA (adapters over an NF4 base, torchao) end to end on 2 CPU ranks. The four guarantees
are two rows of tests/training/test_guarantees.py: ``qlora`` (DDP) and ``qlora-fsdp`` (FSDP2,
whose shards split the NF4 base: tests/configs/e2e-qlora-fsdp.yaml; killed while step 5 waits
for its data). Here, what is particular to QLoRA:

- the base is quantized deterministically and never trains: the checkpoint holds only adapter
  tensors, and the whole-model hash the run wrote equals a fresh quantization of the untouched
  base plus the checkpoint's adapters;
- under FSDP2 the run really is sharded, learns, and checks the sharded NF4 model's hash.
"""

from __future__ import annotations

import pytest

from tests import launch
from tests.methods import QLORA, QLORA_FSDP

pytestmark = pytest.mark.slow

pytest.importorskip("torchao")

STEPS = QLORA.steps


@pytest.fixture
def reference(reference_runs):
    return reference_runs.run(QLORA)


def test_qlora_trains_only_adapters_over_a_deterministic_nf4_base(reference):
    from torch.distributed.checkpoint import FileSystemReader

    from core import config as config_lib
    from core.layout import RunPaths
    from distributed import param_hash
    from models.lora import is_adapter_name
    from models.nf4 import is_nf4
    from training.checkpoint.load import checkpoint_dir, load_checkpoint_model

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


def test_qlora_under_fsdp_is_sharded_and_learns(reference_runs):
    assert "strategy fsdp" in reference_runs.result(QLORA_FSDP).stdout
    expected = launch.ledger(reference_runs.run(QLORA_FSDP))
    assert len(expected) == QLORA_FSDP.steps and expected[-1]["loss"] < expected[0]["loss"]
    assert [r["param_hash"] for r in expected if "param_hash" in r]  # the NF4-sharded hash was checked
