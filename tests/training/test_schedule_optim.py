"""training/optimizers/schedule.py, optim.py, ledger.py and losses.py: the small pure pieces of a step."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from core.config import TrainConfig, is_resumable
from training.record import ledger as ledger_lib
from training.losses import CausalLMLoss
from training.optimizers.build import build_optimizer, param_groups
from training.optimizers.schedule import lr_at, reshape_warning

BASE = TrainConfig(lr=1.0, min_lr_ratio=0.1, warmup_steps=10, max_steps=110)


def test_warmup_is_linear_and_reaches_the_peak():
    assert lr_at(1, BASE) == pytest.approx(0.1)
    assert lr_at(10, BASE) == pytest.approx(1.0)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "wsd"])
def test_schedules_end_at_the_floor_and_never_rise(schedule):
    config = replace(BASE, schedule=schedule)
    values = [lr_at(s, config) for s in range(10, 111)]
    assert values[0] == pytest.approx(1.0)
    assert values[-1] == pytest.approx(0.1)
    assert all(b <= a + 1e-12 for a, b in zip(values, values[1:]))


def test_cosine_midpoint_and_wsd_plateau():
    assert lr_at(60, replace(BASE, schedule="cosine")) == pytest.approx(0.55 + 0.45 * math.cos(math.pi * 49 / 99), abs=1e-12)
    wsd = replace(BASE, schedule="wsd", decay_fraction=0.2)
    assert lr_at(80, wsd) == 1.0  # still in the stable phase
    assert lr_at(100, wsd) < 1.0


def test_schedule_steps_decouple_the_schedule_from_max_steps():
    longer = replace(BASE, max_steps=500, schedule_steps=110)
    assert lr_at(60, longer) == lr_at(60, BASE)


def test_a_resume_that_reshapes_the_schedule_names_the_step_and_both_rates():
    longer = replace(BASE, max_steps=220)
    message = reshape_warning(60, BASE, longer)
    before, after = lr_at(60, BASE), lr_at(60, longer)
    assert before != after
    assert message == (f"warning: train.max_steps 110 -> 220 reshapes the cosine learning-rate schedule: step 60, "
                       f"where this resume continues, runs at lr {after:.6g} (it was {before:.6g} under "
                       f"train.max_steps=110), and the steps after it follow the new schedule -> add "
                       f"train.schedule_steps=110 to keep the recorded one")
    # the hint's key may change on a resume, and with it the schedule is the recorded one
    assert is_resumable("train.schedule_steps")
    kept = replace(longer, schedule_steps=110)
    assert reshape_warning(60, BASE, kept) is None and all(lr_at(s, kept) == lr_at(s, BASE) for s in range(1, 111))
    # no reshape: the same length, a schedule_steps that holds it, a constant rate, nothing left to run
    assert reshape_warning(60, BASE, BASE) is None
    assert reshape_warning(60, replace(BASE, schedule_steps=110), replace(longer, schedule_steps=110)) is None
    assert reshape_warning(60, replace(BASE, schedule="constant"), replace(longer, schedule="constant")) is None
    assert reshape_warning(111, replace(BASE, max_steps=100), BASE) is None


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)


def test_no_weight_decay_on_norms_and_biases():
    groups = param_groups(_Tiny(), weight_decay=0.1)
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p.shape for p in decay["params"]] == [torch.Size([4, 4])]
    assert len(no_decay["params"]) == 3  # norm weight, norm bias, proj bias


def test_optimizer_is_adamw_with_config_hyperparameters():
    opt = build_optimizer(_Tiny(), TrainConfig(lr=0.5, beta1=0.8, beta2=0.9, eps=1e-6), torch.device("cpu"))
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["betas"] == (0.8, 0.9) and opt.defaults["eps"] == 1e-6


def test_ledger_truncation_drops_later_and_torn_lines(tmp_path):
    path = tmp_path / "ledger.jsonl"
    lines = [json.dumps({"step": s, "loss": 1.0 / s}) for s in range(1, 6)]
    path.write_text("\n".join(lines) + "\n" + '{"step": 6, "lo')  # killed mid-write
    assert [r["step"] for r in ledger_lib.read(path)] == [1, 2, 3, 4, 5]
    ledger = ledger_lib.Ledger(path, writer=True)
    ledger.truncate_after(3)
    assert [r["step"] for r in ledger_lib.read(path)] == [1, 2, 3]
    ledger.append({"step": 4, "loss": 0.25})
    assert ledger_lib.read(path)[-1] == {"step": 4, "loss": 0.25}


def test_first_mismatch_names_the_field():
    a = {"step": 3, "loss": 1.5, "grad_norm": 2.0, "batch_hash": "x"}
    assert ledger_lib.first_mismatch(a, dict(a)) is None
    assert ledger_lib.first_mismatch(a, {**a, "grad_norm": 2.0000001}) == "grad_norm"
    assert ledger_lib.first_mismatch({**a, "loss": math.nan}, {**a, "loss": math.nan}) is None


class _Batch:
    def __init__(self, labels):
        self.labels = labels


def test_loss_is_a_sum_over_targets_only():
    logits = torch.zeros(1, 3, 5)
    labels = torch.tensor([[1, -100, 2]])
    loss = CausalLMLoss()
    assert loss.num_targets(_Batch(labels)) == 2
    assert float(loss(logits, _Batch(labels))) == pytest.approx(2 * math.log(5))
