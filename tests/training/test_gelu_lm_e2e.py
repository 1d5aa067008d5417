"""A model family that only the tests register (tests/families/gelu_lm.py) through the whole stack.

``gelu_lm`` is a row and one module: two stacks (``front``, ``back``) of LayerNorm + GELU blocks with
learned positions, an auxiliary loss and two metrics. Nothing outside its module names it; its runs'
ranks register it through their entry script (tests/families/gelu_lm_train.py), this process in the
``registered`` fixture, ``python -m training export`` through ``LOCKSTEP_REGISTER``.

The four guarantees are its row of the guarantee table (tests/methods.py, ``GELU_LM``): SIGKILL +
resume gives the uninterrupted ledger bit for bit (its ``model/*`` fields included), replay of a
step before and after a checkpoint verifies every field, the 2-rank checkpoint resumed on 1 rank
and micro-batches 1 x 4 against 4 x 1 keep the batches, the loss and the ``model/*`` fields within
fp32 noise: the auxiliary loss is divided by the global count of input tokens, whatever the split.
Here, on the row's run and beside it: the fields in the ledger, each stack's blocks as FSDP units
(checkpointed and compiled), FSDP with activation checkpointing and TP=2 training as the reference
does, the sampler, and the Hugging Face-style export read back with identical logits.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess

import pytest
import torch
from safetensors import safe_open

from tests import launch
from tests.distributed.dist_harness import run_on_ranks
from tests.families import gelu_lm
from tests.guarantees import run_dir
from tests.methods import GELU_LM, GELU_LM_FIELDS

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def registered():
    """The family registered in this process (loading the run's config, its checkpoint, its export)."""
    gelu_lm.register()
    yield
    gelu_lm.unregister()


@pytest.fixture(scope="module")
def reference(reference_runs):
    return reference_runs.run(GELU_LM)


def _checkpoint_model(run):
    from core import config as config_lib
    from core.layout import RunPaths
    from training.checkpoint.load import checkpoint_dir, load_checkpoint_model

    paths = RunPaths(run)
    return load_checkpoint_model(config_lib.load(paths.config), checkpoint_dir(paths, None)).eval()


def _logits(model, ids):
    from models.forward import ModelInputs, model_forward

    with torch.no_grad():
        return model_forward(model, ModelInputs(ids)).logits


def test_the_ledger_carries_the_auxiliary_loss_and_the_metrics(reference):
    lines = launch.ledger(reference)
    for line in lines:
        assert all(line[key] > 0 for key in GELU_LM_FIELDS), line
    assert lines[-1]["loss"] < lines[0]["loss"]
    assert [r["step"] for r in lines if "param_hash" in r] == [3, 6]


@pytest.mark.usefixtures("registered")
def test_the_gradient_carries_the_aux_loss_whatever_the_micro_batches():
    """The step (training/step.py) adds the family's auxiliary loss over the global count of input tokens:
    4 micro-batches of one row give one micro-batch of four's gradient (float64: to 1e-12), and without
    the auxiliary loss (aux_weight 0) the gradient differs."""
    import models
    from core import config as config_lib
    from tests.training.test_model_aux import make_batch, step_gradient
    from training.step import local_units

    loaded = config_lib.load(GELU_LM.config_path).model
    batch = make_batch()
    targets, units = batch.num_target_tokens(), local_units(batch)

    def gradient(aux_weight: float, rows_per_micro_batch: int) -> torch.Tensor:
        config = dataclasses.replace(loaded, gelu_lm=dataclasses.replace(loaded.gelu_lm, aux_weight=aux_weight))
        model = models.build(config, generator=torch.Generator().manual_seed(5)).double()
        return step_gradient(model, batch.micro_batches(rows_per_micro_batch), global_targets=targets, units=units)[0]

    whole = gradient(1.0, 4)
    torch.testing.assert_close(gradient(1.0, 1), whole, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(gradient(0.0, 4), whole, rtol=1e-6, atol=0)


def _structure_on_rank():
    """This rank's (stack, index, FSDP unit, checkpointed, compiled) for every block under FSDP + full
    activation checkpointing + compile, and whether the root is an FSDP unit."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    import models
    from core import config as config_lib
    from core.distributed_context import DistributedContext
    from distributed import build_mesh, parallelize
    from distributed.model_structure import plan_blocks

    gelu_lm.register()
    config = config_lib.load(GELU_LM.config_path)
    parallel = dataclasses.replace(config.parallel, strategy="fsdp", activation_checkpointing="full", compile=True,
                                   backend="gloo")
    with DistributedContext.from_env(dataclasses.replace(parallel, strategy="ddp")) as dist:
        model = parallelize(models.build(config.model), parallel, dist, build_mesh(parallel, dist))
        blocks = [(stack.path, index, isinstance(block, FSDPModule), isinstance(block, CheckpointWrapper),
                   getattr(block, "_compiled_call_impl", None) is not None) for stack, index, block in plan_blocks(model)]
        return {"blocks": blocks, "root": isinstance(model, FSDPModule)}


def test_each_stacks_blocks_are_fsdp_units_checkpointed_and_compiled():
    for result in run_on_ranks(_structure_on_rank, 2):
        assert [(path, index) for path, index, *_ in result["blocks"]] == [("front", 0), ("back", 0), ("back", 1)]
        assert all(unit and checkpointed and compiled for _, _, unit, checkpointed, compiled in result["blocks"])
        assert result["root"]


@pytest.mark.parametrize("name, overrides", [
    pytest.param("gelu-lm-fsdp-ac", ("parallel.strategy=fsdp", "parallel.activation_checkpointing=full"), id="fsdp-ac"),
    pytest.param("gelu-lm-tp2", ("parallel.strategy=fsdp", "parallel.tp=2"), id="tp2"),
])
def test_sharded_runs_train_as_the_reference_does(reference_runs, reference, name, overrides):
    """The same batches, and losses and model fields within fp32 noise of the reference's DDP run."""
    result = launch.train(reference_runs.workdir, reference_runs.args(GELU_LM, name=name, max_steps=2,
                                                                      overrides=overrides),
                          nproc=2, timeout=GELU_LM.timeout_s, entry=GELU_LM.entry)
    assert result.returncode == 0, result.stderr
    got, ref = launch.ledger(run_dir(reference_runs.workdir, result)), launch.ledger(reference)[:2]
    assert [r["batch_hash"] for r in got] == [r["batch_hash"] for r in ref]
    for a, b in zip(ref, got):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), a["step"]
        for key in GELU_LM_FIELDS:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-8), (key, a["step"])


def _generate(run, tmp_path, *flags):
    from training.__main__ import main

    out = tmp_path / f"generated-{len(list(tmp_path.iterdir()))}.jsonl"
    code = main(["generate", "--from", str(run), "--device", "cpu", "--prompt", "def ", "--no-chat",
                 "--max-new-tokens", "6", "--samples", "2", "--out", str(out), *flags])
    assert code == 0
    return [json.loads(line) for line in out.read_text().splitlines()]


@pytest.mark.usefixtures("registered")
def test_the_sampler_runs_the_trained_family(reference, tmp_path):
    """Sampling twice gives the same samples; greedy decoding through the KV cache gives the argmax of the
    training forward's logits, token after token."""
    sampled = _generate(reference, tmp_path, "--seed", "3")
    assert sampled == _generate(reference, tmp_path, "--seed", "3")
    assert all(record["token_ids"] for record in sampled)
    greedy = _generate(reference, tmp_path, "--temperature", "0")[0]
    model, ids, expected = _checkpoint_model(reference), list(b"def "), []
    for _ in greedy["token_ids"]:
        expected.append(int(_logits(model, torch.tensor([ids]))[0, -1].argmax()))
        ids.append(expected[-1])
    assert greedy["token_ids"] == expected


@pytest.mark.usefixtures("registered")
def test_the_export_reads_back_with_identical_logits(reference, tmp_path):
    """``python -m training export`` (the family registered through LOCKSTEP_REGISTER) writes the family's
    own layout; ``models.load_pretrained`` reads it back into the checkpoint's model, bit for bit."""
    import models

    out = tmp_path / "hf"
    environment = {**launch.env(tmp_path), "LOCKSTEP_REGISTER": "tests.families.gelu_lm:register"}
    done = subprocess.run([launch.PYTHON, "-m", "training", "export", "--run", str(reference), "--to", str(out)],
                          cwd=tmp_path, env=environment, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    written = json.loads((out / "config.json").read_text())
    assert (written["architectures"], written["model_type"]) == (["GeluLMForCausalLM"], "gelu_lm")
    assert (written["n_layer"], written["n_front_layer"]) == (3, 1)
    with safe_open(str(out / "model.safetensors"), framework="pt") as reader:
        names = set(reader.keys())
    assert "transformer.front.h.0.attn.q.weight" in names and "transformer.back.h.1.mlp.c_fc.bias" in names
    assert all(name.startswith("transformer.") for name in names)  # tied: no lm_head.weight
    loaded = models.load_pretrained(out).eval()
    assert loaded.config.gelu_lm.front_layers == 1
    ids = torch.randint(0, 258, (2, 40), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(loaded, ids), _logits(_checkpoint_model(reference), ids))
