"""LoRA end to end on 2 CPU ranks, with a frozen base that is identified, never saved. The four
guarantees are the ``lora`` row of tests/training/test_guarantees.py (adapter dropout on: its
masks are keyed, not drawn from a saved RNG, so SIGKILL + resume and replay reproduce them; a
1-rank resume draws other masks after the checkpoint). Here, what is particular to LoRA:

- only the adapters train: the ledger's whole-model param_hash at the last step equals the
  hash of the *untouched* base directory plus the checkpoint's adapters, and lora_B left zero;
- a checkpoint holds only adapter tensors (model and optimizer) and the base's path + sha256;
- one rank (fused loss) and two ranks under FSDP2 x TP=2 with activation checkpointing see
  the same batches and losses;
- a resume whose base directory changed is refused with exit 4, naming both hashes;
- an NF4 base that FSDP cannot split is a config error before any process group;
- ``export --adapter`` gives peft + transformers, ``export --merge`` gives transformers, our
  logits within 1e-5 (fp32).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import launch
from tests.methods import LORA, save_base

pytestmark = pytest.mark.slow

STEPS = LORA.steps
LORA_CONFIG = LORA.config_path


def lora_args(base, *, max_steps: int = STEPS, name: str = "lora", overrides=()) -> list[str]:
    return ["--config", str(LORA_CONFIG), f"run.name={name}", f"train.max_steps={max_steps}",
            f"model.init_from={base}", *overrides]


def _run_dir(workdir, result):
    return result.run_dir if result.run_dir.is_absolute() else workdir / result.run_dir


def write_base(path, *, nudge: float = 0.0):
    """A Hugging Face directory of the e2e model shape, from the ``lora`` row's seeded init
    (optionally nudged)."""
    return save_base(LORA.config, path, seed=7, nudge=nudge)


@pytest.fixture
def base_dir(reference_runs):
    return Path(reference_runs.prepared(LORA, "model.init_from"))


@pytest.fixture
def reference(reference_runs):
    return reference_runs.run(LORA)


@pytest.fixture(scope="module")
def exported_adapter(e2e_workdir, reference_runs, tmp_path_factory):
    """``export --adapter`` of the reference run (PEFT format), written once for the tests that read it."""
    adapter = tmp_path_factory.mktemp("lora-export") / "adapter"
    reference = reference_runs.run(LORA)
    result = launch.run_module(e2e_workdir, ["training", "export", "--run", reference.name, "--to", str(adapter),
                                             "--adapter"])
    assert result.returncode == 0, result.stderr
    return adapter


def _checkpoint(run_dir, step: int):
    from core import config as config_lib
    from core.layout import RunPaths
    from training.checkpoint.load import checkpoint_dir

    paths = RunPaths(run_dir)
    return config_lib.load(paths.config), checkpoint_dir(paths, step)


def test_only_the_adapters_train_and_the_base_is_identified_not_saved(reference, base_dir):
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from distributed import param_hash
    from models.lora import base_identity, is_adapter_name
    from training.checkpoint.load import load_checkpoint_model

    lines = launch.ledger(reference)
    assert [r["step"] for r in lines] == list(range(1, STEPS + 1))
    assert lines[-1]["loss"] < lines[0]["loss"]
    config, path = _checkpoint(reference, STEPS)
    # The base in the training process after 8 steps of AdamW with weight decay is still the
    # directory's: the whole-model hash it wrote equals untouched base + checkpointed adapters.
    model = load_checkpoint_model(config, path)
    assert param_hash(model) == lines[-1]["param_hash"]
    assert all(p.abs().max() > 0 for n, p in model.named_parameters() if ".lora_B." in n)  # B starts at 0
    frozen = json.loads((path / "objective_state.json").read_text())["frozen"]
    assert frozen == {"base": {"path": str(base_dir), "sha256": base_identity(base_dir)}}
    # Only adapter tensors are stored: no base weight, not even the head tied to the embedding.
    saved = FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    tensors = [k for k, v in saved.items() if hasattr(v, "size") and not k.startswith("optim.param_groups")]
    assert tensors and all(is_adapter_name(k) for k in tensors), [k for k in tensors if not is_adapter_name(k)]
    adapters = sum(p.numel() for n, p in model.named_parameters() if is_adapter_name(n))
    stored = sum(torch.Size(saved[k].size).numel() for k in tensors if saved[k].size)
    assert stored == 3 * adapters  # weights + AdamW's two moments


def test_strategies_agree_and_a_changed_base_is_refused(e2e_workdir, tmp_path):
    from models.lora import base_identity

    base = write_base(tmp_path / "base")
    no_dropout = ["model.lora.dropout=0.0"]  # masks depend on the data-parallel layout
    one = launch.train(e2e_workdir, lora_args(base, max_steps=2, name="lora-one",
                                              overrides=[*no_dropout, "parallel.strategy=none"]), nproc=1)
    assert one.returncode == 0, one.stderr
    tp = launch.train(e2e_workdir, lora_args(base, max_steps=2, name="lora-fsdp-tp", overrides=[
        *no_dropout, "parallel.strategy=fsdp", "parallel.tp=2", "parallel.activation_checkpointing=full"]), nproc=2)
    assert tp.returncode == 0, tp.stderr
    a, b = launch.ledger(_run_dir(e2e_workdir, one)), launch.ledger(_run_dir(e2e_workdir, tp))
    assert [r["batch_hash"] for r in a] == [r["batch_hash"] for r in b]
    for x, y in zip(a, b):
        assert x["target_tokens"] == y["target_tokens"]  # tensor-parallel peers' rows count once
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-5)  # frozen norms stay frozen under TP
    assert b[-1]["loss"] != b[0]["loss"]

    before = base_identity(base)
    write_base(base, nudge=1e-3)  # same path, other weights
    after = base_identity(base)
    resumed = launch.train(e2e_workdir, ["--resume", one.run_id, "train.max_steps=3"], nproc=1)
    assert resumed.exit_code == 4, resumed.stderr
    assert "frozen base" in resumed.stderr and before in resumed.stderr and after in resumed.stderr


def test_an_nf4_base_that_fsdp_cannot_split_is_a_config_error_before_any_process_group(monkeypatch):
    from core.exceptions import ConfigError
    from training import session

    monkeypatch.setenv("WORLD_SIZE", "2")
    # 64 x 64 projections: not even one whole 16,384-weight NF4 block.
    args = session.Args(config=str(LORA_CONFIG), resume=None, replay=None, step=None, dump=None,
                        overrides=("model.quantize_base=nf4", "parallel.strategy=fsdp"))
    with pytest.raises(ConfigError) as info:
        session.resolve_config(args)
    assert info.value.context["key"] == "model.quantize_base" and "16384" in info.value.message


def test_export_adapter_loads_in_peft_and_merge_in_transformers(e2e_workdir, reference, base_dir, exported_adapter,
                                                              tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from training.checkpoint.load import load_checkpoint_model

    config, path = _checkpoint(reference, None)
    ours = load_checkpoint_model(config, path).eval()
    ids = torch.randint(0, 258, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = ours(ids)

    adapter, merged = exported_adapter, tmp_path / "merged"
    result = launch.run_module(e2e_workdir, ["training", "export", "--run", reference.name, "--to", str(merged),
                                             "--merge"])
    assert result.returncode == 0, result.stderr
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base_dir)
    assert not (adapter / "model.safetensors").exists()

    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, str(adapter)).eval()
    full = transformers.AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
    with torch.no_grad():
        assert (with_adapter(input_ids=ids).logits - expected).abs().max().item() <= 1e-5
        assert (full(ids).logits - expected).abs().max().item() <= 1e-5


def test_a_run_started_from_an_exported_adapter_holds_exactly_those_adapters(e2e_workdir, reference, base_dir,
                                                                             exported_adapter):
    """``model.lora.init_from``: the adapter that ``export --adapter`` wrote (PEFT format) starts
    a new run on the same base. At lr 0 the new run's whole-model hash after one step equals the
    source run's last one: the same base and bit for bit the same adapters."""
    adapter = exported_adapter
    source = launch.ledger(reference)[-1]
    result = launch.train(e2e_workdir, lora_args(base_dir, max_steps=1, name="lora-init-from", overrides=[
        f"model.lora.init_from={adapter}", "train.lr=0", "checkpoint.interval=0"]), nproc=1)
    assert result.returncode == 0, result.stderr
    started = launch.ledger(_run_dir(e2e_workdir, result))
    assert len(started) == 1 and started[0]["param_hash"] == source["param_hash"]
    # The exported adapter fits the model it came from, and it lowered the loss there: the
    # new run's first loss is below the source run's first (both on batch 1 of the same data).
    assert started[0]["loss"] < launch.ledger(reference)[0]["loss"]
