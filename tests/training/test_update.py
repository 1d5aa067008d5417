"""training.step.enqueue_update: the on-device skip equals reading the flags first, and values
read late count their skip once."""

from __future__ import annotations

import copy

import torch

from core.distributed_context import DistributedContext
from runtime.health import NonFiniteGuard
from models.numerics import Numerics
from training.precision import Precision
from training.step import enqueue_update


def _guard() -> NonFiniteGuard:
    dist = DistributedContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo", timeout_s=10)
    return NonFiniteGuard("skip", dist=dist)


def _setup():
    gen = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    for p in model.parameters():
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    guard = _guard()
    precision = Precision(Numerics(precision="fp32"), device=torch.device("cpu"), wrapper_casts=False)
    return model, optimizer, guard, precision


def _losses(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(5, 8, generator=gen)
    loss = model(x).pow(2).sum()
    if step in (0, 3):  # a non-finite first step (before any optimizer state) and a later one
        loss = loss * float("nan")
    return loss


def test_on_device_skip_matches_reading_the_flags_first():
    model, optimizer, guard, precision = _setup()
    ref_model = copy.deepcopy(model)
    ref_optimizer = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.1, fused=True)
    ref_guard = _guard()
    for step in range(6):
        for m, opt, g, fused_path in ((model, optimizer, guard, True), (ref_model, ref_optimizer, ref_guard, False)):
            loss = _losses(m, step)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            if fused_path:
                finite, loss_value, norm_value, _ = enqueue_update(opt, precision, g, loss.detach(), norm).read()
            else:
                finite = g.check(loss, norm)
                if finite:
                    opt.step()
                loss_value, norm_value = float(loss.detach()), float(norm)
            opt.zero_grad(set_to_none=True)
            assert finite is (step not in (0, 3))
            if fused_path:
                fused_values = (loss_value, norm_value)
            else:
                assert (loss_value != loss_value and fused_values[0] != fused_values[0]) or loss_value == fused_values[0]
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b), step
    assert guard.skipped == ref_guard.skipped == 2
    for p, q in zip(model.parameters(), ref_model.parameters()):
        sa, sb = optimizer.state[p], ref_optimizer.state[q]
        assert torch.equal(sa["step"], sb["step"]) and sa["step"].item() == 4
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_extra_values_are_read_with_the_loss_on_both_paths():
    for fused in (True, False):
        model, _, guard, precision = _setup()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        loss = _losses(model, 1)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        extra = torch.tensor([1.5, -2.0, 7.25])
        finite, loss_value, norm_value, values = enqueue_update(optimizer, precision, guard, loss.detach(), norm,
                                                                extra=extra).read()
        assert finite and values == [1.5, -2.0, 7.25]
        assert loss_value == float(loss.detach()) and norm_value == float(norm)
        assert enqueue_update(optimizer, precision, guard, loss.detach(), norm).read()[3] == []


def test_values_read_after_the_next_update_count_a_skip_once():
    # The loop reads a step's values during the next step (runtime.deferred_settle): the
    # skip is decided on the device at once, and counted once however often it is read.
    model, optimizer, guard, precision = _setup()
    pending = []
    for step in range(3):
        loss = _losses(model, step)  # step 0 is non-finite
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        pending.append(enqueue_update(optimizer, precision, guard, loss.detach(), norm))
        optimizer.zero_grad(set_to_none=True)
    assert guard.skipped == 0  # nothing read yet
    reads = [values.read() for values in pending]
    assert [finite for finite, *_ in reads] == [False, True, True]
    assert pending[0].read() is reads[0] and guard.skipped == 1
    assert optimizer.state[next(model.parameters())]["step"].item() == 2  # the skipped update left no trace


def test_a_non_finite_norm_of_any_part_skips_every_parts_update_on_both_paths():
    # training/parts.py: a part trained beside the policy steps with it, under one decision,
    # and its gradient norm is read back after the extra values.
    for fused in (True, False):
        model, _, guard, precision = _setup()
        value = copy.deepcopy(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
        value_optimizer = torch.optim.AdamW(value.parameters(), lr=1e-3, fused=fused)
        for step, value_norm in enumerate((float("inf"), None)):
            loss = _losses(model, 1) + _losses(value, 2)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            measured = torch.nn.utils.clip_grad_norm_(value.parameters(), 0.5)
            value_norm = torch.tensor(value_norm) if value_norm is not None else measured
            before = [p.detach().clone() for p in (*model.parameters(), *value.parameters())]
            finite, loss_value, norm_value, values = enqueue_update(
                optimizer, precision, guard, loss.detach(), norm, extra=torch.tensor([4.0]),
                parts=[(value_optimizer, value_norm)]).read()
            after = list((*model.parameters(), *value.parameters()))
            assert values == [4.0, float(value_norm)] and norm_value == float(norm), fused
            assert finite is (step == 1), fused
            assert all(torch.equal(a, b) for a, b in zip(before, after)) is (not finite), fused
            optimizer.zero_grad(set_to_none=True)
            value_optimizer.zero_grad(set_to_none=True)
        assert guard.skipped == 1
        assert value_optimizer.state[next(value.parameters())]["step"].item() == 1
